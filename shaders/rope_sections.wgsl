// rope_sections: rotary embedding in place on the first n_rot heads of each row of qkv (T, H_all, D),
// half-split pairs (x[i], x[i + D/2]) as transformers' rotate_half, each pair's angle taken from one
// of three positions of its row:
//   axis(i) = 0 for i < s1, 1 for s1 <= i < s2, 2 for i >= s2
//   angle   = f32(pos[t, axis(i)]) * freq[i]
//   (a, b) -> (a cos - b sin, a sin + b cos)
// M-RoPE (Qwen2.5-VL's decoder): the temporal | height | width sections of the frequency pairs;
// a ViT's 2D RoPE: s1 = 0, the first half of the pairs by the patch's row, the rest by its column.
// Positions are i32 (a rotation by a position difference may be negative).
// dispatch ceil(T * n_rot * D/2 / 64) split over x, y; workgroup 64. Built after sincos.wgsl.

struct Params {
    rows: u32,    // T
    heads: u32,   // heads per qkv row (H_all)
    half: u32,    // D / 2
    n_rot: u32,   // heads < n_rot are rotated
    s1: u32,      // section ends (pairs)
    s2: u32,
    qkv_off: u32, // offset of qkv in its binding, in elements
    pos_off: u32, // offset of pos in its binding, in elements
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> pos: array<i32>;             // (T, 3)
@group(0) @binding(2) var<storage, read_write> qkv: array<act>;       // (T, H_all, D)
@group(0) @binding(3) var<storage, read> freq: array<f32>;            // (D/2), host-computed

@compute @workgroup_size(64)
fn rope_sections(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= p.rows * p.n_rot * p.half) { return; }
    let j = i % p.half;
    let th = i / p.half;
    let h = th % p.n_rot;
    let t = th / p.n_rot;
    let axis = select(select(2u, 1u, j < p.s2), 0u, j < p.s1);
    let ang = f32(pos[p.pos_off + 3u * t + axis]) * freq[j];
    let base = p.qkv_off + (t * p.heads + h) * 2u * p.half;
    let r = rotate_by(f32(qkv[base + j]), f32(qkv[base + j + p.half]), ang);
    qkv[base + j] = act(r.x);
    qkv[base + j + p.half] = act(r.y);
}
