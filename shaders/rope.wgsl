// Rotary position embedding in place on a fused qkv tensor, and the KV-cache write, in one kernel
// family (fused so a decode layer needs one dispatch for both).
//   qkv (T, H_all, D) with H_all = Hq + 2*Hkv heads per row: q heads, then k heads, then v heads.
//   Row t has position pos0 + t (pos0 = step[0]); rows t >= n_new (step[1], 0 = all) are skipped.
//   rope only: step[3] = S > 0 makes it pos0 + t % S (encoders: B sequences of S rows in one op).
//   Pair i < rot_dim/2 of a rotated head, angle = pos * inv_freq[i]:
//     adjacent (GGUF llama layout): (x[2i], x[2i+1]);  neox (HF half split): (x[i], x[i + rot_dim/2])
//     (a, b) -> (a*cos - b*sin, a*sin + b*cos) * mscale
//   rope:     rotates heads [0, n_rot)
//   rope_kv:  rotates heads [0, n_rot) and copies (rotated) k heads and v heads into the caches
//   kv_write: copies k heads and v heads into the caches
//   caches (Hkv, ctx, D), row pos0 + t; with RING (a header constant, kernels/common.py Ring: a
//   sliding window with SINKS attention sinks over a window of RING_W positions) position pos >= ctx
//   goes to row cache_row(pos), and rope_kv also writes each q head rotated at min(pos, RING_W) to qsk
//   (T, Hq, D): the query the sinks are scored with.
// Storage is read as vec2<act> (2-byte scalar accesses are slow on some drivers), so sizes and
// offsets count element pairs. One invocation per (t, head, unit): a unit is one vec2 — or, in the
// rotated part of a neox head, the two vec2 at pairs (2u, 2u+1) and (2u + half, 2u+1 + half).
// dispatch ceil(T * n_h * units / 64) split over x,y. Built after sincos.wgsl (the host prepends it).

struct Params {
    rows: u32,    // T dispatched
    heads: u32,   // heads per qkv row (H_all)
    hd2: u32,     // D / 2
    half: u32,    // rot_dim / 2
    h_lo: u32,    // heads [h_lo, h_lo + n_h) are visited
    n_h: u32,
    n_rot: u32,   // heads < n_rot are rotated
    neox: u32,
    k_lo: u32,    // first k head (= Hq); v heads start at k_lo + n_kv
    n_kv: u32,
    ctx: u32,
    qkv_off: u32, // offsets in vec2 units
    kc_off: u32,
    vc_off: u32,
    units: u32,   // units per head
    mscale: f32,  // rotated values are scaled by this (Phi-3 longrope's attention factor; else 1)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: array<u32>;              // (4): pos0, n_new, kv_len, 0
@group(0) @binding(2) var<storage, read_write> qkv: array<vec2<act>>;   // (T, H_all, D/2)
@group(0) @binding(3) var<storage, read> inv_freq: array<f32>;          // (rot_dim/2), host-computed
@group(0) @binding(4) var<storage, read_write> kc: array<vec2<act>>;    // (Hkv, ctx, D/2)
@group(0) @binding(5) var<storage, read_write> vc: array<vec2<act>>;    // (Hkv, ctx, D/2)
// kv_write binds no frequency table, so its caches sit one binding lower
@group(0) @binding(3) var<storage, read_write> kc_w: array<vec2<act>>;
@group(0) @binding(4) var<storage, read_write> vc_w: array<vec2<act>>;

const WG: u32 = 64u;

// (a, b) rotated by angle pos * inv_freq[i]
fn rot(a: f32, b: f32, pos: u32, i: u32) -> vec2<f32> {
    return rotate_by(a, b, f32(pos) * inv_freq[i]) * p.mscale;
}

struct Unit {
    t: u32,
    h: u32,
    v0: u32,    // vec2 index inside the head
    v1: u32,    // second vec2 (neox rotated quads only)
    quad: bool,
    turn: bool, // rotated
    ok: bool,
}

fn locate(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> Unit {
    var r: Unit;
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    let u = i % p.units;
    let th = i / p.units;
    r.h = p.h_lo + th % p.n_h;
    r.t = th / p.n_h;
    let n_new = step[1];
    let rows = select(p.rows, min(p.rows, n_new), n_new != 0u);
    r.ok = r.t < rows;
    let rotated_head = r.h < p.n_rot;
    if (p.neox != 0u) {
        let hq = p.half / 2u;              // quads in the rotated part
        r.quad = u < hq;
        r.v0 = select(p.half + (u - hq), u, r.quad);
        r.v1 = u + hq;
        r.turn = rotated_head && r.quad;
    } else {
        r.quad = false;
        r.v0 = u;
        r.v1 = u;
        r.turn = rotated_head && u < p.half;
    }
    return r;
}

// The unit's values (a, b[, c, d]), rotated at `pos` when it is in the rotated part.
fn rotated(q: Unit, pos: u32, base: u32) -> vec4<f32> {
    var a = vec2<f32>(qkv[base + q.v0]);
    var b = vec2<f32>(0.0);
    if (q.quad) { b = vec2<f32>(qkv[base + q.v1]); }
    if (q.turn) {
        if (q.quad) {
            // pairs 2u and 2u+1: (a.x, b.x) and (a.y, b.y)
            let r0 = rot(a.x, b.x, pos, 2u * q.v0);
            let r1 = rot(a.y, b.y, pos, 2u * q.v0 + 1u);
            a = vec2<f32>(r0.x, r1.x);
            b = vec2<f32>(r0.y, r1.y);
        } else {
            a = rot(a.x, a.y, pos, q.v0);
        }
    }
    return vec4<f32>(a, b);
}

// Rotates the unit in place (when it is in the rotated part) and returns its values (a, b[, c, d]).
// RING: a q head's unit is first stored in qsk rotated at min(pos, RING_W) (the sinks' query).
fn rotate(q: Unit, pos: u32, base: u32) -> vec4<f32> {
    if (RING && q.h < p.k_lo) {
        let s = rotated(q, min(pos, RING_W), base);
        let sb = (q.t * p.k_lo + q.h) * p.hd2;
        put_q_sink(sb + q.v0, s.xy);               // (the host header's: binding 6, qsk (T, Hq, D/2))
        if (q.quad) { put_q_sink(sb + q.v1, s.zw); }
    }
    let v = rotated(q, pos, base);
    if (q.turn) {
        qkv[base + q.v0] = vec2<act>(v.xy);
        if (q.quad) { qkv[base + q.v1] = vec2<act>(v.zw); }
    }
    return v;
}

// The cache row of position pos: pos itself, or with RING past the cache's end its row in the ring
// that follows the SINKS sink rows.
fn cache_row(pos: u32) -> u32 {
    if (!RING || pos < p.ctx) { return pos; }
    return SINKS + (pos - SINKS) % (p.ctx - SINKS);
}

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);
    if (!q.ok) { return; }
    let period = step[3];
    _ = rotate(q, step[0] + select(q.t, q.t % period, period > 0u), p.qkv_off + (q.t * p.heads + q.h) * p.hd2);
}

// Stores unit q of kv head g (the rotated v; k heads g < n_kv, then v heads) in the caches: a k
// head's at row start kb of kc, a v head's at vb of vc (rope_kv, rope_paged.wgsl's rope_kv_paged).
fn put_kv(q: Unit, v: vec4<f32>, g: u32, kb: u32, vb: u32) {
    if (g < p.n_kv) {
        kc[kb + q.v0] = vec2<act>(v.xy);
        if (q.quad) { kc[kb + q.v1] = vec2<act>(v.zw); }
    } else if (g < 2u * p.n_kv) {
        vc[vb + q.v0] = vec2<act>(v.xy);
        if (q.quad) { vc[vb + q.v1] = vec2<act>(v.zw); }
    }
}

@compute @workgroup_size(64)
fn rope_kv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);
    if (!q.ok) { return; }
    let pos = step[0] + q.t;
    let v = rotate(q, pos, p.qkv_off + (q.t * p.heads + q.h) * p.hd2);
    if ((!RING && pos >= p.ctx) || q.h < p.k_lo) { return; }
    let g = q.h - p.k_lo;
    let row = cache_row(pos);
    put_kv(q, v, g, p.kc_off + (g * p.ctx + row) * p.hd2, p.vc_off + ((g - p.n_kv) * p.ctx + row) * p.hd2);
}

@compute @workgroup_size(64)
fn kv_write(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let q = locate(wid, nwg, lid);            // neox = 0: one vec2 per unit
    if (!q.ok) { return; }
    let pos = step[0] + q.t;
    if ((!RING && pos >= p.ctx) || q.h < p.k_lo) { return; }
    let base = p.qkv_off + (q.t * p.heads + q.h) * p.hd2;
    let g = q.h - p.k_lo;
    let row = cache_row(pos);
    if (g < p.n_kv) {
        kc_w[p.kc_off + (g * p.ctx + row) * p.hd2 + q.v0] = qkv[base + q.v0];
    } else if (g < 2u * p.n_kv) {
        vc_w[p.vc_off + ((g - p.n_kv) * p.ctx + row) * p.hd2 + q.v0] = qkv[base + q.v0];
    }
}
