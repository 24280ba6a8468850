// matmul_tiled: y[t, n0 + r] (+)= sum_k x[t, k] * W[r, k] (+ bias[n0 + r]) for T > 1 (prefill,
// BERT encoders), f32 accumulation. dispatch (ceil(rows / WG), ceil(T / TM), 1), workgroup WG.
//
// The host prepends: the activation header (`act`), consts TM (activation rows per workgroup, at
// most 16) and WG (invocations = weight rows per workgroup), `xword` / `xget` (how 4 activations
// are read) and `fn wblock(base, c)` calling one of the `wb_<qtype>` decoders below.
//
// Strategy (tuned for CPU Vulkan, kept as parameters): invocation i owns weight row r = i and keeps
// TM accumulators (one per activation row of the tile) in registers. Per 32-wide K chunk the
// workgroup stages the (TM, 32) x tile in workgroup memory (two barriers), then each invocation
// decodes its own 32 weights ONCE into registers and does TM x 32 FMAs, reading x from workgroup
// memory at addresses that are compile-time constants after inlining: a CPU driver then loads each
// x value once and broadcasts it to all SIMD lanes instead of gathering per lane. Each weight block
// is read and decoded once per TM activation rows, each staged x value serves WG weight rows.

struct TiledParams {
    K: u32,          // columns of W and x
    rows: u32,       // rows of W in this part (buffer)
    T: u32,          // rows of x and y
    row_words: u32,  // u32 words per weight row in the GPU layout
    x_off4: u32,     // offset of x in its binding, in units of 4 activations
    y_off: u32,      // offset of y in its binding, in elements
    y_stride: u32,   // N: elements per row of y
    n0: u32,         // first output column of this part
    b_off: u32,      // offset of bias in its binding, in elements
    flags: u32,      // bit 0: add bias, bit 1: accumulate into y
    nchunks: u32,    // ceil(K / 32): chunks of 32 columns (the last one zero-padded in x)
    k4: u32,         // K / 4
}

@group(0) @binding(0) var<uniform> P: TiledParams;
@group(0) @binding(1) var<storage, read> x: array<xword>;       // (T, K/4) as xword (see xget)
@group(0) @binding(2) var<storage, read> W: array<u32>;         // (rows, row_words) GPU layout
@group(0) @binding(3) var<storage, read_write> y: array<act>;   // (T, N)
@group(0) @binding(4) var<storage, read> bias: array<f32>;      // (N)

var<workgroup> xs: array<vec4<f32>, TM * 16u>;  // 2 x (TM, 32): x tiles of two K chunks
var<private> a: array<f32, 16>;                 // accumulators: a[t] for activation row t0 + t

// ---------------------------------------------------------------- weight decoders: 32 weights of
// one row starting at column 32 c, as plain values. `base` = row * row_words.

fn wb_f32(base: u32, c: u32) -> array<vec4<f32>, 8> {
    // the last chunk of a K % 32 != 0 row reads into the next row (x is zero there);
    // the last row's overrun is clamped by WebGPU's bounds checks
    let b = base + c * 32u;
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        let j = b + 4u * i;
        v[i] = bitcast<vec4<f32>>(vec4<u32>(W[j], W[j + 1u], W[j + 2u], W[j + 3u]));
    }
    return v;
}

fn wb_f16(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let b = base + c * 16u;
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = vec4<f32>(unpack2x16float(W[b + 2u * i]), unpack2x16float(W[b + 2u * i + 1u]));
    }
    return v;
}

fn wb_bf16(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let b = base + c * 16u;
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        let p = W[b + 2u * i];
        let q = W[b + 2u * i + 1u];
        v[i] = bitcast<vec4<f32>>(vec4<u32>(p << 16u, p & 0xFFFF0000u, q << 16u, q & 0xFFFF0000u));
    }
    return v;
}

// 4 quants from the low (sh = 0) or high (sh = 4) nibbles of one word
fn nib4(q: u32, sh: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) >> vec4<u32>(sh)) & vec4<u32>(15u));
}

// 32 values q * d + m from 4 words of nibbles (low nibbles: elements 0..15, high: 16..31)
fn nibbles32(b: u32, d: f32, m: f32) -> array<vec4<f32>, 8> {
    let q0 = W[b];
    let q1 = W[b + 1u];
    let q2 = W[b + 2u];
    let q3 = W[b + 3u];
    let dv = vec4<f32>(d);
    let mv = vec4<f32>(m);
    return array<vec4<f32>, 8>(fma(nib4(q0, 0u), dv, mv), fma(nib4(q1, 0u), dv, mv),
                               fma(nib4(q2, 0u), dv, mv), fma(nib4(q3, 0u), dv, mv),
                               fma(nib4(q0, 4u), dv, mv), fma(nib4(q1, 4u), dv, mv),
                               fma(nib4(q2, 4u), dv, mv), fma(nib4(q3, 4u), dv, mv));
}

// Q4_0 after the upload repack: 5 words per block = (d f16, pad), qs[16]; value = (q - 8) * d
fn wb_q4_0(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let b = base + c * 5u;
    let d = unpack2x16float(W[b]).x;
    return nibbles32(b + 1u, d, -8.0 * d);
}

// Q4_1 as in GGUF: 5 words per block = (d f16, m f16), qs[16]; value = q * d + m
fn wb_q4_1(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let b = base + c * 5u;
    let dm = unpack2x16float(W[b]);
    return nibbles32(b + 1u, dm.x, dm.y);
}

// 4 sign-extended int8 of one word, as f32
fn i8x4(q: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q << 24u, q << 16u, q << 8u, q)) >> vec4<u32>(24u));
}

// Q8_0 after the upload repack: 9 words per block = (d f16, pad), qs int8[32]; value = q * d
fn wb_q8_0(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let b = base + c * 9u;
    let d = unpack2x16float(W[b]).x;
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = i8x4(W[b + 1u + i]) * d;
    }
    return v;
}

// Q4_K (GGUF): 36 words per 256 = (d, dmin f16), scales[12] (six-bit scale/min pairs, ggml's
// get_scale_min_k4), qs[128] in 4 groups of 32 bytes holding sub-blocks 2g (low nibbles) and
// 2g+1 (high). Chunk c is sub-block j = c % 8 of super-block c / 8: value = d*sc*q - dmin*m.
fn sbyte(b: u32, i: u32) -> u32 {   // byte i of scales[12]
    return (W[b + 1u + i / 4u] >> ((i % 4u) * 8u)) & 0xFFu;
}

fn wb_q4_k(base: u32, c: u32) -> array<vec4<f32>, 8> {
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
    let d = vec4<f32>(dd.x * f32(sc));
    let m = vec4<f32>(-dd.y * f32(mn));
    let q = b + 4u + (j / 2u) * 8u;          // first word of this sub-block's 32 qs bytes
    let sh = (j % 2u) * 4u;
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = fma(nib4(W[q + i], sh), d, m);
    }
    return v;
}

// Q6_K after the upload repack: 53 words per 256 = ql[128], qh[64], scales int8[16], d f16, pad.
// Chunk c is quarter j of super-block c / 8 (half h = j / 4, quarter qd = j % 4): element l of it
// has low bits in nibble (qd >= 2) of ql[64h + 32(qd & 1) + l], high bits at bit 2 qd of
// qh[32h + l], scale scales[8h + 2qd + l / 16]; value = d * scale * (q - 32).
fn q6x4(l: u32, h: u32, shl: u32, shh: u32) -> vec4<f32> {
    let lo4 = (vec4<u32>(l, l >> 8u, l >> 16u, l >> 24u) >> vec4<u32>(shl)) & vec4<u32>(15u);
    let hi2 = (vec4<u32>(h, h >> 8u, h >> 16u, h >> 24u) >> vec4<u32>(shh)) & vec4<u32>(3u);
    return vec4<f32>(lo4 | (hi2 << vec4<u32>(4u))) - vec4<f32>(32.0);
}

fn wb_q6_k(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let b = base + (c / 8u) * 53u;
    let j = c % 8u;
    let h = j / 4u;
    let qd = j % 4u;
    let d = unpack2x16float(W[b + 52u]).x;
    let sb = 192u + 8u * h + 2u * qd;                    // both scales lie in one word
    let sw = W[b + sb / 4u] >> ((sb % 4u) * 8u);
    let s0 = d * f32(bitcast<i32>(sw << 24u) >> 24u);    // first 16 weights
    let s1 = d * f32(bitcast<i32>(sw << 16u) >> 24u);    // next 16
    let ql = b + 16u * h + 8u * (qd & 1u);
    let qh = b + 32u + 8u * h;
    let shl = 4u * (qd >> 1u);
    let shh = 2u * qd;
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = q6x4(W[ql + i], W[qh + i], shl, shh) * select(s1, s0, i < 4u);
    }
    return v;
}

// ---------------------------------------------------------------- the tile

// 4 K steps of every activation row: a[t] += w . xs[t, k4]. `k4` is a constant at every call site,
// so after inlining each xs index is a constant (a uniform load, broadcast to the SIMD lanes).
fn kstep(w: vec4<f32>, k4: u32) {
    a[0] = dot(w, xs[k4]) + a[0];
    if (TM > 1u) { a[1] = dot(w, xs[8u + k4]) + a[1]; }
    if (TM > 2u) { a[2] = dot(w, xs[16u + k4]) + a[2]; }
    if (TM > 3u) { a[3] = dot(w, xs[24u + k4]) + a[3]; }
    if (TM > 4u) { a[4] = dot(w, xs[32u + k4]) + a[4]; }
    if (TM > 5u) { a[5] = dot(w, xs[40u + k4]) + a[5]; }
    if (TM > 6u) { a[6] = dot(w, xs[48u + k4]) + a[6]; }
    if (TM > 7u) { a[7] = dot(w, xs[56u + k4]) + a[7]; }
    if (TM > 8u) { a[8] = dot(w, xs[64u + k4]) + a[8]; }
    if (TM > 9u) { a[9] = dot(w, xs[72u + k4]) + a[9]; }
    if (TM > 10u) { a[10] = dot(w, xs[80u + k4]) + a[10]; }
    if (TM > 11u) { a[11] = dot(w, xs[88u + k4]) + a[11]; }
    if (TM > 12u) { a[12] = dot(w, xs[96u + k4]) + a[12]; }
    if (TM > 13u) { a[13] = dot(w, xs[104u + k4]) + a[13]; }
    if (TM > 14u) { a[14] = dot(w, xs[112u + k4]) + a[14]; }
    if (TM > 15u) { a[15] = dot(w, xs[120u + k4]) + a[15]; }
}

fn store(t: u32, r: u32, sum: f32) {
    if (t >= P.T || r >= P.rows) { return; }
    let n = P.n0 + r;
    var v = sum;
    if ((P.flags & 1u) != 0u) { v += bias[P.b_off + n]; }
    let o = P.y_off + t * P.y_stride + n;
    if ((P.flags & 2u) != 0u) { v += f32(y[o]); }
    y[o] = act(v);
}

// Stage the (TM, 32) x tile of chunk c into half `buf` of xs (f32; zero past K, rows past T repeat
// row T-1 and are never written).
fn stage(c: u32, buf: u32, t0: u32, lid: u32) {
    for (var i = lid; i < TM * 8u; i += WG) {
        let t = min(t0 + i / 8u, P.T - 1u);
        let k4 = c * 8u + i % 8u;
        var v = vec4<f32>(0.0);
        if (k4 < P.k4) { v = xget(P.x_off4 + t * P.k4 + k4); }
        xs[buf * TM * 8u + i] = v;
    }
}

// One K chunk, double-buffered: stage chunk c + 1 into the other half while computing chunk c from
// half `buf`, then one barrier. Called by the generated `chunks` (see the host) with constant c and
// buf, so that the x reads below sit outside any loop or branch: CPU drivers broadcast a load only
// when its address is a constant and no lane may be masked off.
fn step(c: u32, buf: u32, base: u32, t0: u32, lid: u32) {
    if (c + 1u < NCH) { stage(c + 1u, 1u - buf, t0, lid); }
    let w = wblock(base, c);
    let o = buf * TM * 8u;
    kstep(w[0], o);
    kstep(w[1], o + 1u);
    kstep(w[2], o + 2u);
    kstep(w[3], o + 3u);
    kstep(w[4], o + 4u);
    kstep(w[5], o + 5u);
    kstep(w[6], o + 6u);
    kstep(w[7], o + 7u);
    workgroupBarrier();   // chunk c's reads of half buf are done; chunk c + 1 is staged
}

@compute @workgroup_size(WG)
fn matmul_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // no early return: every invocation takes part in the barriers; rows past the end re-read the
    // last row and are not written
    let r = wid.x * WG + lid;
    let base = min(r, P.rows - 1u) * P.row_words;
    let t0 = wid.y * TM;
    stage(0u, 0u, t0, lid);
    workgroupBarrier();
    chunks(base, t0, lid);   // step(c, c % 2, ...) for c = 0 .. NCH-1, written out by the host
    // constant indices only: a dynamically indexed `a` would live in memory, not registers
    store(t0, r, a[0]);
    if (TM > 1u) { store(t0 + 1u, r, a[1]); }
    if (TM > 2u) { store(t0 + 2u, r, a[2]); }
    if (TM > 3u) { store(t0 + 3u, r, a[3]); }
    if (TM > 4u) { store(t0 + 4u, r, a[4]); }
    if (TM > 5u) { store(t0 + 5u, r, a[5]); }
    if (TM > 6u) { store(t0 + 6u, r, a[6]); }
    if (TM > 7u) { store(t0 + 7u, r, a[7]); }
    if (TM > 8u) { store(t0 + 8u, r, a[8]); }
    if (TM > 9u) { store(t0 + 9u, r, a[9]); }
    if (TM > 10u) { store(t0 + 10u, r, a[10]); }
    if (TM > 11u) { store(t0 + 11u, r, a[11]); }
    if (TM > 12u) { store(t0 + 12u, r, a[12]); }
    if (TM > 13u) { store(t0 + 13u, r, a[13]); }
    if (TM > 14u) { store(t0 + 14u, r, a[14]); }
    if (TM > 15u) { store(t0 + 15u, r, a[15]); }
}
