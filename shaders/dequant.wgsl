// dequant: the weight decode of every quantised type (kernels/qtypes.py), written once and compiled
// into every kernel that reads weights: matmul.wgsl's row and tile kernels, the batch, GEMM and
// GPU-family kernels, the unrolled decode kernel and its epilogues, the vec4 decode kernel
// (matmul_decode_v4.wgsl), embedding.wgsl and matmul_tiled.wgsl.
//
// `dq_<qtype>(base, c) -> WChunk` decodes chunk c (32 weights, columns 32c..32c+31) of the row whose
// first u32 word is `base` (GPU layout: kernels/qtypes.py), as quants q and affine scales s:
// value[i] = q[i] * s.x + s.z for the first 16 weights (i < 4), q[i] * s.y + s.w for the next 16.
// Types with 32-weight blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, MXFP4) also have
// `dq_<qtype>_w(words...)`, the decode of one block's words already loaded (the vec4 decode kernel
// loads 4 rows' words itself and passes them).
// The including kernel provides the struct WChunk and the weight readers
//   wword(a) -> u32                    word a of the row layout
//   wquad(a) -> vec4<u32>              words a..a+3 (types whose blocks are whole vec4 words call it
//                                      only at offsets that are multiples of 4 inside a block, so a
//                                      kernel may read one aligned vec4 there)
//   woct(a) -> array<vec4<u32>, 2>     words a..a+7 (the same alignment rule; the 32-weight types
//                                      read their block of 5, 6 or 9 words through it, the words
//                                      past the block unused: past the last row, WebGPU's bounds
//                                      rules keep the read in the buffer)
//   wnib4(q, sh) -> vec4<f32>          the 4-bit quants of Q4_0 / Q4_1: the low (sh = 0) or high
//                                      (sh = 4) nibbles of the bytes of q, as dq_nib4 gives them, or
//                                      as dq_nib4_inplace does (component j scaled by 256^j, one
//                                      operation less per weight) for a kernel whose dot product
//                                      undoes that scaling
// Blocks of 18, 22, 34, 110 and 210 bytes arrive with 2 zero bytes inserted by the upload repack
// (at byte 2 for Q4_0 / Q5_0 / IQ4_NL / Q8_0, at the end for Q3_K / Q6_K), MXFP4's 17 with 3 at byte
// 1, so every field below sits in whole words.

// the 4 bytes of a word, low byte first
fn dq_bytes(q: u32) -> vec4<u32> { return vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xFFu); }

// 4 nibbles: the low (sh = 0) or high (sh = 4) halves of the bytes of q
fn dq_nib(q: u32, sh: u32) -> vec4<u32> { return (dq_bytes(q) >> vec4<u32>(sh)) & vec4<u32>(15u); }

// 4 quants: the nibbles dq_nib picks, as f32 (shifted without dq_bytes' byte mask: an operation
// less per 4 weights, the same bits for sh = 0 or 4)
fn dq_nib4(q: u32, sh: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) >> vec4<u32>(sh)) & vec4<u32>(15u));
}

// the same nibbles masked in place: component j comes scaled by 256^j (exact in f32, converted as
// i32 since every value is below 2^31); a kernel reading these dots with x scaled by 256^-j
fn dq_nib4_inplace(q: u32, sh: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q >> sh) & vec4<u32>(0xFu, 0xF00u, 0xF0000u, 0xF000000u)));
}

// 4 sign-extended int8 of one word
fn dq_i8x4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q << 24u, q << 16u, q << 8u, q)) >> vec4<u32>(24u));
}

// 4 quants of 5 bits: nibbles of q, fifth bits from bits hs..hs+3 of h (Q5_0 / Q5_1 qh)
fn dq_q5x4(q: u32, sh: u32, h: u32, hs: u32) -> vec4<f32> {
    let hi = (vec4<u32>(h) >> (vec4<u32>(hs) + vec4<u32>(0u, 1u, 2u, 3u))) & vec4<u32>(1u);
    return vec4<f32>(dq_nib(q, sh) | (hi << vec4<u32>(4u)));
}

// 4 quants: bits sh.. of the bytes of q (width mask m), then bits hb.. of the bytes of h (width
// mask hm) on top at `at`
fn dq_bits4(q: u32, sh: u32, m: u32, h: u32, hb: u32, hm: u32, at: u32) -> vec4<f32> {
    let lo = (dq_bytes(q) >> vec4<u32>(sh)) & vec4<u32>(m);
    let hi = (dq_bytes(h) >> vec4<u32>(hb)) & vec4<u32>(hm);
    return vec4<f32>(lo | (hi << vec4<u32>(at)));
}

// the 32 quants of a K-quant chunk: dq_bits4 of its 8 words of low bits q and the 8 words h holding
// their high bits (Q5_K, Q3_K, Q6_K; Q2_K has none: h zero)
fn dq_bits32(q: array<vec4<u32>, 2>, sh: u32, m: u32, h: array<vec4<u32>, 2>, hb: u32, hm: u32,
             at: u32) -> array<vec4<f32>, 8> {
    let q0 = q[0];
    let q1 = q[1];
    let h0 = h[0];
    let h1 = h[1];
    return array<vec4<f32>, 8>(
        dq_bits4(q0.x, sh, m, h0.x, hb, hm, at), dq_bits4(q0.y, sh, m, h0.y, hb, hm, at),
        dq_bits4(q0.z, sh, m, h0.z, hb, hm, at), dq_bits4(q0.w, sh, m, h0.w, hb, hm, at),
        dq_bits4(q1.x, sh, m, h1.x, hb, hm, at), dq_bits4(q1.y, sh, m, h1.y, hb, hm, at),
        dq_bits4(q1.z, sh, m, h1.z, hb, hm, at), dq_bits4(q1.w, sh, m, h1.w, hb, hm, at));
}

// kvalues_iq4nl (-127 -104 -83 -65 | -49 -35 -22 -10 | 1 13 25 38 | 53 69 89 113) as int8 x 4 per
// word: a nibble n picks word n / 4, byte n % 4 (selects, no table in memory)
const DQ_KV0: u32 = 0xbfad9881u;
const DQ_KV1: u32 = 0xf6eaddcfu;
const DQ_KV2: u32 = 0x26190d01u;
const DQ_KV3: u32 = 0x71594535u;

// the int8 entries of a 16-entry table t (4 per word) that the nibbles of q pick
fn dq_lut4(q: u32, sh: u32, t: vec4<u32>) -> vec4<f32> {
    let n = dq_nib(q, sh);
    let hi = n >> vec4<u32>(2u);
    let w = select(select(vec4<u32>(t.x), vec4<u32>(t.y), hi == vec4<u32>(1u)),
                   select(vec4<u32>(t.z), vec4<u32>(t.w), hi == vec4<u32>(3u)), hi >= vec4<u32>(2u));
    let byte_at_top = w << ((vec4<u32>(3u) - (n & vec4<u32>(3u))) * vec4<u32>(8u));
    return vec4<f32>(bitcast<vec4<i32>>(byte_at_top) >> vec4<u32>(24u));
}

fn dq_kv4(q: u32, sh: u32) -> vec4<f32> { return dq_lut4(q, sh, vec4<u32>(DQ_KV0, DQ_KV1, DQ_KV2, DQ_KV3)); }

// Q4_0, 20 B = 5 words per 32 after the repack: (d f16, pad), qs[16] (low nibbles: elements
// 0..15, high: 16..31). value = (q - 8) d.
fn dq_q4_0_w(h: u32, q: vec4<u32>) -> WChunk {
    let d = unpack2x16float(h).x;
    return WChunk(dq_q4x32(q), vec4<f32>(d, d, -8.0 * d, -8.0 * d));
}

fn dq_q4_0(base: u32, c: u32) -> WChunk {
    let o = woct(base + c * 5u);          // the block's 5 words, then 3 unused
    return dq_q4_0_w(o[0].x, vec4<u32>(o[0].yzw, o[1].x));
}

// Q4_0 with an f32 scale (MLC's q4f32_1, repacked at load), 20 B = 5 words per 32: d f32, qs[16] as
// Q4_0's. value = (q - 8) d.
fn dq_q4_0f32_w(h: u32, q: vec4<u32>) -> WChunk {
    let d = bitcast<f32>(h);
    return WChunk(dq_q4x32(q), vec4<f32>(d, d, -8.0 * d, -8.0 * d));
}

fn dq_q4_0f32(base: u32, c: u32) -> WChunk {
    let o = woct(base + c * 5u);          // the block's 5 words, then 3 unused
    return dq_q4_0f32_w(o[0].x, vec4<u32>(o[0].yzw, o[1].x));
}

// Q4_1, 20 B = 5 words per 32 as in GGUF: (d, m f16), qs[16] as Q4_0's. value = q d + m.
fn dq_q4_1_w(h: u32, q: vec4<u32>) -> WChunk {
    let dm = unpack2x16float(h);
    return WChunk(dq_q4x32(q), vec4<f32>(dm.x, dm.x, dm.y, dm.y));
}

fn dq_q4_1(base: u32, c: u32) -> WChunk {
    let o = woct(base + c * 5u);          // the block's 5 words, then 3 unused
    return dq_q4_1_w(o[0].x, vec4<u32>(o[0].yzw, o[1].x));
}

// the 32 4-bit quants of qs[16] through the kernel's wnib4
fn dq_q4x32(q: vec4<u32>) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(wnib4(q.x, 0u), wnib4(q.y, 0u), wnib4(q.z, 0u), wnib4(q.w, 0u),
                               wnib4(q.x, 4u), wnib4(q.y, 4u), wnib4(q.z, 4u), wnib4(q.w, 4u));
}

// Q8_0, 36 B = 9 words per 32 after the repack: (d f16, pad), qs int8[32]. value = q d.
fn dq_q8_0_w(h: u32, q0: vec4<u32>, q1: vec4<u32>) -> WChunk {
    let d = unpack2x16float(h).x;
    return WChunk(array<vec4<f32>, 8>(dq_i8x4(q0.x), dq_i8x4(q0.y), dq_i8x4(q0.z), dq_i8x4(q0.w),
                                      dq_i8x4(q1.x), dq_i8x4(q1.y), dq_i8x4(q1.z), dq_i8x4(q1.w)),
                  vec4<f32>(d, d, 0.0, 0.0));
}

fn dq_q8_0(base: u32, c: u32) -> WChunk {
    let b = base + c * 9u;
    let o = woct(b);
    return dq_q8_0_w(o[0].x, vec4<u32>(o[0].yzw, o[1].x), vec4<u32>(o[1].yzw, wword(b + 8u)));
}

// Q5_0, 24 B = 6 words per 32: (d f16, pad), qh u32 (bit e: fifth bit of element e), qs[16] (low
// nibbles elements 0..15, high 16..31). value = (q - 16) d.
fn dq_q5_0_w(h: u32, qh: u32, q: vec4<u32>) -> WChunk {
    let d = unpack2x16float(h).x;
    return WChunk(dq_q5x32(qh, q), vec4<f32>(d, d, -16.0 * d, -16.0 * d));
}

fn dq_q5_0(base: u32, c: u32) -> WChunk {
    let o = woct(base + c * 6u);          // the block's 6 words, then 2 unused
    return dq_q5_0_w(o[0].x, o[0].y, vec4<u32>(o[0].zw, o[1].xy));
}

// Q5_1, 24 B = 6 words per 32 as in GGUF: (d, m f16), qh u32, qs[16]. value = q d + m.
fn dq_q5_1_w(h: u32, qh: u32, q: vec4<u32>) -> WChunk {
    let dm = unpack2x16float(h);
    return WChunk(dq_q5x32(qh, q), vec4<f32>(dm.x, dm.x, dm.y, dm.y));
}

fn dq_q5_1(base: u32, c: u32) -> WChunk {
    let o = woct(base + c * 6u);          // the block's 6 words, then 2 unused
    return dq_q5_1_w(o[0].x, o[0].y, vec4<u32>(o[0].zw, o[1].xy));
}

// the 32 5-bit quants of Q5_0 / Q5_1: nibbles of qs[16], fifth bits from qh
fn dq_q5x32(h: u32, q: vec4<u32>) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(
        dq_q5x4(q.x, 0u, h, 0u), dq_q5x4(q.y, 0u, h, 4u), dq_q5x4(q.z, 0u, h, 8u), dq_q5x4(q.w, 0u, h, 12u),
        dq_q5x4(q.x, 4u, h, 16u), dq_q5x4(q.y, 4u, h, 20u), dq_q5x4(q.z, 4u, h, 24u), dq_q5x4(q.w, 4u, h, 28u));
}

// IQ4_NL, 20 B = 5 words per 32: (d f16, pad), qs[16] (low nibbles 0..15, high 16..31).
// value = d kvalues[nibble].
fn dq_iq4_nl_w(h: u32, q: vec4<u32>) -> WChunk {
    let d = unpack2x16float(h).x;
    return WChunk(array<vec4<f32>, 8>(dq_kv4(q.x, 0u), dq_kv4(q.y, 0u), dq_kv4(q.z, 0u), dq_kv4(q.w, 0u),
                                      dq_kv4(q.x, 4u), dq_kv4(q.y, 4u), dq_kv4(q.z, 4u), dq_kv4(q.w, 4u)),
                  vec4<f32>(d, d, 0.0, 0.0));
}

fn dq_iq4_nl(base: u32, c: u32) -> WChunk {
    let o = woct(base + c * 5u);          // the block's 5 words, then 3 unused
    return dq_iq4_nl_w(o[0].x, vec4<u32>(o[0].yzw, o[1].x));
}

// MXFP4 (gpt-oss's experts), 20 B = 5 words per 32 after the repack: (e E8M0, pad 3), qs[16] (low
// nibbles 0..15, high 16..31) of E2M1 codes. value = 2^(e - 127) e2m1[nibble], as ggml computes it:
// the table's values doubled (0 1 2 3 4 6 8 12, negated from 8) times 2^(e - 128) (e < 2: subnormal).
const DQ_MX: vec4<u32> = vec4<u32>(0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu);

fn dq_mxfp4_w(h: u32, q: vec4<u32>) -> WChunk {
    let e = h & 0xFFu;
    let d = bitcast<f32>(select((e - 1u) << 23u, 0x00200000u << e, e < 2u));
    return WChunk(array<vec4<f32>, 8>(dq_lut4(q.x, 0u, DQ_MX), dq_lut4(q.y, 0u, DQ_MX), dq_lut4(q.z, 0u, DQ_MX),
                                      dq_lut4(q.w, 0u, DQ_MX), dq_lut4(q.x, 4u, DQ_MX), dq_lut4(q.y, 4u, DQ_MX),
                                      dq_lut4(q.z, 4u, DQ_MX), dq_lut4(q.w, 4u, DQ_MX)),
                  vec4<f32>(d, d, 0.0, 0.0));
}

fn dq_mxfp4(base: u32, c: u32) -> WChunk {
    let o = woct(base + c * 5u);          // the block's 5 words, then 3 unused
    return dq_mxfp4_w(o[0].x, vec4<u32>(o[0].yzw, o[1].x));
}

// byte i (0..11) of the 12 scale bytes held in words 1..3 of a K-quant head h
fn dq_sbyte(h: vec4<u32>, i: u32) -> u32 { return (h[1u + i / 4u] >> ((i % 4u) * 8u)) & 0xFFu; }

// sub-block j's (d sc, -dmin m) of a Q4_K / Q5_K super-block from its head h = (d, dmin f16),
// scales[12] (ggml's get_scale_min_k4: six-bit scale/min pairs, the top bits of 4..7 in 0..7)
fn dq_k4_sm(h: vec4<u32>, j: u32) -> vec2<f32> {
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
    return vec2<f32>(dd.x * f32(sc), -dd.y * f32(mn));
}

// Q4_K, 144 B = 36 words per 256 as in GGUF: (d, dmin f16), scales[12], qs[128] (4 groups of 32
// bytes: sub-block 2g in the low nibbles, 2g + 1 in the high). Chunk c = sub-block j = c % 8 of
// super-block c / 8: value = d sc q - dmin m.
fn dq_q4_k(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 36u;
    let j = c % 8u;
    let sm = dq_k4_sm(wquad(b), j);
    let q = woct(b + 4u + 8u * (j / 2u));
    let sh = 4u * (j % 2u);
    return WChunk(array<vec4<f32>, 8>(dq_nib4(q[0].x, sh), dq_nib4(q[0].y, sh), dq_nib4(q[0].z, sh),
                                      dq_nib4(q[0].w, sh), dq_nib4(q[1].x, sh), dq_nib4(q[1].y, sh),
                                      dq_nib4(q[1].z, sh), dq_nib4(q[1].w, sh)),
                  vec4<f32>(sm.x, sm.x, sm.y, sm.y));
}

// Q5_K, 176 B = 44 words per 256: (d, dmin f16), scales[12] (as Q4_K's), qh[32] (bit j of qh[l]:
// fifth bit of element l of sub-block j), qs[128] (as Q4_K's). Chunk c = sub-block j = c % 8 of
// super-block c / 8: value = d sc q - dmin m.
fn dq_q5_k(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 44u;
    let j = c % 8u;
    let sm = dq_k4_sm(wquad(b), j);
    return WChunk(dq_bits32(woct(b + 12u + 8u * (j / 2u)), 4u * (j % 2u), 15u, woct(b + 4u), j, 1u, 4u),
                  vec4<f32>(sm.x, sm.x, sm.y, sm.y));
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
    return WChunk(dq_bits32(woct(b + 8u + 8u * (j / 4u)), 2u * (j % 4u), 3u, woct(b), j, 1u, 2u),
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
    return WChunk(dq_bits32(woct(b + 4u + 8u * (j / 4u)), 2u * (j % 4u), 3u, array<vec4<u32>, 2>(), 0u, 1u, 0u),
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

// Q6_K, 212 B = 53 words per 256 after the repack: ql[128] (low 4 bits), qh[64] (high 2 bits),
// scales int8[16], d f16, pad. Chunk c = quarter qd = j % 4 of half h = j / 4 (j = c % 8) of
// super-block c / 8: element l has its low bits in nibble (qd >= 2) of ql[64h + 32(qd & 1) + l],
// its high bits at bit 2 qd of qh[32h + l], its scale in scales[8h + 2qd + l / 16].
// value = d sc (q - 32).
fn dq_q6_k(base: u32, c: u32) -> WChunk {
    let b = base + (c / 8u) * 53u;
    let j = c % 8u;
    let h = j / 4u;
    let qd = j % 4u;
    let d = unpack2x16float(wword(b + 52u)).x;
    let sw = wword(b + 48u + 2u * h + qd / 2u) >> (16u * (qd % 2u));   // both scales in one word
    let s0 = d * f32(bitcast<i32>(sw << 24u) >> 24u);    // first 16 weights
    let s1 = d * f32(bitcast<i32>(sw << 16u) >> 24u);    // next 16
    // 6-bit quants: 4 bits from ql at 4 (qd >> 1), 2 from qh at 2 qd on top
    return WChunk(dq_bits32(woct(b + 16u * h + 8u * (qd & 1u)), 4u * (qd >> 1u), 15u, woct(b + 32u + 8u * h), 2u * qd,
                            3u, 4u),
                  vec4<f32>(s0, s1, -32.0 * s0, -32.0 * s1));
}
