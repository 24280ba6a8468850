// sigmoid_gate: y[t, i] = y[t, i] * sigmoid(g[t, i]): the output gate of Qwen3.5's full-attention
// layers, on the attention's output before the o projection.
// dispatch (ceil(N / 64), 1, 1) over the N = T * cols values, workgroup 64.

struct Params {
    n: u32,
    y_off: u32,
    g_off: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<act>;          // (T, cols)
@group(0) @binding(2) var<storage, read> g: array<act>;                // (T, cols)

@compute @workgroup_size(64)
fn sigmoid_gate(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.n) { return; }
    let gv = f32(g[p.g_off + i]);
    y[p.y_off + i] = act(f32(y[p.y_off + i]) / (1.0 + exp(-gv)));
}
