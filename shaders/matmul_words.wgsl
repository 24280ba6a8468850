// Weight reads for the quantised types (kernels/qtypes.py), whose decode lives in dequant.wgsl, for
// the row kernels: matmul.wgsl (row and 4-row tile), matmul_batch.wgsl, matmul_gemm.wgsl,
// matmul_gpu.wgsl, matmul_decode.wgsl (and its epilogues), matmul_decode_v4.wgsl (which reads the
// same buffer as vec4 words) and embedding.wgsl. The host header adds dequant.wgsl, `wnib4` and
// `fn wchunk(base, c) -> WChunk { return dq_<qtype>(base, c); }` (kernels/matmul/codegen.py
// dequant_source). K % 32 == 0 always.
@group(0) @binding(2) var<storage, read> W: array<u32>;   // (rows, row_words) GPU layout

// word a of the row layout wherever the weight is stored (wmap4 from the host header: identity
// unless the weight is in copy.wgsl's interleaved spans)
fn wword(a: u32) -> u32 { return W[wmap4(a >> 2u) * 4u + (a & 3u)]; }

fn wquad(a: u32) -> vec4<u32> { return vec4<u32>(wword(a), wword(a + 1u), wword(a + 2u), wword(a + 3u)); }

fn woct(a: u32) -> array<vec4<u32>, 2> { return array<vec4<u32>, 2>(wquad(a), wquad(a + 4u)); }

fn wvec4(base: u32, k4: u32) -> vec4<f32> { return vec4<f32>(0.0); }   // no K % 32 tail
