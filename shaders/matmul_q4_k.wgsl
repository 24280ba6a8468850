// Weight decode for Q4_K super-blocks as stored in GGUF (144 B = 36 words per 256 weights):
// word 0 = (d f16, dmin f16); bytes 4..15 = scales[12] (8 six-bit scales + 8 six-bit mins, packed as
// ggml's get_scale_min_k4); bytes 16..143 = qs[128] in 4 groups of 32 bytes, each group holding
// sub-block 2g in its low nibbles and 2g+1 in its high nibbles. value = d*sc*q - dmin*m, returned
// as (q, (d*sc, d*sc, -dmin*m, -dmin*m)). A chunk is one 32-weight sub-block j of super-block c / 8.
// row_words = K / 256 * 36.
@group(0) @binding(2) var<storage, read> W: array<u32>;   // (rows, K/256 blocks of 36 words)

fn sbyte(b: u32, i: u32) -> u32 {   // byte i of scales[12]
    return (W[b + 1u + i / 4u] >> ((i % 4u) * 8u)) & 0xFFu;
}

fn nib4(q: u32, sh: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) >> vec4<u32>(sh)) & vec4<u32>(15u));
}

fn wchunk(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 36u;
    let j = c % 8u;
    let dd = unpack2x16float(W[b]);
    var sc: u32;
    var mn: u32;
    if (j < 4u) {
        sc = sbyte(b, j) & 63u;
        mn = sbyte(b, j + 4u) & 63u;
    } else {
        sc = (sbyte(b, j + 4u) & 15u) | ((sbyte(b, j - 4u) >> 6u) << 4u);
        mn = (sbyte(b, j + 4u) >> 4u) | ((sbyte(b, j) >> 6u) << 4u);
    }
    let d = dd.x * f32(sc);
    let m = -dd.y * f32(mn);
    let q = b + 4u + (j / 2u) * 8u;          // first word of this sub-block's 32 qs bytes
    let sh = (j % 2u) * 4u;
    return WChunk(array<vec4<f32>, 8>(nib4(W[q], sh), nib4(W[q + 1u], sh), nib4(W[q + 2u], sh),
                                      nib4(W[q + 3u], sh), nib4(W[q + 4u], sh), nib4(W[q + 5u], sh),
                                      nib4(W[q + 6u], sh), nib4(W[q + 7u], sh)),
                  vec4<f32>(d, d, m, m));
}

fn wvec4(base: u32, k4: u32) -> vec4<f32> { return vec4<f32>(0.0); }   // K % 256 == 0 always
