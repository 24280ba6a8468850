// matmul: y[t, n0 + r] (+)= sum_k x[t, k] * W[r, k] (+ bias[n0 + r]), f32 accumulation.
// Generic body shared by every weight type: the pipeline is built from the activation header, the
// consts WG (invocations per workgroup) and RR (weight rows per invocation, 1/2/4), this text, and
// the weight's reader (kernels/matmul/codegen.py weight_source: a float row's `matmul_<dtype>.wgsl`,
// or matmul_words.wgsl with dequant.wgsl's decode) that declares the weight binding (2) and `wchunk`
// (32 weights of a row as quants q and affine scales) / `wvec4` (4 plain weights, float types'
// K % 32 tails).
// Strategy (tuned for CPU Vulkan, kept as parameters): one invocation owns RR weight rows, no
// barriers; x words are the same for every invocation of a workgroup (uniform loads) and are
// shared by the RR rows; the affine form d*dot(q, x) + m*sum(x) saves a multiply per weight.

// 32 weights: value[i] = q[i] * s.x + s.z for i < 4 (the first 16), q[i] * s.y + s.w for i >= 4
struct WChunk { q: array<vec4<f32>, 8>, s: vec4<f32> }
// f16 activations are read as u32 pairs (`xword` = vec2<u32>, unpacked in `xget`): CPU drivers
// load storage buffers one component per invocation, so 2 words beat 4 halves.
// 32 activations and the sums of their two halves
struct XChunk { v: array<vec4<f32>, 8>, s: vec2<f32> }

struct MatmulParams {
    K: u32,          // columns of W and x
    rows: u32,       // rows of W in this part (buffer)
    T: u32,          // rows of x and y
    row_words: u32,  // u32 words per weight row in the GPU layout
    x_off4: u32,     // offset of x in its binding, in act4 units
    y_off: u32,      // offset of y in its binding, in elements
    y_stride: u32,   // N: elements per row of y
    n0: u32,         // first output column of this part
    b_off: u32,      // offset of bias in its binding, in elements
    flags: u32,      // bit 0: add bias, bit 1: accumulate into y
    nchunks: u32,    // K / 32 whole chunks
    k4: u32,         // K / 4
}

@group(0) @binding(0) var<uniform> P: MatmulParams;
// x (binding 1), y (3), bias (4) and `store`: matmul_io.wgsl, which the host appends to this text

fn xchunk(xb: u32) -> XChunk {
    var v: array<vec4<f32>, 8>;
    v[0] = xget(xb);
    v[1] = xget(xb + 1u);
    v[2] = xget(xb + 2u);
    v[3] = xget(xb + 3u);
    v[4] = xget(xb + 4u);
    v[5] = xget(xb + 5u);
    v[6] = xget(xb + 6u);
    v[7] = xget(xb + 7u);
    let lo = (v[0] + v[1]) + (v[2] + v[3]);
    let hi = (v[4] + v[5]) + (v[6] + v[7]);
    return XChunk(v, vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0))));
}

// w . a, the partial sums of the two halves reduced with weights f (1 for plain quants)
fn cdot_by(w: WChunk, a: XChunk, f: vec4<f32>) -> f32 {
    var lo = w.q[0] * a.v[0];
    lo = fma(w.q[1], a.v[1], lo);
    lo = fma(w.q[2], a.v[2], lo);
    lo = fma(w.q[3], a.v[3], lo);
    var hi = w.q[4] * a.v[4];
    hi = fma(w.q[5], a.v[5], hi);
    hi = fma(w.q[6], a.v[6], hi);
    hi = fma(w.q[7], a.v[7], hi);
    return dot(w.s, vec4<f32>(dot(lo, f), dot(hi, f), a.s.x, a.s.y));
}

fn cdot(w: WChunk, a: XChunk) -> f32 { return cdot_by(w, a, vec4<f32>(1.0)); }

// the K % 32 tail of float weights: 4 weights at a time
fn tail(base: u32, xr: u32) -> f32 {
    var acc = vec4<f32>(0.0);
    for (var k4 = P.nchunks * 8u; k4 < P.k4; k4++) {
        acc = fma(wvec4(base, k4), xget(xr + k4), acc);
    }
    return dot(acc, vec4<f32>(1.0));
}

// The sums of RR weight rows r0.. (r0 < rows) with activation row t.
fn row_sums(r0: u32, t: u32) -> vec4<f32> {
    let last = P.rows - 1u;         // rows past the end re-read the last row and are not written
    let b0 = r0 * P.row_words;
    let b1 = min(r0 + 1u, last) * P.row_words;
    let b2 = min(r0 + 2u, last) * P.row_words;
    let b3 = min(r0 + 3u, last) * P.row_words;
    let xr = P.x_off4 + t * (P.K / 4u);
    var a0 = 0.0;
    var a1 = 0.0;
    var a2 = 0.0;
    var a3 = 0.0;
    for (var c = 0u; c < P.nchunks; c++) {
        let xc = xchunk(xr + c * 8u);
        a0 += cdot(wchunk(b0, c), xc);
        if (RR > 1u) { a1 += cdot(wchunk(b1, c), xc); }
        if (RR > 2u) {
            a2 += cdot(wchunk(b2, c), xc);
            a3 += cdot(wchunk(b3, c), xc);
        }
    }
    if (P.k4 > P.nchunks * 8u) {
        a0 += tail(b0, xr);
        if (RR > 1u) { a1 += tail(b1, xr); }
        if (RR > 2u) { a2 += tail(b2, xr); a3 += tail(b3, xr); }
    }
    return vec4<f32>(a0, a1, a2, a3);
}

// matmul: RR weight rows r0.. of one activation row t (decode: T = 1).
// dispatch (ceil(rows / (WG * RR)), T, 1), workgroup WG
@compute @workgroup_size(WG)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r0 = (wid.x * WG + lid) * RR;
    if (r0 >= P.rows) { return; }   // no barriers anywhere: early exit is safe
    store4(wid.y, r0, row_sums(r0, wid.y));
}

// The RR weight rows an invocation owns (from r0) and their first words b (matmul_batch.wgsl,
// matmul_decode.wgsl). No early return (it would put every load below inside control flow): rows
// past the end re-read the last row and are not stored.
struct RowGroup { b: vec4<u32>, r0: u32 }

fn row_group(wid: vec3<u32>, lid: u32) -> RowGroup {
    let r0 = (wid.x * WG + lid) * RR;
    let last = P.rows - 1u;
    return RowGroup(vec4<u32>(min(r0, last), min(r0 + 1u, last), min(r0 + 2u, last),
                              min(r0 + 3u, last)) * P.row_words, r0);
}

// chunk c of the RR weight rows whose first words are b, decoded once for every activation row
struct WChunks { w0: WChunk, w1: WChunk, w2: WChunk, w3: WChunk }

fn wchunks(b: vec4<u32>, c: u32) -> WChunks {
    var d: WChunks;
    d.w0 = wchunk(b.x, c);
    if (RR > 1u) { d.w1 = wchunk(b.y, c); }
    if (RR > 2u) {
        d.w2 = wchunk(b.z, c);
        d.w3 = wchunk(b.w, c);
    }
    return d;
}

// one activation row's contribution to RR weight rows: a[i] += w_i . x
fn rows4(w: WChunks, xc: XChunk, a: vec4<f32>) -> vec4<f32> {
    var r = a;
    r.x += cdot(w.w0, xc);
    if (RR > 1u) { r.y += cdot(w.w1, xc); }
    if (RR > 2u) { r.z += cdot(w.w2, xc); r.w += cdot(w.w3, xc); }
    return r;
}

fn store4(t: u32, r0: u32, a: vec4<f32>) {
    store(t, r0, a.x);
    if (RR > 1u) { store(t, r0 + 1u, a.y); }
    if (RR > 2u) { store(t, r0 + 2u, a.z); store(t, r0 + 3u, a.w); }
}

// The sums of RR weight rows r0.. (r0 < rows) with 4 activation rows t0..t0+3, each row's as
// row_sums makes it alone (the same cdot and tail calls in the same order): each weight chunk is
// decoded once per 4 rows of x and each x chunk loaded once per RR rows.
fn tile_sums(r0: u32, t0: u32) -> array<vec4<f32>, 4> {
    let last = P.rows - 1u;
    let b0 = r0 * P.row_words;
    let b1 = min(r0 + 1u, last) * P.row_words;
    let b2 = min(r0 + 2u, last) * P.row_words;
    let b3 = min(r0 + 3u, last) * P.row_words;
    let xk4 = P.K / 4u;
    let lt = P.T - 1u;      // x rows past T re-read row T-1 and are not written
    let x0 = P.x_off4 + t0 * xk4;
    let x1 = P.x_off4 + min(t0 + 1u, lt) * xk4;
    let x2 = P.x_off4 + min(t0 + 2u, lt) * xk4;
    let x3 = P.x_off4 + min(t0 + 3u, lt) * xk4;
    var a0 = vec4<f32>(0.0);   // x row t0 with weight rows r0..r0+3
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    for (var c = 0u; c < P.nchunks; c++) {
        let o = c * 8u;
        let w = wchunks(vec4<u32>(b0, b1, b2, b3), c);
        a0 = rows4(w, xchunk(x0 + o), a0);
        a1 = rows4(w, xchunk(x1 + o), a1);
        a2 = rows4(w, xchunk(x2 + o), a2);
        a3 = rows4(w, xchunk(x3 + o), a3);
    }
    if (P.k4 > P.nchunks * 8u) {
        a0 += vec4<f32>(tail(b0, x0), tail(b1, x0), tail(b2, x0), tail(b3, x0));
        a1 += vec4<f32>(tail(b0, x1), tail(b1, x1), tail(b2, x1), tail(b3, x1));
        a2 += vec4<f32>(tail(b0, x2), tail(b1, x2), tail(b2, x2), tail(b3, x2));
        a3 += vec4<f32>(tail(b0, x3), tail(b1, x3), tail(b2, x3), tail(b3, x3));
    }
    return array<vec4<f32>, 4>(a0, a1, a2, a3);
}

// matmul_tile: RR weight rows x 4 activation rows t0..t0+3 (prefill; fused_rows decode rows).
// dispatch (ceil(rows / (WG * RR)), ceil(T / 4), 1), workgroup WG
@compute @workgroup_size(WG)
fn matmul_tile(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r0 = (wid.x * WG + lid) * RR;
    if (r0 >= P.rows) { return; }
    let t0 = wid.y * 4u;
    let a = tile_sums(r0, t0);
    store4(t0, r0, a[0]);
    store4(t0 + 1u, r0, a[1]);
    store4(t0 + 2u, r0, a[2]);
    store4(t0 + 3u, r0, a[3]);
}
