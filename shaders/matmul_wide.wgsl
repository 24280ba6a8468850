// matmul_wide: the fused decode matmul (matmul_decode.wgsl, matmul_decode_v4.wgsl) for 5..16
// activation rows (continuous batching: one row per sequence), each weight chunk read and decoded
// once for every row, each row's sums made as the one-row kernel makes them alone (the same WGSL
// calls in the same order: dq_*, cdot / cdot_xs, xc_of, dec_sq), so a row's bits do not depend on
// how many rows run, and equal the one-row kernel's wherever the driver compiles the shared calls
// alike (tests/test_kernels_matmul_batch.py checks it on the adapter).
// Why not the unrolled kernel with more rows: its straight-line code grows as rows x K (minutes
// to compile at 8 rows, and 5.4-5.6x one row's time on lavapipe). Here the K loop is a loop (the
// host unrolls only the U chunks one loop step takes, so that a vec4 weight span's word offsets
// stay constants), and x reaches the lanes through the subgroup: a CPU driver (lavapipe) loads a
// storage word lane by lane wherever the address is not a constant outside every loop, so lane l
// of each 8 loads only vec4 l of a row's 32-activation chunk and subgroupBroadcast hands the 8 of
// them to every lane (an extract and a splat each on a SIMD CPU; a shuffle on a GPU). Products
// (x * g, act(gate) * up) are made after the broadcast, on the values the one-row kernel makes them
// from: made per lane before it, lavapipe's sums differed from the one-row kernel's in the last bit.
// Needs the subgroups feature and subgroups of 8 lanes or more (wide.py `ok`).
// Built after matmul.wgsl and matmul_decode.wgsl (+ matmul_decode_v4.wgsl for vec4 weights); the
// host (kernels/matmul/wide.py) generates the entry point `matmul_decode`.
// dispatch (ceil(rows / (WG * RR)), 1, 1), workgroup WG

enable subgroups;

// the lanes' vec4s reach every lane by lanes8 (subgroup_lanes.wgsl, built after this file)

// dec_x's chunk (plain, pnorm) from the lanes' vec4s
fn wide_chunk(v: vec4<f32>) -> XChunk {
    return xc_of(lanes8(v));
}

// dec_sq of the chunk (norm mode: the sum of x^2 as dec_sq makes it)
fn wide_sq(xv: vec4<f32>) -> f32 {
    let a = lanes8(xv);
    let s = (a[0] * a[0] + a[1] * a[1]) + (a[2] * a[2] + a[3] * a[3]) + (a[4] * a[4] + a[5] * a[5]) +
            (a[6] * a[6] + a[7] * a[7]);
    return dot(s, vec4<f32>(1.0));
}

// dec_xn's chunk from the lanes' x and g vec4s: the products made after the broadcast, as dec_xn makes them
fn wide_chunk_n(xv: vec4<f32>, gv: vec4<f32>) -> XChunk {
    let a = lanes8(xv);
    let b = lanes8(gv);
    var v: array<vec4<f32>, 8>;
    v[0] = a[0] * b[0];
    v[1] = a[1] * b[1];
    v[2] = a[2] * b[2];
    v[3] = a[3] * b[3];
    v[4] = a[4] * b[4];
    v[5] = a[5] * b[5];
    v[6] = a[6] * b[6];
    v[7] = a[7] * b[7];
    return xc_of(v);
}

// dec_xs's chunk from the lanes' gate and up vec4s
fn wide_chunk_s(gv: vec4<f32>, uv: vec4<f32>) -> XChunk {
    let a = lanes8(gv);
    let b = lanes8(uv);
    var v: array<vec4<f32>, 8>;
    v[0] = silu4(a[0], b[0]);
    v[1] = silu4(a[1], b[1]);
    v[2] = silu4(a[2], b[2]);
    v[3] = silu4(a[3], b[3]);
    v[4] = silu4(a[4], b[4]);
    v[5] = silu4(a[5], b[5]);
    v[6] = silu4(a[6], b[6]);
    v[7] = silu4(a[7], b[7]);
    return xc_of(v);
}
