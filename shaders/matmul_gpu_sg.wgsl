// matmul_gpu's lane reduction through subgroup shuffles (the device's subgroups feature), no
// workgroup memory or barriers: a butterfly, lane i adding lane i ^ s for s = LN / 2, ..., 1, leaves
// every lane of a row group with the group's sum, the very additions (operands in the same order
// for lane 0) of matmul_gpu_wg.wgsl's tree. Output j of a group (activation row j / RR, weight row
// r0 + j % RR) is stored by lane j % LN.
//
// Valid when a row group's LN lanes lie in one subgroup as consecutive subgroup invocations: LN a
// power of two no larger than the adapter's smallest subgroup, and subgroups made of consecutive
// local_invocation_index values (what 1-D workgroups get on Vulkan, Metal and D3D12 drivers).

enable subgroups;

fn gpu_reduce_store(acc_in: array<vec4<f32>, TT>, lid: u32, r0: u32) {
    let lane = lid % LN;
    var acc = acc_in;
    for (var s = LN / 2u; s > 0u; s >>= 1u) {
        for (var t = 0u; t < TT; t++) { acc[t] += subgroupShuffleXor(acc[t], s); }
    }
    for (var j = lane; j < TT * RR; j += LN) {
        let t = j / RR;
        store(t, r0 + j % RR, acc[t][j % RR]);
    }
}
