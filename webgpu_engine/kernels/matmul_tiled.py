"""Tiled matmul for T > 1 (prefill, BERT encoders): y = x·Wᵀ with each weight block decoded once per tile.

`matmul(dev, x, w, y, bias=, accumulate=)` has the semantics of `matmul.matmul` and returns None
where it does not apply (T == 1, unsupported weight type or shape) so that the caller falls back.
The kernel (`shaders/matmul_tiled.wgsl`) stages a (TM, 32) tile of x in workgroup memory per K chunk
and lets every invocation own one weight row: the row's 32 weights are decoded once into registers
and multiplied with all TM activation rows. Tile sizes are per-device parameters (`TiledConfig`).
Page code: standard library only; `matmul.py` is not imported here (it delegates to this module).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..gpu import Buffer, Device
from .common import DTYPE_SIZE, Op, Tensor, act_header, check, params

if TYPE_CHECKING:  # pragma: no cover
    from .matmul import QWeight

QTYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
_QK = {"q4_0": 32, "q4_1": 32, "q8_0": 32, "q4_k": 256, "q6_k": 256}   # weights per block
_BIND_ALIGN = 256          # WebGPU's default minStorageBufferOffsetAlignment
_MAX_GROUPS = 65535
_MAX_TM = 16               # accumulators written out in the shader


@dataclass
class TiledConfig:
    """Per-device tile: `tm` activation rows per workgroup (the accumulators each invocation keeps
    in registers, 1..16) and `wg` invocations per workgroup, each owning one weight row. A larger
    `tm` reads the weights fewer times; a larger `wg` amortises the staging of each x tile (and its
    two barriers) over more rows but leaves fewer workgroups for the driver's threads."""

    tm: int = 8
    wg: int = 64


def default_config(dev: Device) -> TiledConfig:
    """The tile for `dev`. lavapipe (CPU, 8-wide SIMD, a workgroup per thread): 8 accumulators fit
    the 16 AVX2 registers with the decoded weight and the broadcast x (bench/prefill.py)."""
    return TiledConfig()


# --------------------------------------------------------------------------- helpers
_dummies: "weakref.WeakKeyDictionary[Device, Buffer]" = weakref.WeakKeyDictionary()


def _dummy(dev: Device) -> Buffer:
    """A 16-byte storage buffer bound where the optional bias is absent."""
    b = _dummies.get(dev)
    if b is None or not b.alive:
        b = dev.buffer(16, owner="kernels", label="unused-binding")
        _dummies[dev] = b
    return b


def _window(t: Tensor, unit: int, name: str):
    """(binding, offset in `unit`-byte elements) of a tensor: binding offsets must be 256-aligned,
    so bind from the aligned offset below and pass the rest to the kernel."""
    base = t.offset & ~(_BIND_ALIGN - 1)
    rest = t.offset - base
    check(rest % unit == 0, "matmul_tiled", f"{name} offset {t.offset} is not a multiple of {unit} bytes")
    size = (rest + t.nbytes + 3) & ~3
    return (t.buf, base, size), rest // unit


# how the kernel reads 4 activations: f16 as a pair of u32 words (CPU drivers load storage one
# component at a time, so 2 words beat 4 halves), f32 as a vec4
_XREAD = {
    "f32": "alias xword = vec4<f32>;\nfn xget(i: u32) -> vec4<f32> { return x[i]; }\n",
    "f16": "alias xword = vec2<u32>;\nfn xget(i: u32) -> vec4<f32> {\n    let p = x[i];\n"
           "    return vec4<f32>(unpack2x16float(p.x), unpack2x16float(p.y));\n}\n",
}


def _pipeline(dev: Device, qtype: str, dtype: str, k: int, cfg: TiledConfig):
    nch = -(-k // 32)
    # the K loop written out (one pipeline per K): see `step` in the shader for why
    steps = "".join(f"    step({c}u, {c % 2}u, base, t0, lid);\n" for c in range(nch))
    header = (f"{act_header(dtype)}const TM: u32 = {cfg.tm}u;\nconst WG: u32 = {cfg.wg}u;\n"
              f"const NCH: u32 = {nch}u;\n{_XREAD[dtype]}"
              f"fn wblock(base: u32, c: u32) -> array<vec4<f32>, 8> {{ return wb_{qtype}(base, c); }}\n"
              f"fn chunks(base: u32, t0: u32, lid: u32) {{\n{steps}}}\n")
    return dev.pipeline("matmul_tiled.wgsl", "matmul_tiled", header=header)


def supports(w: "QWeight", T: int) -> bool:
    """Whether `matmul` below handles this weight at T activation rows (else it returns None)."""
    if T <= 1 or w.qtype not in QTYPES:
        return False
    qk = _QK.get(w.qtype, 4)
    return w.k % qk == 0


def matmul(dev: Device, x: Tensor, w: "QWeight", y: Tensor, *, bias: Tensor | None = None,
           accumulate: bool = False, config: TiledConfig | None = None) -> Op | None:
    """y = x·Wᵀ (+ bias); with `accumulate`, y += x·Wᵀ (+ bias). x (T, K), W (N, K), y (T, N).
    None when the tiled kernel does not apply (T == 1, or a weight it cannot read)."""
    check(len(x.shape) == 2 and len(y.shape) == 2, "matmul_tiled", f"x {x.shape} and y {y.shape} must be 2-D")
    T, K = x.shape
    if not supports(w, T):
        return None
    cfg = config or default_config(dev)
    check(1 <= cfg.tm <= _MAX_TM and 1 <= cfg.wg <= 1024, "matmul_tiled", f"unsupported tile {cfg}")
    check(K == w.k, "matmul_tiled", f"x has {K} columns, the weight {w.label!r} has {w.k}")
    check(tuple(y.shape) == (T, w.n), "matmul_tiled", f"y is {y.shape}, expected ({T}, {w.n})")
    check(x.dtype == y.dtype, "matmul_tiled", f"x is {x.dtype} but y is {y.dtype}")
    check(K % 4 == 0, "matmul_tiled", f"K={K} must be a multiple of 4")
    esz = DTYPE_SIZE[x.dtype]
    xb, x_off = _window(x, 4 * esz, "x")
    yb, y_off = _window(y, esz, "y")
    if bias is not None:
        check(bias.dtype == "f32" and bias.numel == w.n, "matmul_tiled", f"bias must be f32 ({w.n},)")
        bb, b_off = _window(bias, 4, "bias")
    else:
        bb, b_off = _dummy(dev), 0
    tiles = -(-T // cfg.tm)
    check(tiles <= _MAX_GROUPS, "matmul_tiled", f"T={T} needs more than 65535 tiles of {cfg.tm} rows")
    pipe = _pipeline(dev, w.qtype, x.dtype, K, cfg)
    flags = (1 if bias is not None else 0) | (2 if accumulate else 0)
    op = Op(name=f"matmul_tiled[{w.label}]")
    for buf, (r0, rows) in zip(w.bufs, w.parts):
        groups = -(-rows // cfg.wg)
        check(groups <= _MAX_GROUPS, "matmul_tiled", f"{rows} rows need more than 65535 workgroups")
        p = params(dev, [K, rows, T, w.row_words, x_off, y_off, w.n, r0, b_off, flags, -(-K // 32), K // 4],
                   owner=y.buf.owner, label=f"matmul_tiled[{w.label}]")
        op.buffers.append(p)
        op.add(pipe, dev.bind(pipe, [p, xb, buf, yb, bb]), groups, tiles)
    return op


__all__ = ["QTYPES", "TiledConfig", "default_config", "supports", "matmul"]
