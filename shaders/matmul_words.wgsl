// Weight reads for the types whose decode lives in dequant.wgsl (Q5_0, Q5_1, IQ4_NL, Q5_K, Q3_K,
// Q2_K, IQ4_XS), for the row kernels: matmul.wgsl (row and 4-row tile), matmul_decode.wgsl (and
// its epilogues) and embedding.wgsl. The host header adds dequant.wgsl and
// `fn wchunk(base, c) -> WChunk { return dq_<qtype>(base, c); }`. K % 32 == 0 always.
@group(0) @binding(2) var<storage, read> W: array<u32>;   // (rows, row_words) GPU layout

// word a of the row layout wherever the weight is stored (wmap4 from the host header: identity
// unless the weight is in copy.wgsl's interleaved spans)
fn wword(a: u32) -> u32 { return W[wmap4(a >> 2u) * 4u + (a & 3u)]; }

fn wquad(a: u32) -> vec4<u32> { return vec4<u32>(wword(a), wword(a + 1u), wword(a + 2u), wword(a + 3u)); }

fn wvec4(base: u32, k4: u32) -> vec4<f32> { return vec4<f32>(0.0); }   // no K % 32 tail
