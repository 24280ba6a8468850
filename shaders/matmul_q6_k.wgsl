// Weight decode for Q6_K super-blocks after the upload repack (210 B → 212 B = 53 words per 256):
// ql[128] (low 4 bits), qh[64] (high 2 bits), scales int8[16], d f16, 2 zero bytes.
// value = d * sc * (q - 32), one scale per 16 weights. Element e of a half h (128 weights):
// quarter = e / 32, l = e % 32: low bits in nibble (quarter >= 2) of ql[64h + 32(quarter & 1) + l],
// high bits at bit 2*quarter of qh[32h + l], scale scales[8h + 2 quarter + l / 16].
// A chunk is one 32-weight quarter j of super-block c / 8, returned as (q, (d*s0, d*s1, -32 d*s0,
// -32 d*s1)) with s0 for its first 16 weights and s1 for the next 16. row_words = K / 256 * 53.
@group(0) @binding(2) var<storage, read> W: array<u32>;   // (rows, K/256 blocks of 53 words)

fn q6x4(l: u32, h: u32, shl: u32, shh: u32) -> vec4<f32> {
    let lo4 = (vec4<u32>(l, l >> 8u, l >> 16u, l >> 24u) >> vec4<u32>(shl)) & vec4<u32>(15u);
    let hi2 = (vec4<u32>(h, h >> 8u, h >> 16u, h >> 24u) >> vec4<u32>(shh)) & vec4<u32>(3u);
    return vec4<f32>(lo4 | (hi2 << vec4<u32>(4u)));
}

fn wchunk(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 53u;
    let j = c % 8u;
    let h = j / 4u;
    let qd = j % 4u;
    let d = unpack2x16float(W[b + 52u]).x;
    let sb = 192u + 8u * h + 2u * qd;                    // both scales lie in one word
    let sw = W[b + sb / 4u] >> ((sb % 4u) * 8u);
    let s0 = d * f32(bitcast<i32>(sw << 24u) >> 24u);
    let s1 = d * f32(bitcast<i32>(sw << 16u) >> 24u);
    let ql = b + 16u * h + 8u * (qd & 1u);
    let qh = b + 32u + 8u * h;
    let shl = 4u * (qd >> 1u);
    let shh = 2u * qd;
    return WChunk(array<vec4<f32>, 8>(
        q6x4(W[ql], W[qh], shl, shh), q6x4(W[ql + 1u], W[qh + 1u], shl, shh),
        q6x4(W[ql + 2u], W[qh + 2u], shl, shh), q6x4(W[ql + 3u], W[qh + 3u], shl, shh),
        q6x4(W[ql + 4u], W[qh + 4u], shl, shh), q6x4(W[ql + 5u], W[qh + 5u], shl, shh),
        q6x4(W[ql + 6u], W[qh + 6u], shl, shh), q6x4(W[ql + 7u], W[qh + 7u], shl, shh)),
        vec4<f32>(s0, s1, -32.0 * s0, -32.0 * s1));
}

fn wvec4(base: u32, k4: u32) -> vec4<f32> { return vec4<f32>(0.0); }   // K % 256 == 0 always
