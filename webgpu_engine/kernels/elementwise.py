"""Host functions of the elementwise kernels (shaders/elementwise.wgsl): add, bias_add, the gated
activations (silu_mul, GeGLU), scale, softcap, gelu (erf and tanh forms) and tanh. Activations are bound read_write, so
an output may alias an input.
"""
from __future__ import annotations

from ..gpu import Buffer, Device
from .common import Op, Tensor, check, params
from .nn_base import _act, _op, _store, _vec_header, _width, _window


def add(dev: Device, a: Tensor, b: Tensor, y: Tensor) -> Op:
    """y = a + b (same shape; y may alias a or b)."""
    k = "add"
    dt = _act(k, a, b, y)
    check(a.numel == b.numel == y.numel, k, f"shapes a{a.shape} b{b.shape} y{y.shape}")
    v = _width(dev, k, [a.numel], [a, b, y])
    (ae, ao), (be, bo), (ye, yo) = (_window(dev, t, k, v) for t in (a, b, y))
    par = params(dev, [a.numel // v, 1, ao, bo, yo, 0, 0, 0], owner=y.buf.owner, label=k)
    put, binds = _store(k, "put", ("y", 3, ye), {"a": (1, ae), "b": (2, be)}, {})
    return _op(dev, k, "elementwise.wgsl", k, _vec_header(dt, v) + put, par, binds, a.numel // v)


def bias_add(dev: Device, x: Tensor, b: Tensor, y: Tensor) -> Op:
    """y[t,n] = x[t,n] + b[n].  x, y (T, N) act; b (N,) f32."""
    k = "bias_add"
    dt = _act(k, x, y)
    n = int(x.shape[-1])
    check(x.numel == y.numel and b.numel == n and b.dtype == "f32", k,
          f"shapes x{x.shape} b{b.shape}/{b.dtype} y{y.shape}")
    v = _width(dev, k, [n], [x, y, b])
    (xe, xo), (ye, yo), (be, bo) = (_window(dev, t, k, v) for t in (x, y, b))
    par = params(dev, [x.numel // v, n // v, xo, bo, yo, 0, 0, 0], owner=y.buf.owner, label=k)
    put, binds = _store(k, "put_bias", ("y", 3, ye), {"a": (1, xe)}, {2: be})
    return _op(dev, k, "elementwise.wgsl", k, _vec_header(dt, v) + put, par, binds, x.numel // v)


def silu_mul(dev: Device, gate_up: Tensor, y: Tensor, *, pairs: bool = False, act: str = "silu",
             alpha: float = 0.0, limit: float = 0.0) -> Op:
    """y[t,f] = silu(gate_up[t,f]) * gate_up[t,F+f].  gate_up (T, 2F) rows [gate | up]; y (T, F).
    pairs: gate_up rows are gate and up interleaved in pairs (g 2j, g 2j+1, u 2j, u 2j+1, ...),
    the layout of a weight uploaded for the decode matmul's silu epilogue (kernels/matmul/epilogues.py).
    act "gelu_tanh": GeGLU, GELU's tanh form in place of silu (Gemma); "swiglu_oai": gpt-oss's clamped
    SwiGLU, (clamp(up, ±limit) + 1) * g * sigmoid(alpha g) with g = min(gate, limit)."""
    check(act in ("silu", "gelu_tanh", "swiglu_oai"), "silu_mul",
          f"act must be silu, gelu_tanh or swiglu_oai, got {act!r}")
    k = {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul"}.get(act, act)
    dt = _act(k, gate_up, y)
    f = int(y.shape[-1])
    check(int(gate_up.shape[-1]) == 2 * f and gate_up.numel == 2 * y.numel, k,
          f"gate_up{gate_up.shape} must be (T, 2F) for y{y.shape}")
    check(act != "swiglu_oai" or limit > 0, k, f"limit must be > 0, got {limit}")
    if pairs:
        check(f % 2 == 0, k, f"pairs need an even F, got {f}")
        v = 2
    else:
        v = _width(dev, k, [f], [gate_up, y])
    (ae, ao), (ye, yo) = (_window(dev, t, k, v) for t in (gate_up, y))
    g_step, u_off = (2, 1) if pairs else (1, f // v)
    clamp = (float(alpha), float(limit)) if act == "swiglu_oai" else (0, 0)
    par = params(dev, [y.numel // v, f // v, ao, clamp[0], yo, g_step, u_off, clamp[1]], owner=y.buf.owner, label=k)
    return _unary_op(dev, k, dt, v, par, ae, ye, y.numel // v)


def gelu_tanh_gate(dev: Device, x: Tensor, e: Tensor, y: Tensor, *, col: int) -> Op:
    """y[t,f] = gelu_tanh(x[t,f]) * e[t, col + f].  x, y (T, F) act (y may alias x); e (T, E) act,
    col + F <= E: Gemma 4's per-layer input gate (e: every layer's inputs, col: this layer's)."""
    k = "gelu_tanh_gate"
    dt = _act(k, x, e, y)
    rows, f = int(x.shape[0]), int(x.shape[-1])
    width = int(e.shape[-1])
    check(x.numel == y.numel == rows * f and e.numel >= rows * width and 0 <= col and col + f <= width, k,
          f"shapes x{x.shape} e{e.shape} y{y.shape}, col {col}")
    v = _width(dev, k, [f, width, col], [x, e, y])
    (ae, ao), (be, bo), (ye, yo) = (_window(dev, t, k, v) for t in (x, e, y))
    par = params(dev, [x.numel // v, f // v, ao, bo, yo, width // v, col // v, 0], owner=y.buf.owner, label=k)
    put, binds = _store(k, "put", ("y", 3, ye), {"a": (1, ae), "b": (2, be)}, {})
    return _op(dev, k, "elementwise.wgsl", k, _vec_header(dt, v) + put, par, binds, x.numel // v)


def _unary_op(dev: Device, k: str, dt: str, v: int, par: Buffer, xe: tuple, ye: tuple, n: int) -> Op:
    """An elementwise.wgsl kernel reading binding 1 and writing binding 2 (or 1, in place)."""
    put, binds = _store(k, "put_u", ("yu", 2, ye), {"a": (1, xe)}, {})
    return _op(dev, k, "elementwise.wgsl", k, _vec_header(dt, v) + put, par, binds, n)


def _unary_f(dev: Device, k: str, x: Tensor, y: Tensor, f: float) -> Op:
    """An elementwise.wgsl unary kernel with one float parameter (p.f0; 0 for those without)."""
    dt = _act(k, x, y)
    check(x.numel == y.numel, k, f"shapes x{x.shape} y{y.shape}")
    v = _width(dev, k, [x.numel], [x, y])
    (xe, xo), (ye, yo) = (_window(dev, t, k, v) for t in (x, y))
    par = params(dev, [x.numel // v, 1, xo, 0, yo, 0, 0, float(f)], owner=y.buf.owner, label=k)
    return _unary_op(dev, k, dt, v, par, xe, ye, x.numel // v)


def scale(dev: Device, x: Tensor, y: Tensor, factor: float) -> Op:
    """y = x * factor (y may alias x)."""
    return _unary_f(dev, "scale", x, y, factor)


def softcap(dev: Device, x: Tensor, y: Tensor, cap: float) -> Op:
    """y = cap * tanh(x / cap) (y may alias x; cap > 0)."""
    check(cap > 0, "softcap", f"cap must be > 0, got {cap}")
    return _unary_f(dev, "softcap", x, y, cap)


def gelu_mul(dev: Device, x: Tensor, y: Tensor) -> Op:
    """y[t,f] = gelu(x[t,f]) * x[t,F+f].  x (T, 2F) rows [input | gate]; y (T, F): ModernBERT's GeGLU."""
    k = "gelu_mul"
    dt = _act(k, x, y)
    f = int(y.shape[-1])
    check(int(x.shape[-1]) == 2 * f and x.numel == 2 * y.numel, k, f"x{x.shape} must be (T, 2F) for y{y.shape}")
    v = _width(dev, k, [f], [x, y])
    (ae, ao), (ye, yo) = (_window(dev, t, k, v) for t in (x, y))
    par = params(dev, [y.numel // v, f // v, ao, 0, yo, 1, f // v, 0], owner=y.buf.owner, label=k)
    return _unary_op(dev, k, dt, v, par, ae, ye, y.numel // v)


def gelu(dev: Device, x: Tensor, y: Tensor) -> Op:
    """y = 0.5 x (1 + erf(x / sqrt 2)) (the exact, erf form of GELU, as BERT uses)."""
    return _unary_f(dev, "gelu", x, y, 0.0)


def gelu_tanh(dev: Device, x: Tensor, y: Tensor) -> Op:
    """y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GELU's tanh form: Phi's gelu_new)."""
    return _unary_f(dev, "gelu_tanh", x, y, 0.0)


def quick_gelu(dev: Device, x: Tensor, y: Tensor) -> Op:
    """y = x sigmoid(1.702 x) (CLIP's quick_gelu: LLaVA's vision tower)."""
    return _unary_f(dev, "quick_gelu", x, y, 0.0)


def tanh(dev: Device, x: Tensor, y: Tensor) -> Op:
    """y = tanh(x) (BERT's pooler, RoBERTa's classification head)."""
    return _unary_f(dev, "tanh_act", x, y, 0.0)
