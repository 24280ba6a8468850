// Scaled dot-product attention with an f32 online softmax (running max subtracted). Vectors are
// act4; D4 = head_dim / 4 and G are header constants. In prefill and BERT the 64 lanes of a
// workgroup are consecutive queries and walk the same keys in lockstep.
//   attn_causal:   prefill. qkv (T, H_all, D): q head h of row t; caches (Hkv, ctx, D) already
//                  hold keys 0..pos0+T-1; query t (position pos0 + t) sees keys 0..pos0+t; head h
//                  reads kv head h / (Hq/Hkv). out (T, Hq*D). Rows t >= n_new are skipped.
//                  Workgroup per (block of 64 queries, G heads of one kv head), lane per query;
//                  dispatch nblk*Hq/G workgroups.
//   attn_split:    decode, flash-decoding: lane per (row t, split s, G heads of one kv head) attends
//                  keys [s*chunk, (s+1)*chunk) ∩ [0, pos0 + t] and writes (acc, max, sum)
//                  partials. Splits past the live context exit at once, so the op is built once
//                  for ctx. dispatch ceil(T*n_splits*Hq/G / SWG) (SWG: a header constant). T rows
//                  (speculative decoding's verify): each row a decode step at its own position, a
//                  row of at most short_keys keys in the short form (split 0's lane attends all its
//                  keys, as attn_decode1, and stores the output; its other splits exit).
//   attn_combine:  out[t, h] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s; lane per (t, h, d4)
//                  (rows of the short form: nothing to do).
//   attn_decode1:  decode over few keys: lane per G heads, all keys, output stored directly.
//   Sliding windows (p.window > 0) mask keys at or below p - window in the causal kernels; whole
//   blocks and splits before a query's window are skipped.
//   RING (header constants RING, SINKS, RING_W; kernels/common.py Ring): WebLLM's sliding window with
//   attention sinks over the causal and decode kernels' cache of ctx rows, which past ctx is a ring
//   after the SINKS sink rows (rope.wgsl's cache_row). A query at position pos sees the sinks and
//   the positions pos - (RING_W - SINKS) .. pos (ring_sees, from the position each row holds given
//   the forward's last one), scoring the sinks with its sink query (qsk: rotated at min(pos, RING_W))
//   and the rest with its own (attend_ring): the sinks first, then rows SINKS.. in blocks from SINKS.
//   Sinks (gpt-oss): a learned logit per q head joins each softmax's denominator (sink_l, from the
//   header: 0 without them), in out_at and attn_combine; sink_h0 is the lane's first q head.
//   attn_bidir:    BERT. qkv (B*S, 3*H*D) rows [q | k | v]; key j of sequence b visible iff
//                  j < lengths[b] (and, with p.window > 0, |j - i| <= window for query i: ModernBERT's
//                  local layers; then G = 1). Workgroup per (b, block of SWG*G queries, h), lane per G
//                  consecutive queries. Binds the qkv window as kc and vc too.

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
    n_blk: u32,     // query blocks of 64 per sequence (attn_causal, attn_bidir)
    window: u32,    // sliding window: query at position p sees keys > p - window (0: all keys)
    softcap: f32,   // scores s -> softcap * tanh(s / softcap) (Gemma 2; 0: none)
    short_keys: u32,// decode rows: a row of at most this many keys takes the short form in attn_split
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: array<u32>;          // (4): pos0, n_new, kv_len, 0
@group(0) @binding(1) var<storage, read> lengths: array<u32>;       // bidir: (B)
@group(0) @binding(2) var<storage, read> qkv: array<act4>;
@group(0) @binding(3) var<storage, read> kc: array<act4>;     // (Hkv, ctx, D)
@group(0) @binding(4) var<storage, read> vc: array<act4>;     // (Hkv, ctx, D)
@group(0) @binding(3) var<storage, read> kcp: array<vec4<u32>>;      // f16 caches read 8 halves a load
@group(0) @binding(4) var<storage, read> vcp: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> kcq: array<u32>;            // q8_0 / q4_0 caches (kernels/kv_quant.py)
@group(0) @binding(4) var<storage, read> vcq: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<act4>;    // (T, Hq*D)
@group(0) @binding(5) var<storage, read_write> part: array<vec4<f32>>;   // (Hq, n_splits, D4+1)
@group(0) @binding(6) var<storage, read_write> out_s: array<act4>;  // attn_split's short-form rows
@group(0) @binding(7) var<storage, read> qsk: array<act4>;          // RING: sink queries (T, Hq, D)
@group(0) @binding(2) var<storage, read_write> part_in: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out_c: array<act4>;

// The host header supplies attention_common.wgsl (WG, BLK, the running max and sum m_run / l_run,
// window_lo, score, ring_sees, fold_block, out_at, store_partial, combine_splits) and the state of G queries that read the same keys (heads sharing one kv
// head, or consecutive BERT queries) as separate vec4 registers plus unrolled helpers over them (loops over private
// arrays spill to per-lane scratch on lavapipe); scores are `sv` (f32 or vecG<f32>, one per head):
//   load_q(qb, qs)  q_g = qkv[qb + g*qs ..] * scale; acc = 0; m_run = -inf; l_run = 0
//   qk(kr) -> sv    q_g . kc[kr..kr+D4): each key vector is loaded once for the G heads
//                   (f16: through kcp, two act4 per vec4<u32> load, when D4 and offsets are even)
//   acc_scale(c)    acc_g *= c_g
//   acc_add(w, vr)  acc_g += w_g * vc[vr..vr+D4)
//   acc_get(g, d)   acc_g[d];  sv_get(v, g): component g of v
// RING: the cache's rows (ring_sees)
fn ring_cap() -> u32 {
    return p.ctx;
}

// A block of keys for attention_common.wgsl's fold_block: key j read by qk at kr + j*ks, its value
// by acc_add at vr + j*vs.
struct KeyBlock { kr: u32, ks: u32, vr: u32, vs: u32 }

fn key_row(b: KeyBlock, j: u32) -> u32 { return b.kr + j * b.ks; }
fn value_row(b: KeyBlock, j: u32) -> u32 { return b.vr + j * b.vs; }

// Folds keys [j_start, n) (key j at kc[kb + j*ks], value at vc[vb + j*vs]) into (m_run, l_run, acc)
// in blocks of BLK; keys j < lo or j >= lim are masked out. j_start and n are the same for all lanes
// where the caller wants uniform loads; j_start is a multiple of BLK, so a query folds the same key
// blocks however many queries run with it (masked blocks before its first key are wiped by the first
// real one).
fn attend(kb: u32, ks: u32, vb: u32, vs: u32, j_start: u32, n: u32, lo: u32, lim: u32) {
    var j0 = j_start;
    loop {
        if (j0 >= n) { break; }
        let nb = min(BLK, n - j0);
        fold_block(j0, nb, lo, lim, j0, KeyBlock(kb + j0 * ks, ks, vb + j0 * vs, vs));
        j0 += nb;
    }
}

// RING: folds rows [j0, n) of the kv head whose rows start at kb / vb (r_pos, r_last set) into a fresh
// state: rows below SINKS scored with the sink query (qsk at sb), the rest with the row's (qkv at qb).
fn attend_ring(kb: u32, vb: u32, qb: u32, sb: u32, j0: u32, n: u32) {
    load_q(qb, D4);
    let ns = clamp(SINKS, j0, n);
    if (ns > j0) {
        set_q_sink(sb, D4);
        attend(kb, D4, vb, D4, j0, ns, 0u, 0u);
        set_q(qb, D4);
    }
    attend(kb, D4, vb, D4, ns, n, 0u, 0u);
}

// outputs g in [g_lo, G) are stored at ob + g*os
fn store_out(ob: u32, os: u32, g_lo: u32) {
    for (var g = g_lo; g < G; g++) {
        for (var d = 0u; d < D4; d++) { out[ob + g * os + d] = out_at(g, d); }
    }
}

@compute @workgroup_size(64)
fn attn_causal(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let c = causal_block(wid, nwg, p.rows, p.ctx);
    if (c.t0 >= c.rows) { return; }
    let t = min(c.t0 + lid, c.rows - 1u);        // spare lanes redo the last row, never store
    let qb = p.qkv_off + (t * p.heads + c.h0) * D4;
    let cb = (c.h0 / p.group) * p.ctx * D4;
    if (RING) {
        r_pos = c.pos0 + t;
        r_last = c.pos0 + c.rows - 1u;
        attend_ring(p.kc_off + cb, p.vc_off + cb, qb, (t * p.hq + c.h0) * D4, 0u, c.n_wg);
    } else {
        load_q(qb, D4);
        let j_start = (window_lo(c.pos0 + c.t0) / BLK) * BLK;  // the block's first query sees the most
        let lim = min(c.pos0 + t + 1u, p.ctx);
        attend(p.kc_off + cb, D4, p.vc_off + cb, D4, j_start, c.n_wg, window_lo(c.pos0 + t), lim);
    }
    if (c.t0 + lid < c.rows) { store_out(p.out_off + (t * p.hq + c.h0) * D4, D4, 0u); }
}

@compute @workgroup_size(SWG)
fn attn_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let lane = split_lane(wid, nwg, lid);
    if (lane.q >= p.rows) { return; }
    let t = lane.q;
    let s = lane.s;
    let h0 = lane.h0;
    let pos = step[0] + t;
    let n_keys = min(pos + 1u, p.ctx);
    let lo = window_lo(pos);
    let qb = p.qkv_off + (t * p.heads + h0) * D4;
    let hb = (h0 / p.group) * p.ctx * D4;    // the kv head's rows
    if (RING) {
        r_pos = pos;
        r_last = step[0] + live_rows(p.rows) - 1u;
    }
    if (n_keys <= p.short_keys) {            // this row's short form (attn_decode1's lane)
        if (s != 0u) { return; }
        if (RING) {
            attend_ring(p.kc_off + hb, p.vc_off + hb, qb, (t * p.hq + h0) * D4, 0u, n_keys);
        } else {
            load_q(qb, D4);
            attend(p.kc_off + hb, D4, p.vc_off + hb, D4, (lo / BLK) * BLK, n_keys, lo, n_keys);
        }
        store_short(p.out_off + (t * p.hq + h0) * D4);
        return;
    }
    let k0 = s * p.chunk;
    if (k0 >= n_keys || k0 + p.chunk <= lo) { return; }
    if (RING) {
        attend_ring(p.kc_off + hb, p.vc_off + hb, qb, (t * p.hq + h0) * D4, k0, min(k0 + p.chunk, n_keys));
        store_partial(t, h0, s);
        return;
    }
    load_q(qb, D4);
    let cb = ((h0 / p.group) * p.ctx + k0) * D4;
    let n = min(p.chunk, n_keys - k0);
    attend(p.kc_off + cb, D4, p.vc_off + cb, D4, 0u, n, max(lo, k0) - k0, n);
    store_partial(t, h0, s);
}

// attn_decode1: decode (T == 1) while the live keys are few (the host picks it over attn_split +
// attn_combine up to a key count it sets): lane per G heads of one kv head attends keys [0, pos0]
// and stores the output itself, so the step needs one dispatch. dispatch ceil(Hq/G / SWG).
@compute @workgroup_size(SWG)
fn attn_decode1(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * SWG + lid;
    let h0 = i * G;
    if (h0 >= p.hq) { return; }
    sink_h0 = h0;
    let n_keys = min(step[0] + 1u, p.ctx);
    let lo = window_lo(step[0]);
    let cb = (h0 / p.group) * p.ctx * D4;
    if (RING) {
        r_pos = step[0];
        r_last = step[0];
        attend_ring(p.kc_off + cb, p.vc_off + cb, p.qkv_off + h0 * D4, h0 * D4, 0u, n_keys);
    } else {
        load_q(p.qkv_off + h0 * D4, D4);
        attend(p.kc_off + cb, D4, p.vc_off + cb, D4, (lo / BLK) * BLK, n_keys, lo, n_keys);
    }
    store_out(p.out_off + h0 * D4, D4, 0u);
}

@compute @workgroup_size(64)
fn attn_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    let h = (i / D4) % p.hq;
    let d = i % D4;
    let t = i / (D4 * p.hq);
    if (t >= p.rows) { return; }
    let pos = step[0] + t;
    let n_keys = min(pos + 1u, p.ctx);
    if (n_keys <= p.short_keys) { return; }
    let n_act = (n_keys + p.chunk - 1u) / p.chunk;
    let s_lo = window_lo(pos) / p.chunk;         // splits before the window wrote nothing
    out_c[p.out_off + (t * p.hq + h) * D4 + d] = combine_splits(t, h, d, s_lo, n_act);
}

@compute @workgroup_size(SWG)
fn attn_bidir(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let wg = wid.y * nwg.x + wid.x;
    let h = wg % p.hq;
    let sb = wg / p.hq;                          // b * n_blk + query block
    let b = sb / p.n_blk;
    let q = ((sb % p.n_blk) * SWG + lid) * G;    // first of the lane's G queries
    if (b * p.ctx >= p.rows) { return; }
    let q_lo = min(q, p.ctx - G);                // spare lanes redo the last queries, never store
    let r = b * p.ctx + q_lo;
    let n_keys = min(lengths[b], p.ctx);
    let rs = p.heads * D4;                       // row stride (3*H*D / 4)
    load_q(p.qkv_off + r * rs + h * D4, rs);
    let kb = p.qkv_off + b * p.ctx * rs + (p.hq + h) * D4;
    // a local window (host: one query per lane) bounds the keys on both sides of the query
    let lo = select(0u, q_lo - min(q_lo, p.window), p.window > 0u);
    let lim = select(n_keys, min(n_keys, q_lo + p.window + 1u), p.window > 0u);
    attend(kb, rs, kb + p.hq * D4, rs, 0u, n_keys, lo, lim);
    // a clamped lane stores only the queries from q on (those below belong to the previous lane)
    if (q < p.ctx) { store_out(p.out_off + (r * p.hq + h) * D4, p.hq * D4, q - q_lo); }
}
