// fma_probe.wgsl: the adapter's FMA ceiling (bench/ceilings.py, not an engine kernel). Each
// invocation keeps the header's Chains (CHAINS act4 values in registers, no dependency between
// them) and runs P.iters calls of chains_step (UNROLL fma per chain each), then stores their sum so
// that no fma is dead. The header (ceilings.probe_header) defines act / act4, Chains, chains_init,
// chains_step and chains_sum. FLOPs per invocation: 2 * 4 * CHAINS * UNROLL * iters.

struct ProbeParams { iters: u32, _a: u32, _b: u32, _c: u32 }

@group(0) @binding(0) var<uniform> P: ProbeParams;
@group(0) @binding(1) var<storage, read_write> out: array<act4>;   // (invocations)

// fma_probe: out[i] = sum of the chains after P.iters steps   dispatch (groups, 1, 1), workgroup 64
@compute @workgroup_size(64)
fn fma_probe(@builtin(global_invocation_id) gid: vec3<u32>) {
    // from the invocation id, so that nothing folds to a constant; 0.5 <= a < 0.75 keeps every
    // chain near b / (1 - a): no overflow, no denormals
    let s = act(gid.x & 7u) * act(0.03125);
    let a = act4(act(0.5) + s);
    let b = act4(act(0.5) - s);
    var c = chains_init(s);
    for (var n = 0u; n < P.iters; n++) {
        c = chains_step(c, a, b);
    }
    out[gid.x] = chains_sum(c);
}
