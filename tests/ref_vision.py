"""numpy references of shaders/vision.wgsl (kernels/vision.py) and of Gemma 3's vision path."""
from __future__ import annotations

import numpy as np

NONE = 0xFFFFFFFF


def splice_rows(x: np.ndarray, feats: np.ndarray, rows: np.ndarray) -> np.ndarray:
    y = x.astype(np.float32).copy()
    for t in range(x.shape[0]):
        if rows[t, 0] != NONE:
            y[t] = feats[rows[t, 0]]
    return y


def attn_image_rows(out: np.ndarray, qkv: np.ndarray, k: np.ndarray, v: np.ndarray, rows: np.ndarray, pos0: int,
                    n_q: int, n_kv: int, scale: float, window: int = 0) -> np.ndarray:
    """out (T, Hq D) with the rows inside an image recomputed over keys lo .. end-1; caches (Hkv, ctx, D)."""
    T, D = qkv.shape[0], qkv.shape[-1]
    y = out.astype(np.float64).reshape(T, n_q, D).copy()
    for t in range(T):
        end = int(rows[t, 1])
        if end == 0:
            continue
        pos = pos0 + t
        lo = pos + 1 - window if window and pos + 1 > window else 0
        for h in range(n_q):
            g = h // (n_q // n_kv)
            s = k[g, lo:end].astype(np.float64) @ qkv[t, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            y[t, h] = (w / w.sum()) @ v[g, lo:end].astype(np.float64)
    return y.reshape(T, n_q * D).astype(np.float32)


def avg_pool(x: np.ndarray, side: int, kernel: int) -> np.ndarray:
    C = x.shape[-1]
    g = x.reshape(side // kernel, kernel, side // kernel, kernel, C).astype(np.float64)
    return g.mean(axis=(1, 3)).reshape(-1, C).astype(np.float32)


def pixel_shuffle(x: np.ndarray, scale: int) -> np.ndarray:
    """transformers' Idefics3Connector.pixel_shuffle of one image's (N, C) patches."""
    n, C = x.shape
    side = int(round(n ** 0.5))
    y = x.reshape(side, side // scale, C * scale).transpose(1, 0, 2)
    y = y.reshape(side // scale, side // scale, C * scale * scale).transpose(1, 0, 2)
    return y.reshape(n // scale ** 2, C * scale * scale)
