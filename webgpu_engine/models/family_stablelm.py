"""StableLM 2 (stablelm-2-1_6b, its zephyr chat model): a Llama layer with LayerNorms (weight and bias)
before the attention, before the FFN and at the end, q/k/v biases (`use_qkv_bias`) and partial
rotary (`partial_rotary_factor`, 0.25 by default as StableLmConfig says); SwiGLU, no o bias.

Refused by name: `qk_layernorm` (per-head LayerNorms of q and k) and `use_parallel_residual` (the
attention and the FFN off one norm), which only the 12B models use; in a GGUF they show as
attn_q_norm tensors and as layers without ffn_norm (how llama.cpp's graph tells them apart).
llama.cpp's converter stores the q/k rows unpermuted (rope pairs halves).
"""
from __future__ import annotations

from ..errors import UnsupportedModelError
from ..loaders.decoder_config import HF_ACTIVATIONS, DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS

HF_STABLELM_TO_OURS = {**HF_LLAMA_TO_OURS,
                       "model.norm.bias": "norm_bias",
                       "model.layers.{i}.input_layernorm.bias": "layers.{i}.attn_norm_bias",
                       "model.layers.{i}.post_attention_layernorm.bias": "layers.{i}.ffn_norm_bias"}


def _layer_norms(fields: dict, eps: float, where: str, qk_norm: bool, parallel: bool) -> dict:
    for on, what in ((qk_norm, "qk_layernorm (per-head q/k LayerNorms)"),
                     (parallel, "use_parallel_residual (attention and FFN off one norm)")):
        if on:
            raise UnsupportedModelError(f"{where}: StableLM's {what} is not implemented (the 12B models)")
    return {**fields, "norm": "layer", "rms_eps": float(eps), "qk_norm": False}


def _gguf(g, fields: dict) -> dict:
    return _layer_norms(fields, g.meta("attention.layer_norm_epsilon", 1e-5), g.where,
                        "blk.0.attn_q_norm.weight" in g.tensors, "blk.0.ffn_norm.weight" not in g.tensors)


def _hf(c: dict, fields: dict, where: str) -> dict:
    act = c.get("hidden_act", "silu")
    if HF_ACTIVATIONS.get(act) != "silu":
        raise UnsupportedModelError(f"{where}: StableLM with hidden_act {act!r} is not implemented (silu)")
    return {**_layer_norms(fields, c.get("layer_norm_eps", 1e-5), where, bool(c.get("qk_layernorm")),
                           bool(c.get("use_parallel_residual"))),
            "qkv_bias": bool(c.get("use_qkv_bias", False))}


STABLELM = DecoderFamily("stablelm", hf_architectures=("StableLmForCausalLM",), hf_model_types=("stablelm",), mlc_model_types=("stablelm",),
                         hf_defaults={"partial_rotary_factor": 0.25}, gguf_neox=True,
                         hf_names=HF_STABLELM_TO_OURS, gguf=_gguf, hf=_hf)

FAMILIES = (STABLELM,)
