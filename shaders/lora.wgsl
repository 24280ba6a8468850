// LoRA deltas of many adapters in one batch (punica / S-LoRA "bgmv"): each row t reads the
// adapter slot idx[t] (NONE: the row has no adapter and is left untouched):
//   lora_shrink: u[t, j]  = sum_k x[t, k] * A[idx[t], j, k]          dispatch (ceil(J / WG), T, 1)
//   lora_expand: y[t, n] += sum_j u[t, j] * B[idx[t], n, j]          dispatch (ceil(N / WG), T, 1)
// J = the group's targets x the pool's rank (q|k|v share one x: their A rows stacked); B holds the
// adapter's scale (alpha / r, or alpha / sqrt(r)) and is laid out as the projection's output rows.
// Workgroup WG; one invocation per output value, its sum in index order (f32). The host prepends the
// activation header (act = x's and y's dtype) and the const WG.

struct LoraParams {
    T: u32,          // rows
    K: u32,          // input width (shrink)
    N: u32,          // output columns (expand)
    J: u32,          // A rows / B columns per slot
    x_off: u32,      // x's offset in its binding, in elements (shrink)
    y_off: u32,      // y's offset in its binding, in elements (expand)
    y_stride: u32,   // y's row stride, in elements (expand)
    slots: u32,      // slots in the pool
}

const NONE: u32 = 0xFFFFFFFFu;

@group(0) @binding(0) var<uniform> P: LoraParams;
@group(0) @binding(1) var<storage, read> idx: array<u32>;             // (T) adapter slot of each row
@group(0) @binding(2) var<storage, read_write> u: array<f32>;          // (T, J) x · Aᵀ
@group(0) @binding(3) var<storage, read> x: array<act>;               // (T, K) (shrink)
@group(0) @binding(4) var<storage, read> a: array<f32>;               // (slots, J, K) (shrink)
@group(0) @binding(5) var<storage, read_write> y: array<act>;         // (T, y_stride) (expand)
@group(0) @binding(6) var<storage, read> b: array<f32>;               // (slots, N, J) (expand)

@compute @workgroup_size(WG)
fn lora_shrink(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let t = gid.y;
    if (j >= P.J || t >= P.T) { return; }
    let s = idx[t];
    if (s == NONE || s >= P.slots) { return; }
    let x0 = P.x_off + t * P.K;
    let a0 = (s * P.J + j) * P.K;
    var acc = 0.0;
    for (var k = 0u; k < P.K; k++) { acc += f32(x[x0 + k]) * a[a0 + k]; }
    u[t * P.J + j] = acc;
}

@compute @workgroup_size(WG)
fn lora_expand(@builtin(global_invocation_id) gid: vec3<u32>) {
    let n = gid.x;
    let t = gid.y;
    if (n >= P.N || t >= P.T) { return; }
    let s = idx[t];
    if (s == NONE || s >= P.slots) { return; }
    let u0 = t * P.J;
    let b0 = (s * P.N + n) * P.J;
    var acc = 0.0;
    for (var j = 0u; j < P.J; j++) { acc += u[u0 + j] * b[b0 + j]; }
    let at = P.y_off + t * P.y_stride + n;
    y[at] = act(f32(y[at]) + acc);
}

// lora_delta: lora_shrink then lora_expand of one row in one workgroup (a decode step's few rows:
// one dispatch per projection instead of two), and where NORM x normed on the way in:
//   u[j] = sum_k (x[t, k] * w[k] / rms(x[t, :])) * A[idx[t], j, k];  y[t, n] += sum_j u[j] * B[idx[t], n, j]
// (w (K) f32, rms = sqrt(mean(x^2) + eps)). dispatch (T, 1, 1), workgroup WG; the host adds the
// consts JMAX (= J) and NORM. A row without an adapter returns at once (its slot read uniformly).
@group(0) @binding(7) var<storage, read> w: array<f32>;               // (K) norm weight (NORM)

struct DeltaParams {
    T: u32,
    K: u32,
    N: u32,
    J: u32,
    x_off: u32,
    y_off: u32,
    slots: u32,
    eps: f32,
}

@group(0) @binding(8) var<uniform> D: DeltaParams;

var<workgroup> wslot: u32;
var<workgroup> wsum: array<f32, WG>;
var<workgroup> wu: array<f32, JMAX>;

@compute @workgroup_size(WG)
fn lora_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    if (lid == 0u) { wslot = idx[t]; }
    let s = workgroupUniformLoad(&wslot);
    if (s == NONE || s >= D.slots) { return; }
    let x0 = D.x_off + t * D.K;
    var inv = 1.0;
    if (NORM) {
        var ss = 0.0;
        for (var k = lid; k < D.K; k += WG) { let v = f32(x[x0 + k]); ss += v * v; }
        wsum[lid] = ss;
        workgroupBarrier();
        if (lid == 0u) {
            var tot = 0.0;
            for (var i = 0u; i < WG; i++) { tot += wsum[i]; }
            wsum[0] = tot;
        }
        workgroupBarrier();
        inv = inverseSqrt(wsum[0] / f32(D.K) + D.eps);
    }
    for (var j = lid; j < D.J; j += WG) {
        let a0 = (s * D.J + j) * D.K;
        var acc = 0.0;
        if (NORM) {
            for (var k = 0u; k < D.K; k++) { acc += f32(x[x0 + k]) * w[k] * a[a0 + k]; }
            acc *= inv;
        } else {
            for (var k = 0u; k < D.K; k++) { acc += f32(x[x0 + k]) * a[a0 + k]; }
        }
        wu[j] = acc;
    }
    workgroupBarrier();
    for (var n = lid; n < D.N; n += WG) {
        let b0 = (s * D.N + n) * D.J;
        var acc = 0.0;
        for (var j = 0u; j < D.J; j++) { acc += wu[j] * b[b0 + j]; }
        let at = D.y_off + t * D.N + n;
        y[at] = act(f32(y[at]) + acc);
    }
}
