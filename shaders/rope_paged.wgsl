// rope_kv_paged: rope_kv (rope.wgsl) for rows at positions of their own, writing the paged KV pool.
//   Row t of qkv (T, Hq+2Hkv, D) has position positions[t] (a decode batch: each sequence's next
//   position; a prefill chunk: pos0 + t); its q and k heads are rotated in place, then its (rotated)
//   k heads and v heads go to pool row slots[t] of kc / vc (n_blocks, BS, Hkv, D) (slot = block *
//   BS + offset; 0xffffffff: rotate only). Rows t >= step[1] (0: all) are skipped.
// Built after sincos.wgsl and rope.wgsl (the host prepends them): their Params, bindings 0-5,
// locate(), rotate() and put_kv() are reused; p.ctx is unused. dispatch as rope_kv.

@group(0) @binding(6) var<storage, read> positions: array<u32>;   // (T)
@group(0) @binding(7) var<storage, read> slots: array<u32>;       // (T)

@compute @workgroup_size(64)
fn rope_kv_paged(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);
    if (!q.ok) { return; }
    let v = rotate(q, positions[q.t], p.qkv_off + (q.t * p.heads + q.h) * p.hd2);
    let slot = slots[q.t];
    if (slot == 0xffffffffu || q.h < p.k_lo) { return; }
    let g = q.h - p.k_lo;
    put_kv(q, v, g, p.kc_off + (slot * p.n_kv + g) * p.hd2, p.vc_off + (slot * p.n_kv + g - p.n_kv) * p.hd2);
}

// rope_paged: rope_kv_paged's rotation only (a quantised pool is written by kv_quant.wgsl's
// kv_quant_slots after it): q and k heads of row t rotated in place at positions[t].
@compute @workgroup_size(64)
fn rope_paged(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);
    if (!q.ok) { return; }
    _ = rotate(q, positions[q.t], p.qkv_off + (q.t * p.heads + q.h) * p.hd2);
}

// rope_kv_rows: rope_kv_paged for CPU adapters (no ring, adjacent pairs, pools in the activations'
// dtype): one invocation per (row t, pair u of a head) instead of per (row, head, pair), so each
// angle's sin and cos are computed once for the row's q and k heads (rope_kv_paged computes them
// once per head, in branches that each mask the SIMD lanes). The same rotation of the same values
// (rotate_by's arithmetic, then * mscale), the same stores. dispatch ceil(T * D/2 / 64) over x,y.
@compute @workgroup_size(64)
fn rope_kv_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    let u = i % p.hd2;
    let t = i / p.hd2;
    let n_new = step[1];
    if (t >= select(p.rows, min(p.rows, n_new), n_new != 0u)) { return; }
    let turn = u < p.half;
    var sc = vec2<f32>(0.0, 1.0);
    if (turn) { sc = sincos(f32(positions[t]) * inv_freq[u]); }
    let slot = slots[t];
    let row = p.qkv_off + t * p.heads * p.hd2 + u;
    for (var h = 0u; h < p.n_rot; h++) {        // q heads, then k heads: rotated
        let a = vec2<f32>(qkv[row + h * p.hd2]);
        var v = a;
        if (turn) {
            v = vec2<f32>(a.x * sc.y - a.y * sc.x, a.x * sc.x + a.y * sc.y) * p.mscale;
            qkv[row + h * p.hd2] = vec2<act>(v);
        }
        if (h >= p.k_lo && slot != 0xffffffffu) {
            kc[p.kc_off + (slot * p.n_kv + h - p.k_lo) * p.hd2 + u] = vec2<act>(v);
        }
    }
    if (slot == 0xffffffffu) { return; }
    for (var g = 0u; g < p.n_kv; g++) {         // v heads: copied
        vc[p.vc_off + (slot * p.n_kv + g) * p.hd2 + u] = qkv[row + (p.n_rot + g) * p.hd2];
    }
}
