// Elementwise kernels, one invocation per output element, f32 math, `act` storage (f32 or f16).
//   add:      y[i] = a[i] + b[i]                         (n = numel)
//   bias_add: y[t,n] = a[t,n] + bias[n]                  (cols = N)
//   silu_mul: y[t,f] = silu(a[t,f*g_step]) * a[t,f*g_step+u_off]   (a is (T, 2F), cols = F):
//             [gate | up] with (g_step, u_off) = (1, F); gate and up columns interleaved in pairs
//             (the decode matmul's silu epilogue layout, matmul_epilogue.wgsl) with vec2 elements
//             (fv = vec2, cols = F/2) and (g_step, u_off) = (2, 1)
//   gelu_tanh_mul: silu_mul with gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
//             in place of silu (GeGLU: Gemma)
//   swiglu_oai: gpt-oss's clamped SwiGLU, silu_mul's layout: g = min(gate, L), u = clamp(up, -L, L),
//             y = (u + 1) * g * sigmoid(alpha g)   (L: p.f0, alpha: p.b_off, both as bits)
//   scale:    y[i] = a[i] * f            (f: the float in p.f0; Gemma's embedding times sqrt(C))
//   softcap:  y[i] = f * tanh(a[i] / f)  (Gemma 2's final logit soft-capping)
//   gelu:     y[i] = 0.5 * a[i] * (1 + erf(a[i] / sqrt(2)))
//   gelu_tanh: y[i] = gelu_tanh(a[i])   (Phi's dense FFN: gelu_new)
//   gelu_mul: y[t,f] = gelu(a[t,f]) * a[t,F+f]   (a is (T, 2F) [input | gate], cols = F: GeGLU)
//   tanh_act: y[i] = tanh(a[i])   (the pooler / classification head of BERT cross-encoders)
//   quick_gelu: y[i] = a[i] * sigmoid(1.702 a[i])   (CLIP's vision tower: LLaVA)
//   gelu_tanh_gate: y[t,f] = gelu_tanh(a[t,f]) * b[t, u_off + f] with b's rows g_step wide (a, y
//             (T, F); b (T, g_step)): Gemma 4's per-layer input gate, layer i's F columns of the inputs
// dispatch (ceil(n/64) split over x,y), workgroup 64. Outputs are written with put / put_bias (y) and put_u (yu),
// which the host header defines: through y / yu, or, for an in-place op, through the input's own binding (WebGPU
// forbids one range bound writable twice in a dispatch); activations are read_write for that.
// The host header sets the storage type `av` (act or act4) and its f32 twin `fv`: one invocation
// handles W = 1 or 4 elements, and every size and offset below counts W-element units.

struct Params {
    n: u32,      // output elements
    cols: u32,   // N (bias_add) or F (silu_mul)
    a_off: u32,
    b_off: u32,
    y_off: u32,
    g_step: u32, // silu_mul: where gate and up columns lie (see above)
    u_off: u32,
    f0: u32,     // scale, softcap: their float, as bits
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<av>;
@group(0) @binding(2) var<storage, read_write> b: array<av>;     // add
@group(0) @binding(2) var<storage, read> bias: array<fv>;        // bias_add: (N)
@group(0) @binding(2) var<storage, read_write> yu: array<av>;    // unary ops' output
@group(0) @binding(3) var<storage, read_write> y: array<av>;     // add, bias_add output

const WG: u32 = 64u;

fn elem_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

@compute @workgroup_size(64)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    put(p.y_off + i, av(fv(a[p.a_off + i]) + fv(b[p.b_off + i])));
}

@compute @workgroup_size(64)
fn bias_add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    put_bias(p.y_off + i, av(fv(a[p.a_off + i]) + bias[p.b_off + i % p.cols]));
}

// tanh(z) + 1 without cancellation for z < 0 and without overflow for large |z|
fn one_plus_tanh(z: fv) -> fv {
    let t = exp(-2.0 * abs(z));
    return select(2.0 / (1.0 + t), 2.0 * t / (1.0 + t), z < fv(0.0));
}

// erfc(z) for z >= 0 with fractional error < 1.2e-7 everywhere (Numerical Recipes' Chebyshev
// fit); the erf form of GELU needs ~1e-6, which Abramowitz-Stegun 7.1.26 (2.5e-5) does not give.
fn erfc_pos(z: fv) -> fv {
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
        t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
        t * (-0.82215223 + t * 0.17087277))))))));
    return t * exp(-z * z + poly);
}

// GELU's tanh form: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
fn gelu_tanh_f(g: fv) -> fv {
    return 0.5 * g * one_plus_tanh(0.7978845608028654 * (g + 0.044715 * g * g * g));
}

// 0.5 v (1 + erf(v/sqrt2)), with 1 + erf(v/sqrt2) = erfc(-v/sqrt2) taken directly for v < 0, so
// no cancellation there
fn gelu_f(v: fv) -> fv {
    let e = erfc_pos(abs(v) * 0.70710678118654752);
    return 0.5 * v * select(2.0 - e, e, v < fv(0.0));
}

// The gated activations (silu_mul, gelu_tanh_mul, gelu_mul): stores act(g) * u as output i (none
// past p.n), with gate g at column f * g_step of row t's [gate | up] (or interleaved pairs) and up
// p.u_off after it.
const SILU: u32 = 0u;
const GELU_TANH: u32 = 1u;
const GELU: u32 = 2u;

fn glu(i: u32, act: u32) {
    if (i >= p.n) { return; }
    let t = i / p.cols;
    let f = i - t * p.cols;
    let gi = p.a_off + t * 2u * p.cols + f * p.g_step;
    let g = fv(a[gi]);
    let u = fv(a[gi + p.u_off]);
    var y: fv;
    switch act {
        // exp(-g) overflows to inf for g < -88: g / inf = -0, the right limit
        case SILU: { y = g / (1.0 + exp(-g)) * u; }
        case GELU_TANH: { y = gelu_tanh_f(g) * u; }
        default: { y = gelu_f(g) * u; }
    }
    put_u(p.y_off + i, av(y));
}

@compute @workgroup_size(64)
fn silu_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    glu(elem_index(wid, nwg, lid), SILU);
}

@compute @workgroup_size(64)
fn gelu_tanh_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    glu(elem_index(wid, nwg, lid), GELU_TANH);
}

@compute @workgroup_size(64)
fn swiglu_oai(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let t = i / p.cols;
    let gi = p.a_off + t * 2u * p.cols + (i - t * p.cols) * p.g_step;
    let lim = fv(bitcast<f32>(p.f0));
    let g = min(fv(a[gi]), lim);
    let u = clamp(fv(a[gi + p.u_off]), -lim, lim);
    // exp overflows to inf for alpha g < -88: g / inf = -0, the right limit
    put_u(p.y_off + i, av((u + 1.0) * g / (1.0 + exp(-bitcast<f32>(p.b_off) * g))));
}

@compute @workgroup_size(64)
fn gelu_tanh_gate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let t = i / p.cols;
    let e = fv(b[p.b_off + t * p.g_step + p.u_off + i - t * p.cols]);
    put(p.y_off + i, av(gelu_tanh_f(fv(a[p.a_off + i])) * e));
}

@compute @workgroup_size(64)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    put_u(p.y_off + i, av(fv(a[p.a_off + i]) * bitcast<f32>(p.f0)));
}

@compute @workgroup_size(64)
fn softcap(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let c = bitcast<f32>(p.f0);
    put_u(p.y_off + i, av(c * (one_plus_tanh(fv(a[p.a_off + i]) / c) - 1.0)));
}

@compute @workgroup_size(64)
fn gelu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    put_u(p.y_off + i, av(gelu_f(fv(a[p.a_off + i]))));
}

@compute @workgroup_size(64)
fn gelu_tanh(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    put_u(p.y_off + i, av(gelu_tanh_f(fv(a[p.a_off + i]))));
}

@compute @workgroup_size(64)
fn quick_gelu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let v = fv(a[p.a_off + i]);
    // exp's argument capped: far in the negative tail v / (1 + e^80) is 0 without an inf
    put_u(p.y_off + i, av(v / (1.0 + exp(min(-1.702 * v, fv(80.0))))));
}

@compute @workgroup_size(64)
fn gelu_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    glu(elem_index(wid, nwg, lid), GELU);     // the host sets g_step = 1
}

@compute @workgroup_size(64)
fn tanh_act(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = elem_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let v = fv(a[p.a_off + i]);
    // from exp(-2|v|) <= 1: no overflow for large |v|, where some drivers' tanh gives NaN
    let t = exp(-2.0 * abs(v));
    put_u(p.y_off + i, av(sign(v) * (1.0 - t) / (1.0 + t)));
}
