// rope_kv_quant: rope_kv (rope.wgsl) for a quantised cache (kv_quant.wgsl's layout) in one dispatch: the q
// heads of qkv rows t < n_new rotated in place at position pos0 + t, and each row's k heads (rotated
// here, in f32) and v heads quantised into cache row h*ctx + pos0 + t (RING: h*ctx + cache_row(pos)).
// The k heads in qkv are left as they were (attention reads keys from the cache).
//   lanes [0, T*Hq*units): rope.wgsl's units over the q heads (h_lo 0, n_h = n_rot = Hq);
//   the rest: a lane per (t, k|v, kv head, scale word w), blocks 2w and 2w + 1 (kv_quant's).
// Built after sincos.wgsl and rope.wgsl (the host prepends them: Params, bindings 0-3, locate,
// rotate, rot) and quant_write.wgsl (the quantising); the header supplies D4, KV_BITS, KV_VPW, SW and
// KV_SOFF, then kv_blocks.wgsl.

@group(0) @binding(4) var<storage, read_write> kq: array<u32>;
@group(0) @binding(5) var<storage, read_write> vq: array<u32>;

// element e of the head whose first vec2 is `src`, rotated at `pos` when `turn` (a k head)
fn head_value(src: u32, e: u32, pos: u32, turn: bool) -> f32 {
    let x = vec2<f32>(qkv[src + e / 2u])[e % 2u];
    if (!turn || e >= 2u * p.half) { return x; }
    if (p.neox != 0u) {                   // pairs (i, i + half)
        if (e < p.half) {
            return rot(x, vec2<f32>(qkv[src + (e + p.half) / 2u])[(e + p.half) % 2u], pos, e).x;
        }
        let i = e - p.half;
        return rot(vec2<f32>(qkv[src + i / 2u])[i % 2u], x, pos, i).y;
    }
    let pair = vec2<f32>(qkv[src + e / 2u]);   // adjacent pairs (2i, 2i + 1): one vec2
    return rot(pair.x, pair.y, pos, e / 2u)[e % 2u];
}

// quant_write.wgsl's value source (a k head rotated at `pos` in f32) and sink (the two caches)
fn kv_src(src: u32, e: u32, pos: u32, v: u32) -> f32 {
    return head_value(src, e, pos, v == 0u);
}

fn kv_put(v: u32, i: u32, w: u32) {
    if (v == 0u) { kq[i] = w; } else { vq[i] = w; }
}

@compute @workgroup_size(64)
fn rope_kv_quant(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    let n_rope = p.rows * p.n_h * p.units;
    if (i < n_rope) {
        let q = locate(wid, nwg, lid);
        if (q.ok) { _ = rotate(q, step[0] + q.t, p.qkv_off + (q.t * p.heads + q.h) * p.hd2); }
        return;
    }
    let j = i - n_rope;
    let per_row = 2u * p.n_kv * SW;
    let t = j / per_row;
    let n_new = step[1];
    let rows = select(p.rows, min(p.rows, n_new), n_new != 0u);
    let pos = step[0] + t;
    if (t >= rows || (!RING && pos >= p.ctx)) { return; }
    let r = j % per_row;
    let v = r / (p.n_kv * SW);                 // 0: k, 1: v
    let h = (r / SW) % p.n_kv;
    let w = r % SW;
    quant_write(p.qkv_off + (t * p.heads + p.k_lo + v * p.n_kv + h) * p.hd2, pos, v, w, h * p.ctx + cache_row(pos));
}
