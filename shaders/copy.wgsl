// copy.wgsl: plain buffer copy (the bandwidth ceiling in bench/kernels.py) and the one-off GPU
// repack of weight blocks whose size is not a multiple of 4 bytes into a word-aligned layout.

struct CopyParams { n: u32, _a: u32, _b: u32, _c: u32 }   // n: vec4 words to copy

@group(0) @binding(0) var<uniform> CP: CopyParams;
@group(0) @binding(1) var<storage, read> src4: array<vec4<u32>>;          // (n)
@group(0) @binding(2) var<storage, read_write> dst4: array<vec4<u32>>;    // (n)

// copy_vec4: dst4[i] = src4[i]   dispatch folded over ceil(n / 64): (min(g, 65535), ceil(g / 65535))
@compute @workgroup_size(64)
fn copy_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i < CP.n) { dst4[i] = src4[i]; }
}

struct RepackParams {
    nblocks: u32,     // blocks to convert
    src_stride: u32,  // bytes per source block (e.g. 18 for q4_0)
    dst_words: u32,   // u32 words per destination block (e.g. 5)
    ins: u32,         // byte position in the block where zero padding is inserted
    pad: u32,         // bytes of padding inserted
    dst_off: u32,     // first destination word
    _a: u32,
    _b: u32,
}

@group(0) @binding(0) var<uniform> RP: RepackParams;
@group(0) @binding(1) var<storage, read> rsrc: array<u32>;          // (nblocks * src_stride bytes)
@group(0) @binding(2) var<storage, read_write> rdst: array<u32>;    // (dst_off + nblocks * dst_words)

fn src_byte(i: u32) -> u32 {
    return (rsrc[i >> 2u] >> ((i & 3u) * 8u)) & 0xFFu;
}

// repack_blocks: destination block b = source block b with `pad` zero bytes inserted at `ins`.
// One invocation per destination word. dispatch folded over ceil(nblocks * dst_words / 64)
@compute @workgroup_size(64)
fn repack_blocks(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let w = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (w >= RP.nblocks * RP.dst_words) { return; }
    let b = w / RP.dst_words;
    let j = w % RP.dst_words;
    var word = 0u;
    for (var q = 0u; q < 4u; q++) {
        let p = j * 4u + q;
        var sp = p;
        if (p >= RP.ins) {
            if (p < RP.ins + RP.pad) { continue; }
            sp = p - RP.pad;
        }
        if (sp < RP.src_stride) { word |= src_byte(b * RP.src_stride + sp) << (q * 8u); }
    }
    rdst[RP.dst_off + w] = word;
}

// Interleaved 4-row spans (the T = 1 matmul's weight layout on CPU adapters, kernels/matmul/layout.py):
// a weight whose rows hold a whole number of vec4 words per 4 rows (`rw` vec4 per 4-row span) is
// cut into groups of 8 spans (32 rows); in each whole group, vec4 v of span j is stored at
// v * 8 + j, so the 8 SIMD lanes of the decode kernel, each owning one span, read one contiguous
// 128-byte run per load instead of 8 runs rw * 16 bytes apart. Words past the last whole group
// (`full` vec4 words) keep the row layout.
fn span_map(i: u32, rw: u32, full: u32) -> u32 {
    if (i >= full) { return i; }
    let r = i % (8u * rw);
    return i - r + (r % rw) * 8u + r / rw;
}

// interleave_spans: dst4[span_map(i)] = src4[i]; CP = (n vec4 words, rw, full, 0).
// dispatch folded over ceil(n / 64) like copy_vec4
@compute @workgroup_size(64)
fn interleave_spans(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i < CP.n) { dst4[span_map(i, CP._a, CP._b)] = src4[i]; }
}
