// matmul_decode_v4: the T = 1 matmul that reads weights as vec4<u32>.
// Why: on CPU Vulkan (lavapipe) a per-lane storage load costs about the same per load whether it
// fetches one u32 or a vec4<u32>, so reading a weight row 16 bytes at a time cuts the load cost
// per weight word by about a third. The GGUF block layout is kept (the prefill kernels read the
// same buffer): one invocation owns 4 consecutive rows (RR = 4, first row a multiple of 4), so its
// 4 rows are one contiguous span of 4 * row_words u32 words, a whole number of vec4s starting on
// a vec4 boundary, whatever the row size (a Q4_1 row of K = 576 is 90 words: 8 bytes off).
// Blocks straddle vec4s (5 or 9 words each); the host knows where each word lies.
// The host generates the entry point `matmul_decode` with every vec4 index a constant offset from
// the invocation's base and calls dequant.wgsl's `dq_<qtype>_w` on the words of each 32-weight
// block. Q4_0 / Q4_1 quants come masked in place (dequant.wgsl dq_nib4_inplace: the host's `wnib4`
// for this kernel), component j scaled by 256^j: they are dotted with v4_xs(x), or with cdot_xs.
// Built after matmul.wgsl + matmul_decode.wgsl (for WChunk, cdot, dec_x*, store) and with
// matmul_words.wgsl + dequant.wgsl (its `W` binding is the same buffer; only `W4` is used here: WGSL
// allows two declarations of one binding when no entry point uses both).

@group(0) @binding(2) var<storage, read> W4: array<vec4<u32>>;   // (rows * row_words / 4)

// 256^-j for component j: undoes dq_nib4_inplace's scaling (powers of 2, so exact)
const V4_UNSCALE = vec4<f32>(1.0, 0.00390625, 1.52587890625e-05, 5.9604644775390625e-08);

// x chunk with component j of every vec4 scaled by 256^-j (the partial sums s stay unscaled)
fn v4_xs(a: XChunk) -> XChunk {
    let f = V4_UNSCALE;
    return XChunk(array<vec4<f32>, 8>(a.v[0] * f, a.v[1] * f, a.v[2] * f, a.v[3] * f,
                                      a.v[4] * f, a.v[5] * f, a.v[6] * f, a.v[7] * f), a.s);
}

// cdot for quants scaled by 256^j (dq_nib4_inplace) against unscaled x: the per-component partial sums
// are scaled when reduced (4 multiplies per row and chunk instead of 32 per chunk on x)
fn cdot_xs(w: WChunk, a: XChunk) -> f32 { return cdot_by(w, a, V4_UNSCALE); }
