"""Batched decode matmul: y = x·Wᵀ for 2 ≤ T ≤ 16 activation rows, each weight chunk decoded once.

A decode step of several sequences (continuous batching) multiplies a few activation rows by every
weight. The row kernels of select.py read and decode each weight once per row (or per 4 rows);
here each weight chunk is read and decoded once for all T rows. Two variants, chosen per device:

- "tiled": tiled.py's kernel (matmul_tiled.wgsl) with its tile height TM = T rounded up to 2, 4 or
  8 (its default 16-row tile spends most of its work on padding rows at small T). x rows sit in
  workgroup memory and are read at constant addresses, which CPU drivers (lavapipe) broadcast
  instead of gathering lane by lane. A row's sums do not depend on TM, so every T gives the same
  bits per row (the prefill's `row_invariant` matmuls use the same kernel).
- "rows": shaders/matmul_batch.wgsl, no barriers and no workgroup memory: an invocation owns `rr`
  weight rows and all T activation rows in registers; each row's sums are those of the T = 1
  kernels (matmul_decode.wgsl, matmul.wgsl row_sums) in the same order: on lavapipe the same bits
  for every type tried but Q8_0 at K ≤ 1024 (its T = 1 kernel, matmul_decode_v4.wgsl, compiles to
  differently contracted arithmetic: ~1.5e-7 relative). On lavapipe its x loads inside
  the K loop are per-lane gathers, so it loses there; it is the candidate for GPUs, whose loads of
  one address across a SIMD group are broadcast by the hardware (not measured on one yet).

`choose(dev, w, T)` is the seam where a measured, per-adapter choice goes (`PROFILES`, filled by
`bench/kernels.py --batch --tune`); without one: "tiled" on CPU adapters (measured on lavapipe),
"rows" elsewhere. Page code: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...gpu import Device
from ...gpu.shaders import load_shader_source
from ..common import XREAD, Op, Tensor, act_header, check, wmap_header
from ..qtypes import QTYPE
from . import tiled
from .codegen import row_source, weight_source
from .dispatch import dispatch_parts, operands, row_groups
from .layout import QWeight

MAX_T = 16                 # rows of x one dispatch takes (the registers / tile it keeps)
_WG_BYTES = 32768          # workgroup memory WebGPU guarantees: caps the tiled kernel's TM x KB
_MAX_BUCKET = 8            # "tiled": the largest T given a tile of its own (see tiled_config)


@dataclass(frozen=True)
class BatchVariant:
    """`kind` "tiled" or "rows" (see the module docstring); for "rows", `rr` weight rows per
    invocation (1, 2 or 4) and `wg` invocations per workgroup."""

    kind: str = "tiled"
    rr: int = 2
    wg: int = 64

    @property
    def key(self) -> str:
        return "tiled" if self.kind == "tiled" else f"rows-rr{self.rr}-wg{self.wg}"


TILED = BatchVariant("tiled")
ROWS = BatchVariant("rows", rr=2, wg=64)
VARIANTS = (TILED, BatchVariant("rows", rr=1, wg=64), ROWS, BatchVariant("rows", rr=4, wg=32))

# adapter key -> {(qtype, n, k, T bucket): BatchVariant}: measured winners (bench/kernels.py --tune)
PROFILES: dict = {}


def bucket(T: int) -> int:
    """The tile height for T rows: 2, 4, 8 or 16 (few pipelines; at most T - 1 padding rows)."""
    return max(2, 1 << (T - 1).bit_length())


def adapter_key(dev: Device) -> str:
    i = dev.info
    return f"{i.vendor}|{i.architecture}|{i.name}|{i.backend}"


def choose(dev: Device, w: QWeight, T: int) -> BatchVariant:
    """The variant for this device, weight and T: the measured winner stored in PROFILES for this
    adapter and shape, else the default per adapter type."""
    prof = PROFILES.get(adapter_key(dev), {})
    v = prof.get((w.qtype, w.n, w.k, bucket(T)))
    if v is not None:
        return v
    info = dev.info
    cpu = "cpu" in info.adapter_type.lower() or "llvmpipe" in info.name.lower()
    return TILED if cpu else ROWS


def supports(w: QWeight, T: int) -> bool:
    """Whether `matmul` handles this weight at T rows: 1 ≤ T ≤ MAX_T, one weight type (select.py
    runs a MIXED weight one sub-weight at a time)."""
    return 1 <= T <= MAX_T and w.qtype in QTYPE and not w.subs


def tiled_config(dev: Device, qtype: str, T: int) -> tiled.TiledConfig:
    """tiled.py's tile for T rows: its default, with TM the bucket of T when T ≤ 8 (same bits
    per row: only padding rows go). From 9 rows on the default tile stays (16 rows for quantised
    weights, the bucket anyway; 24 for float weights), so that the embedders' 16-row
    buckets keep sharing their pipelines with the larger ones (no compile on a first larger batch)."""
    cfg = tiled.default_config(dev, qtype)
    if T <= _MAX_BUCKET:
        tm = bucket(T)
        cfg = replace(cfg, tm=tm, kb=min(cfg.kb, _WG_BYTES // (tm * 256)))
    return cfg


def matmul(dev: Device, x: Tensor, w: QWeight, y: Tensor, *, bias: Tensor | None = None,
           accumulate: bool = False, variant: BatchVariant | None = None) -> Op | None:
    """y = x·Wᵀ (+ bias); with `accumulate`, y += x·Wᵀ (+ bias). x (T, K) with T ≤ 16, W (N, K),
    y (T, N): the semantics of matmul.matmul without fused inputs or epilogues. None where the
    variant cannot read the weight ("tiled": buffers that are not whole 16-byte words), so that the
    caller falls back to the row kernels."""
    check(len(x.shape) == 2 and len(y.shape) == 2, "matmul_batch", f"x {x.shape} and y {y.shape} must be 2-D")
    T, K = x.shape
    check(supports(w, T), "matmul_batch", f"{w.label}: {T} rows of a {w.qtype} weight (1..{MAX_T} rows of "
          "one weight type)")
    v = variant or choose(dev, w, T)
    check(v.kind in ("tiled", "rows") and v.rr in (1, 2, 4) and 1 <= v.wg <= 256, "matmul_batch",
          f"unsupported variant {v}")
    if v.kind == "tiled":
        return tiled.matmul(dev, x, w, y, bias=bias, accumulate=accumulate,
                                   config=tiled_config(dev, w.qtype, T), any_t=True)
    return _matmul_rows(dev, x, w, y, bias, accumulate, v)


# --------------------------------------------------------------------------- "rows"
def _source(w: QWeight, dtype: str, v: BatchVariant, T: int, x_off4: int) -> tuple[str, str]:
    """(weight file, header) of the "rows" pipeline: matmul.wgsl + matmul_batch.wgsl + the
    generated entry point, compiled before the weight type's file (codegen.weight_source)."""
    K, rr = w.k, v.rr
    nch, k4 = K // 32, K // 4
    comp = "xyzw"
    lines = [load_shader_source("matmul_batch.wgsl"),
             "".join(f"const XR{t}: u32 = {x_off4 + t * k4}u;\n" for t in range(T)),
             "@compute @workgroup_size(WG)",
             "fn matmul_batch(@builtin(workgroup_id) wid: vec3<u32>, "
             "@builtin(local_invocation_index) lid: u32) {",
             "    let rows = row_group(wid, lid);"]
    lines += [f"    var a{t} = vec4<f32>(0.0);" for t in range(T)]
    if nch:
        lines.append(f"    for (var c = 0u; c < {nch}u; c++) {{")
        lines += [f"        let w{i} = wchunk(rows.b.{comp[i]}, c);" for i in range(rr)]
        for t in range(T):
            lines.append(f"        let x{t} = xchunk(XR{t} + c * 8u);")
            lines += [f"        a{t}.{comp[i]} += cdot(w{i}, x{t});" for i in range(rr)]
        lines.append("    }")
    if k4 > nch * 8:                 # float weights with K % 32 != 0
        lines += [f"    a{t} = bat_tail(rows, XR{t}, a{t});" for t in range(T)]
    lines += [f"    store4({t}u, rows.r0, a{t});" for t in range(T)]
    lines += ["}", ""]
    header = (f"{act_header(dtype)}const WG: u32 = {v.wg}u;\nconst RR: u32 = {rr}u;\n{wmap_header(w)}"
              f"{XREAD[dtype]}{row_source()}" + "\n".join(lines))
    file, decode = weight_source(w.qtype)
    return file, header + decode


def _matmul_rows(dev: Device, x: Tensor, w: QWeight, y: Tensor, bias, accumulate: bool,
                 v: BatchVariant) -> Op:
    io = operands(dev, x, w, y, bias, "matmul_batch")
    file, header = _source(w, x.dtype, v, io.T, io.x_off)
    pipe = dev.pipeline(file, "matmul_batch", header=header)
    # matmul.wgsl's MatmulParams
    return dispatch_parts(dev, Op(name=f"matmul_batch[{w.label}]"), pipe, w, y, io, "matmul_batch",
                          row_groups(v.wg * v.rr, "matmul_batch"), accumulate=accumulate)


__all__ = ["MAX_T", "BatchVariant", "TILED", "ROWS", "VARIANTS", "PROFILES", "bucket", "adapter_key",
           "choose", "supports", "tiled_config", "matmul"]
