"""Qwen 2 / 2.5 (Llama + q/k/v biases) and Qwen 3 dense (Llama + per-head RMSNorm of q and k before
RoPE, no biases, explicit head_dim).

llama.cpp's converter stores both families' q/k rows unpermuted (rope pairs halves). In a GGUF the
biases and q/k norms are found by their tensors; in config.json Qwen2's attention_bias defaults to
true and Qwen3 always has the norms. Both slide only where config.json sets use_sliding_window.
"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily


def _qwen3_hf(c: dict, fields: dict, where: str) -> dict:
    return {**fields, "qk_norm": True}


QWEN2 = DecoderFamily("qwen2", hf_architectures=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
                      hf_defaults={"attention_bias": True}, gguf_neox=True)
QWEN3 = DecoderFamily("qwen3", hf_architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
                      gguf_neox=True, hf=_qwen3_hf)

FAMILIES = (QWEN2, QWEN3)
