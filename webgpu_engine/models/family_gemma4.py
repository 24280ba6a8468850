"""Gemma 4 (text; gemma-4-E2B-it's decoder): Gemma 3's layer (GeGLU, sqrt(C) embeddings, norms after
the attention and the FFN, per-head q / k norms, sliding layers with their own RoPE base, tied head)
with plain RMSNorm weights (x * w, not 1 + w), unscaled scores (the q / k norms set their size) and
soft-capped logits, plus:

- full-attention layers with wider heads (`global_head_dim`) and proportional RoPE: of a head's D/2
  neox pairs only the first partial_rotary_factor * D/2 rotate, at base^(-2j/D) (LlamaConfig.rope_pairs);
- each v head RMS-normalised without a weight (LlamaConfig.v_norm);
- the last `num_kv_shared_layers` layers compute no K / V: each attends the cache of the last earlier
  layer of its kind (LlamaConfig.kv_sources), with an FFN twice as wide (`use_double_wide_mlp`);
- per-layer inputs (LlamaConfig.ple_dim = P): e = (rms_norm(x0 · Wpᵀ / sqrt(C)) + E[ids] * sqrt(P)) /
  sqrt(2), (T, L, P), from the embeddings x0 and a second table E (V, L P); at the end of layer i,
  x += rms_norm(((gelu_tanh(x · Wgᵀ) * e[:, i]) · Wprojᵀ)), then x *= the layer's scalar.

The KV-sharing layers' files hold no k / v projections; the model gives them their source layer's
(computed, never stored: the fused q|k|v layout stays one). MoE (`enable_moe_block`), `attention_k_eq_v`
(the larger Gemma 4 models) and bidirectional attention are refused by name. A released folder
(Gemma4ForConditionalGeneration: the text model's config in `text_config`, its weights under
`model.language_model.`) loads its text model; its vision and audio towers are not read.
"""
from __future__ import annotations

from ..errors import UnsupportedModelError
from ..loaders.decoder_config import DecoderFamily
from .family_gemma import HF_GEMMA_TO_OURS, _activation

HF_GEMMA4_TO_OURS = {
    **HF_GEMMA_TO_OURS,
    "model.embed_tokens_per_layer.weight": "ple_embed",                         # (V, L P)
    "model.per_layer_model_projection.weight": "ple_model_proj",                # (L P, C)
    "model.per_layer_projection_norm.weight": "ple_norm",                       # (P,)
    "model.layers.{i}.per_layer_input_gate.weight": "layers.{i}.ple_gate",      # (P, C)
    "model.layers.{i}.per_layer_projection.weight": "layers.{i}.ple_proj",      # (C, P)
    "model.layers.{i}.post_per_layer_input_norm.weight": "layers.{i}.ple_norm",  # (C,)
    "model.layers.{i}.layer_scalar": "layers.{i}.scalar",                       # (1,)
}
# gemma-4-E2B-it as released (Gemma4ForConditionalGeneration): the same under model.language_model.,
# beside the vision and audio towers (not read)
HF_GEMMA4_TO_OURS.update({k.replace("model.", "model.language_model.", 1): v
                          for k, v in HF_GEMMA4_TO_OURS.items() if k.startswith("model.")})

# MLC-LLM's gemma4 artifacts (WebLLM's gemma-4-E2B-it-q4f16_1 / q4f32_1): the text model under
# language_model. (loaders/mlc.py drops the prefix) without HF's model.; q, k, v apart and gate|up
# fused; plain norm weights; the per-layer table as one (V, P) embedding per layer, joined into ours;
# layer_scalar without a suffix; v_norm has no weight (nor in HF); the audio tower is not read
MLC_GEMMA4_TO_OURS = {
    "embed_tokens": "embed", "norm": "norm",
    "embed_tokens_per_layer.{i}": "ple_embed[:, {i}]",                            # (V, P) each
    "per_layer_model_projection": "ple_model_proj", "per_layer_projection_norm": "ple_norm",
    **{f"layers.{{i}}.{mlc}": f"layers.{{i}}.{ours}" for mlc, ours in (
        ("input_layernorm", "attn_norm"), ("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"),
        ("self_attn.v_proj", "v"), ("self_attn.q_norm", "q_norm"), ("self_attn.k_norm", "k_norm"),
        ("self_attn.o_proj", "o"), ("post_attention_layernorm", "post_attn_norm"),
        ("pre_feedforward_layernorm", "ffn_norm"), ("mlp.gate_up_proj", "gate_up"), ("mlp.down_proj", "down"),
        ("post_feedforward_layernorm", "post_ffn_norm"), ("per_layer_input_gate", "ple_gate"),
        ("per_layer_projection", "ple_proj"), ("post_per_layer_input_norm", "ple_norm"),
        ("layer_scalar", "scalar"))},
}


def kv_sources(types: list[str], n_shared: int) -> tuple:
    """Each layer's cache source: itself, or for the last n_shared layers the last earlier layer of
    its kind (transformers' Gemma4TextConfig.kv_sharing_modes)."""
    first = len(types) - n_shared
    out = []
    for i, t in enumerate(types):
        if i < first:
            out.append(i)
            continue
        src = [j for j in range(first) if types[j] == t]
        if not src:
            raise UnsupportedModelError(f"Gemma 4 layer {i} ({t}) shares the cache of no earlier {t} layer")
        out.append(src[-1])
    return tuple(out)


def _hf(c: dict, fields: dict, where: str) -> dict:
    # ("vision": only image tokens attend both ways; text runs causal, as here)
    for key, what in (("enable_moe_block", "mixture-of-experts layers"), ("attention_k_eq_v", "keys as values"),
                      ("use_bidirectional_attention", "bidirectional attention")):
        if c.get(key) and not (key == "use_bidirectional_attention" and c[key] == "vision"):
            raise UnsupportedModelError(f"{where}: Gemma 4 with {key} ({what}) is not implemented; "
                                        f"gemma-4-E2B's text model runs")
    n = int(c["num_hidden_layers"])
    types = list(c.get("layer_types") or ["sliding_attention" if (i + 1) % 5 else "full_attention"
                                          for i in range(n)])
    types[-1] = "full_attention"             # transformers forces it too
    local = tuple(t == "sliding_attention" for t in types)
    head, wide = fields["head_dim"], int(c.get("global_head_dim") or 512)
    rp = c.get("rope_parameters") or {}
    full, slide = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    if full.get("rope_type", "proportional") not in ("proportional", "default"):
        raise UnsupportedModelError(f"{where}: Gemma 4 full-attention rope_type {full['rope_type']!r}")
    proportion = float(full.get("partial_rotary_factor", 0.25 if "rope_type" not in full else 1.0))
    shared = int(c.get("num_kv_shared_layers") or 0)
    src = kv_sources(types, shared)
    ffn = fields["ffn_size"]
    double = bool(c.get("use_double_wide_mlp"))
    return {**fields, "act": _activation(c.get("hidden_activation") or c.get("hidden_act"), where),
            "embed_scale": float(fields["hidden_size"]) ** 0.5, "post_norms": True, "qk_norm": True,
            "v_norm": True, "attn_scale": 1.0, "final_softcap": float(c.get("final_logit_softcapping") or 0.0),
            "window_layers": local if c.get("sliding_window") else None,
            "sliding_window": int(c["sliding_window"]) if c.get("sliding_window") else None,
            "rope_base": float(full.get("rope_theta", 1e6)),
            "rope_local_base": float(slide.get("rope_theta", 10000.0)),
            "rot_dim": 0, "rope_freq_factors": None, "rope_scaling": "proportional",
            "rope_pairs": int(proportion * wide // 2),
            "layer_head_dims": tuple(head if x else wide for x in local),
            "layer_ffn_sizes": tuple(2 * ffn if double and src[i] != i else ffn for i in range(n)),
            "kv_sources": src if shared else None,
            "ple_dim": int(c.get("hidden_size_per_layer_input") or 0)}


GEMMA4 = DecoderFamily("gemma4", hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
                       hf_model_types=("gemma4_text", "gemma4"),
                       hf_defaults={"tie_word_embeddings": True}, gguf_neox=True, hf_names=HF_GEMMA4_TO_OURS,
                       hf=_hf, mlc_model_types=("gemma4",), mlc_names=MLC_GEMMA4_TO_OURS)

FAMILIES = (GEMMA4,)
