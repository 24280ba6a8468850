// gated_delta_rule: Gated DeltaNet's recurrence, one token after another, for value head h (key head
// h / (Hv / Hk): HF's order, value heads grouped by key head; or h % Hk where `tiled`: llama.cpp's
// GGUF order), and the gated RMSNorm of its output. Per row t of a sequence:
//   q = l2norm(q_t) / sqrt(Dk), k = l2norm(k_t)        (Dk,)   from the convolved q|k|v row
//   beta = sigmoid(b[t, h]),  g = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])
//   S = S * exp(g);  S += k ⊗ (beta * (v_t - Sᵀ k));  o = Sᵀ q          S: (Dk, Dv) f32
//   y[t, h, :] = o / sqrt(mean(o²) + eps) * w * silu(z[t, h, :])
// S is the sequence's state (slot), kept across calls; a sequence whose first row here is at
// position 0 starts from zeros. Positions and slots as in conv1d.wgsl (per_row 0: pos0 + t from
// `step`, slot 0; per_row 1: positions[t], slots[t]). Sums in f32.
// dispatch (Hv, 1, 1), workgroup DV: invocation j owns column j of S (DK, DV: header constants; DK a
// multiple of 4: the column, q and k are vec4s, which a CPU adapter indexes 4x less often: 1.5x faster).
// A row whose slots entry also names a save slot (row_save(t) = that slot + 1) copies S after it
// there, as conv1d.wgsl does.
// row_pos(t), row_slot(t), row_save(t): each row's position, slot and save slot, in the header
// (kernels/deltanet.py).

struct Params {
    rows: u32,          // T
    n_k_heads: u32,     // Hk
    n_v_heads: u32,     // Hv
    qkv_stride: u32,    // elements per row of qkv (2 Hk Dk + Hv Dv)
    qkv_off: u32,       // element offsets of qkv, z / b / a and y in their bindings
    proj_off: u32,
    y_off: u32,
    proj_stride: u32,   // elements per row of proj
    z_col: u32,         // columns of z (Hv Dv), b (Hv) and a (Hv) in a row of proj
    b_col: u32,
    a_col: u32,
    per_row: u32,
    eps: f32,
    tiled: u32,         // value heads in llama.cpp's tiled order (key head h % Hk)
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<act>;              // (T, qkv_stride): q | k | v
@group(0) @binding(2) var<storage, read> proj: array<act>;             // (T, proj_stride): .. z .. b .. a
@group(0) @binding(3) var<storage, read> hw: array<f32>;               // (2 Hv + Dv): A_log | dt_bias | w
@group(0) @binding(4) var<storage, read_write> state: array<f32>;      // (slots, Hv, DK, DV)
@group(0) @binding(5) var<storage, read_write> y: array<act>;          // (T, Hv DV)
@group(0) @binding(6) var<storage, read> step: array<u32>;             // (4): pos0, n_new, kv_len, 0
@group(0) @binding(7) var<storage, read> positions: array<u32>;        // (T,) per_row 1
@group(0) @binding(8) var<storage, read> slots: array<u32>;            // (T,) per_row 1: slot | (save + 1) << 16

var<workgroup> qs: array<vec4<f32>, DK / 4u>;
var<workgroup> ks: array<vec4<f32>, DK / 4u>;
var<workgroup> red: array<f32, DV>;

fn softplus(x: f32) -> f32 {
    return select(log(1.0 + exp(x)), x, x > 20.0);      // torch's threshold
}

@compute @workgroup_size(DV)
fn gated_delta_rule(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) j: u32) {
    let h = wid.x;
    let hk = select(h / (p.n_v_heads / p.n_k_heads), h % p.n_k_heads, p.tiled == 1u);
    let key_dim = p.n_k_heads * DK;
    let a_log = hw[h];
    let dt_bias = hw[p.n_v_heads + h];
    let wj = hw[2u * p.n_v_heads + j];
    var s: array<vec4<f32>, DK / 4u>;   // column j of S
    for (var t = 0u; t < p.rows; t++) {
        let slot = row_slot(t);
        let base = (slot * p.n_v_heads + h) * DK * DV + j;
        if (t == 0u || row_slot(t - 1u) != slot) {          // the sequence's first row here
            let fresh = row_pos(t) == 0u;
            for (var i = 0u; i < DK / 4u; i++) {
                let at = base + 4u * i * DV;
                let col = vec4(state[at], state[at + DV], state[at + 2u * DV], state[at + 3u * DV]);
                s[i] = select(col, vec4(0.0), fresh);
            }
        }
        let row = p.qkv_off + t * p.qkv_stride;
        workgroupBarrier();                                 // the last row's readers of qs, ks, red are done
        for (var i = j; i < DK / 4u; i += DV) {
            let qa = row + hk * DK + 4u * i;
            let ka = qa + key_dim;
            qs[i] = vec4(f32(qkv[qa]), f32(qkv[qa + 1u]), f32(qkv[qa + 2u]), f32(qkv[qa + 3u]));
            ks[i] = vec4(f32(qkv[ka]), f32(qkv[ka + 1u]), f32(qkv[ka + 2u]), f32(qkv[ka + 3u]));
        }
        workgroupBarrier();
        var qq = 0.0;
        var kk = 0.0;
        for (var i = 0u; i < DK / 4u; i++) { qq += dot(qs[i], qs[i]); kk += dot(ks[i], ks[i]); }
        let qn = inverseSqrt(qq + 1e-6) / sqrt(f32(DK));
        let kn = inverseSqrt(kk + 1e-6);
        let prow = p.proj_off + t * p.proj_stride;
        let beta = 1.0 / (1.0 + exp(-f32(proj[prow + p.b_col + h])));
        let decay = exp(-exp(a_log) * softplus(f32(proj[prow + p.a_col + h]) + dt_bias));
        let v = f32(qkv[row + 2u * key_dim + h * DV + j]);
        var mem = 0.0;
        for (var i = 0u; i < DK / 4u; i++) { s[i] *= decay; mem += dot(s[i], ks[i] * kn); }
        let delta = (v - mem) * beta;
        var o = 0.0;
        for (var i = 0u; i < DK / 4u; i++) { s[i] += (ks[i] * kn) * delta; o += dot(s[i], qs[i] * qn); }
        red[j] = o * o;
        workgroupBarrier();
        var ss = 0.0;
        for (var i = 0u; i < DV; i++) { ss += red[i]; }
        let z = f32(proj[prow + p.z_col + h * DV + j]);
        y[p.y_off + t * p.n_v_heads * DV + h * DV + j] =
            act(o * inverseSqrt(ss / f32(DV) + p.eps) * wj * (z / (1.0 + exp(-z))));
        let save = row_save(t);
        if (save != 0u) {
            let at = ((save - 1u) * p.n_v_heads + h) * DK * DV + j;
            for (var i = 0u; i < DK; i++) { state[at + i * DV] = s[i / 4u][i % 4u]; }
        }
        if (t + 1u == p.rows || row_slot(t + 1u) != slot) {  // its last row here: keep the state
            for (var i = 0u; i < DK; i++) { state[base + i * DV] = s[i / 4u][i % 4u]; }
        }
    }
}
