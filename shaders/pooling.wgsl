// Sequence pooling over the valid tokens of each padded sequence, and L2 normalisation.
//   x (B*S, C) act; lengths (B) u32 (token s of sequence b is valid iff s < lengths[b]);
//   y (B, C) `outt` (f32 or f16, may differ from act).
//   mean_pool: y[b,c] = mean_{s < len} x[b*S+s, c]   (0 for an empty sequence)
//   max_pool:  y[b,c] = max_{s < len} x[b*S+s, c]    (0 for an empty sequence)
//   cls_pool:  y[b,c] = x[b*S, c]
//   last_pool: y[b,c] = x[b*S + len-1, c]                              (sentence-transformers' lasttoken)
//   weighted_mean_pool: y[b,c] = sum_{s < len} (s+1) x[b*S+s, c] / sum_{s < len} (s+1)   (weightedmean)
//   invocation per (b, c); dispatch ceil(B*C / 64) split over x,y.
//   l2_normalize: y[b,:] = x[b,:] / max(||x[b,:]||, 1e-12) (torch F.normalize); invocation per row.

struct Params {
    batch: u32,   // B (rows for l2_normalize)
    seq: u32,     // S
    cols: u32,    // C
    x_off: u32,
    y_off: u32,
    eps: f32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<act>;     // (B*S, C)
@group(0) @binding(2) var<storage, read> lengths: array<u32>;     // (B)
@group(0) @binding(3) var<storage, read_write> y: array<outt>;    // (B, C)
@group(0) @binding(2) var<storage, read_write> yn: array<outt>;   // l2_normalize output

const WG: u32 = 64u;

// an invocation's builtins; flat(l): its index in the dispatch (workgroups of 64 split over x, y)
struct Lane {
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
}

fn flat(l: Lane) -> u32 {
    return (l.wid.y * l.nwg.x + l.wid.x) * WG + l.lid;
}

// x[b*S + t, c] in f32
fn xv(b: u32, t: u32, c: u32) -> f32 {
    return f32(x[p.x_off + (b * p.seq + t) * p.cols + c]);
}

const MEAN: u32 = 0u;
const MAX: u32 = 1u;
const CLS: u32 = 2u;
const LAST: u32 = 3u;
const WEIGHTED_MEAN: u32 = 4u;

// y[b,c] for invocation i = b*C + c of the pooling `kind` (see the top; none past B*C)
fn pool(i: u32, kind: u32) {
    if (i >= p.batch * p.cols) { return; }
    let b = i / p.cols;
    let c = i % p.cols;
    let n = min(lengths[b], p.seq);
    var v = 0.0;
    switch kind {
        case MEAN: {
            for (var t = 0u; t < n; t++) { v += xv(b, t, c); }
            v = v / f32(max(n, 1u));
        }
        case MAX: {
            v = select(0.0, -3.0e38, n > 0u);
            for (var t = 0u; t < n; t++) { v = max(v, xv(b, t, c)); }
        }
        // cls reads lengths only for an empty sequence's 0 (it is bound so that every pooling op
        // shares one signature)
        case CLS: { v = xv(b, 0u, c) * select(0.0, 1.0, lengths[b] > 0u); }
        case LAST: { v = xv(b, max(n, 1u) - 1u, c) * select(0.0, 1.0, n > 0u); }
        default: {
            for (var t = 0u; t < n; t++) { v += f32(t + 1u) * xv(b, t, c); }
            v = v / max(0.5 * f32(n) * f32(n + 1u), 1.0);      // weights 1..n sum to n(n+1)/2
        }
    }
    y[p.y_off + i] = outt(v);
}

// the pooling entry points: invocation per (b, c)
@compute @workgroup_size(64) fn mean_pool(l: Lane) { pool(flat(l), MEAN); }
@compute @workgroup_size(64) fn max_pool(l: Lane) { pool(flat(l), MAX); }
@compute @workgroup_size(64) fn cls_pool(l: Lane) { pool(flat(l), CLS); }
@compute @workgroup_size(64) fn last_pool(l: Lane) { pool(flat(l), LAST); }
@compute @workgroup_size(64) fn weighted_mean_pool(l: Lane) { pool(flat(l), WEIGHTED_MEAN); }

@compute @workgroup_size(64)
fn l2_normalize(l: Lane) {
    let b = flat(l);
    if (b >= p.batch) { return; }
    let xb = p.x_off + b * p.cols;
    var ss = 0.0;
    for (var c = 0u; c < p.cols; c++) {
        let v = f32(x[xb + c]);
        ss += v * v;
    }
    let inv = 1.0 / max(sqrt(ss), p.eps);
    for (var c = 0u; c < p.cols; c++) { yn[p.y_off + b * p.cols + c] = outt(f32(x[xb + c]) * inv); }
}
