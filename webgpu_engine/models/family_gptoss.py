"""gpt-oss (OpenAI's gpt-oss-20b / -120b): a mixture of experts whose layers differ from Llama's in
what they add:

    a = softmax([q · kᵀ * scale, sink_h]) · v, the sink dropped    # a learned logit per q head
    (sliding-window layers alternate with full ones, `layer_types`; q/k/v/o biases; YaRN RoPE)
    e, w = top-k(h · Wrouterᵀ + b), softmax over the k              # = softmax top-k renormalised
    FFN_e(h) = ((clamp(u, ±limit) + 1) * g * sigmoid(alpha g)) · Wdownᵀ + b_down,
               g = min(h · Wgᵀ + b_g, limit), u = h · Wuᵀ + b_u        # swiglu_oai

(LlamaConfig.attn_sinks, act "swiglu_oai" with act_alpha / act_limit; kernels: attention sinks,
expert biases, silu_mul's swiglu_oai.) Its HF folder stacks the experts for x · W with gate and up
columns interleaved (models/experts.py transposes them at upload); llama.cpp's GGUF
(general.architecture `gpt-oss`) stacks them as the other MoE families, biases beside. Its answers
are in harmony (channels: analysis as reasoning_content, final as content, commentary to
functions.NAME as tool calls), parsed by engine/harmony.py.
"""
from __future__ import annotations

from ..errors import UnsupportedModelError
from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS

_L = "model.layers.{i}."
HF_GPTOSS_TO_OURS = {**{k: v for k, v in HF_LLAMA_TO_OURS.items() if ".mlp." not in k},
                     _L + "self_attn.o_proj.bias": "layers.{i}.o_bias",
                     _L + "self_attn.sinks": "layers.{i}.sinks",                          # (Hq,)
                     _L + "mlp.router.weight": "layers.{i}.router",                       # (E, C)
                     _L + "mlp.router.bias": "layers.{i}.router_bias",                    # (E,)
                     _L + "mlp.experts.gate_up_proj": "layers.{i}.gate_up_exps_t",        # (E, C, 2F)
                     _L + "mlp.experts.gate_up_proj_bias": "layers.{i}.gate_up_exps_bias",  # (E, 2F)
                     _L + "mlp.experts.down_proj": "layers.{i}.down_exps_t",              # (E, F, C)
                     _L + "mlp.experts.down_proj_bias": "layers.{i}.down_exps_bias"}      # (E, C)


def _gptoss_hf(c: dict, fields: dict, where: str) -> dict:
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(fields["n_layers"])]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"{where}: layer_types {sorted(set(types))} (sliding / full attention only)")
    if (c.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        raise UnsupportedModelError(f"{where}: the MXFP4 experts of an HF folder are not read; use the "
                                    f"bf16 folder or the GGUF")
    return {**fields, "n_experts": int(c["num_local_experts"]), "n_experts_used": int(c["num_experts_per_tok"]),
            "moe_norm_topk": True, "act": "swiglu_oai", "act_alpha": float(c.get("swiglu_alpha", 1.702)),
            "act_limit": float(c.get("swiglu_limit", 7.0)), "attn_sinks": True, "qkv_bias": True,
            "window_layers": tuple(t == "sliding_attention" for t in types)}


def _gptoss_gguf(g, fields: dict) -> dict:
    """llama.cpp's gpt-oss: the file carries the window, not the layers' pattern (even layers slide,
    llama.cpp's swa pattern 2) nor the SwiGLU's constants (its graph's: alpha 1.702, limit 7)."""
    return {**fields, "moe_norm_topk": True, "act": "swiglu_oai", "act_alpha": 1.702, "act_limit": 7.0,
            "attn_sinks": True, "window_layers": tuple(i % 2 == 0 for i in range(fields["n_layers"]))}


GPTOSS = DecoderFamily("gpt-oss", hf_architectures=("GptOssForCausalLM",), hf_model_types=("gpt_oss",),
                       hf_defaults={"use_sliding_window": True, "sliding_window": 128}, gguf_neox=True,
                       hf_names=HF_GPTOSS_TO_OURS, hf=_gptoss_hf, gguf=_gptoss_gguf,
                       gguf_names={"blk.{i}.post_attention_norm.weight": "layers.{i}.ffn_norm"},
                       chat_format="harmony")

FAMILIES = (GPTOSS,)
