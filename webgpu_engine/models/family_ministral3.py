"""Ministral 3 (Ministral-3-3B / 8B / 14B, and the text model of Mistral3ForConditionalGeneration):
Mistral's layer with YaRN RoPE and, past the original context, Llama 4's attention temperature on the
queries, as transformers' Ministral3Attention computes it:

    q, k = yarn_rope(q, k)                                  # rope_parameters: rope_type "yarn"
    q *= 1 + beta * ln(1 + floor(pos / original))           # llama_4_scaling_beta,
                                                            # original_max_position_embeddings
    a = softmax(q · kᵀ / sqrt(D)) · v

The temperature is an op at the qkv point with the rows' positions ("qkv_rows": kernels/rope.py
q_temperature; it scales q before RoPE, which is linear, so the product is the same). Its HF folders:
`Ministral3ForCausalLM` (model_type `ministral3`, Llama's names) and the released
`Mistral3ForConditionalGeneration` (model_type `mistral3`: the text model's keys in `text_config`,
its weights under `model.language_model.`, or `language_model.model.` as transformers 4 saved them;
the Pixtral vision tower and the projector are not read). llama.cpp's converter writes
general.architecture `mistral3` with adjacent-pair q / k rows, `rope.scaling.yarn_log_multiplier`
(mscale_all_dim) and `attention.temperature_scale` (beta; the length is
`rope.scaling.original_context_length`, as llama.cpp reads it).

MLC's artifacts (model_type `ministral3`, mlc-llm's Ministral3Config) run other math, and they are
run as MLC runs them: no query temperature, and every score scaled by (0.1 ln(factor) mscale_all_dim
+ 1)^2 / sqrt(D) (mlc-llm's Ministral3Attention softmax_scale); the YaRN frequencies are
transformers' (see docs/MODELS.md for how TVM's differ).
"""
from __future__ import annotations

import math

from ..errors import ModelFormatError
from ..kernels.rope import q_temperature
from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS


def _nested(prefix: str, head: str) -> dict:
    """Llama's names with model. as `prefix` and the LM head's as `head`."""
    return {**{k.replace("model.", prefix, 1): v for k, v in HF_LLAMA_TO_OURS.items() if k.startswith("model.")},
            head: "lm_head"}


# Ministral3ForCausalLM's names are Llama's; the released multimodal folder nests them (transformers 5,
# and transformers 4 as older folders were saved)
HF_MINISTRAL3_TO_OURS = {**HF_LLAMA_TO_OURS, **_nested("model.language_model.", "lm_head.weight"),
                         **_nested("language_model.model.", "language_model.lm_head.weight")}


def _mscale(factor: float, m: float) -> float:
    """YaRN's get_mscale (transformers' yarn_get_mscale, mlc-llm's yarn_get_sm_scale)."""
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def _ministral3_hf(c: dict, fields: dict, where: str) -> dict:
    """The query temperature of rope_parameters (c's rope_scaling once read); MLC's softmax scale
    where its hook put one (_ministral3_mlc)."""
    rs = c.get("rope_scaling") or {}
    extra = dict(fields.get("extra") or {})
    beta = rs.get("llama_4_scaling_beta")
    if beta:
        length = rs.get("original_max_position_embeddings")
        if not length or int(length) <= 0:
            raise ModelFormatError(f"{where}: llama_4_scaling_beta needs original_max_position_embeddings")
        extra["q_temperature"] = (float(beta), int(length))
    out = {**fields, "extra": extra}
    if c.get("mlc_softmax_factor"):
        out["attn_scale"] = fields["head_dim"] ** -0.5 * float(c["mlc_softmax_factor"])
    return out


def _ministral3_mlc(c: dict) -> dict:
    """mlc-llm's Ministral 3: its YaRN rotates without scaling cos / sin (TVM's rope_freq_yarn) and
    its attention scales the scores by get_mscale(factor, mscale_all_dim)^2; no query temperature."""
    rp = dict(c.get("rope_parameters") or {})
    rp.pop("llama_4_scaling_beta", None)
    if rp.get("rope_type", rp.get("type")) == "yarn":
        rp["rope_type"], rp["attention_factor"] = "yarn", 1.0
    out = {**c, "rope_parameters": rp}
    if rp.get("mscale_all_dim") and rp.get("factor"):
        out["mlc_softmax_factor"] = _mscale(float(rp["factor"]), float(rp["mscale_all_dim"])) ** 2
    return out


def _ministral3_gguf(g, fields: dict) -> dict:
    """llama.cpp's mistral3: the YaRN attention factor get_mscale(f, 1) / get_mscale(f, log_mul) (its
    llama_context), and the temperature from attention.temperature_scale."""
    extra = dict(fields.get("extra") or {})
    log_mul = g.meta("rope.scaling.yarn_log_multiplier")
    factor = float(g.meta("rope.scaling.factor", 1.0) or 1.0)
    if fields.get("rope_scaling") == "yarn" and log_mul:
        fields = {**fields, "rope_attn_factor": _mscale(factor, 1.0) / _mscale(factor, float(log_mul))}
    beta = g.meta("attention.temperature_scale")
    if beta:
        length = int(g.meta("rope.scaling.original_context_length", 0) or 0)
        if length <= 0:
            raise ModelFormatError(f"{g.where}: attention.temperature_scale needs "
                                   f"rope.scaling.original_context_length")
        extra["q_temperature"] = (float(beta), length)
    return {**fields, "extra": extra}


def _temperature(m, i: int, qkv, T: int, where: tuple) -> list:
    """q *= 1 + beta ln(1 + floor(pos / length)) for each row's position (none where the model has no
    temperature: MLC's artifacts)."""
    temp = m.cfg.extra.get("q_temperature")
    if not temp:
        return []
    step, positions = where
    return [q_temperature(m.dev, qkv, step, n_q_heads=m.cfg.n_heads, head_dim=m.cfg.head_dim_of(i),
                          beta=temp[0], length=temp[1], positions=positions)]


MINISTRAL3 = DecoderFamily("mistral3", hf_architectures=("Ministral3ForCausalLM", "Mistral3ForConditionalGeneration"),
                           hf_model_types=("ministral3", "mistral3"), mlc_model_types=("ministral3",),
                           hf_defaults={"use_sliding_window": True}, hf_names=HF_MINISTRAL3_TO_OURS,
                           hf=_ministral3_hf, gguf=_ministral3_gguf, mlc=_ministral3_mlc,
                           ops={"qkv_rows": _temperature})

FAMILIES = (MINISTRAL3,)

__all__ = ["FAMILIES", "HF_MINISTRAL3_TO_OURS", "MINISTRAL3"]
