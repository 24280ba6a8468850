// paged_causal_window: attention_paged.wgsl's paged_causal (a chunk's causal prefill through a block
// table) for CPU adapters. kernels/attention_paged.py _windows_header appends this file to the
// header of attention_paged.wgsl (whose table_row, store_out, step and bindings it uses), with
// ksh / vsh, st, wread / wwrite, fold_staged, fold_window, load_state and save_state.
//
// lavapipe runs a workgroup on one thread with its lanes as SIMD lanes, loads storage lane by
// lane, and broadcasts a load to the lanes only where its address is a constant and no lane may be
// masked off (outside every loop and branch). So one dispatch folds one window of NWB blocks of
// 16 keys of every query: each block's keys and values are staged once by the whole workgroup in
// workgroup memory (f32), then every lane folds the block with fold_staged, written out by the
// host so that each staged read has a constant address; the window's blocks are written out too,
// and nothing branches around them (a block past a query's keys is masked, and a masked key adds
// exactly nothing after a seen one: exp(MASKED - m) = 0). The first window starts from a fresh
// state; a window stores the state (st: acc, then max and sum, per row and head) for the next one,
// or the output where it holds its block's last keys. Each window reads its index from wread[0]
// and writes the next one's to wwrite[0] (the host binds the first to zeros, then two counts in
// turn), so the host records the one entry point once per window of the chunk's keys.
// The same 16-key blocks from the same first block as paged_causal, folded in the same order with
// the same arithmetic: each query's output is paged_causal's, bit for bit. Rings, image spans and
// quantised pools keep paged_causal.
@compute @workgroup_size(64)
fn paged_causal_window(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let cap = p.max_blocks * BS;
    let w = wread[0];                            // this dispatch's window
    // query blocks counted from the chunk's last row: block k holds rows [t_end - WG, t_end),
    // t_end = rows - k WG (the first block may hold fewer), and sees n_keys - k WG keys, so the
    // blocks that reach window w are the first ceil((n_keys - w KW) / WG) (the host dispatches
    // those); a block past the rows holds none and stores nothing
    let wg = wid.y * nwg.x + wid.x;
    let n_hg = p.hq / G;
    let h0 = (wg % n_hg) * G;
    sink_h0 = h0;
    let rows = live_rows(p.n_seq);
    let pos0 = step[0];
    let t_end = rows - min(rows, (wg / n_hg) * WG);
    let t_first = t_end - min(t_end, WG);
    let n_wg = max(min(pos0 + t_end, cap), 1u);  // the keys its last query sees
    let t = min(t_first + lid, max(t_end, 1u) - 1u);   // spare lanes redo the last row, never store
    let qb = p.qkv_off + (t * p.heads + h0) * D4;
    let sb = (t * p.hq + h0) * (D4 + 1u);
    if (w == 0u) {
        load_q(qb, D4);
    } else {
        set_q(qb, D4);
        load_state(sb);
    }
    let lo = window_lo(pos0 + t);
    let lim = min(pos0 + t + 1u, cap);
    let j0 = (window_lo(pos0 + t_first) / BLK) * BLK + w * NWB * BLK;
    fold_window(j0, h0 / p.group, n_wg, lo, lim, lid);
    // the block's last window stores the output, the others the state; a window past the block's
    // keys (recorded for more keys) stores nothing
    if (t_first + lid < t_end && j0 < n_wg) {
        if (j0 + NWB * BLK >= n_wg) {
            store_out(p.out_off + (t * p.hq + h0) * D4, D4);
        } else {
            save_state(sb);
        }
    }
    if (lid == 0u) { wwrite[0] = w + 1u; }
}

// keys j0 .. j0 + BLK - 1 of kv head hk into ksh / vsh (keys past n_wg: key n_wg - 1, masked)
fn stage_block(j0: u32, hk: u32, n_wg: u32, lid: u32) {
    for (var e = lid; e < BLK * D4; e += WG) {
        let r = table_row(p.tab_off, hk, min(j0 + e / D4, n_wg - 1u)) + e % D4;
        ksh[e] = vec4<f32>(kc[p.kc_off + r]);
        vsh[e] = vec4<f32>(vc[p.vc_off + r]);
    }
}

