// matmul_tiled: y[t, n0 + r] (+)= sum_k x[t, k0 + k] * W[r, k0 + k] (+ bias[n0 + r]) over one K block
// [k0, k0 + 32 KBLK), for T > 1 (prefill, BERT encoders), f32 accumulation.
// dispatch (ceil(rows / WG), ceil(T / TM), 1) per weight buffer and K block, workgroup WG.
//
// The host prepends: the activation header (`act`); consts TM (activation rows per workgroup, at
// most 32), WG (invocations = weight rows per workgroup), KB (32-wide chunks staged per barrier),
// XR = 8 KB, NG (chunk groups per K block), WA (weight rows are whole vec4 words) and BA (blocks
// of a dequant.wgsl type are whole vec4 words);
// `xword` / `xget` (how 4 activations are read); `fn wblock(base, c)` calling one of the float
// decoders `wb_<dtype>` below or, for a quantised type, expanding dequant.wgsl's decode; and
// `fn chunks(...)`, the K loop written out as NG `step` calls.
//
// Strategy (tuned for CPU Vulkan, kept as parameters): invocation i owns weight row r = i and keeps
// TM accumulators (one per activation row of the tile) in registers. The workgroup stages (TM, 32 KB)
// tiles of x in workgroup memory, double-buffered with one barrier per KB chunks; per chunk each
// invocation decodes its own 32 weights ONCE and does TM x 32 FMAs, reading x from workgroup memory
// at addresses that are compile-time constants after inlining, outside any loop or branch: a CPU
// driver (lavapipe) then loads each x value once and broadcasts it to the SIMD lanes instead of
// gathering it lane by lane. Each weight is read and decoded once per TM activation rows; each
// staged x value serves WG weight rows. The price of the written-out loop is compile time, which
// grows faster than the code, so the host splits long K into blocks (later blocks accumulate).

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
    w_off: u32,      // u32 words from a row's start to this K block's first chunk
    k4: u32,         // K / 4
    k0_4: u32,       // first column of this K block / 4
    wi_full: u32,    // vec4 words of the weight in interleaved spans (wmap4; 0: none)
}

@group(0) @binding(0) var<uniform> P: TiledParams;
// x (binding 1), y (3), bias (4) and `store`: matmul_io.wgsl, from the host header
@group(0) @binding(2) var<storage, read> W: array<vec4<u32>>;   // (rows, row_words u32) GPU layout
// vec4 word i of the row layout wherever the weight is stored (wmap4 from the host header: the
// interleaved-span layout of copy.wgsl span_map, or identity)
fn wv(i: u32) -> vec4<u32> { return W[wmap4(i)]; }

var<workgroup> xs: array<vec4<f32>, 2u * TM * XR>;  // 2 x (TM, 32 KB): x tiles of two chunk groups
var<private> a: array<f32, 32>;                 // accumulators: a[t] for activation row t0 + t

// ---------------------------------------------------------------- weight decoders: 32 weights of
// one row starting at column 32 c, as plain values. `base` = row * row_words (in u32 words). W is
// read in vec4 words: a CPU driver loads storage one lane at a time, and one vec4 load costs
// about as much as two scalar ones, so spans of words are read as vec4s and shifted into place.

// the 4 words at offset s (0..3) of the 8 words (a, b)
fn shift4(a: vec4<u32>, b: vec4<u32>, s: u32) -> vec4<u32> {
    let v1 = vec4<u32>(a.yzw, b.x);
    let v2 = vec4<u32>(a.zw, b.xy);
    let v3 = vec4<u32>(a.w, b.xyz);
    return select(select(a, v1, s == 1u), select(v2, v3, s == 3u), s >= 2u);
}

// word s (0..3) of a
fn pick(a: vec4<u32>, s: u32) -> u32 {
    return select(select(a.x, a.y, s == 1u), select(a.z, a.w, s == 3u), s >= 2u);
}

// the 8 words at word offset b (any alignment)
fn words8(b: u32) -> array<vec4<u32>, 2> {
    let i = b / 4u;
    let s = b % 4u;
    let v0 = wv(i);
    let v1 = wv(i + 1u);
    let v2 = wv(i + 2u);   // past the end of the binding at the last row: clamped, unused
    return array<vec4<u32>, 2>(shift4(v0, v1, s), shift4(v1, v2, s));
}

fn f32x4(v: vec4<u32>) -> vec4<f32> { return bitcast<vec4<f32>>(v); }

// f32 rows: row_words = K, a multiple of 4, so every chunk is vec4-aligned. The last chunk of a
// K % 32 != 0 row reads into the next row (x is zero there; the last row's overrun is clamped).
fn wb_f32(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let i = (base + c * 32u) / 4u;
    return array<vec4<f32>, 8>(f32x4(wv(i)), f32x4(wv(i + 1u)), f32x4(wv(i + 2u)), f32x4(wv(i + 3u)),
                               f32x4(wv(i + 4u)), f32x4(wv(i + 5u)), f32x4(wv(i + 6u)), f32x4(wv(i + 7u)));
}

// the 16 words of a 2-byte float chunk (row_words = K / 2: vec4-aligned when K % 8 == 0, WA)
fn words16(b: u32) -> array<vec4<u32>, 4> {
    let i = b / 4u;
    if (WA) { return array<vec4<u32>, 4>(wv(i), wv(i + 1u), wv(i + 2u), wv(i + 3u)); }
    let s = b % 4u;
    let v0 = wv(i);
    let v1 = wv(i + 1u);
    let v2 = wv(i + 2u);
    let v3 = wv(i + 3u);
    let v4 = wv(i + 4u);
    return array<vec4<u32>, 4>(shift4(v0, v1, s), shift4(v1, v2, s), shift4(v2, v3, s), shift4(v3, v4, s));
}

fn h2x4(p: u32, q: u32) -> vec4<f32> { return vec4<f32>(unpack2x16float(p), unpack2x16float(q)); }

fn wb_f16(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let v = words16(base + c * 16u);
    return array<vec4<f32>, 8>(h2x4(v[0].x, v[0].y), h2x4(v[0].z, v[0].w), h2x4(v[1].x, v[1].y),
                               h2x4(v[1].z, v[1].w), h2x4(v[2].x, v[2].y), h2x4(v[2].z, v[2].w),
                               h2x4(v[3].x, v[3].y), h2x4(v[3].z, v[3].w));
}

// a bf16 is the high half of an f32
fn b2x4(p: u32, q: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(p << 16u, p & 0xFFFF0000u, q << 16u, q & 0xFFFF0000u));
}

fn wb_bf16(base: u32, c: u32) -> array<vec4<f32>, 8> {
    let v = words16(base + c * 16u);
    return array<vec4<f32>, 8>(b2x4(v[0].x, v[0].y), b2x4(v[0].z, v[0].w), b2x4(v[1].x, v[1].y),
                               b2x4(v[1].z, v[1].w), b2x4(v[2].x, v[2].y), b2x4(v[2].z, v[2].w),
                               b2x4(v[3].x, v[3].y), b2x4(v[3].z, v[3].w));
}

// one word at word offset b
fn word1(b: u32) -> u32 { return pick(wv(b / 4u), b % 4u); }

// ---------------------------------------------------------------- the quantised types: dequant.wgsl
// decodes them (the host adds it and `wblock` = wvalues(dq_<qtype>(...))); here its word readers
// and the expansion of its (quants, scales) form to plain values.
struct WChunk { q: array<vec4<f32>, 8>, s: vec4<f32> }

fn wword(a: u32) -> u32 { return word1(a); }

// words a..a+3: one vec4 load where blocks and rows are whole vec4 words (BA, a host const: then
// dequant.wgsl asks only at offsets that are multiples of 4), else two, shifted into place
fn wquad(a: u32) -> vec4<u32> {
    if (BA) { return wv(a / 4u); }
    return shift4(wv(a / 4u), wv(a / 4u + 1u), a % 4u);
}

// words a..a+7: two vec4 loads where aligned (BA), else three, shifted into place
fn woct(a: u32) -> array<vec4<u32>, 2> {
    if (BA) { return array<vec4<u32>, 2>(wv(a / 4u), wv(a / 4u + 1u)); }
    return words8(a);
}

fn wvalues(w: WChunk) -> array<vec4<f32>, 8> {
    let d0 = vec4<f32>(w.s.x);
    let m0 = vec4<f32>(w.s.z);
    let d1 = vec4<f32>(w.s.y);
    let m1 = vec4<f32>(w.s.w);
    return array<vec4<f32>, 8>(fma(w.q[0], d0, m0), fma(w.q[1], d0, m0), fma(w.q[2], d0, m0),
                               fma(w.q[3], d0, m0), fma(w.q[4], d1, m1), fma(w.q[5], d1, m1),
                               fma(w.q[6], d1, m1), fma(w.q[7], d1, m1));
}

// ---------------------------------------------------------------- the tile

// acc + w . x as 4 fused multiply-adds (dot() then + would round twice and chain 5 operations)
fn mac(w: vec4<f32>, x: vec4<f32>, acc: f32) -> f32 {
    return fma(w.w, x.w, fma(w.z, x.z, fma(w.y, x.y, fma(w.x, x.x, acc))));
}

// 4 K steps of every activation row: a[t] += w . xs[o + t XR]. `o` is a constant at every call site,
// so after inlining each xs index is a constant (a uniform load, broadcast to the SIMD lanes).
fn kstep(w: vec4<f32>, o: u32) {
    { a[0] = mac(w, xs[o + 0u * XR], a[0]); }
    if (TM > 1u) { a[1] = mac(w, xs[o + 1u * XR], a[1]); }
    if (TM > 2u) { a[2] = mac(w, xs[o + 2u * XR], a[2]); }
    if (TM > 3u) { a[3] = mac(w, xs[o + 3u * XR], a[3]); }
    if (TM > 4u) { a[4] = mac(w, xs[o + 4u * XR], a[4]); }
    if (TM > 5u) { a[5] = mac(w, xs[o + 5u * XR], a[5]); }
    if (TM > 6u) { a[6] = mac(w, xs[o + 6u * XR], a[6]); }
    if (TM > 7u) { a[7] = mac(w, xs[o + 7u * XR], a[7]); }
    if (TM > 8u) { a[8] = mac(w, xs[o + 8u * XR], a[8]); }
    if (TM > 9u) { a[9] = mac(w, xs[o + 9u * XR], a[9]); }
    if (TM > 10u) { a[10] = mac(w, xs[o + 10u * XR], a[10]); }
    if (TM > 11u) { a[11] = mac(w, xs[o + 11u * XR], a[11]); }
    if (TM > 12u) { a[12] = mac(w, xs[o + 12u * XR], a[12]); }
    if (TM > 13u) { a[13] = mac(w, xs[o + 13u * XR], a[13]); }
    if (TM > 14u) { a[14] = mac(w, xs[o + 14u * XR], a[14]); }
    if (TM > 15u) { a[15] = mac(w, xs[o + 15u * XR], a[15]); }
    if (TM > 16u) { a[16] = mac(w, xs[o + 16u * XR], a[16]); }
    if (TM > 17u) { a[17] = mac(w, xs[o + 17u * XR], a[17]); }
    if (TM > 18u) { a[18] = mac(w, xs[o + 18u * XR], a[18]); }
    if (TM > 19u) { a[19] = mac(w, xs[o + 19u * XR], a[19]); }
    if (TM > 20u) { a[20] = mac(w, xs[o + 20u * XR], a[20]); }
    if (TM > 21u) { a[21] = mac(w, xs[o + 21u * XR], a[21]); }
    if (TM > 22u) { a[22] = mac(w, xs[o + 22u * XR], a[22]); }
    if (TM > 23u) { a[23] = mac(w, xs[o + 23u * XR], a[23]); }
    if (TM > 24u) { a[24] = mac(w, xs[o + 24u * XR], a[24]); }
    if (TM > 25u) { a[25] = mac(w, xs[o + 25u * XR], a[25]); }
    if (TM > 26u) { a[26] = mac(w, xs[o + 26u * XR], a[26]); }
    if (TM > 27u) { a[27] = mac(w, xs[o + 27u * XR], a[27]); }
    if (TM > 28u) { a[28] = mac(w, xs[o + 28u * XR], a[28]); }
    if (TM > 29u) { a[29] = mac(w, xs[o + 29u * XR], a[29]); }
    if (TM > 30u) { a[30] = mac(w, xs[o + 30u * XR], a[30]); }
    if (TM > 31u) { a[31] = mac(w, xs[o + 31u * XR], a[31]); }
}

// Stage the (TM, 32 KB) x tile of chunk group g into half `buf` of xs (f32; zero past K; rows past
// T repeat row T-1 and are never written).
fn stage(g: u32, buf: u32, t0: u32, lid: u32) {
    for (var i = lid; i < TM * XR; i += WG) {
        let t = min(t0 + i / XR, P.T - 1u);
        let k4 = P.k0_4 + g * XR + i % XR;
        var v = vec4<f32>(0.0);
        if (k4 < P.k4) { v = xget(P.x_off4 + t * P.k4 + k4); }
        xs[buf * TM * XR + i] = v;
    }
}

// One 32-wide K chunk c from the tile at xs[o..]: this invocation's 32 weights, decoded once.
fn chunk(base: u32, c: u32, o: u32) {
    let w = wblock(base, c);
    kstep(w[0], o);
    kstep(w[1], o + 1u);
    kstep(w[2], o + 2u);
    kstep(w[3], o + 3u);
    kstep(w[4], o + 4u);
    kstep(w[5], o + 5u);
    kstep(w[6], o + 6u);
    kstep(w[7], o + 7u);
}

// Chunk group g (its first nj of KB chunks), double-buffered: stage group g + 1 into the other half
// of xs while computing group g from half `buf`, then one barrier. The host's generated `chunks`
// calls this with constant arguments, so the xs reads sit outside any loop or branch: CPU drivers
// broadcast a load only when its address is a constant and no lane may be masked off. Barriers
// are costly there (every SIMD group of the workgroup is suspended and resumed), hence KB chunks
// per barrier.
fn step(g: u32, buf: u32, nj: u32, base: u32, t0: u32, lid: u32) {
    if (g + 1u < NG) { stage(g + 1u, 1u - buf, t0, lid); }
    let o = buf * TM * XR;
    let c = g * KB;
    chunk(base, c, o);
    if (nj > 1u) { chunk(base, c + 1u, o + 8u); }
    if (nj > 2u) { chunk(base, c + 2u, o + 16u); }
    if (nj > 3u) { chunk(base, c + 3u, o + 24u); }
    if (nj > 4u) { chunk(base, c + 4u, o + 32u); }
    if (nj > 5u) { chunk(base, c + 5u, o + 40u); }
    if (nj > 6u) { chunk(base, c + 6u, o + 48u); }
    if (nj > 7u) { chunk(base, c + 7u, o + 56u); }
    workgroupBarrier();   // group g's reads of half buf are done; group g + 1 is staged
}

@compute @workgroup_size(WG)
fn matmul_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // no early return: every invocation takes part in the barriers; rows past the end re-read the
    // last row and are not written
    let r = wid.x * WG + lid;
    let base = min(r, P.rows - 1u) * P.row_words + P.w_off;
    let t0 = wid.y * TM;
    stage(0u, 0u, t0, lid);
    workgroupBarrier();
    chunks(base, t0, lid);   // step(g, g % 2, ...) for g = 0 .. NG-1, written out by the host
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
    if (TM > 16u) { store(t0 + 16u, r, a[16]); }
    if (TM > 17u) { store(t0 + 17u, r, a[17]); }
    if (TM > 18u) { store(t0 + 18u, r, a[18]); }
    if (TM > 19u) { store(t0 + 19u, r, a[19]); }
    if (TM > 20u) { store(t0 + 20u, r, a[20]); }
    if (TM > 21u) { store(t0 + 21u, r, a[21]); }
    if (TM > 22u) { store(t0 + 22u, r, a[22]); }
    if (TM > 23u) { store(t0 + 23u, r, a[23]); }
    if (TM > 24u) { store(t0 + 24u, r, a[24]); }
    if (TM > 25u) { store(t0 + 25u, r, a[25]); }
    if (TM > 26u) { store(t0 + 26u, r, a[26]); }
    if (TM > 27u) { store(t0 + 27u, r, a[27]); }
    if (TM > 28u) { store(t0 + 28u, r, a[28]); }
    if (TM > 29u) { store(t0 + 29u, r, a[29]); }
    if (TM > 30u) { store(t0 + 30u, r, a[30]); }
    if (TM > 31u) { store(t0 + 31u, r, a[31]); }
}
