// moe_combine: y[t, r] (+)= sum_j wts[t, j] * prods[t * NSEL + j, r], the slots j in order: a token's
// experts' down products (f32, from moe_matmul_grouped) weighted and summed as moe_down sums them.
// dispatch (ceil(N / WG), T, 1), workgroup WG; the host prepends the activation header, WG and NSEL.

struct CombineParams {
    T: u32,          // rows
    N: u32,          // columns of y and prods
    y_off: u32,      // offset of y in its binding, in elements
    acc: u32,        // 1: add to y (the residual)
}

@group(0) @binding(0) var<uniform> P: CombineParams;
@group(0) @binding(1) var<storage, read> prods: array<f32>;      // (T * NSEL, N)
@group(0) @binding(2) var<storage, read> wts: array<f32>;        // (T, NSEL) routing weights
@group(0) @binding(3) var<storage, read_write> y: array<act>;     // (T, N)

@compute @workgroup_size(WG)
fn moe_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x * WG + lid;
    if (r >= P.N) { return; }
    let t = wid.y;
    var a = 0.0;
    for (var j = 0u; j < NSEL; j++) {
        let s = t * NSEL + j;
        a += wts[s] * prods[s * P.N + r];
    }
    let o = P.y_off + t * P.N + r;
    var v = a;
    if (P.acc != 0u) { v += f32(y[o]); }
    y[o] = act(v);
}
