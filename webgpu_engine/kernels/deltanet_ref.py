"""Numpy references of kernels/deltanet.py (Gated DeltaNet, Qwen3.5), written as transformers'
Qwen3_5GatedDeltaNet computes them (its torch_recurrent_gated_delta_rule and causal_conv1d paths),
in float64: tests only."""
from __future__ import annotations

import numpy as np


def _silu(x):
    return x / (1.0 + np.exp(-x))


def causal_conv1d(x: np.ndarray, w: np.ndarray, state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(y (T, C), new state (C, K-1)) of one sequence's rows x (T, C) after `state` (C, K-1; None:
    zeros, a sequence at position 0); w (C, K)."""
    T, C = x.shape
    K = w.shape[1]
    prev = np.zeros((C, K - 1)) if state is None else np.asarray(state, np.float64)
    xs = np.concatenate([prev.T, np.asarray(x, np.float64)], axis=0)          # (K-1+T, C)
    y = np.stack([(xs[t:t + K] * np.asarray(w, np.float64).T).sum(0) for t in range(T)])
    return _silu(y), xs[T:].T.copy()


def gated_delta_rule(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, a_log: np.ndarray,
                     dt_bias: np.ndarray, norm_w: np.ndarray, state: np.ndarray | None, *, n_k_heads: int,
                     k_dim: int, v_dim: int, eps: float, tiled: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(y (T, Hv Dv), new state (Hv, Dk, Dv)) of one sequence's rows: qkv (T, 2 Hk Dk + Hv Dv) the
    convolved q | k | v, z (T, Hv Dv), b and a (T, Hv); state None: zeros. `tiled`: value head h reads
    key head h % Hk (llama.cpp's order), else h / (Hv / Hk)."""
    qkv, z, b, a = (np.asarray(t, np.float64) for t in (qkv, z, b, a))
    T, Hv = b.shape
    Hk, Dk, Dv = n_k_heads, k_dim, v_dim
    heads = np.arange(Hv) % Hk if tiled else np.arange(Hv) // (Hv // Hk)      # each value head's key head
    q = qkv[:, :Hk * Dk].reshape(T, Hk, Dk)[:, heads]
    k = qkv[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)[:, heads]
    v = qkv[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(Dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1.0 / (1.0 + np.exp(-b))
    g = -np.exp(np.asarray(a_log, np.float64)) * np.logaddexp(0.0, a + np.asarray(dt_bias, np.float64))
    S = np.zeros((Hv, Dk, Dv)) if state is None else np.array(state, np.float64)
    out = np.zeros((T, Hv, Dv))
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        mem = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    zz = z.reshape(T, Hv, Dv)
    y = out / np.sqrt((out * out).mean(-1, keepdims=True) + eps) * np.asarray(norm_w, np.float64) * _silu(zz)
    return y.reshape(T, Hv * Dv), S


def state_copy(state: np.ndarray, pairs) -> np.ndarray:
    """state (slots, ...) with each (src, dst) of pairs copied: out[dst] = state[src]."""
    out = np.array(state, copy=True)
    for src, dst in pairs:
        out[dst] = state[src]
    return out


def sigmoid_gate(y: np.ndarray, g: np.ndarray) -> np.ndarray:
    return np.asarray(y, np.float64) / (1.0 + np.exp(-np.asarray(g, np.float64)))
