// matmul_epilogue: what the T = 1 decode matmul (matmul_decode.wgsl) may do with the sums of one
// invocation — rows 4 i4 .. 4 i4 + 3 of its weight part (RR = 4) — instead of storing them, so
// that the small op after the matmul needs no dispatch of its own (on CPU Vulkan a dispatch costs
// ~30 us, more than these ops' work). ep_silu and ep_res_norm take the activation row t (several
// rows of a continuous batch: row t of each output; rows t >= P.T are padding, not stored);
// ep_rope_kv is one row's (its position is step[0]):
//   ep_silu:    the weight is gate and up with rows interleaved in pairs (g 2j, g 2j+1, u 2j,
//               u 2j+1, ...; see interleave_pairs in kernels/matmul/layout.py), so an invocation holds
//               (g 2i4, g 2i4+1, u 2i4, u 2i4+1) and stores y[2 i4 + j] = act(g) * u, j = 0, 1:
//               y is (1, F) while the weight has 2F rows; act is silu or gelu_tanh (gate_act.wgsl).
//   ep_rope_kv: the weight is the fused [q | k | v] projection of a model with adjacent rotary
//               pairs (GGUF llama layout; D % 4 == 0, so the 4 rows lie in one head). Adds the bias,
//               rotates q and k rows by position ep_pos(t) exactly as rope.wgsl does, stores the 4
//               values into y (qkv) and k and v rows also into cache row ep_row(head, t, pos) (the
//               host prepends ep_pos / ep_row: kernels/matmul/epilogues.py).
//   ep_res_norm: the first half of the RMSNorm that follows a residual matmul (x += o·W, the
//               output y being the whole row x): adds the bias and y's old values (accumulate),
//               stores y, y * g into ep_yg and the sum of the 4 squares into ep_part[i4]. The
//               next matmul reads ep_yg and scales its sums by 1 / rms from the partials
//               (matmul_decode.wgsl dec_pss), so the norm needs no dispatch and no barrier.
//               matmul_res_norm is the loop kernel (matmul.wgsl row_sums) ending with it.
// ep_silu and ep_rope_kv first add to the sums what ep_added adds (the host's: nothing, or values
// stored before the matmul, e.g. the rows' LoRA deltas of the projection; kernels/matmul/epilogues.py);
// ep_res_norm adds to x what ep_resid adds. Every entry point calls ep_pro(lid, first row, rows)
// first, in uniform control flow (nothing, or lora_matmul.wgsl's: the workgroup's LoRA shrinks).
// Built after matmul.wgsl, matmul_decode.wgsl and sincos.wgsl; the host adds the consts EP_D (head
// dim), EP_ROT (rotated dims of a head), EP_KLO / EP_VLO (first k / v row), EP_CTX (cache rows),
// EP_KC / EP_VC (cache offsets in elements) for ep_rope_kv; EP_G, EP_YG, EP_PART (offsets in
// elements) for ep_res_norm.

@group(0) @binding(6) var<storage, read> ep_step: array<u32>;       // (4): pos0, n_new, kv_len, 0
@group(0) @binding(7) var<storage, read> ep_freq: array<f32>;       // (rot_dim / 2)
@group(0) @binding(8) var<storage, read_write> ep_kc: array<act>;   // (Hkv, ctx, D)
@group(0) @binding(9) var<storage, read_write> ep_vc: array<act>;   // (Hkv, ctx, D)
@group(0) @binding(10) var<storage, read> ep_g: array<f32>;         // (N) next norm's weight
@group(0) @binding(11) var<storage, read_write> ep_yg: array<act>;  // (N) y * g
@group(0) @binding(12) var<storage, read_write> ep_part: array<f32>;   // (N / 4) sums of y^2

fn ep_silu(t: u32, i4: u32, sums: vec4<f32>) {
    if (4u * i4 >= P.rows || t >= P.T) { return; }
    let r = ep_added(t, P.n0 + 4u * i4, sums);
    let s = gate2(r.xy) * r.zw;         // act(gate) * up: gate2 from gate_act.wgsl
    let o = P.y_off + t * (P.y_stride / 2u) + P.n0 / 2u + 2u * i4;
    y[o] = act(s.x);
    y[o + 1u] = act(s.y);
}

// sums of rows n .. n + 3 plus their bias where the op has one
fn ep_bias(n: u32, sums: vec4<f32>) -> vec4<f32> {
    if ((P.flags & 1u) == 0u) { return sums; }
    let b = P.b_off + n;
    return sums + vec4<f32>(bias[b], bias[b + 1u], bias[b + 2u], bias[b + 3u]);
}

fn ep_rot(a: f32, b: f32, pos: u32, i: u32) -> vec2<f32> {
    return rotate_by(a, b, f32(pos) * ep_freq[i]);
}

fn ep_rope_kv(t: u32, i4: u32, sums: vec4<f32>) {
    if (4u * i4 >= P.rows || t >= P.T) { return; }
    let n = P.n0 + 4u * i4;
    var r = ep_added(t, n, ep_bias(n, sums));
    let pos = ep_pos(t);
    let d = n % EP_D;
    if (n < EP_VLO && d < EP_ROT) {          // a q or k row in the rotated part
        let lo = ep_rot(r.x, r.y, pos, d / 2u);
        var hi = r.zw;
        if (d + 2u < EP_ROT) { hi = ep_rot(r.z, r.w, pos, d / 2u + 1u); }
        r = vec4<f32>(lo, hi);
    }
    let o = P.y_off + t * P.y_stride + n;
    y[o] = act(r.x);
    y[o + 1u] = act(r.y);
    y[o + 2u] = act(r.z);
    y[o + 3u] = act(r.w);
    if (n < EP_KLO) { return; }
    let kv = n < EP_VLO;
    let row = ep_row((n - select(EP_VLO, EP_KLO, kv)) / EP_D, t, pos);
    if (row == 0xffffffffu) { return; }
    if (kv) {
        let c = EP_KC + row * EP_D + d;
        ep_kc[c] = act(r.x);
        ep_kc[c + 1u] = act(r.y);
        ep_kc[c + 2u] = act(r.z);
        ep_kc[c + 3u] = act(r.w);
    } else {
        let c = EP_VC + row * EP_D + d;
        ep_vc[c] = act(r.x);
        ep_vc[c + 1u] = act(r.y);
        ep_vc[c + 2u] = act(r.z);
        ep_vc[c + 3u] = act(r.w);
    }
}

fn ep_res_norm(t: u32, i4: u32, sums: vec4<f32>) {
    if (4u * i4 >= P.rows || t >= P.T) { return; }
    let n = P.n0 + 4u * i4;
    var r = ep_bias(n, sums);
    let row = t * P.y_stride;           // row t of y, of y * g and (a quarter) of the partials
    let o = P.y_off + row + n;
    if ((P.flags & 2u) != 0u) { r += vec4<f32>(f32(y[o]), f32(y[o + 1u]), f32(y[o + 2u]), f32(y[o + 3u])); }
    // the norm sees y as stored (rounded to act), as a separate rms_norm would read it (with what
    // ep_resid adds to it: a row's LoRA delta, lora_matmul.wgsl)
    let v = ep_resid(t, n, vec4<f32>(f32(act(r.x)), f32(act(r.y)), f32(act(r.z)), f32(act(r.w))));
    y[o] = act(v.x);
    y[o + 1u] = act(v.y);
    y[o + 2u] = act(v.z);
    y[o + 3u] = act(v.w);
    let gb = EP_G + n;
    let yg = v * vec4<f32>(ep_g[gb], ep_g[gb + 1u], ep_g[gb + 2u], ep_g[gb + 3u]);
    let q = EP_YG + row + n;
    ep_yg[q] = act(yg.x);
    ep_yg[q + 1u] = act(yg.y);
    ep_yg[q + 2u] = act(yg.z);
    ep_yg[q + 3u] = act(yg.w);
    ep_part[EP_PART + (row + n) / 4u] = dot(v, v);
}

// the loop kernel (K too long to unroll) ending with ep_res_norm; RR = 4; activation row wid.y
// dispatch (ceil(rows / (WG * 4)), T, 1), workgroup WG
@compute @workgroup_size(WG)
fn matmul_res_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i4 = wid.x * WG + lid;
    ep_pro(lid, wid.y, 1u);
    if (4u * i4 >= P.rows) { return; }
    ep_res_norm(wid.y, i4, row_sums(4u * i4, wid.y));
}

// the same over 4 activation rows t0..t0+3 at once (fused_rows: each weight chunk decoded once for
// them; each row's sums as row_sums makes them alone); rows past T are not written
// dispatch (ceil(rows / (WG * 4)), ceil(T / 4), 1), workgroup WG
@compute @workgroup_size(WG)
fn matmul_tile_res_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i4 = wid.x * WG + lid;
    let t0 = wid.y * 4u;
    ep_pro(lid, t0, 4u);
    if (4u * i4 >= P.rows) { return; }
    let a = tile_sums(4u * i4, t0);
    ep_res_norm(t0, i4, a[0]);
    ep_res_norm(t0 + 1u, i4, a[1]);
    ep_res_norm(t0 + 2u, i4, a[2]);
    ep_res_norm(t0 + 3u, i4, a[3]);
}
