// Scaled dot-product attention with an f32 online softmax (running max subtracted), one query
// head per invocation (lavapipe runs row-per-invocation faster than barrier-heavy tiles).
// Vectors are act4 (D4 = head_dim / 4 is a header constant so the loops unroll).
//   attn_causal:  prefill. qkv (T, H_all, D): q head h of row t; caches (Hkv, ctx, D) hold keys
//                 0..pos0+T-1 already; query t (position pos0 + t) sees keys 0..pos0+t; grouped
//                 query: head h reads kv head h / (Hq / Hkv). out (T, Hq*D).
//                 Invocation per (t, head group); dispatch ceil(T*Hq/G / 64) split over x,y.
//   attn_split:   decode (T == 1), flash-decoding: invocation per (split s, head group) attends keys
//                 [s*chunk, (s+1)*chunk) ∩ [0, pos0] and writes (acc, max, sum) partials; splits
//                 past the live context exit at once, so the op is built once for ctx.
//   attn_combine: out[h] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s; invocation per (h, d4).
//   attn_bidir:   BERT. qkv (B*S, 3*H*D) rows [q | k | v]; key j of sequence b visible iff
//                 j < lengths[b]; invocation per (b, s, h). Binds the qkv buffer as kc and vc too.

struct Params {
    rows: u32,      // T (causal) or B*S (bidir)
    hq: u32,        // query heads
    group: u32,     // Hq / Hkv
    heads: u32,     // heads per qkv row in units of D (H_all; 3*H for bidir)
    ctx: u32,       // cache rows (causal) or S (bidir)
    chunk: u32,     // keys per split (decode)
    n_splits: u32,
    scale: f32,
    qkv_off: u32,   // offsets in act4 / vec4 units
    kc_off: u32,
    vc_off: u32,
    out_off: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
    _p3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: array<u32>;          // (4): pos0, n_new, kv_len, 0
@group(0) @binding(1) var<storage, read> lengths: array<u32>;       // bidir: (B)
@group(0) @binding(2) var<storage, read_write> qkv: array<act4>;
@group(0) @binding(3) var<storage, read_write> kc: array<act4>;     // (Hkv, ctx, D)
@group(0) @binding(4) var<storage, read_write> vc: array<act4>;     // (Hkv, ctx, D)
@group(0) @binding(5) var<storage, read_write> out: array<act4>;    // (T, Hq*D)
@group(0) @binding(5) var<storage, read_write> part: array<vec4<f32>>;   // (Hq, n_splits, D4+1)
@group(0) @binding(2) var<storage, read_write> part_in: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out_c: array<act4>;

const WG: u32 = 64u;
const BLK: u32 = 16u;   // keys scored per rescale of the accumulators

// One invocation attends for G query heads that share one kv head (header constant G, a divisor
// of Hq/Hkv; 1 for BERT), so each key and value vector is loaded once for G heads.
// Below, g numbers these head groups: q heads g*G .. g*G+G-1, kv head g*G / (Hq/Hkv).
var<private> qv: array<vec4<f32>, G * D4>;
var<private> acc: array<vec4<f32>, G * D4>;
var<private> m_run: array<f32, G>;
var<private> l_run: array<f32, G>;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// q heads h0..h0+G-1 start at qkv[qb], qkv[qb + D4], ...
fn load_q(qb: u32) {
    for (var i = 0u; i < G * D4; i++) {
        qv[i] = vec4<f32>(qkv[qb + i]) * p.scale;
        acc[i] = vec4<f32>(0.0);
    }
    for (var g = 0u; g < G; g++) {
        m_run[g] = -3.0e38;
        l_run[g] = 0.0;
    }
}

// Folds keys [0, n) (key j at kc[kb + j*ks], value at vc[vb + j*vs]) into (m_run, l_run, acc).
fn attend(kb: u32, ks: u32, vb: u32, vs: u32, n: u32) {
    var j0 = 0u;
    loop {
        if (j0 >= n) { break; }
        let nb = min(BLK, n - j0);
        var sc: array<f32, BLK * G>;
        var mb: array<f32, G>;
        for (var g = 0u; g < G; g++) { mb[g] = m_run[g]; }
        for (var j = 0u; j < nb; j++) {
            let kr = kb + (j0 + j) * ks;
            var s: array<f32, G>;
            // zeroed explicitly: a loop-local var is not re-initialised on each pass everywhere
            for (var g = 0u; g < G; g++) { s[g] = 0.0; }
            for (var i = 0u; i < D4; i++) {
                let kv = vec4<f32>(kc[kr + i]);
                for (var g = 0u; g < G; g++) { s[g] += dot(qv[g * D4 + i], kv); }
            }
            for (var g = 0u; g < G; g++) {
                sc[j * G + g] = s[g];
                mb[g] = max(mb[g], s[g]);
            }
        }
        for (var g = 0u; g < G; g++) {
            let corr = exp(m_run[g] - mb[g]);
            l_run[g] *= corr;
            for (var i = 0u; i < D4; i++) { acc[g * D4 + i] *= corr; }
            m_run[g] = mb[g];
        }
        for (var j = 0u; j < nb; j++) {
            var pj: array<f32, G>;
            for (var g = 0u; g < G; g++) {
                pj[g] = exp(sc[j * G + g] - mb[g]);
                l_run[g] += pj[g];
            }
            let vr = vb + (j0 + j) * vs;
            for (var i = 0u; i < D4; i++) {
                let vv = vec4<f32>(vc[vr + i]);
                for (var g = 0u; g < G; g++) { acc[g * D4 + i] += pj[g] * vv; }
            }
        }
        j0 += nb;
    }
}

// out[ob + g*D4 + d] = acc / l for the G heads (zeros for an empty key range)
fn store_out(ob: u32) {
    for (var g = 0u; g < G; g++) {
        let inv = select(0.0, 1.0 / l_run[g], l_run[g] > 0.0);
        for (var d = 0u; d < D4; d++) { out[ob + g * D4 + d] = act4(acc[g * D4 + d] * inv); }
    }
}

fn live_rows() -> u32 {
    let n_new = step[1];
    return select(p.rows, min(p.rows, n_new), n_new != 0u);
}

@compute @workgroup_size(64)
fn attn_causal(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    let n_kv = p.hq / G;
    let t = i / n_kv;
    let g = i % n_kv;
    if (t >= live_rows()) { return; }
    let n_keys = min(step[0] + t + 1u, p.ctx);
    load_q(p.qkv_off + (t * p.heads + g * G) * D4);
    let cb = (g * G / p.group) * p.ctx * D4;
    attend(p.kc_off + cb, D4, p.vc_off + cb, D4, n_keys);
    store_out(p.out_off + (t * p.hq + g * G) * D4);
}

@compute @workgroup_size(64)
fn attn_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    let n_kv = p.hq / G;
    let s = i / n_kv;
    let g = i % n_kv;
    let n_keys = min(step[0] + 1u, p.ctx);
    let k0 = s * p.chunk;
    if (s >= p.n_splits || k0 >= n_keys) { return; }
    load_q(p.qkv_off + g * G * D4);
    let cb = ((g * G / p.group) * p.ctx + k0) * D4;
    attend(p.kc_off + cb, D4, p.vc_off + cb, D4, min(p.chunk, n_keys - k0));
    for (var gg = 0u; gg < G; gg++) {
        let pb = ((g * G + gg) * p.n_splits + s) * (D4 + 1u);
        for (var d = 0u; d < D4; d++) { part[pb + d] = acc[gg * D4 + d]; }
        part[pb + D4] = vec4<f32>(m_run[gg], l_run[gg], 0.0, 0.0);
    }
}

@compute @workgroup_size(64)
fn attn_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    let h = i / D4;
    let d = i % D4;
    if (h >= p.hq) { return; }
    let n_keys = min(step[0] + 1u, p.ctx);
    let n_act = (n_keys + p.chunk - 1u) / p.chunk;
    let stride = D4 + 1u;
    let hb = h * p.n_splits * stride;
    var mx = -3.0e38;
    for (var s = 0u; s < n_act; s++) { mx = max(mx, part_in[hb + s * stride + D4].x); }
    var l = 0.0;
    var o = vec4<f32>(0.0);
    for (var s = 0u; s < n_act; s++) {
        let ml = part_in[hb + s * stride + D4];
        let w = exp(ml.x - mx);
        l += w * ml.y;
        o += w * part_in[hb + s * stride + d];
    }
    out_c[p.out_off + h * D4 + d] = act4(o / l);
}

@compute @workgroup_size(64)
fn attn_bidir(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    let r = i / p.hq;          // row b*S + s
    let h = i % p.hq;
    if (r >= p.rows) { return; }
    let b = r / p.ctx;
    let n_keys = min(lengths[b], p.ctx);
    let rs = p.heads * D4;     // row stride (3*H*D / 4)
    load_q(p.qkv_off + r * rs + h * D4);
    let kb = p.qkv_off + b * p.ctx * rs + (p.hq + h) * D4;
    attend(kb, rs, kb + p.hq * D4, rs, n_keys);
    store_out(p.out_off + (r * p.hq + h) * D4);   // G == 1 here
}
