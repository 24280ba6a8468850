"""Host functions of shaders/vision.wgsl: what brings image features into a decoder's forward.

- splice_rows: the rows of the input embeddings that hold image tokens take the image's features;
- attn_image_rows: an image's token rows attend every key up to the image's last token (an image's
  tokens see each other both ways, Gemma 3), after the causal attention has written every row;
- avg_pool: a vision tower's patch grid pooled KxK (Gemma 3's projector);
- pixel_shuffle: each s x s square of the patch grid as one token s^2 times as wide (Idefics3's).

`rows` (T, 2) u32 per forward row: the feature row it takes (0xffffffff: none) and the end of its
image's keys (0: the row is text and keeps its causal attention). The numpy references are in
tests/ref_vision.py.
"""
from __future__ import annotations

from ..gpu import Device
from .common import Op, Tensor, act_header, check, params
from .nn_base import _act, _op, _step_entry, _window

NONE = 0xFFFFFFFF
_FILE = "vision.wgsl"


def _header(dt: str, head_dim: int = 4) -> str:
    return act_header(dt) + f"const HEAD_DIM: u32 = {int(head_dim)}u;\n"


def splice_rows(dev: Device, x: Tensor, feats: Tensor, rows: Tensor) -> Op:
    """x[t,:] = feats[rows[t, 0],:] for the rows holding an image token.  x (T, C) act; feats (N, C)
    f32; rows (>= T, 2) u32."""
    k = "splice_rows"
    dt = _act(k, x)
    T, C = int(x.shape[0]), int(x.shape[-1])
    check(feats.dtype == "f32" and int(feats.shape[-1]) == C, k, f"feats {feats.shape} must be f32 (N, {C})")
    check(rows.dtype == "u32" and rows.numel >= 2 * T, k, f"rows {rows.shape} must be u32 (>= {T}, 2)")
    (xe, xo), (fe, fo), (re, ro) = (_window(dev, t, k) for t in (x, feats, rows))
    check(ro == 0, k, "rows must start at a bindable offset")
    par = params(dev, [T * C, C, xo, fo, 0, 0, 0, 0, 0, 0, 0.0, 0], owner=x.buf.owner, label=k)
    return _op(dev, k, _FILE, k, _header(dt), par, {1: re, 2: fe, 3: xe}, T * C)


def attn_image_rows(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, step, rows: Tensor, *,
                    n_q_heads: int, n_kv_heads: int, head_dim: int, ctx: int, scale: float, window: int = 0) -> Op:
    """For each row t with rows[t, 1] = end > 0 (at position pos0 + t): out[t, h] = softmax over keys
    lo .. end-1 of q·k * scale, times v; lo = pos - window + 1 where a window applies, else 0. qkv (T,
    Hq + 2Hkv, D) act; caches (Hkv, ctx, D) act, already holding keys up to end - 1; out (T, Hq D)."""
    k = "attn_image_rows"
    dt = _act(k, qkv, k_cache, v_cache, out)
    T = int(qkv.shape[0])
    heads_all = n_q_heads + 2 * n_kv_heads
    check(qkv.numel == T * heads_all * head_dim, k, f"qkv {qkv.shape} must be ({T}, {heads_all}, {head_dim})")
    check(out.numel == T * n_q_heads * head_dim, k, f"out {out.shape} must be ({T}, {n_q_heads * head_dim})")
    for c in (k_cache, v_cache):
        check(c.numel == n_kv_heads * ctx * head_dim, k, f"cache {c.shape} must be ({n_kv_heads}, {ctx}, {head_dim})")
    check(rows.dtype == "u32" and rows.numel >= 2 * T, k, f"rows {rows.shape} must be u32 (>= {T}, 2)")
    (re, _), (qe, qo), (ke, ko), (ve, vo), (oe, oo) = (_window(dev, t, k) for t in (rows, qkv, k_cache, v_cache, out))
    par = params(dev, [T * n_q_heads, n_q_heads, n_q_heads // n_kv_heads, head_dim, ctx, int(window),
                       qo, ko, vo, oo, float(scale), heads_all], owner=out.buf.owner, label=k)
    return _op(dev, k, _FILE, k, _header(dt, head_dim), par,
               {1: re, 2: _step_entry(step), 3: qe, 4: ke, 5: ve, 6: oe}, T * n_q_heads)


def avg_pool(dev: Device, x: Tensor, y: Tensor, *, side: int, kernel: int) -> Op:
    """y (Nt, C) = x (side*side, C) averaged over kernel x kernel squares of its row-major patch grid
    (Nt = (side / kernel)^2), both f32."""
    k = "avg_pool"
    C = int(x.shape[-1])
    check(side % kernel == 0, k, f"a grid of {side} does not split into squares of {kernel}")
    n_out = (side // kernel) ** 2
    check(x.dtype == y.dtype == "f32" and x.numel == side * side * C and y.numel == n_out * C, k,
          f"x {x.shape} must be ({side * side}, C), y {y.shape} ({n_out}, C), f32")
    (xe, xo), (ye, yo) = _window(dev, x, k), _window(dev, y, k)
    check(xo == 0 and yo == 0, k, "x and y must start at bindable offsets")
    par = params(dev, [n_out * C, C, side, kernel, 0, 0, 0, 0, 0, 0, 0.0, 0], owner=y.buf.owner, label=k)
    return _op(dev, k, _FILE, k, _header("f32"), par, {1: xe, 2: ye}, n_out * C)


def pixel_shuffle(dev: Device, x: Tensor, y: Tensor, *, side: int, scale: int) -> Op:
    """y ((side/scale)^2, C scale^2) from x (side*side, C), both f32: each scale x scale square of the
    row-major patch grid as one row, as transformers' Idefics3 pixel_shuffle lays it out."""
    k = "pixel_shuffle"
    C = int(x.shape[-1])
    check(side % scale == 0, k, f"a grid of {side} does not split into squares of {scale}")
    check(x.dtype == y.dtype == "f32" and x.numel == side * side * C == y.numel, k,
          f"x {x.shape} must be ({side * side}, C) and y {y.shape} as many f32 values")
    (xe, xo), (ye, yo) = _window(dev, x, k), _window(dev, y, k)
    check(xo == 0 and yo == 0, k, "x and y must start at bindable offsets")
    par = params(dev, [x.numel, C, side, scale, 0, 0, 0, 0, 0, 0, 0.0, 0], owner=y.buf.owner, label=k)
    return _op(dev, k, _FILE, k, _header("f32"), par, {1: xe, 2: ye}, x.numel)
