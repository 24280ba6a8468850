// Weight decode for Q4_0 blocks after the upload repack (18 B → 20 B = 5 words per 32 weights):
// word 0 = (d f16, zero pad); words 1..4 = qs[16]: low nibbles are elements 0..15, high 16..31.
// value = (q - 8) * d, returned as (q, scales (d, d, -8d, -8d)). row_words = K / 32 * 5.
@group(0) @binding(2) var<storage, read> W: array<u32>;   // (rows, K/32 blocks of 5 words)

// 4 quants from the low (sh = 0) or high (sh = 4) nibbles of one word
// weight word a (row layout index) wherever the weight is stored: wmap4 (host header) maps
// vec4 words of the interleaved-span layout (copy.wgsl span_map); identity otherwise
fn wld(a: u32) -> u32 { return W[wmap4(a >> 2u) * 4u + (a & 3u)]; }

fn nib4(q: u32, sh: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) >> vec4<u32>(sh)) & vec4<u32>(15u));
}

fn wchunk(base: u32, c: u32) -> WChunk {
    let b = base + c * 5u;
    let dm = unpack2x16float(wld(b));
    let q0 = wld(b + 1u);
    let q1 = wld(b + 2u);
    let q2 = wld(b + 3u);
    let q3 = wld(b + 4u);
    return WChunk(array<vec4<f32>, 8>(nib4(q0, 0u), nib4(q1, 0u), nib4(q2, 0u), nib4(q3, 0u),
                                      nib4(q0, 4u), nib4(q1, 4u), nib4(q2, 4u), nib4(q3, 4u)),
                  vec4<f32>(dm.x, dm.x, -8.0 * dm.x, -8.0 * dm.x));
}

fn wvec4(base: u32, k4: u32) -> vec4<f32> { return vec4<f32>(0.0); }   // K % 32 == 0 always
