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

PHI3 = DecoderFamily("phi3", hf_architectures=("Phi3ForCausalLM",), hf_model_types=("phi3",),
                     hf_defaults={"use_sliding_window": True}, gguf_neox=True)

FAMILIES = (PHI3,)
