"""Numpy reference NomicBert encoder (float64) for tests, written from nomic-ai's NomicBertModel code
(post-norm blocks, rotary positions on q and k with half-split pairs, SwiGLU fc11(x) * silu(fc12(x)),
no linear biases): HF safetensors weights → pooled sentence vectors. Independent of the engine.

nomic-embed-text's modelling code is remote code on the Hugging Face hub (transformers cannot build
it offline), so this reference stands in for it. It was checked once against that code
(modeling_hf_nomic_bert.py, run by sentence-transformers with trust_remote_code on
tests/tiny_encoders.py's model, full and half rotary): vectors equal within 1e-7.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ref_bert import _layer_norm, load_weights


def load_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def rotate(x: np.ndarray, base: float, rot_dim: int) -> np.ndarray:
    """x (S, H, D) with position s at row s: pairs (i, i + rot_dim/2) rotated by s * base^(-2i/rot_dim)."""
    S = x.shape[0]
    half = rot_dim // 2
    inv = base ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)          # (half,)
    ang = np.arange(S, dtype=np.float64)[:, None] * inv[None]                       # (S, half)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., :half], x[..., half:rot_dim]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., rot_dim:]], axis=-1)


def encode_hidden(W: dict, cfg: dict, ids: list[int]) -> np.ndarray:
    S, C, H = len(ids), cfg["n_embd"], cfg["n_head"]
    D, eps = C // H, cfg.get("layer_norm_epsilon", 1e-12)
    rot = int(D * cfg["rotary_emb_fraction"])
    x = W["embeddings.word_embeddings.weight"][np.asarray(ids)] + W["embeddings.token_type_embeddings.weight"][0]
    x = _layer_norm(x, W["emb_ln.weight"], W["emb_ln.bias"], eps)                   # (S, C)
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        qkv = (x @ W[p + "attn.Wqkv.weight"].T).reshape(S, 3, H, D)
        q, k, v = (rotate(qkv[:, 0], cfg["rotary_emb_base"], rot), rotate(qkv[:, 1], cfg["rotary_emb_base"], rot),
                   qkv[:, 2])
        s = np.einsum("shd,thd->hst", q, k) / math.sqrt(D)                          # (H, S, S)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("hst,thd->shd", s / s.sum(-1, keepdims=True), v).reshape(S, C)
        x = _layer_norm(a @ W[p + "attn.out_proj.weight"].T + x, W[p + "norm1.weight"], W[p + "norm1.bias"], eps)
        up, gate = x @ W[p + "mlp.fc11.weight"].T, x @ W[p + "mlp.fc12.weight"].T
        h = up * (gate / (1.0 + np.exp(-gate)))
        x = _layer_norm(h @ W[p + "mlp.fc2.weight"].T + x, W[p + "norm2.weight"], W[p + "norm2.bias"], eps)
    return x


def embed(W: dict, cfg: dict, ids: list[int], *, normalize: bool = True) -> np.ndarray:
    v = encode_hidden(W, cfg, ids).mean(0)
    return v / max(np.linalg.norm(v), 1e-12) if normalize else v


__all__ = ["embed", "encode_hidden", "load_config", "load_weights", "rotate"]
