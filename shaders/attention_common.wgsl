// The online softmax's state and helpers, and the causal kernels' workgroups, that attention.wgsl (a contiguous cache) and
// attention_paged.wgsl (pool blocks through a table) share: the host prepends this part to their
// headers (kernels/attention.py _attn_header), beside D4, G, sv, load_q, qk, acc_* and sink_l.
// Header constants: WINDOWED and CAPPED (kernels without a window or a cap compile without their
// checks); RING, SINKS, RING_W (kernels/common.py ring_header). The kernel file supplies Params p,
// the part / part_in bindings, ring_cap() (the rows of the cache a RING query reads) and KeyBlock
// with key_row / value_row (where fold_block reads a block's keys and values).

const WG: u32 = 64u;
const BLK: u32 = 16u;   // keys scored per rescale of the accumulator
const MASKED: f32 = -1.0e30;

var<private> m_run: sv;
var<private> l_run: sv;
var<private> r_pos: u32;        // RING: the query's position
var<private> r_last: u32;       // RING: the forward's last position (the newest key in the cache)
var<private> r_img: u32;        // RING: an image row's last key (its image's end - 1; else 0: r_pos's)

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// The first key a query at position `pos` sees.
fn window_lo(pos: u32) -> u32 {
    if (!WINDOWED) { return 0u; }
    return select(0u, pos + 1u - p.window, p.window > 0u && pos + 1u > p.window);
}

fn score(kr: u32) -> sv {
    let s = qk(kr);
    if (CAPPED) { return p.softcap * tanh(s / p.softcap); }
    return s;
}

// RING: whether the query at r_pos sees cache row j (the position the row holds: j itself until the
// cache of cap = ring_cap() rows is full, then the newest position written there); a row inside an
// image (r_img) also sees its image's later keys.
fn ring_sees(j: u32) -> bool {
    let cap = ring_cap();
    var kp = j;
    if (r_last >= cap && j >= SINKS) {
        let r = cap - SINKS;
        kp = r_last - (SINKS + (r_last - SINKS) % r + r - j) % r;
    }
    return kp <= max(r_pos, r_img) && (kp < SINKS || kp + RING_W >= r_pos + SINKS);
}

// One block step of the online softmax: folds keys j0 + j, j < nb, into (m_run, l_run, acc): key j
// read by qk at key_row(b, j), its value by acc_add at value_row(b, j) (the kernel's KeyBlock: a
// cache's rows, or a pool's through a table); keys j0 + j < lo or >= lim are masked, or with RING
// the cache rows ring_j0 + j that ring_sees rejects.
fn fold_block(j0: u32, nb: u32, lo: u32, lim: u32, ring_j0: u32, b: KeyBlock) {
    var sc: array<sv, BLK>;
    var mb = m_run;
    for (var j = 0u; j < nb; j++) {
        var seen = j0 + j < lim && (!WINDOWED || j0 + j >= lo);
        if (RING) { seen = ring_sees(ring_j0 + j); }
        let s = select(sv(MASKED), score(key_row(b, j)), seen);
        sc[j] = s;
        mb = max(mb, s);
    }
    let corr = exp(m_run - mb);
    l_run *= corr;
    acc_scale(corr);
    for (var j = 0u; j < nb; j++) {
        let pj = exp(sc[j] - mb);
        l_run += pj;
        acc_add(pj, value_row(b, j));
    }
    m_run = mb;
}

// The rows of a forward of n rows that run: step[1] (n_new) of them where it is set.
fn live_rows(n: u32) -> u32 {
    let n_new = step[1];
    return select(n, min(n, n_new), n_new != 0u);
}

// A causal prefill workgroup (attn_causal, attn_flash, paged_causal) over a forward of n rows and a
// cache of cap rows: a block of WG queries from row t0, at positions pos0 + t, and G heads from h0 of
// one kv head (a workgroup with t0 >= rows has nothing to do); n_wg: the keys the block's last query
// sees. Sets sink_h0. Uniform over the workgroup (the lane's own row, t0 + lid, is the kernel's).
struct CausalBlock { h0: u32, t0: u32, rows: u32, pos0: u32, n_wg: u32 }

fn causal_block(wid: vec3<u32>, nwg: vec3<u32>, n: u32, cap: u32) -> CausalBlock {
    let wg = wid.y * nwg.x + wid.x;
    let n_hg = p.hq / G;                         // head groups of G
    let h0 = (wg % n_hg) * G;
    sink_h0 = h0;
    let t0 = (wg / n_hg) * WG;
    let rows = live_rows(n);
    let pos0 = step[0];
    return CausalBlock(h0, t0, rows, pos0, min(pos0 + min(t0 + WG, rows), cap));
}

// A flash-decoding lane (attn_split, paged_split): its row or sequence q, split s and G heads from h0
// of one kv head, from the invocation's index; sets sink_h0.
struct SplitLane { q: u32, s: u32, h0: u32 }

fn split_lane(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> SplitLane {
    let i = (wid.y * nwg.x + wid.x) * SWG + lid;
    let n_hg = p.hq / G;                         // head groups of G
    let per_row = p.n_splits * n_hg;
    let h0 = (i % n_hg) * G;
    sink_h0 = h0;
    return SplitLane(i / per_row, (i % per_row) / n_hg, h0);
}

// Output g, column d of the state: acc / l (an empty key range, a length-0 sequence, gives zeros
// rather than 0/0; sinks join the sum).
fn out_at(g: u32, d: u32) -> act4 {
    let l = sv_get(l_run, g) + sink_l(sink_h0 + g, sv_get(m_run, g));
    return act4(acc_get(g, d) * select(0.0, 1.0 / l, l > 0.0));
}

// The short form's output (a split lane that attends all its keys): head g of the lane at
// out_s[ob + g*D4 ..].
fn store_short(ob: u32) {
    for (var g = 0u; g < G; g++) {
        for (var d = 0u; d < D4; d++) { out_s[ob + g * D4 + d] = out_at(g, d); }
    }
}

// The partials (acc, max, sum) of heads h0 .. h0+G-1 of row t for split s.
fn store_partial(t: u32, h0: u32, s: u32) {
    for (var g = 0u; g < G; g++) {
        let pb = ((t * p.hq + h0 + g) * p.n_splits + s) * (D4 + 1u);
        for (var d = 0u; d < D4; d++) { part[pb + d] = acc_get(g, d); }
        part[pb + D4] = vec4<f32>(sv_get(m_run, g), sv_get(l_run, g), 0.0, 0.0);
    }
}

// Row t, head h, column d of the output from the partials of splits [s_lo, n_act):
// sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + the sink's term).
fn combine_splits(t: u32, h: u32, d: u32, s_lo: u32, n_act: u32) -> act4 {
    let stride = D4 + 1u;
    let hb = (t * p.hq + h) * p.n_splits * stride;
    var mx = -3.0e38;
    for (var s = s_lo; s < n_act; s++) { mx = max(mx, part_in[hb + s * stride + D4].x); }
    var l = 0.0;
    var o = vec4<f32>(0.0);
    for (var s = s_lo; s < n_act; s++) {
        let ml = part_in[hb + s * stride + D4];
        let w = exp(ml.x - mx);
        l += w * ml.y;
        o += w * part_in[hb + s * stride + d];
    }
    l += sink_l(h, mx);
    return act4(o / l);
}
