// vision.wgsl: the kernels that bring images into a decoder (kernels/vision.py).
//   splice_rows:     x[t,:] = feats[rows[t].x,:] where row t holds an image token  dispatch T*C / 64
//   attn_image_rows: attention of the query rows inside an image, over keys up to their image's end
//                    (the image's tokens see each other both ways)                 dispatch T*Hq / 64
//   avg_pool:        y[t,c] = mean of a KxK patch square of x (the projector's pooling)  dispatch Nt*C / 64
//   pixel_shuffle:   y[t,:] = an s x s patch square of x side by side (Idefics3's connector)  dispatch N*C / 64
// `act` (f32 or f16) comes from the header; image features are f32; sums are f32.

struct Params {
    n: u32,          // invocations
    c: u32,          // splice: row width; attention: q heads; pool: channels
    a: u32,          // splice: x offset; attention: q heads per kv head; pool: patches per side
    b: u32,          // splice: feats offset; attention: head_dim; pool: kernel
    ctx: u32,        // attention: cache rows
    window: u32,     // attention: sliding window (0: none)
    q_off: u32,
    k_off: u32,
    v_off: u32,
    o_off: u32,
    scale: f32,
    heads_all: u32,  // attention: q + k + v heads of a qkv row
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> rows: array<u32>;           // (T, 2): feature row | key end, per row
@group(0) @binding(2) var<storage, read> feats: array<f32>;          // splice: (N, C)
@group(0) @binding(3) var<storage, read_write> x: array<act>;        // splice: (T, C)
@group(0) @binding(2) var<storage, read> step: array<u32>;           // attention: (4) pos0, n_new, kv_len, 0
@group(0) @binding(3) var<storage, read> qkv: array<act>;            // attention: (T, Hq + 2 Hkv, D)
@group(0) @binding(4) var<storage, read> kc: array<act>;             // attention: (Hkv, ctx, D)
@group(0) @binding(5) var<storage, read> vc: array<act>;             // attention: (Hkv, ctx, D)
@group(0) @binding(6) var<storage, read_write> out: array<act>;      // attention: (T, Hq D)
@group(0) @binding(1) var<storage, read> px: array<f32>;             // pool: (P*P, C)
@group(0) @binding(2) var<storage, read_write> py: array<f32>;       // pool: ((P/K)^2, C)

const NONE: u32 = 0xffffffffu;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * 64u + lid;
}

@compute @workgroup_size(64)
fn splice_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    if (i >= p.n) { return; }
    let t = i / p.c;
    let r = rows[2u * t];
    if (r == NONE) { return; }
    x[p.a + i] = act(feats[p.b + r * p.c + i % p.c]);
}

// One invocation per (row t, q head h). A row outside an image (key end 0) keeps what the causal
// attention wrote; a row inside one attends keys lo .. end-1, lo = pos - window + 1 on sliding layers.
@compute @workgroup_size(64)
fn attn_image_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    if (i >= p.n) { return; }
    let t = i / p.c;
    let h = i % p.c;
    let end = rows[2u * t + 1u];
    if (end == 0u) { return; }
    let D = p.b;
    let pos = step[0] + t;
    var lo = 0u;
    if (p.window > 0u && pos + 1u > p.window) { lo = pos + 1u - p.window; }
    let q0 = p.q_off + (t * p.heads_all + h) * D;
    let kv0 = (h / p.a) * p.ctx * D;
    var m = -3.0e38;
    var l = 0.0;
    var acc: array<f32, HEAD_DIM>;
    for (var d = 0u; d < D; d++) { acc[d] = 0.0; }
    for (var j = lo; j < end; j++) {
        var s = 0.0;
        for (var d = 0u; d < D; d++) {
            s += f32(qkv[q0 + d]) * f32(kc[p.k_off + kv0 + j * D + d]);
        }
        s *= p.scale;
        let m2 = max(m, s);
        let c = exp(m - m2);
        let e = exp(s - m2);
        l = l * c + e;
        for (var d = 0u; d < D; d++) {
            acc[d] = acc[d] * c + e * f32(vc[p.v_off + kv0 + j * D + d]);
        }
        m = m2;
    }
    let o0 = p.o_off + (t * p.c + h) * D;
    for (var d = 0u; d < D; d++) { out[o0 + d] = act(acc[d] / l); }
}

@compute @workgroup_size(64)
fn avg_pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    if (i >= p.n) { return; }
    let C = p.c;
    let P = p.a;
    let K = p.b;
    let side = P / K;
    let t = i / C;
    let c = i % C;
    let ty = t / side;
    let tx = t % side;
    var s = 0.0;
    for (var ky = 0u; ky < K; ky++) {
        for (var kx = 0u; kx < K; kx++) {
            s += px[((ty * K + ky) * P + tx * K + kx) * C + c];
        }
    }
    py[i] = s / f32(K * K);
}

// pixel_shuffle: y (P*P/s^2, C s^2) from x (P*P, C): token (a, b) of the (P/s)^2 grid holds, for
// column j = r*C*s + q*C + c, patch (a*s + r, b*s + q)'s channel c (transformers' view/permute chain)
@compute @workgroup_size(64)
fn pixel_shuffle(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    if (i >= p.n) { return; }
    let C = p.c;
    let P = p.a;
    let S = p.b;
    let W = C * S * S;
    let t = i / W;
    let j = i % W;
    let a = t / (P / S);
    let b = t % (P / S);
    let h = a * S + j / (C * S);
    let w = b * S + (j % (C * S)) / C;
    py[i] = px[(h * P + w) * C + j % C];
}
