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

That math beyond Gemma 3's layer runs as ops at models/decoder.py's points: "embed" (x *= sqrt(C)),
"inputs" (e, from x as the first layer reads it: after image rows, as transformers projects them),
"layer_end" (x += the layer's per-layer input; x *= its scalar) and "logits" (the soft-cap).

The KV-sharing layers' files hold no k / v projections; the model gives them their source layer's
(computed, never stored: the fused q|k|v layout stays one). MoE (`enable_moe_block`), `attention_k_eq_v`
(the larger Gemma 4 models) and bidirectional attention are refused by name. A released folder
(Gemma4ForConditionalGeneration: the text model's config in `text_config`, its weights under
`model.language_model.`) loads its text model; its vision and audio towers are not read.
"""
from __future__ import annotations

import struct

from ..errors import ModelFormatError, UnsupportedModelError
from ..kernels import matmul as mm
from ..kernels import nn
from ..loaders.decoder_config import DecoderFamily
from .family_gemma import HF_GEMMA_TO_OURS, _activation, cap_logits, scale_embeddings

# Gemma 4's tensors beyond Gemma 3's: ours -> (HF name less `model.`, llama.cpp's GGUF name)
GEMMA4_NAMES = {
    "ple_embed": ("embed_tokens_per_layer.weight", "per_layer_token_embd.weight"),                  # (V, L P)
    "ple_model_proj": ("per_layer_model_projection.weight", "per_layer_model_proj.weight"),         # (L P, C)
    "ple_norm": ("per_layer_projection_norm.weight", "per_layer_proj_norm.weight"),                 # (P,)
    "layers.{i}.ple_gate": ("layers.{i}.per_layer_input_gate.weight", "blk.{i}.inp_gate.weight"),    # (P, C)
    "layers.{i}.ple_proj": ("layers.{i}.per_layer_projection.weight", "blk.{i}.proj.weight"),        # (C, P)
    "layers.{i}.ple_norm": ("layers.{i}.post_per_layer_input_norm.weight", "blk.{i}.post_norm.weight"),  # (C,)
    "layers.{i}.scalar": ("layers.{i}.layer_scalar", "blk.{i}.layer_output_scale.weight"),          # (1,)
}
HF_GEMMA4_TO_OURS = {**HF_GEMMA_TO_OURS, **{"model." + hf: ours for ours, (hf, _) in GEMMA4_NAMES.items()}}
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
    return _gemma4(fields, act=_activation(c.get("hidden_activation") or c.get("hidden_act"), where), local=local,
                   window=int(c.get("sliding_window") or 0), softcap=float(c.get("final_logit_softcapping") or 0.0),
                   rope_base=float(full.get("rope_theta", 1e6)), local_base=float(slide.get("rope_theta", 10000.0)),
                   pairs=int(proportion * wide // 2), head_dims=tuple(head if x else wide for x in local),
                   ffn_sizes=tuple(2 * ffn if double and src[i] != i else ffn for i in range(n)),
                   sources=src if shared else None, ple=int(c.get("hidden_size_per_layer_input") or 0))


def _gemma4(fields: dict, *, act: str, local: tuple, window: int, softcap: float, rope_base: float,
            local_base: float, pairs: int, head_dims: tuple, ffn_sizes: tuple, sources, ple: int) -> dict:
    """The LlamaConfig fields of a Gemma 4, however its file spells them."""
    return {**fields, "act": act, "embed_scale": float(fields["hidden_size"]) ** 0.5, "post_norms": True,
            "qk_norm": True, "v_norm": True, "attn_scale": 1.0, "final_softcap": softcap,
            "window_layers": local if window else None, "sliding_window": window or None,
            "rope_base": rope_base, "rope_local_base": local_base,
            "rot_dim": 0, "rope_freq_factors": None, "rope_scaling": "proportional", "rope_pairs": pairs,
            "layer_head_dims": head_dims, "layer_ffn_sizes": ffn_sizes, "kv_sources": sources, "ple_dim": ple}


# llama.cpp's gemma4 tensors beyond Gemma 3's (loaders/gguf.py's table has those)
GGUF_GEMMA4_TO_OURS = {gguf: ours for ours, (_, gguf) in GEMMA4_NAMES.items()}


def _gguf(g, fields: dict) -> dict:
    """Gemma 4 as llama.cpp's converter writes it (arch gemma4): per-layer sliding flags
    (attention.sliding_window_pattern), head sizes (key_length for full-attention layers, key_length_swa
    for sliding ones), FFN widths (a per-layer feed_forward_length), attention.shared_kv_layers,
    embedding_length_per_layer_input, the sliding layers' RoPE base (rope.freq_base_swa); the norms
    hold w (its norm_shift is 0). Proportional RoPE is `rope_freqs.weight`: a factor of 1 for each
    pair that rotates, 1e30 (frozen) for the others, the full layers' only."""
    if g.meta("expert_count", 0):
        raise UnsupportedModelError(f"{g.where}: Gemma 4 with expert_count (mixture-of-experts layers) is not "
                                    f"implemented; gemma-4-E2B's text model runs")
    n = fields["n_layers"]
    pattern = g.meta("attention.sliding_window_pattern", required=True)
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ModelFormatError(f"{g.where}: attention.sliding_window_pattern must list {n} flags, got {pattern!r}"[:300])
    local = tuple(bool(x) for x in pattern)
    wide = int(g.meta("attention.key_length", required=True))
    head = int(g.meta("attention.key_length_swa", wide))
    ffn = g.meta("feed_forward_length", required=True)
    ffn = tuple(int(x) for x in ffn) if isinstance(ffn, list) else (int(ffn),) * n
    factors = g.tensors.get("rope_freqs.weight")
    pairs = sum(1 for f in struct.unpack(f"<{factors.numel}f", bytes(factors.data)) if f < 1e29) \
        if factors is not None and factors.qtype == "f32" else wide // 2
    shared = int(g.meta("attention.shared_kv_layers", 0) or 0)
    types = ["sliding_attention" if x else "full_attention" for x in local]
    fields = {**fields, "head_dim": head, "ffn_size": ffn[0], "norm_plus_one": False}
    return _gemma4(fields, act="gelu_tanh", local=local, window=int(g.meta("attention.sliding_window", 0) or 0),
                   softcap=float(g.meta("final_logit_softcapping", 0.0) or 0.0),
                   rope_base=float(g.meta("rope.freq_base", 1e6)), local_base=float(g.meta("rope.freq_base_swa", 1e4)),
                   pairs=pairs, head_dims=tuple(head if x else wide for x in local), ffn_sizes=ffn,
                   sources=kv_sources(types, shared) if shared else None,
                   ple=int(g.meta("embedding_length_per_layer_input", 0) or 0))


def _per_layer_inputs(m, i: int, x, T: int, rows) -> list:
    """e = (rms_norm(x · Wpᵀ / sqrt(C)) + E[ids] * sqrt(P)) / sqrt(2), (T, L P): every layer's P
    per-layer input values, from the scaled embeddings x, their projection Wp (L P, C) normed per layer
    and token, and the per-layer table E (V, L P)."""
    c, dev, P = m.cfg, m.dev, m.cfg.ple_dim
    if not P:
        return []
    e, proj = m.ple.view((T, c.n_layers * P)), m.ple_tmp.view((T, c.n_layers * P))
    per_layer = proj.view((T * c.n_layers, P))
    return [mm.embedding(dev, rows.kv.ids.view((T,)), m.ple_embed, e), nn.scale(dev, e, e, P ** 0.5),
            mm.matmul(dev, x, m.ple_model_proj, proj, **rows.flags), nn.scale(dev, proj, proj, c.hidden_size ** -0.5),
            nn.rms_norm(dev, per_layer, m.ple_norm, per_layer, eps=c.rms_eps),
            nn.add(dev, proj, e, e), nn.scale(dev, e, e, 0.5 ** 0.5)]


def _layer_end(m, i: int, x, T: int, rows) -> list:
    """x += rms_norm((gelu_tanh(x · Wgᵀ) * e[:, i]) · Wpᵀ), layer i's per-layer input (h: the
    layer's scratch row), then x *= the layer's scalar."""
    c, dev, P, L = m.cfg, m.dev, m.cfg.ple_dim, m.layers[i]
    ops = []
    if L.ple_gate is not None:
        g, h = m.ple_act.view((T, P)), m.h.view((T, c.hidden_size))
        ops += [mm.matmul(dev, x, L.ple_gate, g, **rows.flags),
                nn.gelu_tanh_gate(dev, g, m.ple.view((T, c.n_layers * P)), g, col=i * P),
                mm.matmul(dev, g, L.ple_proj, h, **rows.flags), nn.rms_norm(dev, h, L.ple_norm, h, eps=c.rms_eps),
                nn.add(dev, x, h, x)]
    if L.scale != 1.0:
        ops.append(nn.scale(dev, x, x, L.scale))
    return ops


GEMMA4 = DecoderFamily("gemma4", hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
                       hf_model_types=("gemma4_text", "gemma4"),
                       hf_defaults={"tie_word_embeddings": True}, gguf_neox=True, hf_names=HF_GEMMA4_TO_OURS,
                       hf=_hf, gguf=_gguf, gguf_names=GGUF_GEMMA4_TO_OURS,
                       mlc_model_types=("gemma4",), mlc_names=MLC_GEMMA4_TO_OURS,
                       ops={"embed": scale_embeddings, "inputs": _per_layer_inputs, "layer_end": _layer_end,
                            "logits": cap_logits})

FAMILIES = (GEMMA4,)
