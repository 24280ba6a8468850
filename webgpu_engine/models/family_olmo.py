"""OLMo 2: a Llama layer with norms after the attention and after the FFN instead of before them
(x += rms_norm(attn(x)); x += rms_norm(ffn(x))) and q / k norms over the whole projections (q_norm
(Hq D,), k_norm (Hkv D,)), before RoPE; SwiGLU, no biases.

HF names the attention output's norm post_attention_layernorm (Llama's FFN input norm), hence its own
name table. llama.cpp's converter stores the q/k rows unpermuted (rope pairs halves).
"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS
from ..loaders.mlc import MLC_LLAMA_TO_OURS

HF_OLMO2_TO_OURS = {**{k: v for k, v in HF_LLAMA_TO_OURS.items() if not v.endswith("_norm")},
                    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm",      # (Hq D,)
                    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm",      # (Hkv D,)
                    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm",
                    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_ffn_norm"}

MLC_OLMO2_TO_OURS = {**{k: v for k, v in MLC_LLAMA_TO_OURS.items() if not v.endswith("_norm")},
                     **{k.removesuffix(".weight"): v for k, v in HF_OLMO2_TO_OURS.items() if v.endswith("_norm")}}


def _post_norms(fields: dict) -> dict:
    return {**fields, "pre_norms": False, "post_norms": True, "qk_norm": True, "qk_norm_whole": True}


OLMO2 = DecoderFamily("olmo2", hf_architectures=("Olmo2ForCausalLM",), hf_model_types=("olmo2",), gguf_neox=True,
                      hf_names=HF_OLMO2_TO_OURS, mlc_model_types=("olmo2",), mlc_names=MLC_OLMO2_TO_OURS, gguf=lambda g, fields: _post_norms(fields),
                      hf=lambda c, fields, where: _post_norms(fields))

FAMILIES = (OLMO2,)
