"""Shared host-side helpers of the non-matmul kernels (norm.py, elementwise.py, rope.py,
attention.py, pooling.py; kernels/attention_paged.py too): dispatch grids, bind-group windows of
tensors at any element offset, activation dtype checks, vector-width headers, one-dispatch ops and
the WGSL output writers of elementwise.wgsl / norm.wgsl.

Tensors may sit at any element offset of their buffer: bindings start at the offset rounded down to
the device's alignment and the kernel gets the remainder.
"""
from __future__ import annotations

from ..gpu import Buffer, Device
from .common import DTYPE_SIZE, Op, Tensor, act_header, check

WG = 64
MAX_WG = 65535


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


def _qkv_heads(k: str, qkv: Tensor, head_dim: int) -> tuple[int, int]:
    check(len(qkv.shape) in (2, 3), k, f"qkv must be (T, H_all, D) or (T, H_all*D), got {qkv.shape}")
    rows = int(qkv.shape[0])
    width = qkv.numel // max(rows, 1)
    check(width % head_dim == 0, k, f"qkv row of {width} is not a whole number of {head_dim}-wide heads")
    return rows, width // head_dim
