"""Tiny random encoders of the families beyond BERT that no installed library can build offline,
written as sentence-transformers folders (tests/tinymodels.py's WordPiece tokenizer and module files).

    write_tiny_nomic(folder)     # NomicBertModel: rotary, SwiGLU, no biases, mean pooling, normalised
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tinymodels import write_tiny_bert
from webgpu_engine.loaders.safetensors import write_safetensors


def write_tiny_nomic(folder, *, seed: int = 0, hidden_size: int = 64, n_layers: int = 2, n_heads: int = 4,
                     intermediate_size: int = 256, rotary_fraction: float = 1.0, rope_base: float = 1000.0,
                     max_seq_length: int = 64, n_positions: int = 128) -> dict:
    """A NomicBertModel sentence-transformers folder; returns {folder, config (dict), vocab}. Its gated
    MLP rounds the hidden width up to a multiple of 256, so intermediate_size is one."""
    folder = Path(folder)
    info = write_tiny_bert(folder, pooling="mean", normalize=True, max_seq_length=max_seq_length,
                           hidden_size=hidden_size, n_heads=n_heads)
    C, F, V = hidden_size, intermediate_size, info["config"].vocab_size
    rng = np.random.default_rng(seed)

    def mat(n, k):
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n, center=0.0):
        return (center + 0.1 * rng.standard_normal(n)).astype(np.float32)
    w = {"embeddings.word_embeddings.weight": rng.standard_normal((V, C)).astype(np.float32),
         "embeddings.token_type_embeddings.weight": (0.5 * rng.standard_normal((2, C))).astype(np.float32),
         "emb_ln.weight": vec(C, 1.0), "emb_ln.bias": vec(C)}
    for i in range(n_layers):
        p = f"encoder.layers.{i}."
        w[p + "attn.Wqkv.weight"], w[p + "attn.out_proj.weight"] = mat(3 * C, C), mat(C, C)
        w[p + "mlp.fc11.weight"], w[p + "mlp.fc12.weight"], w[p + "mlp.fc2.weight"] = mat(F, C), mat(F, C), mat(C, F)
        for n in ("norm1", "norm2"):
            w[p + n + ".weight"], w[p + n + ".bias"] = vec(C, 1.0), vec(C)
    (folder / "model.safetensors").unlink()
    write_safetensors(folder / "model.safetensors", {k: ("f32", a.shape, a.tobytes()) for k, a in w.items()},
                      {"format": "pt"})
    cfg = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert",
           "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                        "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
           "vocab_size": V, "n_embd": C, "n_head": n_heads, "n_layer": n_layers, "n_inner": F,
           "n_positions": n_positions, "type_vocab_size": 2, "layer_norm_epsilon": 1e-12,
           "rotary_emb_fraction": rotary_fraction, "rotary_emb_base": rope_base, "rotary_emb_interleaved": False,
           "rotary_emb_scale_base": None, "rotary_scaling_factor": None, "max_trained_positions": 2048,
           "activation_function": "swiglu", "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
           "prenorm": False, "causal": False, "pad_vocab_size_multiple": 1, "pad_token_id": 0,
           # nomic's code applies attention dropout in eval mode too: its released configs set 0
           "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return dict(folder=folder, config=cfg, vocab=info["vocab"])
