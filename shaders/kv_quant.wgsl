// KV cache in q8_0 or q4_0 (kv_cache_dtype "q8_0" / "q4_0"): blocks of 32 values of a head row share
// one scale d, stored as f16; value = n * f16(d) (kv_blocks.wgsl has the codes, llama.cpp's rules):
//   q8_0: d = max|x| / 127 (f32), n = round(x / d) in [-127, 127], a signed byte;
//   q4_0: d = vmax / -8 (vmax: the value of largest |x|, its sign kept), n = min(15, trunc(x / d +
//         8.5)) - 8 in [-8, 7], stored as the nibble n + 8.
// Our own layout, so that a row's vec4 i is one word's unpack, as an f32/f16 cache's act4 i is a load:
//   words [0, Hkv*ctx*DW):             row r = h*ctx + pos, DW = D*bits/32 words of values:
//                                       q8_0 (DW = D/4): word r*DW + i holds values 4i..4i+3 as signed
//                                         bytes (value 4i in the low byte): vec4 i is word i;
//                                       q4_0 (DW = D/8): word r*DW + i holds values 8i..8i+7 as nibbles
//                                         (value 8i + j in bits 4j..4j+3): vec4 2i is its low
//                                         half-word, vec4 2i + 1 its high one;
//   words [S_OFF, S_OFF + Hkv*ctx*SW): S_OFF = Hkv*ctx*DW, SW = ceil(D/64); word S_OFF + r*SW + w
//                                       holds the f16 scales of blocks 2w (low half) and 2w+1
// so a row costs 4*DW + 4*SW bytes (D = 64: q8_0 68 B, 0.53x of f16's 128 B; q4_0 36 B, 0.28x).
//   kv_quant:       k heads and v heads of qkv (T, H_all, D) rows t < n_new (step[1], 0 = all)
//                   written to cache row pos0 + t (pos0 = step[0]); lane per (t, k|v, kv head, scale
//                   word w).
//   kv_quant_slots: the paged pool (n_blocks, BS, Hkv) rows: qkv row t's kv head h goes to pool row
//                   slots[t] * Hkv + h (0xffffffff: skipped); S_OFF = n_blocks * BS * Hkv * DW.
// The host header supplies act, D4, KV_BITS, KV_VPW, SW and KV_SOFF (= S_OFF), then kv_blocks.wgsl
// and quant_write.wgsl (the quantising).

struct Params {
    rows: u32,     // T dispatched
    heads: u32,    // heads per qkv row (H_all)
    k_lo: u32,     // first k head (= Hq); v heads start at k_lo + n_kv
    n_kv: u32,
    ctx: u32,
    qkv_off: u32,  // act4 units
    idx_off: u32,  // kv_quant_slots: offset of the slots in u32 units
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: array<u32>;     // (4): pos0, n_new, kv_len, 0 (slots: n_new)
@group(0) @binding(2) var<storage, read> qkv: array<act4>;
@group(0) @binding(3) var<storage, read_write> kq: array<u32>;
@group(0) @binding(4) var<storage, read_write> vq: array<u32>;
@group(0) @binding(5) var<storage, read> slots: array<u32>;     // kv_quant_slots: (T) pool rows

// quant_write.wgsl's value source and sink: qkv's heads (src in act4 units), the two caches
fn kv_src(src: u32, e: u32, pos: u32, v: u32) -> f32 {
    return vec4<f32>(qkv[src + e / 4u])[e % 4u];
}

fn kv_put(v: u32, i: u32, w: u32) {
    if (v == 0u) { kq[i] = w; } else { vq[i] = w; }
}

// quantises qkv row t's k (v = 0) or v (v = 1) head h, blocks 2w and 2w + 1, into cache row `row`
fn quant(t: u32, v: u32, h: u32, w: u32, row: u32) {
    quant_write(p.qkv_off + (t * p.heads + p.k_lo + v * p.n_kv + h) * D4, 0u, v, w, row);
}

struct Lane {
    t: u32,
    v: u32,
    h: u32,
    w: u32,
    ok: bool,   // a live row
}

fn lane(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> Lane {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid;
    let per_row = 2u * p.n_kv * SW;
    let t = i / per_row;
    let n_new = step[1];
    let rows = select(p.rows, min(p.rows, n_new), n_new != 0u);
    let r = i % per_row;
    return Lane(t, r / (p.n_kv * SW), (r / SW) % p.n_kv, r % SW, t < rows);
}

@compute @workgroup_size(64)
fn kv_quant(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let l = lane(wid, nwg, lid);
    let pos = step[0] + l.t;
    if (!l.ok || pos >= p.ctx) { return; }
    quant(l.t, l.v, l.h, l.w, l.h * p.ctx + pos);
}

@compute @workgroup_size(64)
fn kv_quant_slots(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let l = lane(wid, nwg, lid);
    if (!l.ok) { return; }
    let slot = slots[p.idx_off + l.t];
    if (slot == 0xffffffffu) { return; }
    quant(l.t, l.v, l.h, l.w, slot * p.n_kv + l.h);
}
