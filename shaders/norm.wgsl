// Row normalisations over the last axis, f32 accumulation, one invocation per row
// (lavapipe runs row-per-invocation faster than cooperative reductions with barriers).
//   rms_norm:       y[t,:] = x[t,:] / sqrt(mean(x[t,:]^2) + eps) * w
//   layer_norm:     y[t,:] = (x[t,:] - mean) / sqrt(var + eps) * w + b
//   layer_norm_res: the same on h = x + r (fused residual add); y may alias x or r.
//   head_rms_norm:  in place on a fused qkv row (T, H_all, D): rms_norm of each of the first
//                   n_norm heads over its D values, heads < n_q with weight w[0..D), heads < n_qk
//                   with w[D..2D), the rest with w[2D..3D) (Qwen3 / Gemma 3 q and k norms; Gemma 4's
//                   v heads too); one invocation per (t, head).
//   proj_rms_norm:  in place on a fused qkv row (T, q_cols + 2 k_cols): rms_norm of the whole q
//                   projection (its first q_cols values) with w[0..q_cols) and of the whole k
//                   projection (the next k_cols) with w[q_cols..) (OLMo-2's q and k norms); one
//                   invocation per (t, q or k).
// dispatch (ceil(T/64) split over x,y), workgroup 64. The host header sets the storage type `av`
// (act or act4), its f32 twin `fv` and `hsum(fv)`: rows move W = 1 or 4 elements per load, and
// every size and offset below counts W-element units.
// Rows are written with put_norm(i, v), defined by the host header: through y, or through x or r when y
// is the same tensor (in place: WebGPU forbids one range bound writable twice in a dispatch).

struct Params {
    rows: u32,   // T
    cols: u32,   // C
    x_off: u32,  // element offsets of the tensors inside their bindings
    y_off: u32,
    r_off: u32,
    eps: f32,
    w_off: u32,
    b_off: u32,
}

struct HeadParams {
    items: u32,  // T * n_norm
    cols: u32,   // D
    x_off: u32,
    heads: u32,  // H_all: heads per qkv row
    n_norm: u32, // heads [0, n_norm) are normalised
    n_q: u32,    // heads [0, n_q) take the first weight row
    eps: f32,
    w_off: u32,
    n_qk: u32,   // heads [n_q, n_qk) take the second, heads [n_qk, n_norm) the third
    _a: u32,
    _b: u32,
    _c: u32,
}

struct ProjParams {
    items: u32,  // T * 2: (row, q or k)
    q_cols: u32, // Hq * D
    x_off: u32,
    row: u32,    // a qkv row: (Hq + 2 Hkv) * D
    k_cols: u32, // Hkv * D
    eps: f32,
    w_off: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(0) var<uniform> hp: HeadParams;
@group(0) @binding(0) var<uniform> pp: ProjParams;
@group(0) @binding(1) var<storage, read_write> x: array<av>;  // (T, C)
@group(0) @binding(2) var<storage, read> w: array<fv>;        // (C)
@group(0) @binding(3) var<storage, read_write> y: array<av>;  // (T, C)
@group(0) @binding(4) var<storage, read> b: array<fv>;        // (C)
@group(0) @binding(5) var<storage, read_write> r: array<av>;  // (T, C)

const WG: u32 = 64u;

fn row_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// the mean of n units' W * n values, whose W-wide partial sums are s
fn mean_of(s: fv, n: u32) -> f32 {
    return hsum(s) / f32(n * W);
}

// 1 / sqrt(mean square + eps) of the n units from x[xb]
fn inv_rms(xb: u32, n: u32, eps: f32) -> f32 {
    var ss = fv(0.0);
    for (var c = 0u; c < n; c++) {
        let v = fv(x[xb + c]);
        ss += v * v;
    }
    return inverseSqrt(mean_of(ss, n) + eps);
}

@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let t = row_index(wid, nwg, lid);
    if (t >= p.rows) { return; }
    let xb = p.x_off + t * p.cols;
    let yb = p.y_off + t * p.cols;
    let inv = inv_rms(xb, p.cols, p.eps);
    for (var c = 0u; c < p.cols; c++) {
        put_norm(yb + c, av(fv(x[xb + c]) * inv * w[p.w_off + c]));
    }
}

@compute @workgroup_size(64)
fn layer_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let t = row_index(wid, nwg, lid);
    if (t >= p.rows) { return; }
    let xb = p.x_off + t * p.cols;
    let yb = p.y_off + t * p.cols;
    var s = fv(0.0);
    for (var c = 0u; c < p.cols; c++) { s += fv(x[xb + c]); }
    let mean = mean_of(s, p.cols);
    // two-pass variance: no cancellation when |mean| >> std
    var vs = fv(0.0);
    for (var c = 0u; c < p.cols; c++) {
        let d = fv(x[xb + c]) - mean;
        vs += d * d;
    }
    let inv = inverseSqrt(mean_of(vs, p.cols) + p.eps);
    for (var c = 0u; c < p.cols; c++) {
        put_norm(yb + c, av((fv(x[xb + c]) - mean) * inv * w[p.w_off + c] + b[p.b_off + c]));
    }
}

@compute @workgroup_size(64)
fn layer_norm_res(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let t = row_index(wid, nwg, lid);
    if (t >= p.rows) { return; }
    let xb = p.x_off + t * p.cols;
    let rb = p.r_off + t * p.cols;
    let yb = p.y_off + t * p.cols;
    var s = fv(0.0);
    for (var c = 0u; c < p.cols; c++) { s += fv(x[xb + c]) + fv(r[rb + c]); }
    let mean = mean_of(s, p.cols);
    var vs = fv(0.0);
    for (var c = 0u; c < p.cols; c++) {
        let d = fv(x[xb + c]) + fv(r[rb + c]) - mean;
        vs += d * d;
    }
    let inv = inverseSqrt(mean_of(vs, p.cols) + p.eps);
    // element c is read before it is written, so y may alias x or r
    for (var c = 0u; c < p.cols; c++) {
        let h = fv(x[xb + c]) + fv(r[rb + c]);
        put_norm(yb + c, av((h - mean) * inv * w[p.w_off + c] + b[p.b_off + c]));
    }
}

@compute @workgroup_size(64)
fn head_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = row_index(wid, nwg, lid);
    if (i >= hp.items) { return; }
    let h = i % hp.n_norm;
    let xb = hp.x_off + ((i / hp.n_norm) * hp.heads + h) * hp.cols;
    let wb = hp.w_off + select(select(2u * hp.cols, hp.cols, h < hp.n_qk), 0u, h < hp.n_q);
    let inv = inv_rms(xb, hp.cols, hp.eps);
    for (var c = 0u; c < hp.cols; c++) {
        x[xb + c] = av(fv(x[xb + c]) * inv * w[wb + c]);
    }
}

@compute @workgroup_size(64)
fn proj_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = row_index(wid, nwg, lid);
    if (i >= pp.items) { return; }
    let is_k = i % 2u == 1u;
    let start = select(0u, pp.q_cols, is_k);
    let n = select(pp.q_cols, pp.k_cols, is_k);
    let xb = pp.x_off + (i / 2u) * pp.row + start;
    let wb = pp.w_off + start;
    let inv = inv_rms(xb, n, pp.eps);
    for (var c = 0u; c < n; c++) {
        x[xb + c] = av(fv(x[xb + c]) * inv * w[wb + c]);
    }
}
