// attn_flash: prefill attention (attn_causal's semantics, see attention.wgsl) for GPUs, flash-
// attention style: the keys and values of each 16-key block are staged once in workgroup memory by
// the whole workgroup and read from there by its 64 queries, which fold them with the same online
// softmax as attn_causal (running max, rescaled accumulator), block by block from the same first
// block: a query's result does not depend on how many queries run with it.
// dispatch nblk*Hq/G workgroups of 64 (as attn_causal).
//
// The host prepends nn._attn_header with its key / value reads pointed at `ksh` / `vsh` (f32, row
// j of a block at j * D4) and attention.wgsl (Params, bindings, store_out; attention_common.wgsl's
// causal_block, window_lo, fold_block, BLK, WG).

var<workgroup> ksh: array<vec4<f32>, BLK * D4>;   // (BLK, D4): keys j0 .. j0 + BLK - 1 of one kv head
var<workgroup> vsh: array<vec4<f32>, BLK * D4>;   // (BLK, D4): their values

@compute @workgroup_size(64)
fn attn_flash(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let c = causal_block(wid, nwg, p.rows, p.ctx);
    if (c.t0 >= c.rows) { return; }              // the whole workgroup: barriers stay uniform
    let t = min(c.t0 + lid, c.rows - 1u);        // spare lanes redo the last row, never store
    let n_wg = c.n_wg;
    load_q(p.qkv_off + (t * p.heads + c.h0) * D4, D4);
    let cb = (c.h0 / p.group) * p.ctx * D4;
    let lo = window_lo(c.pos0 + t);
    let lim = min(c.pos0 + t + 1u, p.ctx);
    for (var j0 = (window_lo(c.pos0 + c.t0) / BLK) * BLK; j0 < n_wg; j0 += BLK) {
        let nb = min(BLK, n_wg - j0);
        for (var e = lid; e < BLK * D4; e += WG) {
            let r = cb + min(j0 + e / D4, n_wg - 1u) * D4 + e % D4;
            ksh[e] = kc_at(p.kc_off + r);         // (dequantised from a q8_0 / q4_0 cache)
            vsh[e] = vc_at(p.vc_off + r);
        }
        workgroupBarrier();
        fold_block(j0, nb, lo, lim, j0, KeyBlock(0u, D4, 0u, D4));   // the staged keys j0 + j at row j
        workgroupBarrier();
    }
    if (c.t0 + lid < c.rows) { store_out(p.out_off + (t * p.hq + c.h0) * D4, D4, 0u); }
}
