"""Phi-3 / 3.5 / Phi-4-mini: Llama with q|k|v and gate|up fused in the checkpoint (split on load:
HF qkv_proj / gate_up_proj, GGUF attn_qkv / ffn_up, in the shared name tables), `longrope` ("su")
RoPE scaling (short factors, and long ones once the context window exceeds the original context),
partial rotary (Phi-4-mini), and a sliding window where config.json sets one.

longrope and partial_rotary_factor are read by the shared reading (transformers' rope utilities
accept them for any family; llama.cpp writes rope_factors_long/short.weight), so what is Phi-3's own
here is its names, its window default and its unpermuted q/k rows in GGUF.
"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily

# MLC's Phi-3 names (its converter keeps the msft layout's transformer.h.* prefix)
MLC_PHI3_TO_OURS = {
    "transformer.embd": "embed", "transformer.norm": "norm", "lm_head": "lm_head",
    "transformer.h.{i}.ln": "layers.{i}.attn_norm",
    "transformer.h.{i}.post_attention_layernorm": "layers.{i}.ffn_norm",
    "transformer.h.{i}.mixer.qkv_proj": "layers.{i}.qkv",
    "transformer.h.{i}.mixer.out_proj": "layers.{i}.o",
    "transformer.h.{i}.mlp.gate_up_proj": "layers.{i}.gate_up",
    "transformer.h.{i}.mlp.down_proj": "layers.{i}.down",
    # Phi-3.5-vision (phi3_v): MLC's Phi3VForCausalLM names its Phi3Model `model` (the image side's
    # vision_embed_tokens.* is read by vision/phi3v_gpu.py)
    "model.embd": "embed", "model.norm": "norm",
    "model.h.{i}.ln": "layers.{i}.attn_norm",
    "model.h.{i}.post_attention_layernorm": "layers.{i}.ffn_norm",
    "model.h.{i}.mixer.qkv_proj": "layers.{i}.qkv",
    "model.h.{i}.mixer.out_proj": "layers.{i}.o",
    "model.h.{i}.mlp.gate_up_proj": "layers.{i}.gate_up",
    "model.h.{i}.mlp.down_proj": "layers.{i}.down",
}

PHI3 = DecoderFamily("phi3", hf_architectures=("Phi3ForCausalLM",), hf_model_types=("phi3",),
                     hf_defaults={"use_sliding_window": True}, gguf_neox=True,
                     mlc_model_types=("phi3", "phi3_v"), mlc_names=MLC_PHI3_TO_OURS)

FAMILIES = (PHI3,)
