// moe_matmul / moe_down: products with the selected experts of a stacked expert weight
// W (E * N, K) (expert e's rows e*N .. e*N+N-1), expert ids from sel (T, NSEL), written by moe_route
// on the GPU. Only the chosen experts' rows are read: a row's bytes are NSEL experts' whatever E.
//   moe_matmul: y[t*NSEL + j, r] = x[t or t*NSEL + j, :] · W[sel[t, j] * N + r, :]   (gate|up)
//   moe_down:   y[t, r] (+)= sum_j wts[t, j] * (x[t*NSEL + j, :] · W[sel[t, j] * N + r, :])
// Appended to matmul.wgsl (MatmulParams P with P.rows = N, one expert's rows; xchunk, cdot, tail,
// store) and the weight type's reader (wchunk); the host adds the consts NSEL, XSLOT (1: x has a
// row per slot t*NSEL + j; 0: per token t) and the experts this weight buffer holds, E0 .. E0+NE-1
// (a stack larger than one binding is split into buffers of whole experts, a dispatch each: slots
// of other experts are another dispatch's). Every output is one invocation's sum in a fixed order
// (K chunks, then the slots j in order; buffers in order), so a row's values do not depend on the
// other rows. The host's header also defines expert_bias(e, r): expert e's bias of row r (gpt-oss:
// ebias (E, N) f32 at binding 9), or 0 (the same bits as none).

@group(0) @binding(5) var<storage, read> sel: array<u32>;     // (T, NSEL) expert ids
@group(0) @binding(6) var<storage, read> wts: array<f32>;     // (T, NSEL) routing weights (moe_down)
@group(0) @binding(7) var<storage, read> order: array<u32>;   // (T * NSEL) slots by expert (moe_group)
@group(0) @binding(8) var<storage, read> start: array<u32>;   // (E + 1) first slot of each expert

fn held(e: u32) -> bool { return e >= E0 && e < E0 + NE; }

// row r of expert e (held here) times the activation row starting at xword xr
fn expert_row_sum(e: u32, r: u32, xr: u32) -> f32 {
    let b = ((e - E0) * P.rows + r) * P.row_words;
    var a = 0.0;
    for (var c = 0u; c < P.nchunks; c++) {
        a += cdot(wchunk(b, c), xchunk(xr + c * 8u));
    }
    if (P.k4 > P.nchunks * 8u) { a += tail(b, xr); }
    return a;
}

// dispatch (ceil(N / WG), T * NSEL, 1), workgroup WG; P.T = T * NSEL, P.y_stride = N
@compute @workgroup_size(WG)
fn moe_matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x * WG + lid;
    if (r >= P.rows) { return; }
    let s = wid.y;                              // slot t * NSEL + j
    if (!held(sel[s])) { return; }
    let xrow = select(s / NSEL, s, XSLOT == 1u);
    store(s, r, expert_row_sum(sel[s], r, P.x_off4 + xrow * (P.K / 4u)) + expert_bias(sel[s], r));
}

// dispatch (ceil(N / WG), T, 1), workgroup WG; P.T = T, P.y_stride = N
@compute @workgroup_size(WG)
fn moe_down(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x * WG + lid;
    if (r >= P.rows) { return; }
    let t = wid.y;
    var a = 0.0;
    for (var j = 0u; j < NSEL; j++) {
        let s = t * NSEL + j;
        if (!held(sel[s])) { continue; }
        a += wts[s] * (expert_row_sum(sel[s], r, P.x_off4 + s * (P.K / 4u)) + expert_bias(sel[s], r));
    }
    store(t, r, a);
}

// moe_matmul_grouped: moe_matmul's values with the slots grouped by expert (a prefill's rows): the
// invocation of expert E0 + wid.y's row r reads each weight chunk once for 4 of its slots, each
// slot's sum the same operations in the same order as expert_row_sum's (the same bits).
// dispatch (ceil(N / WG), NE, 1), workgroup WG; P.T = T * NSEL, P.y_stride = N
fn slot_x(s: u32) -> u32 { return P.x_off4 + select(s / NSEL, s, XSLOT == 1u) * (P.K / 4u); }

@compute @workgroup_size(WG)
fn moe_matmul_grouped(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x * WG + lid;
    if (r >= P.rows) { return; }
    let e = E0 + wid.y;
    let b = (wid.y * P.rows + r) * P.row_words;
    let s1 = start[e + 1u];
    for (var i = start[e]; i < s1; i += 4u) {
        let n = min(4u, s1 - i);             // slots past n re-read the last one and are not stored
        let sa = order[i];
        let sb = order[i + min(1u, n - 1u)];
        let sc = order[i + min(2u, n - 1u)];
        let sd = order[i + min(3u, n - 1u)];
        let xa = slot_x(sa);
        let xb = slot_x(sb);
        let xc = slot_x(sc);
        let xd = slot_x(sd);
        var a = vec4<f32>(0.0);
        for (var c = 0u; c < P.nchunks; c++) {
            let w = wchunk(b, c);
            a.x += cdot(w, xchunk(xa + c * 8u));
            a.y += cdot(w, xchunk(xb + c * 8u));
            a.z += cdot(w, xchunk(xc + c * 8u));
            a.w += cdot(w, xchunk(xd + c * 8u));
        }
        if (P.k4 > P.nchunks * 8u) {
            a += vec4<f32>(tail(b, xa), tail(b, xb), tail(b, xc), tail(b, xd));
        }
        let bias = expert_bias(e, r);
        store(sa, r, a.x + bias);
        if (n > 1u) { store(sb, r, a.y + bias); }
        if (n > 2u) { store(sc, r, a.z + bias); }
        if (n > 3u) { store(sd, r, a.w + bias); }
    }
}
