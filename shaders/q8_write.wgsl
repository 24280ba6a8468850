// q8_write: quantise blocks 2w and 2w + 1 of one head row into row `row` of a q8_0 cache
// (kv_quant.wgsl's layout; llama.cpp's q8_0 rule: d = max|x| / 127 in f32, q = round(x / d) in
// [-127, 127], the scale stored as f16), for the kernels that write the cache: kv_quant.wgsl and
// rope_kv_q8.wgsl. Each defines where the values come from and where the words go:
//   fn q8_src(src: u32, e: u32, pos: u32, v: u32) -> f32   value e of the k (v = 0) or v (v = 1)
//                                                           head whose data starts at `src`
//   fn q8_put(v: u32, i: u32, word: u32)                    word i of the K (v = 0) or V cache
// The host header supplies D4, SW and Q8_SOFF.

fn q8_byte(q: f32) -> u32 {
    return u32(i32(q)) & 0xffu;
}

fn q8_write(src: u32, pos: u32, v: u32, w: u32, row: u32) {
    var d = vec2<f32>(0.0);
    for (var b2 = 0u; b2 < 2u; b2++) {
        let b = 2u * w + b2;
        if (b * 8u >= D4) { break; }
        var x: array<f32, 32>;
        var amax = 0.0;
        for (var e = 0u; e < 32u; e++) {
            x[e] = q8_src(src, b * 32u + e, pos, v);
            amax = max(amax, abs(x[e]));
        }
        let db = amax / 127.0;
        let id = select(0.0, 1.0 / db, db > 0.0);
        for (var k = 0u; k < 8u; k++) {
            let q = clamp(round(vec4<f32>(x[4u * k], x[4u * k + 1u], x[4u * k + 2u], x[4u * k + 3u]) * id),
                          vec4<f32>(-127.0), vec4<f32>(127.0));
            q8_put(v, row * D4 + b * 8u + k, q8_byte(q.x) | (q8_byte(q.y) << 8u) | (q8_byte(q.z) << 16u)
                                             | (q8_byte(q.w) << 24u));
        }
        d[b2] = db;
    }
    q8_put(v, Q8_SOFF + row * SW + w, pack2x16float(d));
}
