// dequant: the weight decode of Q5_0, Q5_1, IQ4_NL, Q5_K, Q3_K, Q2_K and IQ4_XS, written once and
// compiled into every kernel that reads weights (matmul.wgsl's row and tile kernels, the unrolled
// decode kernel and its epilogues, embedding.wgsl, matmul_tiled.wgsl).
//
// `dq_<qtype>(base, c) -> WChunk` decodes chunk c (32 weights, columns 32c..32c+31) of the row whose
// first u32 word is `base` (GPU layout: kernels/qtypes.py), as quants q and affine scales s:
// value[i] = q[i] * s.x + s.z for the first 16 weights (i < 4), q[i] * s.y + s.w for the next 16.
// The including kernel provides the struct WChunk and the weight readers
//   wword(a) -> u32         word a of the row layout
//   wquad(a) -> vec4<u32>   words a..a+3 (types whose blocks are whole vec4 words call it only at
//                           offsets that are multiples of 4 inside a block, so a kernel may read
//                           one aligned vec4 there)
// Blocks of 22, 18 and 110 bytes arrive with 2 zero bytes inserted by the upload repack (at byte 2
// for Q5_0 / IQ4_NL, at the end for Q3_K), so every field below sits in whole words.

// the 4 bytes of a word, low byte first
fn dq_bytes(q: u32) -> vec4<u32> { return vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xFFu); }

// 4 nibbles: the low (sh = 0) or high (sh = 4) halves of the bytes of q
fn dq_nib(q: u32, sh: u32) -> vec4<u32> { return (dq_bytes(q) >> vec4<u32>(sh)) & vec4<u32>(15u); }

// 4 quants of 5 bits: nibbles of q, fifth bits from bits hs..hs+3 of h (Q5_0 / Q5_1 qh)
fn dq_q5x4(q: u32, sh: u32, h: u32, hs: u32) -> vec4<f32> {
    let hi = (vec4<u32>(h) >> (vec4<u32>(hs) + vec4<u32>(0u, 1u, 2u, 3u))) & vec4<u32>(1u);
    return vec4<f32>(dq_nib(q, sh) | (hi << vec4<u32>(4u)));
}

// 4 quants: bits sh.. of the bytes of q (width mask m), then bit hb of the bytes of h on top at `at`
fn dq_bits4(q: u32, sh: u32, m: u32, h: u32, hb: u32, at: u32) -> vec4<f32> {
    let lo = (dq_bytes(q) >> vec4<u32>(sh)) & vec4<u32>(m);
    let hi = (dq_bytes(h) >> vec4<u32>(hb)) & vec4<u32>(1u);
    return vec4<f32>(lo | (hi << vec4<u32>(at)));
}

// kvalues_iq4nl (-127 -104 -83 -65 | -49 -35 -22 -10 | 1 13 25 38 | 53 69 89 113) as int8 x 4 per
// word: a nibble n picks word n / 4, byte n % 4 (selects, no table in memory)
const DQ_KV0: u32 = 0xbfad9881u;
const DQ_KV1: u32 = 0xf6eaddcfu;
const DQ_KV2: u32 = 0x26190d01u;
const DQ_KV3: u32 = 0x71594535u;

fn dq_kv4(q: u32, sh: u32) -> vec4<f32> {
    let n = dq_nib(q, sh);
    let hi = n >> vec4<u32>(2u);
    let w = select(select(vec4<u32>(DQ_KV0), vec4<u32>(DQ_KV1), hi == vec4<u32>(1u)),
                   select(vec4<u32>(DQ_KV2), vec4<u32>(DQ_KV3), hi == vec4<u32>(3u)), hi >= vec4<u32>(2u));
    let byte_at_top = w << ((vec4<u32>(3u) - (n & vec4<u32>(3u))) * vec4<u32>(8u));
    return vec4<f32>(bitcast<vec4<i32>>(byte_at_top) >> vec4<u32>(24u));
}

// Q5_0, 24 B = 6 words per 32: (d f16, pad), qh u32 (bit e: fifth bit of element e), qs[16] (low
// nibbles elements 0..15, high 16..31). value = (q - 16) d.
fn dq_q5_0(base: u32, c: u32) -> WChunk {
    let b = base + c * 6u;
    let d = unpack2x16float(wword(b)).x;
    let h = wword(b + 1u);
    let q = wquad(b + 2u);
    return WChunk(array<vec4<f32>, 8>(
        dq_q5x4(q.x, 0u, h, 0u), dq_q5x4(q.y, 0u, h, 4u), dq_q5x4(q.z, 0u, h, 8u), dq_q5x4(q.w, 0u, h, 12u),
        dq_q5x4(q.x, 4u, h, 16u), dq_q5x4(q.y, 4u, h, 20u), dq_q5x4(q.z, 4u, h, 24u), dq_q5x4(q.w, 4u, h, 28u)),
        vec4<f32>(d, d, -16.0 * d, -16.0 * d));
}

// Q5_1, 24 B = 6 words per 32 as in GGUF: (d, m f16), qh u32, qs[16]. value = q d + m.
fn dq_q5_1(base: u32, c: u32) -> WChunk {
    let b = base + c * 6u;
    let dm = unpack2x16float(wword(b));
    let h = wword(b + 1u);
    let q = wquad(b + 2u);
    return WChunk(array<vec4<f32>, 8>(
        dq_q5x4(q.x, 0u, h, 0u), dq_q5x4(q.y, 0u, h, 4u), dq_q5x4(q.z, 0u, h, 8u), dq_q5x4(q.w, 0u, h, 12u),
        dq_q5x4(q.x, 4u, h, 16u), dq_q5x4(q.y, 4u, h, 20u), dq_q5x4(q.z, 4u, h, 24u), dq_q5x4(q.w, 4u, h, 28u)),
        vec4<f32>(dm.x, dm.x, dm.y, dm.y));
}

// IQ4_NL, 20 B = 5 words per 32: (d f16, pad), qs[16] (low nibbles 0..15, high 16..31).
// value = d kvalues[nibble].
fn dq_iq4_nl(base: u32, c: u32) -> WChunk {
    let b = base + c * 5u;
    let d = unpack2x16float(wword(b)).x;
    let q = wquad(b + 1u);
    return WChunk(array<vec4<f32>, 8>(dq_kv4(q.x, 0u), dq_kv4(q.y, 0u), dq_kv4(q.z, 0u), dq_kv4(q.w, 0u),
                                      dq_kv4(q.x, 4u), dq_kv4(q.y, 4u), dq_kv4(q.z, 4u), dq_kv4(q.w, 4u)),
                  vec4<f32>(d, d, 0.0, 0.0));
}

// byte i (0..11) of the 12 scale bytes held in words 1..3 of a K-quant head h
fn dq_sbyte(h: vec4<u32>, i: u32) -> u32 { return (h[1u + i / 4u] >> ((i % 4u) * 8u)) & 0xFFu; }

// Q5_K, 176 B = 44 words per 256: (d, dmin f16), scales[12] (Q4_K's six-bit scale/min pairs),
// qh[32] (bit j of qh[l]: fifth bit of element l of sub-block j), qs[128] (4 groups of 32 bytes:
// sub-block 2g in the low nibbles, 2g + 1 in the high). Chunk c = sub-block j = c % 8 of
// super-block c / 8: value = d sc q - dmin m.
fn dq_q5_k(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 44u;
    let j = c % 8u;
    let h = wquad(b);
    let dd = unpack2x16float(h.x);
    var sc: u32;
    var mn: u32;
    if (j < 4u) {
        sc = dq_sbyte(h, j) & 63u;
        mn = dq_sbyte(h, j + 4u) & 63u;
    } else {
        sc = (dq_sbyte(h, j + 4u) & 15u) | ((dq_sbyte(h, j - 4u) >> 6u) << 4u);
        mn = (dq_sbyte(h, j + 4u) >> 4u) | ((dq_sbyte(h, j) >> 6u) << 4u);
    }
    let d = dd.x * f32(sc);
    let m = -dd.y * f32(mn);
    let h0 = wquad(b + 4u);
    let h1 = wquad(b + 8u);
    let q0 = wquad(b + 12u + 8u * (j / 2u));
    let q1 = wquad(b + 16u + 8u * (j / 2u));
    let sh = 4u * (j % 2u);
    return WChunk(array<vec4<f32>, 8>(
        dq_bits4(q0.x, sh, 15u, h0.x, j, 4u), dq_bits4(q0.y, sh, 15u, h0.y, j, 4u),
        dq_bits4(q0.z, sh, 15u, h0.z, j, 4u), dq_bits4(q0.w, sh, 15u, h0.w, j, 4u),
        dq_bits4(q1.x, sh, 15u, h1.x, j, 4u), dq_bits4(q1.y, sh, 15u, h1.y, j, 4u),
        dq_bits4(q1.z, sh, 15u, h1.z, j, 4u), dq_bits4(q1.w, sh, 15u, h1.w, j, 4u)),
        vec4<f32>(d, d, m, m));
}

// Q3_K scale i (0..15, stored plus 32) from the scale bytes in t.x, t.y, t.z
fn dq_q3_scale(t: vec4<u32>, i: u32) -> u32 {
    let lb = i % 8u;
    let low = (t[lb / 4u] >> (8u * (lb % 4u) + 4u * (i / 8u))) & 15u;
    let high = (t.z >> (8u * (i % 4u) + 2u * (i / 4u))) & 3u;
    return low | (high << 4u);
}

// Q3_K, 112 B = 28 words per 256 after the repack: hmask[32], qs[64], scales[12], d f16, pad.
// Chunk c = 32 weights j = c % 8 of super-block c / 8: element l has 2 bits at 2 (j % 4) of
// qs[32 (j / 4) + l] and a third at bit j of hmask[l] (q = 0..7); 16 six-bit scales, one per 16
// weights (scale i: low nibble of byte i % 8, high nibble for i >= 8; top bits at 2 (i / 4) of
// byte 8 + i % 4), stored plus 32. value = d (sc - 32) (q - 4).
fn dq_q3_k(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 28u;
    let j = c % 8u;
    let t = wquad(b + 24u);                     // scales[0..12), d
    let d = unpack2x16float(t.w).x;
    let s0 = d * f32(i32(dq_q3_scale(t, 2u * j)) - 32);         // first 16 weights
    let s1 = d * f32(i32(dq_q3_scale(t, 2u * j + 1u)) - 32);    // next 16
    let m0 = wquad(b);
    let m1 = wquad(b + 4u);
    let q0 = wquad(b + 8u + 8u * (j / 4u));
    let q1 = wquad(b + 12u + 8u * (j / 4u));
    let sh = 2u * (j % 4u);
    return WChunk(array<vec4<f32>, 8>(
        dq_bits4(q0.x, sh, 3u, m0.x, j, 2u), dq_bits4(q0.y, sh, 3u, m0.y, j, 2u),
        dq_bits4(q0.z, sh, 3u, m0.z, j, 2u), dq_bits4(q0.w, sh, 3u, m0.w, j, 2u),
        dq_bits4(q1.x, sh, 3u, m1.x, j, 2u), dq_bits4(q1.y, sh, 3u, m1.y, j, 2u),
        dq_bits4(q1.z, sh, 3u, m1.z, j, 2u), dq_bits4(q1.w, sh, 3u, m1.w, j, 2u)),
        vec4<f32>(s0, s1, -4.0 * s0, -4.0 * s1));
}

// Q2_K, 84 B = 21 words per 256: scales[16] (low nibble: scale, high: min, one pair per 16 weights),
// qs[64], (d, dmin f16). Chunk c = 32 weights j = c % 8 of super-block c / 8: 2 bits at 2 (j % 4)
// of qs[32 (j / 4) + l]; value = d sc q - dmin m.
fn dq_q2_k(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 21u;
    let j = c % 8u;
    let sw = wword(b + j / 2u) >> (16u * (j % 2u));      // scale bytes 2j, 2j + 1
    let dd = unpack2x16float(wword(b + 20u));
    let s0 = dd.x * f32(sw & 15u);
    let s1 = dd.x * f32((sw >> 8u) & 15u);
    let m0 = -dd.y * f32((sw >> 4u) & 15u);
    let m1 = -dd.y * f32((sw >> 12u) & 15u);
    let q0 = wquad(b + 4u + 8u * (j / 4u));
    let q1 = wquad(b + 8u + 8u * (j / 4u));
    let sh = 2u * (j % 4u);
    return WChunk(array<vec4<f32>, 8>(
        dq_bits4(q0.x, sh, 3u, 0u, 0u, 0u), dq_bits4(q0.y, sh, 3u, 0u, 0u, 0u),
        dq_bits4(q0.z, sh, 3u, 0u, 0u, 0u), dq_bits4(q0.w, sh, 3u, 0u, 0u, 0u),
        dq_bits4(q1.x, sh, 3u, 0u, 0u, 0u), dq_bits4(q1.y, sh, 3u, 0u, 0u, 0u),
        dq_bits4(q1.z, sh, 3u, 0u, 0u, 0u), dq_bits4(q1.w, sh, 3u, 0u, 0u, 0u)),
        vec4<f32>(s0, s1, m0, m1));
}

// IQ4_XS, 136 B = 34 words per 256: (d f16, scales_h u16), scales_l[4], qs[128] (16 bytes per 32
// weights: low nibbles 0..15, high 16..31). Sub-block j = c % 8 has the six-bit scale
// ls = nibble j of scales_l | bits 2j.. of scales_h << 4; value = d (ls - 32) kvalues[nibble].
fn dq_iq4_xs(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 34u;
    let j = c % 8u;
    let w0 = wword(b);
    let ls = ((wword(b + 1u) >> (4u * j)) & 15u) | (((w0 >> (16u + 2u * j)) & 3u) << 4u);
    let d = unpack2x16float(w0).x * f32(i32(ls) - 32);
    let q = wquad(b + 2u + 4u * j);
    return WChunk(array<vec4<f32>, 8>(dq_kv4(q.x, 0u), dq_kv4(q.y, 0u), dq_kv4(q.z, 0u), dq_kv4(q.w, 0u),
                                      dq_kv4(q.x, 4u), dq_kv4(q.y, 4u), dq_kv4(q.z, 4u), dq_kv4(q.w, 4u)),
                  vec4<f32>(d, d, 0.0, 0.0));
}
