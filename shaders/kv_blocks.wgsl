// kv_blocks: the KV block types' codes (kv_quant.wgsl has the layout), for the kernels that write a
// quantised cache (quant_write.wgsl) and those that read it (the attention headers). The host header
// supplies KV_BITS (8: q8_0, 4: q4_0) and KV_VPW (row vec4s per u32 word: 8 / KV_BITS); the branches
// on it are compile-time constants. Both types: 32 values share an f16 scale d, value = n * f16(d).

// vec4 s of a row's word w as the integers n (before the scale)
fn kv_unpack(w: u32, s: u32) -> vec4<f32> {
    if (KV_BITS == 8u) {      // four signed bytes, the low byte first
        return vec4<f32>(vec4<i32>(bitcast<i32>(w << 24u), bitcast<i32>(w << 16u), bitcast<i32>(w << 8u),
                                   bitcast<i32>(w)) >> vec4<u32>(24u));
    }
    // eight nibbles n + 8, the low nibble first: vec4 0 in the low half-word, vec4 1 in the high one
    return vec4<f32>((vec4<u32>(w) >> (vec4<u32>(0u, 4u, 8u, 12u) + 16u * s)) & vec4<u32>(15u)) - 8.0;
}

// a block's scale from its largest |x| (amax) and that value with its sign (vmax), as llama.cpp's
// q8_0 (d = amax / 127) and q4_0 (d = vmax / -8)
fn kv_scale(amax: f32, vmax: f32) -> f32 {
    if (KV_BITS == 8u) { return amax / 127.0; }
    return vmax / -8.0;
}

// the stored code of x / d (y = x * (1 / d), 0 where d = 0): q8_0 round(y) in [-127, 127] as a byte;
// q4_0 min(15, trunc(y + 8.5)) as a nibble
fn kv_code(y: f32) -> u32 {
    if (KV_BITS == 8u) { return u32(i32(clamp(round(y), -127.0, 127.0))) & 0xffu; }
    return min(15u, u32(y + 8.5));
}
