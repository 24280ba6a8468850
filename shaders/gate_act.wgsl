// The gate activations of a gated FFN (act(gate) * up), for the decode matmul's fused input
// (matmul_decode.wgsl dec_xs) and its SiLU·up epilogue (matmul_epilogue.wgsl ep_silu). The host
// (kernels/matmul/codegen.py gate_act_source) appends `gate2` / `gate4` naming one pair:
//   silu:      g / (1 + exp(-g))                                            (Llama, Qwen, Mistral, Phi)
//   gelu_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))              (GeGLU: Gemma)
// Same formulas as elementwise.wgsl's silu_mul / gelu_tanh_mul.

// exp(-g) overflows to inf for g < -88: g / inf = -0, the right limit
fn silu_v2(g: vec2<f32>) -> vec2<f32> { return g / (1.0 + exp(-g)); }
fn silu_v4(g: vec4<f32>) -> vec4<f32> { return g / (1.0 + exp(-g)); }

// tanh(z) + 1 without cancellation for z < 0 and without overflow for large |z|
fn gelu_tanh_v2(g: vec2<f32>) -> vec2<f32> {
    let z = 0.7978845608028654 * (g + 0.044715 * g * g * g);
    let t = exp(-2.0 * abs(z));
    return 0.5 * g * select(2.0 / (1.0 + t), 2.0 * t / (1.0 + t), z < vec2<f32>(0.0));
}
fn gelu_tanh_v4(g: vec4<f32>) -> vec4<f32> {
    let z = 0.7978845608028654 * (g + 0.044715 * g * g * g);
    let t = exp(-2.0 * abs(z));
    return 0.5 * g * select(2.0 / (1.0 + t), 2.0 * t / (1.0 + t), z < vec4<f32>(0.0));
}
