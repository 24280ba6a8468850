"""Host functions of pooling (shaders/pooling.wgsl): mean, max, CLS, last-token and weighted-mean
pooling of padded sequences, and l2_normalize.
"""
from __future__ import annotations

from ..gpu import Device
from .common import Op, Tensor, act_header, check, params
from .nn_base import _act, _op, _rows_cols, _vec_entry, _window


def _pool_header(x: Tensor, y: Tensor) -> str:
    check(y.dtype in ("f32", "f16"), "pooling", f"output dtype must be f32 or f16, got {y.dtype}")
    h = act_header(x.dtype)
    if y.dtype == "f16" and x.dtype != "f16":
        h = "enable f16;\n" + h
    return h + f"alias outt = {y.dtype};\n"


def _pool(dev: Device, entry: str, x: Tensor, lengths: Tensor, y: Tensor) -> Op:
    _act(entry, x)
    b, c = int(y.shape[0]), int(y.shape[-1])
    check(y.numel == b * c and x.shape[-1] == c and x.numel % (b * c) == 0, entry,
          f"x {x.shape} must be (B*S, C) for y {y.shape}")
    check(lengths.numel >= b, entry, f"lengths {lengths.shape} must hold B={b} entries")
    seq = x.numel // (b * c)
    (xe, xo), (ye, yo) = _window(dev, x, entry), _window(dev, y, entry)
    par = params(dev, [b, seq, c, xo, yo, 0.0, 0, 0], owner=y.buf.owner, label=entry)
    return _op(dev, entry, "pooling.wgsl", entry, _pool_header(x, y), par,
               [xe, _vec_entry(dev, lengths, entry), ye], b * c)


def mean_pool(dev: Device, x: Tensor, lengths: Tensor, y: Tensor) -> Op:
    """y[b,:] = mean of x[b*S + s, :] over s < lengths[b].  x (B*S, C); lengths (B,) u32; y (B, C)."""
    return _pool(dev, "mean_pool", x, lengths, y)


def max_pool(dev: Device, x: Tensor, lengths: Tensor, y: Tensor) -> Op:
    """y[b,:] = elementwise max of x[b*S + s, :] over s < lengths[b]."""
    return _pool(dev, "max_pool", x, lengths, y)


def cls_pool(dev: Device, x: Tensor, lengths: Tensor, y: Tensor) -> Op:
    """y[b,:] = x[b*S, :] (the first, [CLS], token of each sequence)."""
    return _pool(dev, "cls_pool", x, lengths, y)


def last_pool(dev: Device, x: Tensor, lengths: Tensor, y: Tensor) -> Op:
    """y[b,:] = x[b*S + lengths[b] - 1, :] (the last real token: decoder embedders' pooling)."""
    return _pool(dev, "last_pool", x, lengths, y)


def weighted_mean_pool(dev: Device, x: Tensor, lengths: Tensor, y: Tensor) -> Op:
    """y[b,:] = sum_s (s+1) x[b*S + s, :] / sum_s (s+1) over s < lengths[b] (sentence-transformers'
    weightedmean: later tokens weigh more)."""
    return _pool(dev, "weighted_mean_pool", x, lengths, y)


def l2_normalize(dev: Device, x: Tensor, y: Tensor, *, eps: float = 1e-12) -> Op:
    """y[b,:] = x[b,:] / max(||x[b,:]||_2, eps).  x, y (B, C); y may be f32 when x is f16."""
    k = "l2_normalize"
    _act(k, x)
    rows, cols = _rows_cols(x)
    check(y.numel == x.numel, k, f"shapes x{x.shape} y{y.shape}")
    (xe, xo), (ye, yo) = _window(dev, x, k), _window(dev, y, k)
    par = params(dev, [rows, 1, cols, xo, yo, float(eps), 0, 0], owner=y.buf.owner, label=k)
    return _op(dev, k, "pooling.wgsl", k, _pool_header(x, y), par, [xe, ye], rows)
