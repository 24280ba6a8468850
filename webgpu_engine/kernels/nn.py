"""Host functions for the transformer's non-matmul kernels: norms, elementwise ops, RoPE, KV-cache
writes, attention (causal prefill, split-key decode, bidirectional) and pooling.

Each function checks shapes, writes its parameters into a uniform buffer once, builds its bind
group once and returns an `Op`; per-step values (pos0, n_new) come from the `step` buffer, so a
decode op built once stays right while the context grows. Tensors may sit at any element offset
of their buffer: bindings start at the offset rounded down to the device's alignment and the kernel
gets the remainder. Norm, elementwise, rope and pooling bind activations read_write so that an
output may alias an input (WebGPU forbids one buffer bound read-only and read_write in the same
dispatch); attention binds qkv and the caches read-only, so its `out` must live in another buffer.

Decode dispatches per Llama layer from this module, where the matmuls take no epilogues (GPU
adapters): rms_norm 1 + rope_kv 1 (rope and kv_write fused) + attention 2 (split + combine; 1 while
the context is short) + rms_norm 1 + silu_mul 1 = 6. On CPU adapters the decode matmuls absorb
rope_kv, silu_mul and both norms (kernels/matmul/epilogues.py), leaving attention alone.
"""
from __future__ import annotations

import struct

from ..gpu import Buffer, Device
from ..gpu.shaders import load_shader_source
from .common import DTYPE_SIZE, Op, Tensor, act_header, check, params

WG = 64
MAX_WG = 65535
_MAX_LANE_DIMS = 256      # attention: query dims one lane holds (heads_per_lane * head_dim)

__all__ = ["rms_norm", "head_rms_norm", "layer_norm", "add", "bias_add", "silu_mul", "scale", "softcap",
           "gelu", "rope", "rope_kv",
           "kv_write", "attention", "attention_bidir", "mean_pool", "cls_pool", "max_pool",
           "l2_normalize", "decode_splits"]


# ----------------------------------------------------------------------------- helpers
def _grid(n: int, kernel: str) -> tuple[int, int]:
    """Workgroups (x, y) covering n invocations of WG each, within 65535 per dimension."""
    groups = max(1, -(-int(n) // WG))
    x = min(groups, MAX_WG)
    y = -(-groups // x)
    check(y <= MAX_WG, kernel, f"{n} invocations exceed the dispatch limit")
    return x, y


def _window(dev: Device, t: Tensor, kernel: str, vec: int = 1) -> tuple[tuple, int]:
    """(bind-group entry, element offset in units of `vec` elements) for tensor t."""
    align = int(dev.limits.get("min-storage-buffer-offset-alignment", 256))
    base = t.offset - t.offset % align
    unit = DTYPE_SIZE[t.dtype] * vec
    check((t.offset - base) % unit == 0, kernel,
          f"tensor offset {t.offset} B is not a multiple of {unit} B (needed for {vec}-wide loads)")
    end = min(t.buf.size, (t.offset + t.nbytes + 3) & ~3)
    check(t.offset + t.nbytes <= t.buf.size, kernel,
          f"tensor {t.shape} at offset {t.offset} overruns its {t.buf.size} B buffer")
    return (t.buf, base, end - base), (t.offset - base) // unit


def _step_entry(step) -> tuple:
    if isinstance(step, Tensor):
        return (step.buf, step.offset, 16)
    check(isinstance(step, Buffer) and step.size >= 16, "step", "step must be a Buffer of >= 16 bytes")
    return (step, 0, 16)


def _vec_entry(dev: Device, t: Tensor, kernel: str) -> tuple:
    """A u32 vector bound read-only from its own offset (sequence lengths)."""
    align = int(dev.limits.get("min-storage-buffer-offset-alignment", 256))
    check(t.offset % align == 0, kernel, f"lengths must start at a multiple of {align} B, not {t.offset}")
    return (t.buf, t.offset, (t.nbytes + 3) & ~3)


def _act(kernel: str, *ts: Tensor) -> str:
    dt = ts[0].dtype
    for t in ts:
        check(t.dtype == dt, kernel, f"activation dtypes differ: {[x.dtype for x in ts]}")
    check(dt in ("f32", "f16"), kernel, f"activation dtype must be f32 or f16, got {dt}")
    return dt


def _vec_header(dt: str, w: int) -> str:
    """Storage type `av` moving w (1, 2 or 4) elements per load, its f32 twin `fv`, and `hsum`."""
    if w == 2:
        return act_header(dt) + ("const W: u32 = 2u;\nalias av = vec2<act>;\nalias fv = vec2<f32>;\n"
                                 "fn hsum(v: fv) -> f32 { return v.x + v.y; }\n")
    if w == 4:
        return act_header(dt) + ("const W: u32 = 4u;\nalias av = act4;\nalias fv = vec4<f32>;\n"
                                 "fn hsum(v: fv) -> f32 { return v.x + v.y + v.z + v.w; }\n")
    return act_header(dt) + ("const W: u32 = 1u;\nalias av = act;\nalias fv = f32;\n"
                             "fn hsum(v: fv) -> f32 { return v; }\n")


def _width(dev: Device, k: str, sizes, tensors) -> int:
    """4 when every size and tensor offset allows 4-wide loads (lavapipe runs them much faster), else 1."""
    align = int(dev.limits.get("min-storage-buffer-offset-alignment", 256))
    ok = all(int(n) % 4 == 0 for n in sizes) and all(
        (t.offset % align) % (4 * DTYPE_SIZE[t.dtype]) == 0 for t in tensors)
    return 4 if ok else 1


def _rows_cols(t: Tensor) -> tuple[int, int]:
    cols = int(t.shape[-1])
    return t.numel // max(cols, 1), cols


def _op(dev: Device, name: str, file: str, entry: str, header: str, par: Buffer, entries,
        n_inv: int, constants=None) -> Op:
    """One dispatch; `entries` go to bindings 1.. (a list) or to the bindings a mapping names."""
    pipe = dev.pipeline(file, entry, constants, header=header)
    op = Op(name=name)
    op.buffers.append(par)
    x, y = _grid(n_inv, name)
    binds = {0: par, **entries} if isinstance(entries, dict) else [par] + list(entries)
    op.add(pipe, dev.bind(pipe, binds), x, y)
    return op


def _store(kernel: str, fn: str, out: tuple[str, int, tuple | None], ins: dict[str, tuple[int, tuple]],
           others: dict[int, tuple]) -> tuple[str, dict]:
    """The WGSL writers of elementwise.wgsl / norm.wgsl and a kernel's bindings. The kernel's writer
    `fn` stores the output (var name, binding, window) through its own binding, or, when its window
    is an input's (an in-place op), through that input's binding, its own left out: WebGPU forbids
    one buffer range bound writable twice in a dispatch (the browser's Dawn refuses it). The other
    writers keep their own bindings, so every entry point of the module validates."""
    var, binding, win = out
    binds = dict(others)
    binds.update({b: e for b, e in ins.values()})
    target = var
    for name, (_, e) in ins.items():
        if win is not None and e[0] is win[0] and e[1] < win[1] + win[2] and win[1] < e[1] + e[2]:
            check(e == win, kernel, "the output overlaps an input without being the same tensor")
            target = name
    if target == var and win is not None:
        binds[binding] = win
    writers = _WRITERS["norm" if fn == "put_norm" else "elementwise"]
    text = "".join(f"fn {f}(i: u32, v: av) {{ {target if f == fn else v}[i] = v; }}\n"
                   for f, v in writers.items())
    return text, binds


_WRITERS = {"elementwise": {"put": "y", "put_bias": "y", "put_u": "yu"}, "norm": {"put_norm": "y"}}


# ----------------------------------------------------------------------------- norms
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
                  head_dim: int, eps: float) -> Op:
    """In place on qkv (T, H_all, D): rms_norm over each q head with w[:D] and each following k head
    with w[D:] (Qwen3's and Gemma 3's q_norm / k_norm, applied before RoPE); v heads untouched."""
    k = "head_rms_norm"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    n = n_q_heads + n_k_heads
    check(n <= heads and w.numel == 2 * head_dim and w.dtype == "f32", k,
          f"qkv{qkv.shape} with {n} normed heads of {head_dim}, w{w.shape}/{w.dtype}")
    v = _width(dev, k, [head_dim], [qkv, w])
    (xe, xo), (we, wo) = (_window(dev, t, k, v) for t in (qkv, w))
    par = params(dev, [rows * n, head_dim // v, xo, heads, n, n_q_heads, float(eps), wo],
                 owner=qkv.buf.owner, label=k)
    put, binds = _store(k, "put_norm", ("y", 3, None), {"x": (1, xe)}, {2: we})
    return _op(dev, k, "norm.wgsl", k, _vec_header(dt, v) + put, par, binds, rows * n)


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


# ----------------------------------------------------------------------------- elementwise
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


def silu_mul(dev: Device, gate_up: Tensor, y: Tensor, *, pairs: bool = False, act: str = "silu") -> Op:
    """y[t,f] = silu(gate_up[t,f]) * gate_up[t,F+f].  gate_up (T, 2F) rows [gate | up]; y (T, F).
    pairs: gate_up rows are gate and up interleaved in pairs (g 2j, g 2j+1, u 2j, u 2j+1, ...),
    the layout of a weight uploaded for the decode matmul's silu epilogue (kernels/matmul/epilogues.py).
    act "gelu_tanh": GeGLU, GELU's tanh form in place of silu (Gemma)."""
    check(act in ("silu", "gelu_tanh"), "silu_mul", f"act must be silu or gelu_tanh, got {act!r}")
    k = "silu_mul" if act == "silu" else "gelu_tanh_mul"
    dt = _act(k, gate_up, y)
    f = int(y.shape[-1])
    check(int(gate_up.shape[-1]) == 2 * f and gate_up.numel == 2 * y.numel, k,
          f"gate_up{gate_up.shape} must be (T, 2F) for y{y.shape}")
    if pairs:
        check(f % 2 == 0, k, f"pairs need an even F, got {f}")
        v = 2
    else:
        v = _width(dev, k, [f], [gate_up, y])
    (ae, ao), (ye, yo) = (_window(dev, t, k, v) for t in (gate_up, y))
    g_step, u_off = (2, 1) if pairs else (1, f // v)
    par = params(dev, [y.numel // v, f // v, ao, 0, yo, g_step, u_off, 0], owner=y.buf.owner, label=k)
    return _unary_op(dev, k, dt, v, par, ae, ye, y.numel // v)


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


def tanh(dev: Device, x: Tensor, y: Tensor) -> Op:
    """y = tanh(x) (BERT's pooler, RoBERTa's classification head)."""
    return _unary_f(dev, "tanh_act", x, y, 0.0)


# ----------------------------------------------------------------------------- rope and kv cache
def rope_frequencies(dev: Device, rot_dim: int, base: float, *, owner: str, factors=None) -> Buffer:
    """The f32 table of rot_dim/2 RoPE frequencies base^(-2i/rot_dim) that rope kernels bind, each
    divided by `factors[i]` when given (RoPE scaling: Llama 3.1+'s rope_freqs, linear scaling)."""
    # Computed on the host in float64 and rounded once, so every device (and the numpy reference)
    # multiplies the same f32 frequencies: at pos ~4000 a 1-ulp frequency error moves the angle 2e-4.
    half = rot_dim // 2
    check(factors is None or len(factors) == half, "rope", f"need {half} frequency factors")
    vals = [float(base) ** (-(2.0 * i) / rot_dim) / (float(factors[i]) if factors else 1.0)
            for i in range(half)] or [0.0]
    return dev.upload(struct.pack(f"<{len(vals)}f", *vals), owner=owner, label="rope.inv_freq")


def _qkv_heads(k: str, qkv: Tensor, head_dim: int) -> tuple[int, int]:
    check(len(qkv.shape) in (2, 3), k, f"qkv must be (T, H_all, D) or (T, H_all*D), got {qkv.shape}")
    rows = int(qkv.shape[0])
    width = qkv.numel // max(rows, 1)
    check(width % head_dim == 0, k, f"qkv row of {width} is not a whole number of {head_dim}-wide heads")
    return rows, width // head_dim


def _rope_op(dev, k, entry, qkv, step, *, h_lo, n_h, n_rot, head_dim, rot_dim, base, neox,
             k_lo=0, n_kv=0, ctx=0, caches=None, factors=None, mscale=1.0) -> Op:
    dt = _act(k, qkv, *(caches or ()))
    rows, heads = _qkv_heads(k, qkv, head_dim)
    check(head_dim % 2 == 0 and rot_dim % 2 == 0 and 0 <= rot_dim <= head_dim, k,
          f"need even rot_dim <= head_dim, got rot_dim={rot_dim} head_dim={head_dim}")
    check(not neox or rot_dim % 4 == 0, k, f"neox rope needs rot_dim % 4 == 0, got {rot_dim}")
    check(h_lo + n_h <= heads, k, f"heads [{h_lo}, {h_lo + n_h}) exceed the {heads} heads of a qkv row")
    owner = qkv.buf.owner
    qe, qo = _window(dev, qkv, k, 2)
    entries = [_step_entry(step), qe]
    kco = vco = 0
    if entry != "kv_write":
        freq = rope_frequencies(dev, rot_dim, base, owner=owner, factors=factors)
        entries.append((freq, 0, freq.size))
    if caches is not None:
        for c in caches:
            check(c.numel == n_kv * ctx * head_dim, k,
                  f"cache {c.shape} must be (Hkv={n_kv}, ctx={ctx}, D={head_dim})")
        (ke, kco), (ve, vco) = _window(dev, caches[0], k, 2), _window(dev, caches[1], k, 2)
        entries += [ke, ve]
    half = rot_dim // 2
    # units per head: vec2 pairs, except that a neox head's rotated part goes in quads
    units = half // 2 + (head_dim - rot_dim) // 2 if neox else head_dim // 2
    par = params(dev, [rows, heads, head_dim // 2, half, h_lo, n_h, n_rot, int(bool(neox)),
                       k_lo, n_kv, ctx, qo, kco, vco, units, float(mscale)], owner=owner, label=k)
    op = _op(dev, k, "rope.wgsl", entry, act_header(dt) + load_shader_source("sincos.wgsl"), par, entries,
             rows * n_h * units)
    if entry != "kv_write":
        op.buffers.append(freq)
    return op


def rope(dev: Device, qkv: Tensor, step, *, n_heads: int, head_dim: int, rot_dim: int | None = None,
         base: float = 10000.0, neox: bool = False, factors=None, mscale: float = 1.0) -> Op:
    """Rotates, in place, the first `n_heads` heads (q then k) of each row of qkv (T, H_all, D);
    row t has position step.pos0 + t (step[3] = S > 0: pos0 + t % S, for B padded sequences of S rows). neox=False: adjacent pairs (GGUF llama layout); True: half split.
    `factors`: RoPE scaling, frequency i divided by factors[i] (see rope_frequencies); `mscale`:
    the rotated values multiplied by it (longrope's attention factor)."""
    rot = head_dim if rot_dim is None else rot_dim
    return _rope_op(dev, "rope", "rope", qkv, step, h_lo=0, n_h=n_heads, n_rot=n_heads,
                    head_dim=head_dim, rot_dim=rot, base=base, neox=neox, factors=factors, mscale=mscale)


def kv_write(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
             n_kv_heads: int, head_dim: int, ctx: int) -> Op:
    """Copies the k and v heads of qkv rows (T, Hq+2Hkv, D) into caches (Hkv, ctx, D) at rows pos0+t."""
    return _rope_op(dev, "kv_write", "kv_write", qkv, step, h_lo=n_q_heads, n_h=2 * n_kv_heads,
                    n_rot=0, head_dim=head_dim, rot_dim=0, base=1.0, neox=False, k_lo=n_q_heads,
                    n_kv=n_kv_heads, ctx=ctx, caches=(k_cache, v_cache))


def rope_kv(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
            n_kv_heads: int, head_dim: int, ctx: int, rot_dim: int | None = None,
            base: float = 10000.0, neox: bool = False, factors=None, mscale: float = 1.0) -> Op:
    """rope on the q and k heads followed by kv_write, fused into one dispatch (the decode path)."""
    rot = head_dim if rot_dim is None else rot_dim
    n_rot = n_q_heads + n_kv_heads
    return _rope_op(dev, "rope_kv", "rope_kv", qkv, step, h_lo=0, n_h=n_q_heads + 2 * n_kv_heads,
                    n_rot=n_rot, head_dim=head_dim, rot_dim=rot, base=base, neox=neox,
                    k_lo=n_q_heads, n_kv=n_kv_heads, ctx=ctx, caches=(k_cache, v_cache), factors=factors,
                    mscale=mscale)


# ----------------------------------------------------------------------------- attention
def decode_splits(ctx: int, *, min_chunk: int = 32, max_splits: int = 128) -> tuple[int, int]:
    """(keys per split, number of splits) of the decode path for a cache of ctx rows: chunks of at
    least `min_chunk` keys (per-device tuning), at most `max_splits` partials to combine."""
    chunk = max(min_chunk, -(-ctx // max_splits))
    return chunk, -(-ctx // chunk)


def _attn_header(dt: str, head_dim: int, g: int = 1, split_wg: int = WG, packed: bool = False,
                 windowed: bool = False, capped: bool = False, kv: tuple = ("kc", "vc")) -> str:
    """Constants plus the state of g heads unrolled into vec4 registers (see attention.wgsl).
    packed: f16 keys and values are read as vec4<u32> (8 halves per load; kr, vr even).
    kv: the arrays keys and values are read from (attention_flash.wgsl: its workgroup tiles)."""
    n = head_dim // 4
    r, gs = range(n), range(g)
    sv = "f32" if g == 1 else f"vec{g}<f32>"
    comp = (lambda v, j: v) if g == 1 else (lambda v, j: f"{v}[{j}]")
    out = [act_header(dt), f"const D4: u32 = {n}u;", f"const G: u32 = {g}u;", f"const SWG: u32 = {split_wg}u;",
           f"const WINDOWED: bool = {str(bool(windowed)).lower()};", f"const CAPPED: bool = {str(bool(capped)).lower()};",
           f"alias sv = {sv};",
           "fn sv_get(v: sv, g: u32) -> f32 { return " + ("v" if g == 1 else "v[g]") + "; }"]
    out += [f"var<private> q{j}_{i}: vec4<f32>;\nvar<private> a{j}_{i}: vec4<f32>;" for j in gs for i in r]
    out.append("fn load_q(qb: u32, qs: u32) {\n" + "".join(
        f"  q{j}_{i} = vec4<f32>(qkv[qb + {j}u * qs + {i}u]) * p.scale; a{j}_{i} = vec4<f32>(0.0);\n"
        for j in gs for i in r) + "  m_run = sv(-3.0e38); l_run = sv(0.0);\n}")
    def loads(name, buf, base):
        if not packed:
            return "".join(f"  let {name}{i} = vec4<f32>({buf}[{base} + {i}u]);\n" for i in r)
        return "".join(f"  let w{i} = {buf}p[{base} / 2u + {i}u];\n"
                       f"  let {name}{2 * i} = vec4<f32>(unpack2x16float(w{i}.x), unpack2x16float(w{i}.y));\n"
                       f"  let {name}{2 * i + 1} = vec4<f32>(unpack2x16float(w{i}.z), unpack2x16float(w{i}.w));\n"
                       for i in range(n // 2))
    out.append("fn qk(kr: u32) -> sv {\n" + loads("k", kv[0], "kr")
               + "  return sv(" + ", ".join(" + ".join(f"dot(q{j}_{i}, k{i})" for i in r) for j in gs)
               + ");\n}")
    out.append("fn acc_scale(c: sv) {\n" + "".join(f"  a{j}_{i} *= {comp('c', j)};\n" for j in gs for i in r)
               + "}")
    out.append("fn acc_add(wt: sv, vr: u32) {\n" + loads("v", kv[1], "vr")
               + "".join(f"  a{j}_{i} += {comp('wt', j)} * v{i};\n" for j in gs for i in r) + "}")
    cases = [(j * n + i, f"a{j}_{i}") for j in gs for i in r]
    out.append("fn acc_get(g: u32, d: u32) -> vec4<f32> {\n  switch g * D4 + d {\n" + "".join(
        f"    case {c}u: {{ return {v}; }}\n" for c, v in cases[:-1])
        + f"    default: {{ return {cases[-1][1]}; }}\n  }}\n}}")
    return "\n".join(out) + "\n"


def _heads_per_lane(k: str, group: int, head_dim: int, g: int | None) -> int:
    """The q heads of one kv head a lane serves: `g` if given, else the most (up to 4) dividing the
    group within _MAX_LANE_DIMS query dims (the paged kernels choose the same way)."""
    g = g or max(d for d in (1, 2, 3, 4) if group % d == 0 and (d == 1 or d * head_dim <= _MAX_LANE_DIMS))
    check(group % g == 0, k, f"heads_per_lane {g} must divide Hq/Hkv = {group}")
    check(g == 1 or g * head_dim <= _MAX_LANE_DIMS, k,
          f"heads_per_lane {g} x head_dim {head_dim} exceeds {_MAX_LANE_DIMS} dims per lane")
    return g


def flash_attention(dev: Device) -> bool:
    """Whether prefill attention stages key tiles in workgroup memory (shaders/attention_flash.wgsl):
    where the matmuls run the GPU kernel family (kernels/matmul/config.py kernel_family). The CPU family
    keeps attn_causal, so that CPU adapters run exactly what they ran before the families."""
    from .matmul import is_cpu_adapter, kernel_family     # the matmul package does not import this module
    family = kernel_family(dev)
    return family == "gpu" or family == "tuned" and not is_cpu_adapter(dev)


def attention(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, step, *,
              n_q_heads: int, n_kv_heads: int, head_dim: int, ctx: int, scale: float,
              max_t: int | None = None, min_chunk: int | None = None, max_splits: int = 128,
              heads_per_lane: int | None = None, split_wg: int | None = None,
              causal: bool = False, window: int = 0, softcap: float = 0.0) -> Op:
    """Causal attention of the q heads of qkv (T, Hq+2Hkv, D) over the caches (Hkv, ctx, D), which
    already hold this step's keys: query t (position pos0+t) sees keys 0..pos0+t; head h reads kv
    head h // (Hq/Hkv). out (T, Hq*D). Rows t >= step.n_new are skipped (n_new 0: all T rows).
    max_t (default T) rows are dispatched; max_t == 1 takes the split-key decode path (2 dispatches),
    sized once for ctx: splits past the live context exit at once; `causal` keeps the prefill
    kernel for one row too (a query's result then does not depend on how many rows run with it:
    every query folds its keys in the same 16-key blocks from key 0). `window` > 0: a sliding
    window, query at position p sees keys p-window+1..p only (Mistral, Gemma's local layers);
    `softcap` > 0: scores s become softcap*tanh(s/softcap) (Gemma 2). f16 caches are read 8 halves
    per load when head_dim % 8 == 0 and the cache offsets are 16-byte aligned.
    Per-device tuning: heads_per_lane (q heads of one kv head served by one lane, which loads each
    key once for them; default the largest divisor of Hq/Hkv up to 4); decode: min_chunk /
    max_splits (keys per split) and split_wg (workgroup size). CPU adapters (lavapipe) default to
    128-key splits in workgroups of 8 (fewer partials, spread over cores), others to 32 and 64."""
    k = "attention"
    dt = _act(k, qkv, k_cache, v_cache, out)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    t_max = rows if max_t is None else int(max_t)
    check(0 < t_max <= rows, k, f"max_t={max_t} must be in 1..{rows}")
    check(head_dim % 4 == 0, k, f"head_dim {head_dim} must be a multiple of 4")
    check(window >= 0 and softcap >= 0, k, f"window {window} and softcap {softcap} must be >= 0")
    check(n_kv_heads > 0 and n_q_heads % n_kv_heads == 0, k,
          f"n_q_heads {n_q_heads} must be a multiple of n_kv_heads {n_kv_heads}")
    check(heads >= n_q_heads + 2 * n_kv_heads, k, f"qkv rows have {heads} heads, need {n_q_heads}+2*{n_kv_heads}")
    check(out.numel >= t_max * n_q_heads * head_dim, k, f"out {out.shape} is smaller than (T, Hq*D)")
    check(all(out.buf is not t.buf for t in (qkv, k_cache, v_cache)), k,
          "out must not share a buffer with qkv or the caches (they are bound read-only)")
    for c in (k_cache, v_cache):
        check(c.numel == n_kv_heads * ctx * head_dim, k,
              f"cache {c.shape} must be (Hkv={n_kv_heads}, ctx={ctx}, D={head_dim})")
    owner = out.buf.owner
    group = n_q_heads // n_kv_heads
    (qe, qo), (ke, ko), (ve, vo), (oe, oo) = (_window(dev, t, k, 4) for t in (qkv, k_cache, v_cache, out))
    # a lane holds G heads' q and accumulator in unrolled vec4 registers; lavapipe computed wrong
    # results from G*D = 384 on (Llama-3's G = 4 x 128, Gemma's 2 x 256), so wide heads share less
    g = _heads_per_lane(k, group, head_dim, heads_per_lane)
    cpu = dev.info.adapter_type.upper() == "CPU"
    # f16 caches are read 8 halves per load when head rows and cache offsets are 16-byte aligned
    packed = dt == "f16" and head_dim % 8 == 0 and ko % 2 == 0 and vo % 2 == 0
    if t_max > 1 or causal:
        n_blk = -(-t_max // WG)
        par = params(dev, [t_max, n_q_heads, group, heads, ctx, 0, 0, float(scale), qo, ko, vo, oo,
                           n_blk, int(window), float(softcap), 0], owner=owner, label=k)
        if flash_attention(dev):     # the same folds, keys and values staged in workgroup memory
            header = _attn_header(dt, head_dim, g, windowed=window > 0, capped=softcap > 0, kv=("ksh", "vsh"))
            return _op(dev, k, "attention_flash.wgsl", "attn_flash", header + load_shader_source("attention.wgsl"),
                       par, [_step_entry(step), qe, ke, ve, oe], n_blk * (n_q_heads // g) * WG)
        return _op(dev, k, "attention.wgsl", "attn_causal",
                   _attn_header(dt, head_dim, g, packed=packed, windowed=window > 0, capped=softcap > 0),
                   par, [_step_entry(step), qe, ke, ve, oe], n_blk * (n_q_heads // g) * WG)
    min_chunk = min_chunk or (128 if cpu else 32)
    chunk, n_splits = decode_splits(ctx, min_chunk=min_chunk, max_splits=max_splits)
    part = dev.buffer(n_q_heads * n_splits * (head_dim // 4 + 1) * 16, owner=owner, label="attention.partials")
    par = params(dev, [1, n_q_heads, group, heads, ctx, chunk, n_splits, float(scale), qo, ko, vo, oo,
                       0, int(window), float(softcap), 0], owner=owner, label=k)
    swg = split_wg or (8 if cpu else WG)
    header = _attn_header(dt, head_dim, g, swg, packed, windowed=window > 0, capped=softcap > 0)
    entries = [_step_entry(step), qe, ke, ve, (part, 0, part.size)]
    pipe = dev.pipeline("attention.wgsl", "attn_split", header=header)
    op = Op(name=k, buffers=[par])
    x, y = _grid(-(-n_splits * n_q_heads // g // swg) * WG, k)
    op.add(pipe, dev.bind(pipe, [par] + entries), x, y)
    comb = dev.pipeline("attention.wgsl", "attn_combine", header=header)
    x, y = _grid(n_q_heads * head_dim // 4, k)
    op.add(comb, dev.bind(comb, [par, _step_entry(step), (part, 0, part.size), oe]), x, y)
    op.buffers.append(part)
    # the short form for steps whose live keys fit the splits one workgroup holds (one split on a
    # GPU, where the lanes of a workgroup run in parallel; on a CPU adapter a workgroup's lanes take
    # turns, so several splits in one workgroup gain nothing): one dispatch, no partials
    n_hg = n_q_heads // g
    one = dev.pipeline("attention.wgsl", "attn_decode1", header=header)
    x, y = _grid(-(-n_hg // swg) * WG, k)
    op.short = [(one, dev.bind(one, [par, _step_entry(step), qe, ke, ve, oe]), x, y, 1)]
    op.max_keys = chunk * (max(1, swg // n_hg) if cpu else 1)
    return op


def attention_bidir(dev: Device, qkv: Tensor, lengths: Tensor, out: Tensor, *, batch: int, seq: int,
                    n_heads: int, head_dim: int, scale: float, queries_per_lane: int = 2, window: int = 0) -> Op:
    """BERT self-attention over B sequences padded to S: qkv (B*S, 3*H*D) rows [q | k | v];
    key j of sequence b is visible iff j < lengths[b] (u32). out (B*S, H*D); padded query rows
    get finite values. queries_per_lane (1..4, per-device tuning): consecutive queries one lane
    serves, loading each key once for them. window > 0: query i also sees only keys with
    |j - i| <= window (ModernBERT's local layers; one query per lane then)."""
    k = "attention_bidir"
    dt = _act(k, qkv, out)
    rows = batch * seq
    check(head_dim % 4 == 0, k, f"head_dim {head_dim} must be a multiple of 4")
    check(qkv.numel == rows * 3 * n_heads * head_dim, k,
          f"qkv {qkv.shape} must be (B*S={rows}, 3*H*D={3 * n_heads * head_dim})")
    check(out.numel == rows * n_heads * head_dim, k, f"out {out.shape} must be (B*S, H*D)")
    check(out.buf is not qkv.buf, k, "out must not share a buffer with qkv (bound read-only)")
    check(lengths.numel >= batch, k, f"lengths {lengths.shape} must hold B={batch} entries")
    check(1 <= queries_per_lane <= 4, k, f"queries_per_lane must be 1..4, got {queries_per_lane}")
    check(window >= 0, k, f"window must be >= 0, got {window}")
    queries_per_lane = 1 if window else min(queries_per_lane, seq)     # the kernel needs S >= queries per lane
    (qe, qo), (oe, oo) = _window(dev, qkv, k, 4), _window(dev, out, k, 4)
    n_blk = -(-seq // (WG * queries_per_lane))
    par = params(dev, [rows, n_heads, 1, 3 * n_heads, seq, 0, 0, float(scale), qo, qo, qo, oo,
                       n_blk, int(window), 0, 0], owner=out.buf.owner, label=k)
    # the qkv window is bound as q, k and v source alike (the kernel shares code with attn_causal)
    header = _attn_header(dt, head_dim, queries_per_lane, windowed=window > 0)
    return _op(dev, k, "attention.wgsl", "attn_bidir", header, par,
               [_vec_entry(dev, lengths, k), qe, qe, qe, oe], batch * n_blk * n_heads * WG)


# ----------------------------------------------------------------------------- pooling
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
