// Weight decode for f32 rows (HF safetensors): row r is K floats, row_words = K.
// Used by matmul.wgsl / embedding.wgsl (see there); K % 4 == 0.
@group(0) @binding(2) var<storage, read> W: array<vec4<f32>>;   // (rows, K/4)

fn wchunk(base: u32, c: u32) -> WChunk {
    let b = base / 4u + c * 8u;
    return WChunk(array<vec4<f32>, 8>(W[b], W[b + 1u], W[b + 2u], W[b + 3u],
                               W[b + 4u], W[b + 5u], W[b + 6u], W[b + 7u]), vec4<f32>(1.0, 1.0, 0.0, 0.0));
}

fn wvec4(base: u32, k4: u32) -> vec4<f32> {
    return W[base / 4u + k4];
}
