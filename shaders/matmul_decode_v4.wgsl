// matmul_decode_v4: block decoders for the T = 1 matmul that reads weights as vec4<u32>.
// Why: on CPU Vulkan (lavapipe) a per-lane storage load costs about the same per load whether it
// fetches one u32 or a vec4<u32>, so reading a weight row 16 bytes at a time cuts the load cost
// per weight word by about a third. The GGUF block layout is kept (the prefill kernels read the
// same buffer): one invocation owns 4 consecutive rows (RR = 4, first row a multiple of 4), so its
// 4 rows are one contiguous span of 4 * row_words u32 words, a whole number of vec4s starting on
// a vec4 boundary, whatever the row size (a Q4_1 row of K = 576 is 90 words: 8 bytes off).
// Blocks straddle vec4s (5 or 9 words each); the host knows where each word lies.
// The host generates the entry point `matmul_decode` with every vec4 index a constant offset from
// the invocation's base and calls `wblock_<qtype>` on the words of each 32-weight block.
// Built after matmul.wgsl + matmul_decode.wgsl (for WChunk, cdot, dec_x*, store) and with one
// `matmul_<qtype>.wgsl` (its `W` binding is the same buffer; only `W4` is used here: WGSL allows
// two declarations of one binding when no entry point uses both).

@group(0) @binding(2) var<storage, read> W4: array<vec4<u32>>;   // (rows * row_words / 4)

// 4 quants from the low (q) or high (q >> 4) nibbles of one word, component j still scaled by
// 256^j (masked in place, not shifted down: one op less per weight; exact in f32, and converted as
// i32 since every value is below 2^31). Dot them with x scaled by 256^-j (v4_xs: once per chunk,
// shared by the 4 rows; powers of 2, so exact).
fn v4_nib4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q) & vec4<u32>(0xFu, 0xF00u, 0xF0000u, 0xF000000u)));
}

// 256^-j for component j: undoes v4_nib4's in-place scaling (powers of 2, so exact)
const V4_UNSCALE = vec4<f32>(1.0, 0.00390625, 1.52587890625e-05, 5.9604644775390625e-08);

// x chunk with component j of every vec4 scaled by 256^-j (the partial sums s stay unscaled)
fn v4_xs(a: XChunk) -> XChunk {
    let f = V4_UNSCALE;
    return XChunk(array<vec4<f32>, 8>(a.v[0] * f, a.v[1] * f, a.v[2] * f, a.v[3] * f,
                                      a.v[4] * f, a.v[5] * f, a.v[6] * f, a.v[7] * f), a.s);
}

// cdot for quants scaled by 256^j (v4_nib4) against unscaled x: the per-component partial sums
// are scaled when reduced (4 multiplies per row and chunk instead of 32 per chunk on x)
fn cdot_xs(w: WChunk, a: XChunk) -> f32 { return cdot_by(w, a, V4_UNSCALE); }

// 4 sign-extended int8 of one word
fn v4_i8x4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q << 24u, q << 16u, q << 8u, q)) >> vec4<u32>(24u));
}

// Q4_1 (5 words): (d, m) f16 | qs[16]; value = q * d + m (see matmul_q4_1.wgsl). Quants scaled
// as v4_nib4 says: dot with v4_xs(x).
fn wblock_q4_1(w0: u32, w1: u32, w2: u32, w3: u32, w4: u32) -> WChunk {
    let dm = unpack2x16float(w0);
    return WChunk(array<vec4<f32>, 8>(v4_nib4(w1), v4_nib4(w2), v4_nib4(w3), v4_nib4(w4),
                                      v4_nib4(w1 >> 4u), v4_nib4(w2 >> 4u), v4_nib4(w3 >> 4u),
                                      v4_nib4(w4 >> 4u)),
                  vec4<f32>(dm.x, dm.x, dm.y, dm.y));
}

// Q4_0 after the upload repack (5 words): (d f16, pad) | qs[16]; value = (q - 8) * d; with v4_xs(x)
fn wblock_q4_0(w0: u32, w1: u32, w2: u32, w3: u32, w4: u32) -> WChunk {
    let d = unpack2x16float(w0).x;
    return WChunk(array<vec4<f32>, 8>(v4_nib4(w1), v4_nib4(w2), v4_nib4(w3), v4_nib4(w4),
                                      v4_nib4(w1 >> 4u), v4_nib4(w2 >> 4u), v4_nib4(w3 >> 4u),
                                      v4_nib4(w4 >> 4u)),
                  vec4<f32>(d, d, -8.0 * d, -8.0 * d));
}

// Q8_0 after the upload repack (9 words): (d f16, pad) | qs int8[32]; value = q * d
fn wblock_q8_0(w0: u32, w1: u32, w2: u32, w3: u32, w4: u32, w5: u32, w6: u32, w7: u32,
               w8: u32) -> WChunk {
    let d = unpack2x16float(w0).x;
    return WChunk(array<vec4<f32>, 8>(v4_i8x4(w1), v4_i8x4(w2), v4_i8x4(w3), v4_i8x4(w4),
                                      v4_i8x4(w5), v4_i8x4(w6), v4_i8x4(w7), v4_i8x4(w8)),
                  vec4<f32>(d, d, 0.0, 0.0));
}
