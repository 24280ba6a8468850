// matmul_gpu: y[t, n0 + r] (+)= sum_k x[t, k] * W[r, k] (+ bias[n0 + r]) for the T <= TT activation
// rows of a decode step (1..8 sequences), f32 accumulation; for GPUs.
// dispatch (groups, 1, 1) or folded into (65535, ceil(groups / 65535), 1) with
// groups = ceil(rows / (RR * WG / LN)), workgroup WG.
//
// The host prepends the activation header, consts WG (invocations per workgroup), RR (weight rows
// per row group: 1, 2 or 4), LN (lanes per row group, a power of two dividing WG), TT (activation
// rows held: 1, 2, 4 or 8; rows past T re-read row T - 1 and are not stored), `xword` / `xget`,
// `wmap4`, and matmul.wgsl (MatmulParams, WChunk, xchunk, cdot, wchunks, rows4; matmul_io.wgsl's
// bindings 1, 3, 4 and store);
// then this file and the reduction (`gpu_reduce_store`: matmul_gpu_wg.wgsl through workgroup memory
// or matmul_gpu_sg.wgsl through subgroup shuffles); the weight type's file follows (binding 2,
// `wchunk` / `wvec4`, the same decode every kernel uses).
//
// Strategy (for GPUs, where neighbouring invocations' loads coalesce): a workgroup holds WG / LN row
// groups; the LN lanes of a group stride along K over 32-weight chunks of the same RR rows, so lane
// i reads chunk i, lane i + 1 the next block of the row: one contiguous span per SIMD group. Each
// chunk is decoded once in registers and multiplied with the TT activation rows. The lanes' partial
// sums are then reduced over the LN lanes of each group, the same tree of additions in either
// reduction, so that both give the same bits.

// the first word of row r, rows past the end clamped to the last (their sums are not stored)
fn gpu_row(r: u32) -> u32 { return min(r, P.rows - 1u) * P.row_words; }

@compute @workgroup_size(WG)
fn matmul_gpu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let lane = lid % LN;
    let grp = lid / LN;
    let r0 = ((wid.y * nw.x + wid.x) * (WG / LN) + grp) * RR;
    let b0 = gpu_row(r0);
    let b1 = gpu_row(r0 + 1u);
    let b2 = gpu_row(r0 + 2u);
    let b3 = gpu_row(r0 + 3u);
    let k4 = P.K / 4u;
    let lt = P.T - 1u;
    var acc: array<vec4<f32>, TT>;          // acc[t]: activation row t with weight rows r0..r0+3
    for (var t = 0u; t < TT; t++) { acc[t] = vec4<f32>(0.0); }
    for (var c = lane; c < P.nchunks; c += LN) {
        let w = wchunks(vec4<u32>(b0, b1, b2, b3), c);
        for (var t = 0u; t < TT; t++) {
            acc[t] = rows4(w, xchunk(P.x_off4 + min(t, lt) * k4 + c * 8u), acc[t]);
        }
    }
    // float weights with K % 32 != 0: the last K % 32 columns, 4 at a time
    for (var q = P.nchunks * 8u + lane; q < P.k4; q += LN) {
        let v0 = wvec4(b0, q);
        let v1 = wvec4(b1, q);
        let v2 = wvec4(b2, q);
        let v3 = wvec4(b3, q);
        for (var t = 0u; t < TT; t++) {
            let xv = xget(P.x_off4 + min(t, lt) * k4 + q);
            acc[t] += vec4<f32>(dot(v0, xv), dot(v1, xv), dot(v2, xv), dot(v3, xv));
        }
    }
    gpu_reduce_store(acc, lid, r0);
}
