// moe_route: per row t, the router's top NSEL experts and their weights:
//   p = softmax(logits[t, :]) (f32); sel[t, j] = the j-th largest p (ties: the lower expert id);
//   w[t, j] = p[sel[t, j]], divided by their sum when P.norm (Qwen3-MoE norm_topk_prob, Mixtral).
// dispatch (ceil(T / WG), 1, 1), workgroup WG. The host prepends the activation header and the
// consts WG and NSEL (experts per token). A row's result depends on its own logits only.

struct RouteParams {
    T: u32,          // rows
    E: u32,          // experts
    l_off: u32,      // offset of logits in its binding, in elements
    norm: u32,       // 1: the selected weights sum to 1
}

@group(0) @binding(0) var<uniform> P: RouteParams;
@group(0) @binding(1) var<storage, read> logits: array<act>;      // (T, E): h · Wrouterᵀ
@group(0) @binding(2) var<storage, read_write> sel: array<u32>;   // (T, NSEL) expert ids
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;   // (T, NSEL) their weights

@compute @workgroup_size(WG)
fn moe_route(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x;
    if (t >= P.T) { return; }
    let l0 = P.l_off + t * P.E;
    var m = -3.4e38;
    for (var e = 0u; e < P.E; e++) { m = max(m, f32(logits[l0 + e])); }
    var denom = 0.0;
    for (var e = 0u; e < P.E; e++) { denom += exp(f32(logits[l0 + e]) - m); }
    var picked: array<u32, NSEL>;
    var total = 0.0;
    for (var j = 0u; j < NSEL; j++) {
        var best = 0xFFFFFFFFu;
        var bl = -3.4e38;
        for (var e = 0u; e < P.E; e++) {
            var taken = false;
            for (var i = 0u; i < j; i++) { taken = taken || picked[i] == e; }
            let l = f32(logits[l0 + e]);
            if (!taken && (best == 0xFFFFFFFFu || l > bl)) { best = e; bl = l; }
        }
        picked[j] = best;
        let p = exp(bl - m) / denom;
        sel[t * NSEL + j] = best;
        wts[t * NSEL + j] = p;
        total += p;
    }
    if (P.norm != 0u) {
        for (var j = 0u; j < NSEL; j++) { wts[t * NSEL + j] = wts[t * NSEL + j] / total; }
    }
}

// moe_group: the slots s = t * NSEL + j of T rows grouped by expert, for the prefill's expert products
// (moe_matmul_grouped): order[start[e] .. start[e + 1]] are expert e's slots, in slot order.
// dispatch (1, 1, 1), one invocation (T * NSEL slots, a prefill chunk's: a few thousand at most).
@group(0) @binding(4) var<storage, read_write> order: array<u32>;   // (T * NSEL) slots by expert
@group(0) @binding(5) var<storage, read_write> start: array<u32>;   // (E + 1) first slot of each expert

@compute @workgroup_size(1)
fn moe_group() {
    let n = P.T * NSEL;
    for (var e = 0u; e <= P.E; e++) { start[e] = 0u; }
    for (var s = 0u; s < n; s++) { start[sel[s] + 1u] += 1u; }
    for (var e = 0u; e < P.E; e++) { start[e + 1u] += start[e]; }
    for (var s = 0u; s < n; s++) {          // start[e] is expert e's cursor: it ends at e + 1's start
        let e = sel[s];
        order[start[e]] = s;
        start[e] += 1u;
    }
    for (var e = P.E; e > 0u; e--) { start[e] = start[e - 1u]; }
    start[0] = 0u;
}
