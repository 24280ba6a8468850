// Weight decode for Q8_0 blocks after the upload repack (34 B → 36 B = 9 words per 32 weights):
// word 0 = (d f16, zero pad); words 1..8 = qs int8[32]. value = q * d, returned as (q, (d, d, 0, 0)).
// row_words = K / 32 * 9.
@group(0) @binding(2) var<storage, read> W: array<u32>;   // (rows, K/32 blocks of 9 words)

// 4 sign-extended int8 of one word, as f32
// weight word a (row layout index) wherever the weight is stored: wmap4 (host header) maps
// vec4 words of the interleaved-span layout (copy.wgsl span_map); identity otherwise
fn wld(a: u32) -> u32 { return W[wmap4(a >> 2u) * 4u + (a & 3u)]; }

fn i8x4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q << 24u, q << 16u, q << 8u, q)) >> vec4<u32>(24u));
}

fn wchunk(base: u32, c: u32) -> WChunk {
    let b = base + c * 9u;
    let d = unpack2x16float(wld(b)).x;
    return WChunk(array<vec4<f32>, 8>(i8x4(wld(b + 1u)), i8x4(wld(b + 2u)), i8x4(wld(b + 3u)),
                                      i8x4(wld(b + 4u)), i8x4(wld(b + 5u)), i8x4(wld(b + 6u)),
                                      i8x4(wld(b + 7u)), i8x4(wld(b + 8u))),
                  vec4<f32>(d, d, 0.0, 0.0));
}

fn wvec4(base: u32, k4: u32) -> vec4<f32> { return vec4<f32>(0.0); }   // K % 32 == 0 always
