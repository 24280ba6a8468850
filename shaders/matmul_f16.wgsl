// Weight decode for f16 rows (IEEE half, HF safetensors): row_words = K / 2; K % 4 == 0.
// Reads u32 words and unpacks them, so f16 weights need no shader-f16 feature.
@group(0) @binding(2) var<storage, read> W: array<vec2<u32>>;   // (rows, K/4) pairs of f16x2

fn wvec4(base: u32, k4: u32) -> vec4<f32> {
    let p = W[base / 2u + k4];
    return vec4<f32>(unpack2x16float(p.x), unpack2x16float(p.y));
}

fn wchunk(base: u32, c: u32) -> WChunk {
    let k = c * 8u;
    return WChunk(array<vec4<f32>, 8>(wvec4(base, k), wvec4(base, k + 1u), wvec4(base, k + 2u),
                               wvec4(base, k + 3u), wvec4(base, k + 4u), wvec4(base, k + 5u),
                               wvec4(base, k + 6u), wvec4(base, k + 7u)), vec4<f32>(1.0, 1.0, 0.0, 0.0));
}
