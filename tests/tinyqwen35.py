"""A tiny random Qwen3.5 text model (transformers' Qwen3_5ForCausalLM, `qwen3_5_text`) with the parts
the released checkpoints have, at sizes a test runs in seconds:

- Gated DeltaNet layers (`linear_attention`): one projection of x to q|k|v (through a causal
  depthwise conv1d of 4 taps and SiLU), z (the output gate), b (beta) and a (the decay); q / k
  L2-normalised per head, 2 key heads serving 4 value heads; the gated delta rule over a (Dk, Dv)
  state per value head; a gated RMSNorm (plain w, times silu(z)) before out_proj;
- gated full-attention layers every third layer: q_proj gives each head's q and its output gate
  side by side, q / k RMSNorms (1 + w), partial rotary (a quarter of the head, neox pairs);
- (1 + w) RMSNorms before the mixer, the FFN and the head; an untied LM head.

Deterministic for a seed; names are transformers'. Used by tests/test_qwen35.py and
tests/fixtures/make_qwen35.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import tinymodels as tm
from tinyfamilies import _write_hf

DIMS = dict(vocab_size=300, hidden_size=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_size=96, head_dim=16,
            context_length=512, rope_base=1e6, rms_eps=1e-6, tie_embeddings=False)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention",
               "linear_attention", "linear_attention", "full_attention"]


def qwen35_weights(seed: int = 0, **dims) -> tuple[dict, list, list, dict]:
    """(dims, tokens, merges, {HF name: array}) of the tiny model."""
    d = tm._dims(**{**DIMS, **dims})
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = V = len(tokens)
    rng = np.random.default_rng(seed)
    C, F, H, Hkv, D = d["hidden_size"], d["ffn_size"], d["n_heads"], d["n_kv_heads"], d["head_dim"]
    Hk, Hv = LINEAR["linear_num_key_heads"], LINEAR["linear_num_value_heads"]
    Dk, Dv, K = LINEAR["linear_key_head_dim"], LINEAR["linear_value_head_dim"], LINEAR["linear_conv_kernel_dim"]

    def mat(n, k):                      # std 1/sqrt(k): activations stay O(1) through the layers
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n, center=0.0, spread=0.2):  # (1 + w) norms: w near 0
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": (rng.standard_normal((V, C)) / np.sqrt(C)).astype(np.float32),
         "model.norm.weight": vec(C), "lm_head.weight": mat(V, C)}
    for i, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = vec(C), vec(C)
        if kind == "full_attention":
            w[p + "self_attn.q_proj.weight"] = mat(2 * H * D, C)          # per head: q rows, then gate rows
            w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"] = mat(Hkv * D, C), mat(Hkv * D, C)
            w[p + "self_attn.o_proj.weight"] = mat(C, H * D)
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = vec(D), vec(D)
        else:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = mat(2 * Hk * Dk + Hv * Dv, C)
            w[a + "in_proj_z.weight"] = mat(Hv * Dv, C)
            w[a + "in_proj_b.weight"], w[a + "in_proj_a.weight"] = mat(Hv, C), mat(Hv, C)
            w[a + "conv1d.weight"] = (rng.standard_normal((2 * Hk * Dk + Hv * Dv, 1, K)) * 0.5).astype(np.float32)
            w[a + "dt_bias"] = vec(Hv, 0.5, 0.5)
            w[a + "A_log"] = np.log(rng.uniform(0.5, 8.0, Hv)).astype(np.float32)
            w[a + "norm.weight"] = vec(Dv, 1.0)
            w[a + "out_proj.weight"] = mat(C, Hv * Dv)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = mat(F, C), mat(F, C)
        w[p + "mlp.down_proj.weight"] = mat(C, F)
    return d, tokens, merges, w


def qwen35_config(d: dict) -> dict:
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "head_dim": d["head_dim"],
            "hidden_act": "silu", "layer_types": LAYER_TYPES, "attention_bias": False, **LINEAR,
            "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_base"], "partial_rotary_factor": 0.25,
                                "mrope_section": [1, 1, 0], "mrope_interleaved": True}}


def write_tiny_qwen35_safetensors(folder, seed: int = 0, released: bool = False, **dims) -> dict:
    """The HF folder (config.json, model.safetensors, tokenizer) of the tiny model; `released`: laid
    out as Qwen's checkpoints are, a Qwen3_5ForConditionalGeneration whose text model's config is
    `text_config` and whose weights lie under model.language_model., beside a vision tower and the
    multi-token-prediction layer (neither read)."""
    d, tokens, merges, w = qwen35_weights(seed, **dims)
    folder = Path(folder)
    if released:
        w = {k.replace("model.", "model.language_model.", 1): a for k, a in w.items()}
        w["model.visual.patch_embed.proj.weight"] = np.ones((4, 12), np.float32)
        w["mtp.fc.weight"] = np.ones((4, 8), np.float32)
    _write_hf(folder, w, qwen35_config(d), tokens, merges, d)
    if released:
        text = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {"model_type": "qwen3_5"},
            "tie_word_embeddings": False, "eos_token_id": text["eos_token_id"]}, indent=2))
    return dict(folder=folder, weights=w, dims=d)
