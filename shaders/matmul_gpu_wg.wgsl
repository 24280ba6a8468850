// matmul_gpu's lane reduction through workgroup memory: the LN partial sums of each row group
// added as a tree (stride LN / 2, LN / 4, ..., 1), then output j of a group (activation row j / RR,
// weight row r0 + j % RR) stored by lane j % LN. Needs WG * TT * 16 bytes of workgroup memory.

var<workgroup> red: array<vec4<f32>, WG * TT>;   // (TT, WG): lane partial sums of RR rows

fn gpu_reduce_store(acc: array<vec4<f32>, TT>, lid: u32, r0: u32) {
    let lane = lid % LN;
    let grp = lid / LN;
    for (var t = 0u; t < TT; t++) { red[t * WG + lid] = acc[t]; }
    workgroupBarrier();
    for (var s = LN / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var t = 0u; t < TT; t++) { red[t * WG + lid] += red[t * WG + lid + s]; }
        }
        workgroupBarrier();
    }
    for (var j = lane; j < TT * RR; j += LN) {
        let t = j / RR;
        store(t, r0 + j % RR, red[t * WG + grp * LN][j % RR]);
    }
}
