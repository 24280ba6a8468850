// lora_matmul: a group's LoRA deltas inside the decode matmul of its projection (kernels/lora.py
// Delta, matmul_source), on a CPU adapter, where a delta in a dispatch of its own cost a thread-pool
// round trip of the driver (about as much as its work):
//   ep_pro(lid, t0, nt): called first by the matmul's entry point, in uniform control flow. For each
//     of the workgroup's activation rows t = t0 .. t0 + nt - 1 (t < P.T) with an adapter (slot s =
//     idx[t] < LR_S), lane l makes row l of each target's block of A (rows l, R + l, 2R + l) against
//     the matmul's x row t (x' = x, or with LR_PNORM x / rms from the norm's partial sums, 1 / rms
//     made as the matmul makes it), its sum in index order (wdot: lora_delta's), into ep_lu; then a
//     barrier. The host runs as few workgroups as the driver runs at once (delta_wg): each makes u
//     once.
//   ep_added(t, n, r) (qkv, gate_up: before the RoPE + KV write or act(gate) * up): r + row t's
//     delta of weight rows n .. n + 3, rounded to act as lora_delta's stored y;
//   ep_resid(t, n, v) (o, down, LR_RES: matmul_epilogue.wgsl ep_res_norm's x as stored): act(v +
//     the delta), rounded into x as stored, before the next norm's values are made from it.
// The expand is lora_delta's (rows n, n + 1 one target's, n + 2, n + 3 one target's: cols[n / 4];
// B compact, its sums in index order). A row without an adapter keeps every value, bit for bit.
// Built after the matmul's text (P, x and xget, act4) and its epilogue (matmul_epilogue.wgsl); the
// host prepends the consts LR_* (idx offset, slots, J / 4, R, targets, K, N, x offset and row
// stride in xwords, the partial sums' offset and row stride in vec4, rows a workgroup, LR_PNORM,
// LR_EPS, LR_RES), `wvec` / `wdot`, ep_mac3 / ep_expand4 (lora_delta's text) and lr_inv(t) (1 / rms
// of row t, or 1).

@group(0) @binding(15) var<storage, read> ep_lidx: array<u32>;          // (T) adapter slots
@group(0) @binding(16) var<storage, read> ep_lb: array<wvec>;           // (slots, N, R / VW) B compact
@group(0) @binding(17) var<storage, read> ep_lcols: array<vec2<u32>>;   // (N / 4) first u column of each row pair
@group(0) @binding(18) var<storage, read> ep_la: array<wvec>;           // (slots, J, K / VW) A

const LR_K8: u32 = LR_K / VW;
const LR_R4: u32 = LR_R / VW;

var<workgroup> ep_lu: array<vec4<f32>, LR_ROWS * LR_J4>;    // the workgroup's rows' u
var<private> ep_lt0: u32;                                  // its first row

fn ep_pro(lid: u32, t0: u32, nt: u32) {
    ep_lt0 = t0;
    for (var i = 0u; i < LR_ROWS; i++) {
        let t = t0 + i;
        if (i < nt && t < P.T) {
            let s = ep_lidx[LR_IO + t];
            if (s < LR_S) { ep_shrink(t, i, s, lid); }
        }
    }
    workgroupBarrier();
}

fn ep_shrink(t: u32, i: u32, s: u32, lid: u32) {
    let xb = LR_XO + t * LR_X4;
    let RK = LR_R * LR_K8;
    for (var l = lid; l < LR_R; l += WG) {
        let inv = lr_inv(t);             // (the shrink's lanes only: made by all, ~2.7 ms a SmolLM2 step)
        let a0 = (s * LR_NT * LR_R + l) * LR_K8;
        var acc = vec3<f32>(0.0);        // rows l, R + l, 2R + l
        for (var k8 = 0u; k8 < LR_K8; k8++) {
            let x0 = xget(xb + k8 * (VW / 4u));
            let x1 = xget(xb + k8 * (VW / 4u) + (VW / 4u - 1u));
            acc = ep_mac3(acc, x0, x1, a0 + k8, RK, LR_NT);
        }
        if (LR_PNORM) { acc *= inv; }
        let u0 = i * LR_J4;
        ep_lu[u0 + l / 4u][l % 4u] = acc.x;
        if (LR_NT > 1u) { ep_lu[u0 + (LR_R + l) / 4u][(LR_R + l) % 4u] = acc.y; }
        if (LR_NT > 2u) { ep_lu[u0 + (2u * LR_R + l) / 4u][(2u * LR_R + l) % 4u] = acc.z; }
    }
}

// row t's delta of weight rows n .. n + 3 (slot s): lora_delta's expand (ep_expand4: the host's text,
// kernels/lora.py _EXPAND4)
fn ep_ldelta(t: u32, n: u32, s: u32) -> vec4<f32> {
    return ep_expand4(ep_lcols[n / 4u] / 4u + vec2<u32>((t - ep_lt0) * LR_J4), (s * LR_N + n) * LR_R4, LR_R4);
}

fn ep_added(t: u32, n: u32, r: vec4<f32>) -> vec4<f32> {
    let s = ep_lidx[LR_IO + t];
    if (LR_RES || s >= LR_S) { return r; }
    return r + vec4<f32>(act4(ep_ldelta(t, n, s)));
}

fn ep_resid(t: u32, n: u32, v: vec4<f32>) -> vec4<f32> {
    let s = ep_lidx[LR_IO + t];
    if (!LR_RES || s >= LR_S) { return v; }
    return vec4<f32>(act4(v + ep_ldelta(t, n, s)));
}
