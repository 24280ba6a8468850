// lanes8: the first 8 lanes' vec4s of a subgroup as every lane's array (lane i: values 4i .. 4i + 3
// of a 32-value block). A CPU driver (lavapipe) loads a storage or workgroup word lane by lane, so
// lane i of each 8 loads only vec4 i and this hands the 8 to every lane (an extract and a splat each
// on a SIMD CPU; a shuffle on a GPU). Needs `enable subgroups;` and subgroups of 8 lanes or more:
// matmul_wide.wgsl (kernels/matmul/wide.py), lora.wgsl and lora_rows.wgsl (kernels/lora.py).
fn lanes8(v: vec4<f32>) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(subgroupBroadcast(v, 0u), subgroupBroadcast(v, 1u), subgroupBroadcast(v, 2u),
                               subgroupBroadcast(v, 3u), subgroupBroadcast(v, 4u), subgroupBroadcast(v, 5u),
                               subgroupBroadcast(v, 6u), subgroupBroadcast(v, 7u));
}
