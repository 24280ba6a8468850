"""What every matmul strategy does around its kernel (select.py's row, tile and decode kernels, gpu.py,
batch.py, tiled.py): the operand checks and the binding windows of x, y and the bias (`operands`),
matmul.wgsl's MatmulParams (`matmul_values`), and the loop over the weight's buffers — each holds a
part of its rows (QWeight.parts) — that packs each dispatch's params and binds them with x, the
part, y and the bias (`dispatch_parts`). Page code: standard library only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ...gpu import Device
from ..common import DTYPE_SIZE, Op, Tensor, check, params, placeholder, window
from .layout import MAX_GROUPS, QWeight


@dataclass(frozen=True)
class Operands:
    """A matmul's checked operands: x has T rows of K columns; the (binding, element offset) windows
    of x, y and the bias (without a bias, the device's placeholder at offset 0)."""

    T: int
    K: int
    xb: tuple
    x_off: int
    yb: tuple
    y_off: int
    bb: object
    b_off: int
    has_bias: bool

    def flags(self, accumulate: bool) -> int:
        """matmul.wgsl's flags: 1 adds the bias, 2 adds to y."""
        return (1 if self.has_bias else 0) | (2 if accumulate else 0)


def operands(dev: Device, x: Tensor, w: QWeight, y: Tensor, bias: Tensor | None, kernel: str, *,
             x_bind: Tensor | None = None, y_shape: bool = True) -> Operands:
    """Check y = x·Wᵀ (+ bias) for `kernel` (x (T, K) with K = w.k a multiple of 4 and T > 0, y (T, N)
    of x's dtype, the bias f32 (N,)) and window its operands. `x_bind`: the tensor bound for x when
    it is not x itself (a fused SiLU·up input binds [gate | up]); `y_shape=False`: y's shape is the
    caller's to check (a fused epilogue stores fewer columns)."""
    T, K = x.shape
    check(K == w.k, kernel, f"x has {K} columns, the weight {w.label!r} has {w.k}")
    check(not y_shape or tuple(y.shape) == (T, w.n), kernel, f"y is {y.shape}, expected ({T}, {w.n})")
    check(x.dtype == y.dtype, kernel, f"x is {x.dtype} but y is {y.dtype}")
    check(T > 0, kernel, "empty input")
    check(K % 4 == 0, kernel, f"K={K} must be a multiple of 4")
    esz = DTYPE_SIZE[x.dtype]
    xb, x_off = window(x if x_bind is None else x_bind, 4 * esz, kernel, "x")
    yb, y_off = window(y, esz, kernel, "y")
    if bias is not None:
        check(bias.dtype == "f32" and bias.numel == w.n, kernel, f"bias must be f32 ({w.n},)")
        bb, b_off = window(bias, 4, kernel, "bias")
    else:
        bb, b_off = placeholder(dev), 0
    return Operands(T, K, xb, x_off, yb, y_off, bb, b_off, bias is not None)


def matmul_values(io: Operands, w: QWeight, r0: int, rows: int, accumulate: bool) -> list:
    """matmul.wgsl's MatmulParams for the part of `rows` rows of w from row r0."""
    K = io.K
    return [K, rows, io.T, w.row_words, io.x_off, io.y_off, w.n, r0, io.b_off, io.flags(accumulate),
            K // 32, K // 4]


def row_groups(per_group: int, kernel: str, gy: int = 1) -> Callable[[int], tuple[int, int]]:
    """The grid of a part of `rows` weight rows: a workgroup per `per_group` rows (at most 65535),
    by `gy`."""
    def grid(rows: int) -> tuple[int, int]:
        groups = -(-rows // per_group)
        check(groups <= MAX_GROUPS, kernel, f"{rows} rows need more than 65535 workgroups")
        return groups, gy
    return grid


def dispatch_parts(dev: Device, op: Op, pipe, w: QWeight, y: Tensor, io: Operands, kernel: str,
                   grid: Callable[[int], tuple[int, int]], *, accumulate: bool = False,
                   blocks: Callable[[int, int], Iterable[list]] | None = None, extra: dict | None = None,
                   bind_bias: bool = True) -> Op:
    """For each buffer of w and its part (r0, rows): the workgroups `grid(rows)`, and a dispatch of
    `pipe` per params `blocks(r0, rows)` yields (default: one, matmul_values), each params buffer
    (labelled `kernel[w.label]`) bound with x, the part, y and the bias (bindings 0-4; `extra`:
    more bindings; `bind_bias=False`: no binding 4). Returns `op` with the dispatches added."""
    for buf, (r0, rows) in zip(w.bufs, w.parts):
        gx, gy = grid(rows)
        for values in ([matmul_values(io, w, r0, rows, accumulate)] if blocks is None else blocks(r0, rows)):
            p = params(dev, values, owner=y.buf.owner, label=f"{kernel}[{w.label}]")
            op.buffers.append(p)
            if extra is None:
                entries = [p, io.xb, buf, io.yb, io.bb]
            else:
                entries = {0: p, 1: io.xb, 2: buf, 3: io.yb, 4: io.bb, **extra}
            if not bind_bias:
                del entries[4]
            op.add(pipe, dev.bind(pipe, entries), gx, gy)
    return op


__all__ = ["Operands", "operands", "matmul_values", "row_groups", "dispatch_parts"]
