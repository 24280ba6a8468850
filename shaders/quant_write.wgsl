// quant_write: quantise blocks 2w and 2w + 1 of one head row into row `row` of a quantised cache
// (kv_quant.wgsl's layout; kv_blocks.wgsl's codes, llama.cpp's rules: the scale from the block's
// largest |x| in f32, the codes from x times its inverse, the scale stored as f16), for the kernels
// that write the cache: kv_quant.wgsl and rope_kv_quant.wgsl. Each defines where the values come
// from and where the words go:
//   fn kv_src(src: u32, e: u32, pos: u32, v: u32) -> f32   value e of the k (v = 0) or v (v = 1)
//                                                           head whose data starts at `src`
//   fn kv_put(v: u32, i: u32, word: u32)                    word i of the K (v = 0) or V cache
// The host header supplies D4, KV_BITS, KV_VPW, SW and KV_SOFF, then kv_blocks.wgsl.

fn quant_write(src: u32, pos: u32, v: u32, w: u32, row: u32) {
    let per_word = 32u / KV_BITS;                    // values per word; a block fills KV_BITS words
    var d = vec2<f32>(0.0);
    for (var b2 = 0u; b2 < 2u; b2++) {
        let b = 2u * w + b2;
        if (b * 8u >= D4) { break; }
        var x: array<f32, 32>;
        var amax = 0.0;
        var vmax = 0.0;                              // the first value of largest |x|, its sign kept
        for (var e = 0u; e < 32u; e++) {
            x[e] = kv_src(src, b * 32u + e, pos, v);
            if (abs(x[e]) > amax) { amax = abs(x[e]); vmax = x[e]; }
        }
        let db = kv_scale(amax, vmax);
        let id = select(0.0, 1.0 / db, db != 0.0);
        for (var k = 0u; k < KV_BITS; k++) {
            var word = 0u;
            for (var j = 0u; j < per_word; j++) {
                word |= kv_code(x[k * per_word + j] * id) << (j * KV_BITS);
            }
            kv_put(v, row * (D4 / KV_VPW) + b * KV_BITS + k, word);
        }
        d[b2] = db;
    }
    kv_put(v, KV_SOFF + row * SW + w, pack2x16float(d));
}
