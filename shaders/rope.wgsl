// Rotary position embedding in place on a fused qkv tensor, and the KV-cache write, in one kernel
// family (fused so a decode layer needs one dispatch for both).
//   qkv (T, H_all, D) with H_all = Hq + 2*Hkv heads per row: q heads, then k heads, then v heads.
//   Row t has position pos0 + t (pos0 = step[0]); rows t >= n_new (step[1], 0 = all) are skipped.
//   Pair j < rot_dim/2 of a rotated head, angle = pos * inv_freq[j]:
//     adjacent (GGUF llama layout): (x[2j], x[2j+1]);  neox (HF half split): (x[j], x[j + rot_dim/2])
//     (a, b) -> (a*cos - b*sin, a*sin + b*cos)
//   rope:     rotates heads [0, n_rot)
//   rope_kv:  rotates heads [0, n_rot) and copies (rotated) k heads and v heads into the caches
//   kv_write: copies k heads and v heads into the caches
//   caches (Hkv, ctx, D), row pos0 + t.
// One invocation per (t, head, pair j < D/2); dispatch ceil(T*n_h*D/2 / 64) split over x,y.

struct Params {
    rows: u32,    // T dispatched
    heads: u32,   // heads per qkv row (H_all)
    hd: u32,      // D
    half: u32,    // rot_dim / 2
    h_lo: u32,    // heads [h_lo, h_lo + n_h) are visited
    n_h: u32,
    n_rot: u32,   // heads < n_rot are rotated
    neox: u32,
    k_lo: u32,    // first k head (= Hq); v heads start at k_lo + n_kv
    n_kv: u32,
    ctx: u32,
    qkv_off: u32,
    kc_off: u32,
    vc_off: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: array<u32>;        // (4): pos0, n_new, kv_len, 0
@group(0) @binding(2) var<storage, read_write> qkv: array<act>;   // (T, H_all, D)
@group(0) @binding(3) var<storage, read> inv_freq: array<f32>;    // (rot_dim/2), host-computed
@group(0) @binding(4) var<storage, read_write> kc: array<act>;    // (Hkv, ctx, D)
@group(0) @binding(5) var<storage, read_write> vc: array<act>;    // (Hkv, ctx, D)
// kv_write binds no frequency table, so its caches sit one binding lower
@group(0) @binding(3) var<storage, read_write> kc_w: array<act>;
@group(0) @binding(4) var<storage, read_write> vc_w: array<act>;

const WG: u32 = 64u;

// sin and cos of an f32 angle, accurate to ~1e-7 for angles up to ~1e5 (long contexts): a
// three-part Cody-Waite reduction by pi/2 and minimax polynomials on [-pi/4, pi/4]. Builtin
// sin/cos only promise ~2^-11 absolute error on [-pi, pi] and nothing outside it.
fn sincos(a: f32) -> vec2<f32> {
    let k = round(a * 0.63661977236758134);
    let r = ((a - k * 1.5703125) - k * 4.837512969970703125e-4) - k * 7.54978995489188216e-8;
    let z = r * r;
    let s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 +
        z * 2.443315711809948e-5));
    let q = u32(i32(k)) & 3u;
    if (q == 0u) { return vec2<f32>(s, c); }
    if (q == 1u) { return vec2<f32>(c, -s); }
    if (q == 2u) { return vec2<f32>(-s, -c); }
    return vec2<f32>(-c, s);
}

struct Pair {
    t: u32,
    h: u32,
    j: u32,
    e0: u32,   // element indices of the pair inside the head
    e1: u32,
    ok: bool,
}

fn locate(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> Pair {
    var r: Pair;
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    let hp = p.hd / 2u;
    r.j = i % hp;
    let th = i / hp;
    r.h = p.h_lo + th % p.n_h;
    r.t = th / p.n_h;
    let n_new = step[1];
    let rows = select(p.rows, min(p.rows, n_new), n_new != 0u);
    r.ok = r.t < rows;
    // neox pairs (j, j + half) inside the rotated part; every other pair is adjacent (2j, 2j+1)
    let split = p.neox != 0u && r.j < p.half;
    r.e0 = select(2u * r.j, r.j, split);
    r.e1 = select(2u * r.j + 1u, r.j + p.half, split);
    return r;
}

fn rotate(q: Pair, pos: u32, base: u32) -> vec2<f32> {
    var v = vec2<f32>(f32(qkv[base + q.e0]), f32(qkv[base + q.e1]));
    if (q.h < p.n_rot && q.j < p.half) {
        let sc = sincos(f32(pos) * inv_freq[q.j]);
        v = vec2<f32>(v.x * sc.y - v.y * sc.x, v.x * sc.x + v.y * sc.y);
        qkv[base + q.e0] = act(v.x);
        qkv[base + q.e1] = act(v.y);
    }
    return v;
}

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);
    if (!q.ok) { return; }
    let pos = step[0] + q.t;
    _ = rotate(q, pos, p.qkv_off + (q.t * p.heads + q.h) * p.hd);
}

@compute @workgroup_size(64)
fn rope_kv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);
    if (!q.ok) { return; }
    let pos = step[0] + q.t;
    let v = rotate(q, pos, p.qkv_off + (q.t * p.heads + q.h) * p.hd);
    if (pos >= p.ctx || q.h < p.k_lo) { return; }
    let g = q.h - p.k_lo;
    if (g < p.n_kv) {
        let cb = p.kc_off + (g * p.ctx + pos) * p.hd;
        kc[cb + q.e0] = act(v.x);
        kc[cb + q.e1] = act(v.y);
    } else if (g < 2u * p.n_kv) {
        let cb = p.vc_off + ((g - p.n_kv) * p.ctx + pos) * p.hd;
        vc[cb + q.e0] = act(v.x);
        vc[cb + q.e1] = act(v.y);
    }
}

@compute @workgroup_size(64)
fn kv_write(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);
    if (!q.ok) { return; }
    let pos = step[0] + q.t;
    if (pos >= p.ctx || q.h < p.k_lo) { return; }
    let base = p.qkv_off + (q.t * p.heads + q.h) * p.hd;
    let g = q.h - p.k_lo;
    if (g < p.n_kv) {
        let cb = p.kc_off + (g * p.ctx + pos) * p.hd;
        kc_w[cb + q.e0] = qkv[base + q.e0];
        kc_w[cb + q.e1] = qkv[base + q.e1];
    } else if (g < 2u * p.n_kv) {
        let cb = p.vc_off + ((g - p.n_kv) * p.ctx + pos) * p.hd;
        vc_w[cb + q.e0] = qkv[base + q.e0];
        vc_w[cb + q.e1] = qkv[base + q.e1];
    }
}
