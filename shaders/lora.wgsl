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
@group(0) @binding(3) var<storage, read_write> x: array<act>;         // (T, K) (shrink)
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
// (w (K) f32, rms = sqrt(mean(x^2) + eps)). A is lora_shrink's (slots, J, K), read as vec4; B is
// compact, (slots, N, R): row n holds only the R columns of its target's block (the others are
// zeros in B's (N, J) form), which start at u's column cols[p] for rows 2p and 2p + 1 (one
// target's: its index x R). Each sum in the order lora_shrink / lora_expand make it (the zero
// columns left out add nothing); with NORM, 1 / rms from each lane's sum of squares (added in lane
// order). With STORE, y = the delta instead (a row without an adapter: -0.0, so that a matmul
// adding y to its sums keeps a base row's bits: models/lora.py). x and y are read and written 4
// values a load (xv, yv: x_off, y_off, K and N multiples of 4; on a CPU adapter a load or store
// costs per invocation whatever its width), a lane making 4 rows of y.
// dispatch (T, 1, 1), workgroup WG (the shrink's R lanes in passes of WG); the host adds the consts
// VL (the norm's virtual lanes), JMAX (= J), NORM, STORE, KC and SHAPE_K/N/J/R (the widths, or 0:
// the uniforms'), and A and B's element type: `wvec` f32 (vec4<f32>, VW = 4 values a load) or f16
// or bf16 pairs (vec4<u32>, VW = 8: on a CPU adapter a load costs per invocation whatever its
// width, so 16-bit weights halve the loads) with `wdot`, which adds a load's VW products in index
// order (the same sums, the same bits for the same values). A row without an adapter returns at
// once (its slot read uniformly).
@group(0) @binding(3) var<storage, read_write> xv: array<act4>;       // (T, K / 4) x (lora_delta)
@group(0) @binding(5) var<storage, read_write> yv: array<act4>;       // (T, N / 4) y (lora_delta)
@group(0) @binding(9) var<storage, read> cols: array<vec2<u32>>;      // (N / 4) first u column of each row pair
@group(0) @binding(10) var<storage, read> a4: array<wvec>;            // (slots, J, K / VW) A
@group(0) @binding(11) var<storage, read> b4: array<wvec>;            // (slots, N, R / VW) B compact
@group(0) @binding(12) var<storage, read> w4: array<vec4<f32>>;       // (K / 4) norm weight (NORM)

struct DeltaParams {
    T: u32,
    K: u32,
    N: u32,
    J: u32,
    x_off: u32,
    y_off: u32,
    slots: u32,
    eps: f32,
    R: u32,          // B's columns per row (the pool's rank)
}

@group(0) @binding(8) var<uniform> D: DeltaParams;

var<workgroup> wslot: u32;
var<workgroup> wsum: array<f32, VL>;     // the norm's sums of squares, a virtual lane each
var<workgroup> wtot: f32;
var<workgroup> wu: array<vec4<f32>, (JMAX + 3u) / 4u>;
var<workgroup> wx: array<vec4<f32>, KC / 4u>;

@compute @workgroup_size(WG)
fn lora_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let s = row_slot(t, lid);
    if (s == NONE || s >= D.slots) {
        store_none(t, lid);
        return;
    }
    delta_row(t, s, lid);
}

// STORE: a row's delta is -0.0, which leaves any value it is added to as it is
fn store_none(t: u32, lid: u32) {
    let N = select(D.N, SHAPE_N, SHAPE_K > 0u);
    let y0 = (D.y_off + t * N) / 4u;
    for (var q = lid; STORE && q < N / 4u; q += WG) { yv[y0 + q] = act4(vec4<f32>(bitcast<f32>(0x80000000u))); }
}

// lora_delta's work for row t of adapter slot s
fn delta_row(t: u32, s: u32, lid: u32) {
    // the widths: the host's compile-time ones where it gives them (SHAPE_K > 0: loops of known
    // trip counts, which a CPU adapter unrolls), else the uniforms
    let K = select(D.K, SHAPE_K, SHAPE_K > 0u);
    let N = select(D.N, SHAPE_N, SHAPE_K > 0u);
    let J = select(D.J, SHAPE_J, SHAPE_K > 0u);
    let R = select(D.R, SHAPE_R, SHAPE_K > 0u);
    let x0 = (D.x_off + t * K) / 4u;
    // u = A · x: invocation l sums row l of each target's block of A (rows l, R + l, 2R + l: the
    // group's J / R targets, at most 3) against x (times w), VW values a load, x staged KC values
    // at a time in workgroup memory (each x value read once for the lane's rows; R lanes, WG at a
    // time: the rows past the first WG in further passes, x staged again only where K > KC).
    // NORM: the VL virtual lanes' sums of x^2 made on the way (the first pass over x; lane i makes
    // virtual lanes i, i + WG, ..., so any WG gives the same sums), 1 / rms(x) applied to u
    let K4 = K / VW;
    let a0 = (s * J) * K4;
    let NT = J / R;
    var inv = 1.0;
    let ln = sg_lane();
    for (var l0 = 0u; l0 < R; l0 += WG) {
        let l = l0 + lid;
        let aj = a0 + min(l, R - 1u) * K4;   // SG: lanes past R make row R - 1's sums again, not stored
        var acc = vec3<f32>(0.0);        // rows l, R + l, 2R + l
        for (var kc = 0u; kc < K; kc += KC) {
            let kn = min(KC, K - kc);
            workgroupBarrier();
            for (var v = lid; v < VL && (l0 == 0u || K > KC); v += WG) {    // the lane's virtual lanes
                var ss = select(0.0, wsum[v], kc > 0u);
                for (var k4 = v; k4 < kn / 4u; k4 += VL) {      // 4 values: one load of x, of w, one store
                    var x4 = vec4<f32>(xv[x0 + kc / 4u + k4]);
                    if (NORM) {
                        ss = dot_seq(ss, x4, x4);
                        x4 *= w4[kc / 4u + k4];
                    }
                    wx[k4] = x4;
                }
                if (NORM && l0 == 0u) { wsum[v] = ss; }
            }
            workgroupBarrier();
            let ak = aj + kc / VW;
            let RK = R * K4;
            if (SG) {                    // 32 x values a block through the subgroup, then the rest
                let nb = kn / 32u;
                for (var kb = 0u; kb < nb; kb++) {
                    let m = lanes8(wx[kb * 8u + ln]);
                    let a = ak + kb * (32u / VW);
                    if (VW == 8u) {
                        acc = mac3(acc, m[0], m[1], a, RK, NT);
                        acc = mac3(acc, m[2], m[3], a + 1u, RK, NT);
                        acc = mac3(acc, m[4], m[5], a + 2u, RK, NT);
                        acc = mac3(acc, m[6], m[7], a + 3u, RK, NT);
                    } else {
                        acc = mac3(acc, m[0], m[0], a, RK, NT);
                        acc = mac3(acc, m[1], m[1], a + 1u, RK, NT);
                        acc = mac3(acc, m[2], m[2], a + 2u, RK, NT);
                        acc = mac3(acc, m[3], m[3], a + 3u, RK, NT);
                        acc = mac3(acc, m[4], m[4], a + 4u, RK, NT);
                        acc = mac3(acc, m[5], m[5], a + 5u, RK, NT);
                        acc = mac3(acc, m[6], m[6], a + 6u, RK, NT);
                        acc = mac3(acc, m[7], m[7], a + 7u, RK, NT);
                    }
                }
                for (var k4 = nb * (32u / VW); k4 < kn / VW; k4++) {
                    acc = mac3(acc, wx[k4 * (VW / 4u)], wx[k4 * (VW / 4u) + (VW / 4u - 1u)], ak + k4, RK, NT);
                }
            } else if (l < R) {
                for (var k4 = 0u; k4 < kn / VW; k4++) {     // VW = 4: x1 is x0 again
                    acc = mac3(acc, wx[k4 * (VW / 4u)], wx[k4 * (VW / 4u) + (VW / 4u - 1u)], ak + k4, RK, NT);
                }
            }
        }
        if (NORM && l0 == 0u) { inv = wsum_inv(lid, K); }
        if (l < R) {
            if (NORM) { acc *= inv; }
            put_u(l, R, NT, acc);
        }
    }
    workgroupBarrier();
    // y += B · u: invocation q makes rows n = 4q .. 4q + 3 (rows 4q, 4q + 1 one target's, 4q + 2,
    // 4q + 3 one target's: cols[q]), each u value read once for two rows, y 4 values a store
    let R4 = R / VW;
    let b0 = s * N * R4;
    let y0 = (D.y_off + t * N) / 4u;
    for (var q = lid; q < N / 4u; q += WG) {
        let acc = expand4(cols[q] / 4u, b0 + 4u * q * R4, R4);     // (expand4, mac3: kernels/lora.py's text)
        if (STORE) {
            yv[y0 + q] = act4(acc);
        } else {
            yv[y0 + q] = act4(vec4<f32>(yv[y0 + q]) + acc);
        }
    }
}

// 1 / rms of a row from each lane's sum of squares ss (a workgroup of VL lanes: lora_rows)
fn row_inv(lid: u32, ss: f32, K: u32) -> f32 {
    wsum[lid] = ss;
    return wsum_inv(lid, K);
}

// 1 / rms of a row from the VL virtual lanes' sums of squares in wsum, added in lane order (the same
// bits whatever the rows beside it, and whatever the workgroup's width)
fn wsum_inv(lid: u32, K: u32) -> f32 {
    workgroupBarrier();
    if (lid == 0u) {
        var tot = 0.0;
        for (var i = 0u; i < VL; i++) { tot += wsum[i]; }
        wtot = tot;
    }
    return inverseSqrt(workgroupUniformLoad(&wtot) / f32(K) + D.eps);
}

// u rows l, R + l, 2R + l (an invocation's sums, the first nt) into workgroup memory
fn put_u(l: u32, R: u32, nt: u32, acc: vec3<f32>) {
    wu[l / 4u][l % 4u] = acc.x;
    if (nt > 1u) { wu[(R + l) / 4u][(R + l) % 4u] = acc.y; }
    if (nt > 2u) { wu[(2u * R + l) / 4u][(2u * R + l) % 4u] = acc.z; }
}

// row t's adapter slot, read once and shared (uniform: a row without an adapter returns at once)
fn row_slot(t: u32, lid: u32) -> u32 {
    if (lid == 0u) { wslot = idx[t]; }
    return workgroupUniformLoad(&wslot);
}
