// q_temperature: q[t, h, :] *= 1 + beta * ln(1 + floor(pos_t / length)) for the n_q query heads of each
// row of q|k|v heads: Llama 4's attention temperature, with which Ministral 3 scales its queries
// past the original context (`llama_4_scaling_beta`, `original_max_position_embeddings`); 1 below it.
// pos_t: step[0] + t (per_row 0: one sequence; step[3] = S > 0: step[0] + t % S, as rope.wgsl) or
// positions[t] (per_row 1: the paged batch's rows).
// dispatch (ceil(T * Hq * D / 64), 1, 1) (2D past 65535 workgroups), workgroup 64.

struct Params {
    rows: u32,          // T
    q_cols: u32,        // Hq * D: the query values of a row
    stride: u32,        // (Hq + 2 Hkv) * D: values per row
    off: u32,           // element offset of qkv in its binding
    per_row: u32,
    length: u32,        // original context
    beta: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<act>;      // (T, Hq + 2 Hkv, D)
@group(0) @binding(2) var<storage, read> step: array<u32>;           // (4): pos0, n_new, kv_len, S
@group(0) @binding(3) var<storage, read> positions: array<u32>;      // (T,) per_row 1

@compute @workgroup_size(64)
fn q_temperature(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.rows * p.q_cols) { return; }
    let t = i / p.q_cols;
    var pos = step[0] + select(t, t % step[3], step[3] > 0u);
    if (p.per_row == 1u) { pos = positions[t]; }
    let s = 1.0 + p.beta * log(1.0 + f32(pos / p.length));
    let j = p.off + t * p.stride + i % p.q_cols;
    qkv[j] = act(f32(qkv[j]) * s);
}
