"""A tiny random Gemma 4 text model (transformers' Gemma4ForCausalLM, `gemma4_text`) with every part
gemma-4-E2B-it's text config turns on, at sizes a test runs in seconds:

- layers of two kinds: sliding (head_dim 16, RoPE base 10000 over the whole head, a window of 48
  keys) and full attention (global_head_dim 32, proportional RoPE: base 1e6, only the first quarter
  of the head's neox pairs rotate, at base^(-2j/32));
- the last `num_kv_shared_layers` layers compute no K / V: each attends the cache of the last
  earlier layer of its kind; their FFN is twice as wide (use_double_wide_mlp);
- q / k RMSNorms per head (weights w, not 1 + w), v RMS-normalised without a weight, scores not
  scaled (1.0);
- per-layer input embeddings: a (V, L * P) table and a projection of the scaled embeddings, each
  layer's P values gating a GELU of its own projection of x, added back through a post norm;
- a per-layer scalar multiplying x at the end of the layer; logits soft-capped at 30.

Deterministic for a seed; names are transformers'. Used by tests/test_gemma4.py and
tests/fixtures/make_gemma4.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import tinymodels as tm
from tinyfamilies import _write_hf, write_released_hf
from webgpu_engine.models.family_gemma4 import kv_sources

DIMS = dict(vocab_size=300, hidden_size=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_size=96, head_dim=16,
            context_length=512, rope_base=1e6, rms_eps=1e-6, tie_embeddings=True)
GLOBAL_HEAD_DIM, PLE_DIM, KV_SHARED, WINDOW = 32, 8, 2, 48
# layers 4 (sliding) and 5 (full) share the caches of layers 3 and 2
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention"]


def gemma4_weights(seed: int = 0, **dims) -> tuple[dict, list, list, dict]:
    """(dims, tokens, merges, {HF name: array}) of the tiny model."""
    d = tm._dims(**{**DIMS, **dims})
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = V = len(tokens)
    rng = np.random.default_rng(seed)
    C, F, L, P, H, Hkv = d["hidden_size"], d["ffn_size"], d["n_layers"], PLE_DIM, d["n_heads"], d["n_kv_heads"]

    def mat(n, k):                      # std 1/sqrt(k): activations stay O(1) through the layers
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n, center=1.0, spread=0.2):
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    src = kv_sources(LAYER_TYPES, KV_SHARED)
    w = {"model.embed_tokens.weight": (rng.standard_normal((V, C)) / np.sqrt(C)).astype(np.float32),
         "model.embed_tokens_per_layer.weight": (rng.standard_normal((V, L * P)) / np.sqrt(P)).astype(np.float32),
         "model.per_layer_model_projection.weight": mat(L * P, C),
         "model.per_layer_projection_norm.weight": vec(P),
         "model.norm.weight": vec(C)}
    for i, kind in enumerate(LAYER_TYPES):
        p, D = f"model.layers.{i}.", GLOBAL_HEAD_DIM if kind == "full_attention" else d["head_dim"]
        Fi = 2 * F if src[i] != i else F
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_per_layer_input_norm"):
            w[p + n + ".weight"] = vec(C)
        w[p + "self_attn.q_proj.weight"] = mat(H * D, C)
        w[p + "self_attn.q_norm.weight"] = vec(D)
        if src[i] == i:
            w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"] = mat(Hkv * D, C), mat(Hkv * D, C)
            w[p + "self_attn.k_norm.weight"] = vec(D)
        w[p + "self_attn.o_proj.weight"] = mat(C, H * D)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = mat(Fi, C), mat(Fi, C)
        w[p + "mlp.down_proj.weight"] = mat(C, Fi)
        w[p + "per_layer_input_gate.weight"], w[p + "per_layer_projection.weight"] = mat(P, C), mat(C, P)
        w[p + "layer_scalar"] = np.array([0.6 + 0.15 * i], np.float32)
    return d, tokens, merges, w


def gemma4_config(d: dict) -> dict:
    return {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "head_dim": d["head_dim"],
            "global_head_dim": GLOBAL_HEAD_DIM, "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": WINDOW, "layer_types": LAYER_TYPES, "final_logit_softcapping": 30.0,
            "hidden_size_per_layer_input": PLE_DIM, "vocab_size_per_layer_input": d["vocab_size"],
            "num_kv_shared_layers": KV_SHARED, "use_double_wide_mlp": True, "attention_k_eq_v": False,
            "enable_moe_block": False, "attention_bias": False,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1e6}}}


def write_tiny_gemma4_safetensors(folder, seed: int = 0, released: bool = False, **dims) -> dict:
    """The HF folder (config.json, model.safetensors, tokenizer) of the tiny model; `released`: laid
    out as gemma-4-E2B-it is, a Gemma4ForConditionalGeneration whose text model's config is
    `text_config` and whose weights lie under model.language_model., beside a vision tower."""
    d, tokens, merges, w = gemma4_weights(seed, **dims)
    folder = Path(folder)
    if released:
        w = write_released_hf(folder, w, gemma4_config(d), tokens, merges, d,
                              architecture="Gemma4ForConditionalGeneration", model_type="gemma4",
                              towers={"model.vision_tower.patch_embedder.input_proj.weight":
                                      np.ones((4, 12), np.float32)},
                              config={"vision_config": {"model_type": "gemma4_vision"}})
    else:
        _write_hf(folder, w, gemma4_config(d), tokens, merges, d)
    return dict(folder=folder, weights=w, dims=d)
