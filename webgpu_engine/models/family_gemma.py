"""Gemma 1, 2 and 3 (text). Every Gemma: GeGLU (tanh GELU), RMSNorm with (1 + w), embeddings times
sqrt(C), an explicit head_dim, the LM head tied by default; Gemma 1 is that and a Llama layer. Gemma 2
and 3 add norms after attention and after the FFN, `query_pre_attn_scalar`, sliding windows on some
layers (Gemma 2: every other one from the first; Gemma 3: all but every sixth, with their own RoPE
base) wherever config.json sets one, soft-capped scores and logits (Gemma 2) and per-head q/k norms
(Gemma 3).

HF Gemma 1 checkpoints name their tensors as Llama's; Gemma 2 / 3 name the norms differently
(post_attention_layernorm is the norm of the attention *output*), hence their own name table.
llama.cpp's converter stores q/k rows unpermuted and adds the 1 to the norm weights itself
(norm_plus_one stays False for GGUF).

Their math beyond the shared layer, as ops at models/decoder.py's points:

    x = embed(ids) * sqrt(C)                         # "embed": before image rows take their features
    logits = cap * tanh(logits / cap)                # "logits": Gemma 2 (final_logit_softcapping)
"""
from __future__ import annotations

from ..errors import UnsupportedModelError
from ..kernels import nn
from ..loaders.decoder_config import HF_ACTIVATIONS, DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS
from ..loaders.mlc import MLC_LLAMA_TO_OURS

# Gemma 2 / 3 HF names -> ours: the FFN has pre and post norms, the attention a post norm
HF_GEMMA_TO_OURS = {**{k: v for k, v in HF_LLAMA_TO_OURS.items() if v != "layers.{i}.ffn_norm"},
                    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm",
                    "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.ffn_norm",
                    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_ffn_norm"}

# MLC's Gemma 2 / 3 names: the same norms (1 + w stored), Gemma 3's per-head q / k norms
MLC_GEMMA_TO_OURS = {**{k: v for k, v in MLC_LLAMA_TO_OURS.items() if v != "layers.{i}.ffn_norm"},
                     **{k.removesuffix(".weight"): v for k, v in HF_GEMMA_TO_OURS.items()
                        if v.endswith(("post_attn_norm", "ffn_norm"))},
                     "model.layers.{i}.self_attn.q_norm": "layers.{i}.q_norm",
                     "model.layers.{i}.self_attn.k_norm": "layers.{i}.k_norm"}


def _every_gemma(fields: dict, act: str = "gelu_tanh") -> dict:
    """GeGLU and embeddings times sqrt(C) (scores scaled by head_dim^-0.5 unless a reader says)."""
    return {**fields, "act": act, "embed_scale": float(fields["hidden_size"]) ** 0.5}


def _activation(name: str | None, where: str) -> str:
    name = name or "gelu_pytorch_tanh"
    if name not in HF_ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: activation {name!r} is not implemented; supported: "
                                    f"{sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]


def _gguf_gemma(g, fields: dict) -> dict:
    """Gemma 1 as llama.cpp reads it (the norms hold 1 + w already)."""
    return _every_gemma(fields)


def _hf_gemma(c: dict, fields: dict, where: str) -> dict:
    """Gemma 1: transformers reads `hidden_act`, and its "gelu" (the value of the official releases)
    as the tanh approximation they were trained with, as MLC does; MLC's config says
    `hidden_activation`."""
    act = c.get("hidden_act") or c.get("hidden_activation")
    return {**_every_gemma(fields, _activation("gelu_pytorch_tanh" if act == "gelu" else act, where)),
            "norm_plus_one": True}


def _gguf(g, fields: dict) -> dict:
    """Gemma settings as llama.cpp reads them: the norms hold 1 + w already; sliding layers every
    other one from the first (Gemma 2) or all but every sixth (Gemma 3, local rope base 10000 unless
    the file says); scores scaled by head_dim^-0.5, except for the 27B models (46 / 62 layers), whose
    query_pre_attn_scalar is hidden / heads."""
    arch, n = g.architecture, fields["n_layers"]
    hidden, n_heads, head_dim = fields["hidden_size"], fields["n_heads"], fields["head_dim"]
    pattern = g.meta("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):           # per-layer flags, as newer converters write them
        local = tuple(bool(x) for x in pattern)
    else:
        local = tuple(i % 2 == 0 if arch == "gemma2" else (i + 1) % int(pattern) != 0 for i in range(n))
    big = n == (46 if arch == "gemma2" else 62)
    return {**_every_gemma(fields), "post_norms": True,
            "attn_scale": float(hidden // n_heads if big else head_dim) ** -0.5,
            "attn_softcap": float(g.meta("attn_logit_softcapping", 0.0) or 0.0),
            "final_softcap": float(g.meta("final_logit_softcapping", 0.0) or 0.0),
            "window_layers": local if g.meta("attention.sliding_window") else None,
            "rope_local_base": float(g.meta("rope.freq_base_swa", g.meta("rope.local.freq_base", 10000.0)))
            if arch == "gemma3" else 0.0, **(_ollama_gemma3(g) if arch == "gemma3" else {})}


def _ollama_gemma3(g) -> dict:
    """Ollama's converter writes no norm epsilon or rope base for a multimodal Gemma 3 (its gemma3
    blobs): Gemma 3's own, as Ollama's runtime defaults them (1e-6, 1e6), where the file has none."""
    return {**({"rms_eps": 1e-6} if g.meta("attention.layer_norm_rms_epsilon") is None else {}),
            **({"rope_base": 1e6} if g.meta("rope.freq_base") is None else {})}


def _hf(c: dict, fields: dict, where: str) -> dict:
    """Which layers slide: layer_types, else Gemma 2 every other layer from the first, Gemma 3 all but
    every sliding_window_pattern-th; Gemma 3's local rope base and q/k norms."""
    arch = fields["arch"]
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types:
        local = tuple(t == "sliding_attention" for t in types)
    elif arch == "gemma2":
        local = tuple(i % 2 == 0 for i in range(n))
    else:
        pattern = int(c.get("sliding_window_pattern", 6))
        local = tuple((i + 1) % pattern != 0 for i in range(n))
    scalar = c.get("query_pre_attn_scalar")
    act = _activation(c.get("hidden_activation") or c.get("hidden_act"), where)
    return {**_every_gemma(fields, act), "post_norms": True, "norm_plus_one": True, "qk_norm": arch == "gemma3",
            "attn_scale": float(scalar) ** -0.5 if scalar else 0.0,
            "attn_softcap": float(c.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(c.get("final_logit_softcapping") or 0.0),
            "window_layers": local if c.get("sliding_window") else None,
            "rope_local_base": float(c.get("rope_local_base_freq") or 0.0) if arch == "gemma3" else 0.0}


def scale_embeddings(m, i: int, x, T: int, rows) -> list:
    """x *= sqrt(C) (cfg.embed_scale): the embeddings' scale, before image rows take their
    features (the projector's, unscaled)."""
    return [nn.scale(m.dev, x, x, m.cfg.embed_scale)] if m.cfg.embed_scale != 1.0 else []


def cap_logits(m, i: int, logits, rows: int) -> list:
    """logits = cap * tanh(logits / cap) (cfg.final_softcap; none where it is 0)."""
    cap = m.cfg.final_softcap
    return [nn.softcap(m.dev, logits, logits, cap)] if cap else []


OPS = {"embed": scale_embeddings, "logits": cap_logits}
GEMMA = DecoderFamily("gemma", hf_architectures=("GemmaForCausalLM",), hf_model_types=("gemma",),
                      hf_defaults={"tie_word_embeddings": True}, gguf_neox=True, gguf=_gguf_gemma, hf=_hf_gemma,
                      mlc_model_types=("gemma",), ops=OPS)
_DEFAULTS = {"use_sliding_window": True, "tie_word_embeddings": True}
GEMMA2 = DecoderFamily("gemma2", hf_architectures=("Gemma2ForCausalLM",), hf_model_types=("gemma2",),
                       hf_defaults=_DEFAULTS, gguf_neox=True, hf_names=HF_GEMMA_TO_OURS, gguf=_gguf, hf=_hf,
                       mlc_model_types=("gemma2",), mlc_names=MLC_GEMMA_TO_OURS, ops=OPS)
# transformers' Gemma 3 default for the local layers' RoPE base (MLC's config does not always carry it)
# Gemma3ForConditionalGeneration (the multimodal releases): the text model under language_model.model.
# (the hub's files) or model.language_model. (transformers 4.5x+); its vision tower is models/siglip.py's
HF_GEMMA3_TO_OURS = {**HF_GEMMA_TO_OURS,
                     **{k.replace("model.", prefix, 1): v for k, v in HF_GEMMA_TO_OURS.items()
                        for prefix in ("language_model.model.", "model.language_model.")},
                     "language_model.lm_head.weight": "lm_head"}
GEMMA3 = DecoderFamily("gemma3", hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                       hf_model_types=("gemma3_text",),
                       hf_defaults={**_DEFAULTS, "rope_local_base_freq": 10000.0}, gguf_neox=True,
                       hf_names=HF_GEMMA3_TO_OURS, gguf=_gguf, hf=_hf,
                       mlc_model_types=("gemma3", "gemma3_text"), mlc_names=MLC_GEMMA_TO_OURS, ops=OPS)

FAMILIES = (GEMMA, GEMMA2, GEMMA3)
