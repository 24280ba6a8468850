"""Qwen 2 / 2.5 (Llama + q/k/v biases) and Qwen 3 dense (Llama + per-head RMSNorm of q and k before
RoPE, no biases, explicit head_dim).

llama.cpp's converter stores both families' q/k rows unpermuted (rope pairs halves). In a GGUF the
biases and q/k norms are found by their tensors; in config.json Qwen2's attention_bias defaults to
true and Qwen3 always has the norms. Both slide only where config.json sets use_sliding_window.
"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily
from ..loaders.mlc import MLC_LLAMA_TO_OURS

# MLC's Qwen names: q|k|v as `c_attn` (with its bias), Qwen 3's per-head q / k norms
MLC_QWEN_TO_OURS = {**{k: v for k, v in MLC_LLAMA_TO_OURS.items() if "qkv_proj" not in k},
                    "model.layers.{i}.self_attn.c_attn": "layers.{i}.qkv",
                    "model.layers.{i}.self_attn.q_norm": "layers.{i}.q_norm",
                    "model.layers.{i}.self_attn.k_norm": "layers.{i}.k_norm"}


def _qwen3_hf(c: dict, fields: dict, where: str) -> dict:
    return {**fields, "qk_norm": True}


QWEN2 = DecoderFamily("qwen2", hf_architectures=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
                      hf_defaults={"attention_bias": True}, gguf_neox=True,
                      mlc_model_types=("qwen2",), mlc_names=MLC_QWEN_TO_OURS)
QWEN3 = DecoderFamily("qwen3", hf_architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
                      gguf_neox=True, hf=_qwen3_hf,
                      mlc_model_types=("qwen3",), mlc_names=MLC_QWEN_TO_OURS)

FAMILIES = (QWEN2, QWEN3)
