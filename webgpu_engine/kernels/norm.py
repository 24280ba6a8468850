"""Host functions of the norm kernels (shaders/norm.wgsl): rms_norm, the per-head rms_norm of
q / k heads, the rms_norm of the whole q / k projections, layer_norm (with an optional residual
added first). Activations are bound read_write, so an output may alias an input.
"""
from __future__ import annotations

from ..gpu import Device
from .common import Op, Tensor, check, params
from .nn_base import _act, _op, _qkv_heads, _rows_cols, _store, _vec_header, _width, _window


def rms_norm(dev: Device, x: Tensor, w: Tensor, y: Tensor, *, eps: float) -> Op:
    """y[t,:] = x[t,:] / sqrt(mean(x[t,:]^2) + eps) * w.   x, y (T, C) act; w (C,) f32."""
    k = "rms_norm"
    dt = _act(k, x, y)
    rows, cols = _rows_cols(x)
    check(y.numel == x.numel and w.numel == cols and w.dtype == "f32", k,
          f"shapes x{x.shape} w{w.shape}/{w.dtype} y{y.shape}")
    v = _width(dev, k, [cols], [x, y, w])
    (xe, xo), (ye, yo), (we, wo) = (_window(dev, t, k, v) for t in (x, y, w))
    par = params(dev, [rows, cols // v, xo, yo, 0, float(eps), wo, 0], owner=y.buf.owner, label=k)
    put, binds = _store(k, "put_norm", ("y", 3, ye), {"x": (1, xe)}, {2: we})
    return _op(dev, k, "norm.wgsl", k, _vec_header(dt, v) + put, par, binds, rows)


def head_rms_norm(dev: Device, qkv: Tensor, w: Tensor, *, n_q_heads: int, n_k_heads: int,
                  head_dim: int, eps: float, n_v_heads: int = 0) -> Op:
    """In place on qkv (T, H_all, D): rms_norm over each q head with w[:D] and each following k head
    with w[D:2D] (Qwen3's and Gemma 3's q_norm / k_norm, applied before RoPE); v heads untouched,
    or the n_v_heads after the k heads normed with w[2D:3D] (Gemma 4's v norm: w all ones)."""
    k = "head_rms_norm"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    n = n_q_heads + n_k_heads + n_v_heads
    check(n <= heads and w.numel == (3 if n_v_heads else 2) * head_dim and w.dtype == "f32", k,
          f"qkv{qkv.shape} with {n} normed heads of {head_dim}, w{w.shape}/{w.dtype}")
    v = _width(dev, k, [head_dim], [qkv, w])
    (xe, xo), (we, wo) = (_window(dev, t, k, v) for t in (qkv, w))
    par = params(dev, [rows * n, head_dim // v, xo, heads, n, n_q_heads, float(eps), wo,
                       n_q_heads + n_k_heads, 0, 0, 0], owner=qkv.buf.owner, label=k)
    put, binds = _store(k, "put_norm", ("y", 3, None), {"x": (1, xe)}, {2: we})
    return _op(dev, k, "norm.wgsl", k, _vec_header(dt, v) + put, par, binds, rows * n)


def proj_rms_norm(dev: Device, qkv: Tensor, w: Tensor, *, q_dim: int, k_dim: int, eps: float) -> Op:
    """In place on qkv (T, q_dim + 2 k_dim): rms_norm over each row's whole q projection (its first
    q_dim values) with w[:q_dim] and over its k projection (the next k_dim) with w[q_dim:] (OLMo-2's
    q_norm / k_norm, before RoPE); v untouched."""
    k = "proj_rms_norm"
    dt = _act(k, qkv)
    rows, cols = _rows_cols(qkv)
    check(q_dim + k_dim <= cols and w.numel == q_dim + k_dim and w.dtype == "f32", k,
          f"qkv{qkv.shape} with q {q_dim} and k {k_dim} normed, w{w.shape}/{w.dtype}")
    v = _width(dev, k, [q_dim, k_dim, cols], [qkv, w])
    (xe, xo), (we, wo) = (_window(dev, t, k, v) for t in (qkv, w))
    par = params(dev, [rows * 2, q_dim // v, xo, cols // v, k_dim // v, float(eps), wo, 0],
                 owner=qkv.buf.owner, label=k)
    put, binds = _store(k, "put_norm", ("y", 3, None), {"x": (1, xe)}, {2: we})
    return _op(dev, k, "norm.wgsl", k, _vec_header(dt, v) + put, par, binds, rows * 2)


def layer_norm(dev: Device, x: Tensor, w: Tensor, b: Tensor, y: Tensor, *, eps: float,
               residual: Tensor | None = None) -> Op:
    """y = LayerNorm(x + residual) * w + b over the last axis.  x, residual, y (T, C) act; w, b (C,) f32.
    y may be the same tensor as x or residual."""
    k = "layer_norm"
    ts = (x, y) if residual is None else (x, y, residual)
    dt = _act(k, *ts)
    rows, cols = _rows_cols(x)
    check(all(t.numel == x.numel for t in ts) and w.numel == cols and b.numel == cols
          and w.dtype == "f32" and b.dtype == "f32", k,
          f"shapes x{x.shape} w{w.shape} b{b.shape} y{y.shape}")
    v = _width(dev, k, [cols], list(ts) + [w, b])
    (xe, xo), (ye, yo), (we, wo), (be, bo) = (_window(dev, t, k, v) for t in (x, y, w, b))
    ins = {"x": (1, xe)}
    ro = 0
    if residual is not None:
        re, ro = _window(dev, residual, k, v)
        ins["r"] = (5, re)
    par = params(dev, [rows, cols // v, xo, yo, ro, float(eps), wo, bo], owner=y.buf.owner, label=k)
    entry = "layer_norm" if residual is None else "layer_norm_res"
    put, binds = _store(k, "put_norm", ("y", 3, ye), ins, {2: we, 4: be})
    return _op(dev, k, "norm.wgsl", entry, _vec_header(dt, v) + put, par, binds, rows)
