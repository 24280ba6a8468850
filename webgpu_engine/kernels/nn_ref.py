"""numpy references for the kernels of nn.py (tests and debugging only; imports numpy)."""
from __future__ import annotations

import math

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


def head_rms_norm(qkv: np.ndarray, w: np.ndarray, n_q: int, n_k: int, eps: float) -> np.ndarray:
    """qkv (T, H_all, D): heads [0, n_q) rms-normed with w[:D], heads [n_q, n_q+n_k) with w[D:]."""
    y = qkv.astype(np.float64).copy()
    D = qkv.shape[-1]
    y[:, :n_q] = rms_norm(y[:, :n_q], w[:D], eps)
    y[:, n_q:n_q + n_k] = rms_norm(y[:, n_q:n_q + n_k], w[D:], eps)
    return y.astype(np.float32)


def proj_rms_norm(qkv: np.ndarray, w: np.ndarray, q_dim: int, k_dim: int, eps: float) -> np.ndarray:
    """qkv (T, q_dim + 2 k_dim): the first q_dim values of a row rms-normed together with w[:q_dim],
    the next k_dim with w[q_dim:]."""
    y = qkv.astype(np.float64).copy()
    y[:, :q_dim] = rms_norm(y[:, :q_dim], w[:q_dim], eps)
    y[:, q_dim:q_dim + k_dim] = rms_norm(y[:, q_dim:q_dim + k_dim], w[q_dim:], eps)
    return y.astype(np.float32)


def layer_norm(x, w, b, eps, residual=None) -> np.ndarray:
    h = x.astype(np.float64) + (0 if residual is None else residual.astype(np.float64))
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    return ((h - mu) / np.sqrt(var + eps) * w + b).astype(np.float32)


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    f = gate_up.shape[-1] // 2
    g, u = gate_up[..., :f].astype(np.float64), gate_up[..., f:].astype(np.float64)
    return (g / (1 + np.exp(-g)) * u).astype(np.float32)


def moe_route(logits: np.ndarray, n_sel: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids (T, n_sel), weights (T, n_sel)): the n_sel largest of softmax(logits[t]) per row, largest
    first (ties: the lower id), renormalised to sum 1 when `norm` (transformers' Qwen3-MoE / OLMoE /
    Mixtral routers)."""
    lg = logits.astype(np.float64)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-lg, axis=-1, kind="stable")[:, :n_sel]
    w = np.take_along_axis(p, ids, -1)
    return ids, (w / w.sum(-1, keepdims=True) if norm else w)


def moe_matmul(x: np.ndarray, w: np.ndarray, ids: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """(T * n_sel, N): row t*n_sel + j = x[t or t*n_sel + j] · w[ids[t, j]]ᵀ (+ bias[ids[t, j]]); w (E, N, K),
    bias (E, N)."""
    T, n_sel = ids.shape
    xs = x if len(x) == T * n_sel else np.repeat(x, n_sel, axis=0)
    y = np.einsum("sk,snk->sn", xs, w[ids.reshape(-1)])
    return y if bias is None else y + bias[ids.reshape(-1)]


def moe_down(x: np.ndarray, w: np.ndarray, ids: np.ndarray, wts: np.ndarray, bias: np.ndarray | None = None
             ) -> np.ndarray:
    """(T, N): sum_j wts[t, j] * (x[t*n_sel + j] · w[ids[t, j]]ᵀ (+ bias[ids[t, j]])); x (T * n_sel, K),
    w (E, N, K)."""
    T, n_sel = ids.shape
    return (moe_matmul(x, w, ids, bias).reshape(T, n_sel, -1) * wts[..., None]).sum(1)


def swiglu_oai(gate_up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss's clamped SwiGLU of [gate | up] (T, 2F) -> (T, F): g = min(gate, limit), u = clamp(up,
    ±limit), (u + 1) * g * sigmoid(alpha * g)."""
    f = gate_up.shape[-1] // 2
    g = np.minimum(gate_up[..., :f].astype(np.float64), limit)
    u = np.clip(gate_up[..., f:].astype(np.float64), -limit, limit)
    return ((u + 1) * g / (1 + np.exp(-alpha * g))).astype(np.float32)

def tanh(x: np.ndarray) -> np.ndarray:
    return np.tanh(x.astype(np.float64)).astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    g = x.astype(np.float64)
    return (0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))).astype(np.float32)


def gelu_tanh_gate(x: np.ndarray, e: np.ndarray, col: int) -> np.ndarray:
    """gelu_tanh(x[t, f]) * e[t, col + f] (Gemma 4's per-layer input gate)."""
    return (gelu_tanh(x).astype(np.float64) * e[:, col:col + x.shape[-1]]).astype(np.float32)


def head_rms_norm_v(qkv: np.ndarray, w: np.ndarray, n_q: int, n_k: int, n_v: int, eps: float) -> np.ndarray:
    """head_rms_norm, and the n_v heads after the k heads rms-normed with w[2D:3D] (Gemma 4)."""
    D = qkv.shape[-1]
    y = head_rms_norm(qkv, w[:2 * D], n_q, n_k, eps)
    y[:, n_q + n_k:n_q + n_k + n_v] = rms_norm(y[:, n_q + n_k:n_q + n_k + n_v], w[2 * D:3 * D], eps)
    return y


def gelu_tanh_mul(gate_up: np.ndarray) -> np.ndarray:
    f = gate_up.shape[-1] // 2
    return (gelu_tanh(gate_up[..., :f]).astype(np.float64) * gate_up[..., f:].astype(np.float64)).astype(np.float32)


def gelu_mul(x: np.ndarray) -> np.ndarray:
    f = x.shape[-1] // 2
    return (gelu(x[..., :f]).astype(np.float64) * x[..., f:].astype(np.float64)).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    # 1 + erf(x/sqrt2) written as erfc(-x/sqrt2): no cancellation in the negative tail
    erfc = np.vectorize(math.erfc)
    x = x.astype(np.float64)
    return (0.5 * x * erfc(-x / math.sqrt(2))).astype(np.float32)


def quick_gelu(x: np.ndarray) -> np.ndarray:
    """x sigmoid(1.702 x) (CLIP's quick_gelu)."""
    x = x.astype(np.float64)
    return (x / (1.0 + np.exp(np.minimum(-1.702 * x, 80.0)))).astype(np.float32)


def inv_freq(rot_dim: int, base: float) -> np.ndarray:
    """f32 frequencies base^(-2i/rot_dim), rounded once from float64 (what the kernel binds)."""
    return np.array([base ** (-(2.0 * i) / rot_dim) for i in range(rot_dim // 2)], np.float32)


def rope(x: np.ndarray, positions: np.ndarray, *, n_heads: int, rot_dim: int, base: float,
         neox: bool) -> np.ndarray:
    """x (T, H_all, D): rotates heads [0, n_heads); angle = f32(pos) * f32 inv_freq, as the kernel."""
    y = x.astype(np.float64).copy()
    half = rot_dim // 2
    ang = (positions.astype(np.float32)[:, None] * inv_freq(rot_dim, base)[None, :]).astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]   # (T, 1, half)
    if neox:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = np.arange(half) * 2, np.arange(half) * 2 + 1
    a, b = y[:, :n_heads, i0].copy(), y[:, :n_heads, i1].copy()
    y[:, :n_heads, i0] = a * c - b * s
    y[:, :n_heads, i1] = a * s + b * c
    return y.astype(np.float32)


def rope_sections(x: np.ndarray, positions: np.ndarray, freq: np.ndarray, *, n_rot: int,
                  sections: tuple[int, int]) -> np.ndarray:
    """x (T, H_all, D): heads [0, n_rot) rotated in half-split pairs, pair i by positions[t, axis(i)] *
    freq[i] (f32 product), axis 0 below sections[0], 1 below sections[1], else 2, as
    shaders/rope_sections.wgsl."""
    y = x.astype(np.float64).copy()
    half = x.shape[-1] // 2
    axis = np.where(np.arange(half) < sections[0], 0, np.where(np.arange(half) < sections[1], 1, 2))
    ang = (positions[:, axis].astype(np.float32) * freq.astype(np.float32)[None, :]).astype(np.float64)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]   # (T, 1, half)
    a, b = y[:, :n_rot, :half].copy(), y[:, :n_rot, half:].copy()
    y[:, :n_rot, :half] = a * c - b * s
    y[:, :n_rot, half:] = a * s + b * c
    return y.astype(np.float32)


def q_temperature(x: np.ndarray, positions: np.ndarray, *, n_q_heads: int, beta: float, length: int) -> np.ndarray:
    """x (T, H_all, D): heads [0, n_q_heads) of row t times 1 + beta ln(1 + floor(pos_t / length)) in f32,
    as shaders/q_temperature.wgsl (Llama 4's attention temperature)."""
    y = x.astype(np.float32).copy()
    s = (1.0 + np.float32(beta) * np.log1p((positions.astype(np.int64) // int(length)).astype(np.float32))).astype(np.float32)
    y[:, :n_q_heads] *= s[:, None, None]
    return y


def softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softcap: float = 0.0,
                   sink: float | None = None) -> np.ndarray:
    """q (D,), k/v (n, D) → (D,) in float64; `sink`: a logit in the softmax's denominator with no value
    (gpt-oss's attention sinks)."""
    s = k.astype(np.float64) @ q.astype(np.float64) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    m = s.max() if sink is None else max(s.max(), sink)
    p = np.exp(s - m)
    return (p / (p.sum() + (0.0 if sink is None else np.exp(sink - m)))) @ v.astype(np.float64)


def causal_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int,
                     scale: float, window: int = 0, softcap: float = 0.0, sinks=None) -> np.ndarray:
    """q (T, Hq, D); caches (Hkv, ctx, D) → (T, Hq*D): query t sees keys 0..pos0+t of kv head h//G
    (keys pos0+t-window+1.. only when window > 0); scores soft-capped when softcap > 0; sinks (Hq,):
    each head's sink logit in its softmax's denominator."""
    t_n, hq, d = q.shape
    g = hq // k_cache.shape[0]
    out = np.zeros((t_n, hq, d))
    for t in range(t_n):
        n = pos0 + t + 1
        lo = max(0, n - window) if window else 0
        for h in range(hq):
            out[t, h] = softmax_attend(q[t, h], k_cache[h // g, lo:n], v_cache[h // g, lo:n], scale, softcap,
                                       None if sinks is None else float(sinks[h]))
    return out.reshape(t_n, hq * d).astype(np.float32)


def ring_attention(q: np.ndarray, q_sink: np.ndarray, k: np.ndarray, v: np.ndarray, positions, sinks: int,
                   window: int, scale: float, softcap: float = 0.0) -> np.ndarray:
    """WebLLM's sliding window with attention sinks (kernels/common.py Ring), by position: q and q_sink
    (T, Hq, D) the queries at `positions` rotated at pos and at min(pos, window); k, v (Hkv, N, D) the
    keys and values of positions 0..N-1 (keys rotated at their own positions). The query at pos sees
    positions j < sinks, scored with q_sink, and pos - (window - sinks) .. pos, scored with q → (T, Hq*D);
    scores soft-capped when softcap > 0."""
    t_n, hq, d = q.shape
    g = hq // k.shape[0]
    out = np.zeros((t_n, hq, d))
    for t, pos in enumerate(positions):
        sink = np.arange(min(sinks, pos + 1))
        near = np.arange(max(sinks, pos - (window - sinks)), pos + 1)
        for h in range(hq):
            kh, vh = k[h // g].astype(np.float64), v[h // g].astype(np.float64)
            s = np.concatenate([kh[sink] @ q_sink[t, h].astype(np.float64), kh[near] @ q[t, h].astype(np.float64)])
            s = s * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ np.concatenate([vh[sink], vh[near]])
    return out.reshape(t_n, hq * d).astype(np.float32)


def bidir_attention(qkv: np.ndarray, lengths, batch: int, seq: int, n_heads: int, head_dim: int,
                    scale: float, window: int = 0) -> np.ndarray:
    """qkv (B*S, 3*H*D) rows [q | k | v] → (B*S, H*D); key j of sequence b visible iff j < lengths[b]
    (and |j - i| <= window for query i when window > 0). Padded query rows (s >= lengths[b]) also
    attend over the valid keys (the kernel's choice)."""
    hd = n_heads * head_dim
    x = qkv.reshape(batch, seq, 3, n_heads, head_dim).astype(np.float64)
    out = np.zeros((batch, seq, n_heads, head_dim))
    for b in range(batch):
        n = int(lengths[b])
        if n == 0:
            continue
        s = np.einsum("qhd,khd->hqk", x[b, :, 0], x[b, :n, 1]) * scale
        if window:
            far = np.abs(np.arange(seq)[:, None] - np.arange(n)[None]) > window
            s = np.where(far[None], -1e30, s)       # padded queries past the window: finite
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[b] = np.einsum("hqk,khd->qhd", p, x[b, :n, 2])
    return out.reshape(batch * seq, hd).astype(np.float32)


def mean_pool(x: np.ndarray, lengths, batch: int) -> np.ndarray:
    s = x.shape[0] // batch
    x = x.reshape(batch, s, -1).astype(np.float64)
    return np.stack([x[b, :lengths[b]].sum(0) / max(int(lengths[b]), 1) for b in range(batch)]).astype(np.float32)


def max_pool(x: np.ndarray, lengths, batch: int) -> np.ndarray:
    s = x.shape[0] // batch
    x = x.reshape(batch, s, -1)
    return np.stack([x[b, :lengths[b]].max(0) if lengths[b] else np.zeros(x.shape[-1])
                     for b in range(batch)]).astype(np.float32)


def cls_pool(x: np.ndarray, lengths, batch: int) -> np.ndarray:
    s = x.shape[0] // batch
    return x.reshape(batch, s, -1)[:, 0].astype(np.float32)


def last_pool(x: np.ndarray, lengths, batch: int) -> np.ndarray:
    s = x.shape[0] // batch
    return np.stack([x.reshape(batch, s, -1)[b, max(int(lengths[b]), 1) - 1] for b in range(batch)]).astype(np.float32)


def weighted_mean_pool(x: np.ndarray, lengths, batch: int) -> np.ndarray:
    s = x.shape[0] // batch
    x = x.reshape(batch, s, -1).astype(np.float64)
    w = [np.arange(1, int(n) + 1, dtype=np.float64)[:, None] for n in lengths]
    return np.stack([(x[b, :lengths[b]] * w[b]).sum(0) / max(w[b].sum(), 1.0) for b in range(batch)]).astype(np.float32)


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    x = x.astype(np.float64)
    return (x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)).astype(np.float32)


KV_BITS = {"q8_0": 8, "q4_0": 4}       # the quantised KV caches' bits per value (kernels/kv_quant.py)


def kv_quantize(x: np.ndarray, kind: str = "q8_0") -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q8_0 or q4_0 of rows x (..., D), D % 32 == 0 (shaders/kv_quant.wgsl): blocks of 32
    values, in f32 q8_0: d = max|x| / 127, n = round(x / d) (ties to even); q4_0: d = vmax / -8 (vmax:
    the first value of largest |x|), n = min(15, trunc(x / d + 8.5)) - 8; both times x / d as x * (1 / d)
    (0 where d = 0) -> (n int8 (..., D), d f16 (..., D/32)); the values are n * f16(d)."""
    x = np.asarray(x, np.float32)
    b = x.reshape(*x.shape[:-1], -1, 32)
    if kind == "q8_0":
        d = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float32)
    else:
        vmax = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        d = (vmax / np.float32(-8)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    y = b * inv[..., None]
    if kind == "q8_0":
        n = np.clip(np.round(y), -127, 127)
    else:
        n = np.minimum(15, np.trunc(y + np.float32(8.5))) - 8
    return n.astype(np.int8).reshape(x.shape), d.astype(np.float16)


def kv_dequantize(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values a quantised cache holds: n * f16(d) in f32."""
    b = q.reshape(*q.shape[:-1], -1, 32).astype(np.float32) * d.astype(np.float32)[..., None]
    return b.reshape(q.shape)


def kv_pack(q: np.ndarray, d: np.ndarray, kind: str = "q8_0") -> np.ndarray:
    """The u32 words of a quantised cache (Hkv, ctx, D): every row's values (q8_0: signed bytes, the
    first value in the low byte; q4_0: nibbles n + 8, value 8i + j of a row in bits 4j of its word i),
    then every row's scales, two per word."""
    hkv, ctx, dim = q.shape
    if kind == "q8_0":
        data = np.ascontiguousarray(q).view(np.uint8).reshape(-1).view(np.uint32)
    else:
        nib = (q.astype(np.int32) + 8).astype(np.uint32).reshape(-1, 8)
        data = (nib << (4 * np.arange(8, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)
    sw = -(-dim // 64)
    scales = np.zeros((hkv, ctx, 2 * sw), np.float16)
    scales[..., :d.shape[-1]] = d
    return np.concatenate([data, scales.reshape(-1).view(np.uint32)])


def kv_unpack(words: np.ndarray, hkv: int, ctx: int, dim: int, kind: str = "q8_0") -> tuple[np.ndarray, np.ndarray]:
    """kv_pack's inverse: (n int8 (Hkv, ctx, D), d f16 (Hkv, ctx, D/32))."""
    words = np.asarray(words, np.uint32)
    n = hkv * ctx * dim * KV_BITS[kind] // 32
    if kind == "q8_0":
        q = words[:n].view(np.int8).reshape(hkv, ctx, dim)
    else:
        nib = (words[:n, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
        q = (nib.astype(np.int8) - 8).reshape(hkv, ctx, dim)
    d = words[n:].view(np.float16).reshape(hkv, ctx, -1)[..., :dim // 32]
    return q, d
