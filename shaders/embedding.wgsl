// embedding: out[t, :] = dequant(W[ids[t] - r0, :]) for the ids that fall in this part's rows.
// 32 weights: value[i] = q[i] * s.x + s.z for i < 4 (the first 16), q[i] * s.y + s.w for i >= 4
struct WChunk { q: array<vec4<f32>, 8>, s: vec4<f32> }

// Generic body: built after the activation header and `WG` const, before the weight's reader (a
// float row's `matmul_<dtype>.wgsl`, or matmul_words.wgsl with dequant.wgsl) that declares the table
// binding (2) and `wchunk` / `wvec4`.
// One invocation writes one 32-wide chunk (or one trailing 4-wide group) of one output row.
// dispatch folded over T * units: (min(g, 65535), ceil(g / 65535), 1), workgroup WG
struct EmbedParams {
    C: u32,          // columns of the table and of out
    T: u32,          // number of ids
    row_words: u32,  // u32 words per table row in the GPU layout
    out_off: u32,    // offset of out in its binding, in elements
    ids_off: u32,    // offset of ids in its binding, in elements
    r0: u32,         // first table row held by this part
    rows: u32,       // table rows in this part
    nchunks: u32,    // C / 32 whole chunks
    units: u32,      // nchunks + (C / 4 - 8 * nchunks) trailing vec4s
}

@group(0) @binding(0) var<uniform> P: EmbedParams;
@group(0) @binding(1) var<storage, read> ids: array<u32>;           // (T)
@group(0) @binding(3) var<storage, read_write> outv: array<act>;    // (T, C)

@compute @workgroup_size(WG)
fn embedding(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let g = (wid.x + wid.y * nwg.x) * WG + lid;
    let t = g / P.units;
    let u = g % P.units;
    if (t >= P.T) { return; }
    let id = ids[P.ids_off + t];
    if (id < P.r0 || id >= P.r0 + P.rows) { return; }
    let base = (id - P.r0) * P.row_words;
    let o = P.out_off + t * P.C;
    if (u < P.nchunks) {
        let w = wchunk(base, u);
        for (var j = 0u; j < 8u; j++) {
            let v = select(fma(w.q[j], vec4<f32>(w.s.y), vec4<f32>(w.s.w)),
                           fma(w.q[j], vec4<f32>(w.s.x), vec4<f32>(w.s.z)), j < 4u);
            let e = o + u * 32u + j * 4u;
            outv[e] = act(v.x);
            outv[e + 1u] = act(v.y);
            outv[e + 2u] = act(v.z);
            outv[e + 3u] = act(v.w);
        }
    } else {
        let k4 = P.nchunks * 8u + (u - P.nchunks);
        let w = wvec4(base, k4);
        let e = o + k4 * 4u;
        outv[e] = act(w.x);
        outv[e + 1u] = act(w.y);
        outv[e + 2u] = act(w.z);
        outv[e + 3u] = act(w.w);
    }
}
