"""Numpy reference BERT encoder (float64) for tests: HF safetensors weights → pooled sentence vectors.

Independent of the engine: weights come from the `safetensors` package, the maths is written out
from the BERT paper / HF `BertModel` (post-LN, erf GELU, absolute positions, token type 0).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def load_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of `model.safetensors` as float64, with any `bert.` prefix stripped."""
    from safetensors import safe_open
    path = Path(folder) / "model.safetensors"
    out = {}
    with safe_open(str(path), "np") as f:
        bf16 = {k for k, v in _header(path).items() if isinstance(v, dict) and v.get("dtype") == "BF16"}
        for k in f.keys():
            # numpy has no bfloat16: take the raw bits as the top half of an f32
            t = _bf16_tensor(path, k) if k in bf16 else f.get_tensor(k)
            name = k[len("bert."):] if k.startswith("bert.") else k
            out[name] = t.astype(np.float64) if t.dtype.kind == "f" else t
    return out


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def _bf16_tensor(path: Path, name: str) -> np.ndarray:
    meta = _header(path)[name]
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        a, b = meta["data_offsets"]
        f.seek(8 + n + a)
        bits = np.frombuffer(f.read(b - a), dtype="<u2")
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(meta["shape"])


def load_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU; math.erf per element keeps the reference free of approximations."""
    e = np.fromiter(map(math.erf, (x / math.sqrt(2.0)).ravel().tolist()), np.float64, x.size)
    return 0.5 * x * (1.0 + e.reshape(x.shape))


def encode_hidden(W: dict, cfg: dict, ids: list[int]) -> np.ndarray:
    """Last hidden states (S, C) of one unpadded sequence (what a padded batch gives at valid rows)."""
    S = len(ids)
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    D, eps = C // H, cfg.get("layer_norm_eps", 1e-12)
    ids_a = np.asarray(ids, dtype=np.int64)
    # embeddings: word + position + token type 0 → LN                             x: (S, C)
    x = (W["embeddings.word_embeddings.weight"][ids_a]
         + W["embeddings.position_embeddings.weight"][:S]
         + W["embeddings.token_type_embeddings.weight"][0])
    x = _layer_norm(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def lin(name, v):
            return v @ W[p + name + ".weight"].T + W[p + name + ".bias"]
        q = lin("attention.self.query", x).reshape(S, H, D).transpose(1, 0, 2)   # (H, S, D)
        k = lin("attention.self.key", x).reshape(S, H, D).transpose(1, 0, 2)
        v = lin("attention.self.value", x).reshape(S, H, D).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(D)                             # (H, S, S)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v                                  # (H, S, D)
        a = a.transpose(1, 0, 2).reshape(S, C)
        x = _layer_norm(lin("attention.output.dense", a) + x, W[p + "attention.output.LayerNorm.weight"],
                        W[p + "attention.output.LayerNorm.bias"], eps)
        h = _gelu(lin("intermediate.dense", x))                                 # (S, F)
        x = _layer_norm(lin("output.dense", h) + x, W[p + "output.LayerNorm.weight"],
                        W[p + "output.LayerNorm.bias"], eps)
    return x


def pool(h: np.ndarray, mode: str) -> np.ndarray:
    if mode == "mean":
        return h.mean(0)
    if mode == "cls":
        return h[0]
    if mode == "max":
        return h.max(0)
    if mode == "lasttoken":
        return h[-1]
    if mode == "weightedmean":                     # sentence-transformers: weights 1..S
        w = np.arange(1, h.shape[0] + 1, dtype=np.float64)[:, None]
        return (h * w).sum(0) / w.sum()
    raise ValueError(mode)


def embed(W: dict, cfg: dict, ids: list[int], *, pooling: str = "mean", normalize: bool = False) -> np.ndarray:
    """One sentence vector (C,): encoder → pooling → optional L2 normalisation."""
    v = pool(encode_hidden(W, cfg, ids), pooling)
    if normalize:
        v = v / max(np.linalg.norm(v), 1e-12)
    return v


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


SEP = 102   # [SEP] of the uncased BERT vocabulary (all-MiniLM-L6-v2)


def reference_ids(item: dict, max_len: int) -> list[int]:
    """The ids sentence-transformers embedded. The golden file lists the first `max_len` ids of the
    untruncated encoding for over-long texts, but its embedding comes from the truncated encoding,
    which keeps [SEP] last (checked by test_numpy_reference_matches_sentence_transformers)."""
    ids = item["token_ids"]
    return ids if ids[-1] == SEP else ids[:max_len - 1] + [SEP]
