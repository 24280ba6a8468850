// Paged attention: keys and values live in a pool of blocks, one buffer per layer for K and one for V,
// each (n_blocks, BS, Hkv, D); sequence q's key j sits in block tables[q][j / BS] at row j % BS.
// Same arithmetic as attention.wgsl (f32 online softmax, keys folded in 16-key blocks, G heads of one
// kv head per lane, sliding window and soft-cap), so a sequence's result does not depend on where
// its blocks are. The host header (kernels/attention.py _attn_header) supplies D4, G, SWG, sv, load_q,
// qk, acc_scale, acc_add, acc_get and attention_common.wgsl (WG, BLK, m_run / l_run, window_lo, score,
// ring_sees, fold_block, out_at, store_partial, combine_splits); BS (block size), WINDOWED and CAPPED are header
// constants (kernels without a window or a cap compile without their checks).
//   paged_kv_write: kw/vw[slots[t]] = the k/v heads of qkv row t (after RoPE); slot = block*BS + offset,
//                   0xffffffff skips the row. Lane per (t, kv head of k or v, d4); dispatch T*2Hkv*D4.
//   paged_split:    ragged decode, flash-decoding: sequence q (one query row, qkv row q) at position
//                   lens[q] - 1 sees keys [0, lens[q]); lane per (q, split s, G heads) attends keys
//                   [s*chunk, (s+1)*chunk) and writes (acc, max, sum) partials; lens[q] == 0: idle
//                   slot, nothing written. dispatch (ceil(n_live*Hq/G / SWG), S) workgroups: a row of
//                   them per sequence (paged_lane), for the n_live splits the step's longest sequence
//                   reaches (at most n_splits).
//                   A sequence of at most short_keys keys takes the short form instead, chosen by its
//                   own length alone: split 0's lane attends all its keys (as the contiguous
//                   attn_decode1 does) and stores the output; its other splits exit.
//   paged_short:    the short form alone, for a step whose every sequence takes it (record(n_keys) at most
//                   short_keys): lane per (q, G heads), the same lane work as paged_split's split 0;
//                   dispatch ceil(S*Hq/G / SWG) workgroups (paged_split's grid also holds the lanes of
//                   every other split, whose workgroups a CPU adapter starts one by one only to exit).
//   paged_combine:  out[q, h] from the partials of its live splits; lane per (q, h, d4) (sequences
//                   of the short form: nothing to do).
//   paged_causal:   chunked prefill of one sequence: rows t < n_new (step[1]) at positions
//                   pos0 + t (step[0]) see keys [window_lo, pos0 + t] through the table at tab_off,
//                   whose blocks already hold keys 0 .. pos0 + n_new - 1. Workgroup per (block of 64
//                   queries, G heads of one kv head), lane per query, as attn_causal.
//                   IMAGE SPANS (header: key_end, binding 10 `spans` (T, 2) u32, the end at [t, 1]): a
//                   row inside an image whose tokens attend each other both ways (Gemma 3) sees keys
//                   up to its image's end (in the chunk: chunks never cut such an image); a row
//                   with end 0 (text) keeps its causal keys and its bits. With RING the same: an image
//                   row also sees its image's later keys (r_img), from its window's start.
//   RING (header constants RING, SINKS, RING_W; kernels/common.py Ring): a sequence's table of
//   cap = max_blocks * BS rows is attention.wgsl's ring cache of ctx = cap rows (rows 0..SINKS-1 the
//   sinks, past cap position pos in row SINKS + (pos - SINKS) % (cap - SINKS)): decode's lens[q] is
//   the sequence's position + 1 (unbounded; rows min(lens, cap)), prefill's positions pos0 + t. A row
//   attends exactly what attention.wgsl's ring attends (ring_sees, attend_ring): the sinks scored
//   with its sink query (qsk, rope_paged.wgsl wrote it), then rows SINKS.. with its own.

struct Params {
    n_seq: u32,      // S slots (decode), T rows (prefill, kv write)
    hq: u32,
    group: u32,      // Hq / Hkv
    heads: u32,      // heads per qkv row (Hq + 2*Hkv)
    hkv: u32,
    chunk: u32,      // keys per split (decode)
    n_splits: u32,
    scale: f32,
    qkv_off: u32,    // offsets in act4 units
    kc_off: u32,
    vc_off: u32,
    out_off: u32,
    max_blocks: u32, // blocks per table row
    window: u32,     // query at position p sees keys > p - window (0: all)
    softcap: f32,    // scores s -> softcap * tanh(s / softcap) (0: none)
    tab_off: u32,    // offsets in u32 units
    idx_off: u32,    // lens (decode) / slots (kv write) / spans (prefill)
    n_blk: u32,      // query blocks of 64 (prefill)
    short_keys: u32, // decode: sequences of at most this many keys take the short form in paged_split
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> lens: array<u32>;         // decode: (S) keys per sequence
@group(0) @binding(1) var<storage, read> slots: array<u32>;        // kv write: (T) pool rows
@group(0) @binding(1) var<storage, read> step: array<u32>;         // prefill: (4) pos0, n_new, ., .
@group(0) @binding(2) var<storage, read> qkv: array<act4>;         // (T, Hq+2Hkv, D)
@group(0) @binding(3) var<storage, read> kc: array<act4>;          // (n_blocks, BS, Hkv, D)
@group(0) @binding(4) var<storage, read> vc: array<act4>;          // (n_blocks, BS, Hkv, D)
@group(0) @binding(3) var<storage, read> kcp: array<vec4<u32>>;    // f16 pools read 8 halves a load
@group(0) @binding(4) var<storage, read> vcp: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> kcq: array<u32>;          // q8_0 / q4_0 pools (kernels/kv_quant.py)
@group(0) @binding(4) var<storage, read> vcq: array<u32>;
@group(0) @binding(3) var<storage, read_write> kw: array<act4>;    // kv write's pools
@group(0) @binding(4) var<storage, read_write> vw: array<act4>;
@group(0) @binding(5) var<storage, read_write> out: array<act4>;   // (T or S, Hq*D)
@group(0) @binding(5) var<storage, read_write> part: array<vec4<f32>>;   // (S, Hq, n_splits, D4+1)
@group(0) @binding(6) var<storage, read> tables: array<u32>;       // (S, max_blocks) block ids
@group(0) @binding(7) var<storage, read_write> out_s: array<act4>; // paged_split's short-form output
@group(0) @binding(9) var<storage, read> qsk: array<act4>;         // RING: sink queries (S or T, Hq, D)
@group(0) @binding(2) var<storage, read_write> part_in: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out_c: array<act4>;

// RING: a sequence's table rows (ring_sees)
fn ring_cap() -> u32 {
    return p.max_blocks * BS;
}

// pool row (act4 units, before kc_off / vc_off) of key j of kv head hk, table at tables[tb]
fn table_row(tb: u32, hk: u32, j: u32) -> u32 {
    let blk = tables[tb + j / BS];
    return ((blk * BS + j % BS) * p.hkv + hk) * D4;
}

// A block of keys from key `first` of kv head hk (table at tables[tb]) for attention_common.wgsl's
// fold_block: where it lies in one pool block (`one`: always, for block-aligned starts when BS is a
// multiple of BLK) key j is pool row r0 + j*rs after one table lookup, else each key is looked up;
// the rows are the same either way, so is the arithmetic.
struct KeyBlock { one: bool, r0: u32, rs: u32, tb: u32, hk: u32, first: u32 }

fn pool_row(b: KeyBlock, j: u32) -> u32 {
    if (b.one) { return b.r0 + j * b.rs; }
    return table_row(b.tb, b.hk, b.first + j);
}
fn key_row(b: KeyBlock, j: u32) -> u32 { return p.kc_off + pool_row(b, j); }
fn value_row(b: KeyBlock, j: u32) -> u32 { return p.vc_off + pool_row(b, j); }

// attention.wgsl's attend with keys base + j looked up through the table: folds keys j in
// [j_start, n) into (m_run, l_run, acc), masking j < lo and j >= lim.
fn attend(tb: u32, hk: u32, base: u32, j_start: u32, n: u32, lo: u32, lim: u32) {
    var j0 = j_start;
    let rs = p.hkv * D4;                          // pool rows between consecutive keys of a block
    loop {
        if (j0 >= n) { break; }
        let nb = min(BLK, n - j0);
        let first = base + j0;
        let one = first % BS + nb <= BS;
        var r0 = 0u;
        if (one) { r0 = table_row(tb, hk, first); }
        fold_block(j0, nb, lo, lim, first, KeyBlock(one, r0, rs, tb, hk, first));
        j0 += nb;
    }
}

fn store_out(ob: u32, os: u32) {
    for (var g = 0u; g < G; g++) {
        for (var d = 0u; d < D4; d++) { out[ob + g * os + d] = out_at(g, d); }
    }
}

// RING: folds table rows [j0, n) (r_pos, r_last set) into a fresh state, as attention.wgsl's
// attend_ring: rows below SINKS scored with the sink query (qsk at sb), the rest with the row's (qkv at qb).
fn attend_ring(tb: u32, hk: u32, qb: u32, sb: u32, j0: u32, n: u32) {
    load_q(qb, D4);
    let ns = clamp(SINKS, j0, n);
    if (ns > j0) {
        set_q_sink(sb, D4);
        attend(tb, hk, 0u, j0, ns, 0u, 0u);
        set_q(qb, D4);
    }
    attend(tb, hk, 0u, ns, n, 0u, 0u);
}

// all keys of sequence q for heads h0 .. h0+G-1 (the short form)
fn attend_all(q: u32, h0: u32, n_keys: u32) {
    if (RING) {
        attend_ring(p.tab_off + q * p.max_blocks, h0 / p.group, p.qkv_off + (q * p.heads + h0) * D4,
                    (q * p.hq + h0) * D4, 0u, n_keys);
        return;
    }
    let lo = window_lo(n_keys - 1u);
    load_q(p.qkv_off + (q * p.heads + h0) * D4, D4);
    attend(p.tab_off + q * p.max_blocks, h0 / p.group, 0u, (lo / BLK) * BLK, n_keys, lo, n_keys);
}

fn seq_keys(q: u32) -> u32 {
    return min(lens[p.idx_off + q], p.max_blocks * BS);
}

@compute @workgroup_size(64)
fn paged_kv_write(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    let d = i % D4;
    let g = (i / D4) % (2u * p.hkv);             // k heads, then v heads
    let t = i / (D4 * 2u * p.hkv);
    if (t >= p.n_seq) { return; }
    let slot = slots[p.idx_off + t];
    if (slot == 0xffffffffu) { return; }
    let v = qkv[p.qkv_off + (t * p.heads + p.hq + g) * D4 + d];
    if (g < p.hkv) {
        kw[p.kc_off + (slot * p.hkv + g) * D4 + d] = v;
    } else {
        vw[p.vc_off + (slot * p.hkv + g - p.hkv) * D4 + d] = v;
    }
}

// paged_split's lane: (q, s, G heads from h0); sets sink_h0. Row q of the grid is sequence q's, its
// lanes by split, then head group (a lone live sequence's splits share workgroups), as many as the
// splits the step dispatches need.
fn paged_lane(wid: vec3<u32>, lid: u32) -> SplitLane {
    let j = wid.x * SWG + lid;
    let n_hg = p.hq / G;                         // head groups of G
    let h0 = (j % n_hg) * G;
    sink_h0 = h0;
    return SplitLane(wid.y, j / n_hg, h0);
}

@compute @workgroup_size(SWG)
fn paged_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let lane = paged_lane(wid, lid);
    let q = lane.q;
    if (q >= p.n_seq) { return; }
    let n_keys = seq_keys(q);
    if (n_keys == 0u) { return; }
    if (RING) {
        r_pos = lens[p.idx_off + q] - 1u;
        r_last = r_pos;
    }
    if (n_keys <= p.short_keys) {
        if (lane.s != 0u) { return; }
        attend_all(q, lane.h0, n_keys);
        store_short(p.out_off + (q * p.hq + lane.h0) * D4);
        return;
    }
    let lo = window_lo(n_keys - 1u);
    let k0 = lane.s * p.chunk;                   // spare lanes of the last workgroup: s >= n_splits, past every key
    if (k0 >= n_keys || k0 + p.chunk <= lo) { return; }
    if (RING) {
        attend_ring(p.tab_off + q * p.max_blocks, lane.h0 / p.group, p.qkv_off + (q * p.heads + lane.h0) * D4,
                    (q * p.hq + lane.h0) * D4, k0, min(k0 + p.chunk, n_keys));
        store_partial(q, lane.h0, lane.s);
        return;
    }
    load_q(p.qkv_off + (q * p.heads + lane.h0) * D4, D4);
    let n = min(p.chunk, n_keys - k0);
    attend(p.tab_off + q * p.max_blocks, lane.h0 / p.group, k0, 0u, n, max(lo, k0) - k0, n);
    store_partial(q, lane.h0, lane.s);
}

@compute @workgroup_size(SWG)
fn paged_short(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * SWG + lid;
    let n_hg = p.hq / G;                         // head groups of G
    let q = i / n_hg;
    let h0 = (i % n_hg) * G;
    sink_h0 = h0;
    if (q >= p.n_seq) { return; }
    let n_keys = seq_keys(q);
    if (n_keys == 0u || n_keys > p.short_keys) { return; }
    if (RING) {
        r_pos = lens[p.idx_off + q] - 1u;
        r_last = r_pos;
    }
    attend_all(q, h0, n_keys);
    store_short(p.out_off + (q * p.hq + h0) * D4);
}

@compute @workgroup_size(64)
fn paged_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = flat(wid, nwg, lid);
    let d = i % D4;
    let h = (i / D4) % p.hq;
    let q = i / (D4 * p.hq);
    if (q >= p.n_seq) { return; }
    let n_keys = seq_keys(q);
    if (n_keys == 0u || n_keys <= p.short_keys) { return; }
    let n_act = (n_keys + p.chunk - 1u) / p.chunk;
    let s_lo = window_lo(n_keys - 1u) / p.chunk;   // splits before the window wrote nothing
    out_c[p.out_off + (q * p.hq + h) * D4 + d] = combine_splits(q, h, d, s_lo, n_act);
}

@compute @workgroup_size(64)
fn paged_causal(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let cap = p.max_blocks * BS;
    let c = causal_block(wid, nwg, p.n_seq, cap);
    if (c.t0 >= c.rows) { return; }
    let t = min(c.t0 + lid, c.rows - 1u);        // spare lanes redo the last row, never store
    let h0 = c.h0;
    if (RING) {
        r_pos = c.pos0 + t;
        r_last = c.pos0 + c.rows - 1u;
        let img = key_end(t, 0u, 0xffffffffu);    // an image row: its image's end (in the chunk), else 0
        r_img = max(img, 1u) - 1u;
        attend_ring(p.tab_off, h0 / p.group, p.qkv_off + (t * p.heads + h0) * D4, (t * p.hq + h0) * D4, 0u,
                    max(c.n_wg, min(img, cap)));
    } else {
        load_q(p.qkv_off + (t * p.heads + h0) * D4, D4);
        let j_start = (window_lo(c.pos0 + c.t0) / BLK) * BLK;
        let lim = key_end(t, min(c.pos0 + t + 1u, cap), cap);
        attend(p.tab_off, h0 / p.group, 0u, j_start, max(c.n_wg, lim), window_lo(c.pos0 + t), lim);
    }
    if (c.t0 + lid < c.rows) { store_out(p.out_off + (t * p.hq + h0) * D4, D4); }
}
