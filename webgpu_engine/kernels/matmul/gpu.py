"""GPU kernel family of the matmul: coalesced decode (T = 1..8 rows) and a workgroup-tiled GEMM.

The CPU family's kernels (select.py's own, tiled.py, batch.py) are shaped by CPU Vulkan: no
barriers, each invocation walking whole weight rows. On a discrete or integrated GPU neighbouring
invocations should read neighbouring words and a prefill GEMM should reuse tiles from workgroup
memory. Two kernels, each a variant object with a `key` (what a tuned profile stores):

- `Decode(rr, ln, wg, sg)` — `shaders/matmul_gpu.wgsl`: a row group of `ln` lanes per `rr` weight
  rows, the lanes striding along K over 32-weight chunks (coalesced), each chunk decoded once in
  registers for up to 8 activation rows, partial sums reduced through workgroup memory
  (`matmul_gpu_wg.wgsl`) or, with `sg`, through subgroup shuffles (`matmul_gpu_sg.wgsl`: devices
  with the subgroups feature, `ln` no larger than the adapter's smallest subgroup). Both
  reductions add in the same order: the same bits.
- `Gemm(bt)` — `shaders/matmul_gemm.wgsl`: bt x bt output tiles, 4 x 4 register blocks, K steps of
  32 with the x tile and the dequantised weight tile in workgroup memory. A row's sums do not depend
  on T, so it serves the prefill's `row_invariant` matmuls for every T.

Both read the weight through the `wchunk` every kernel uses (a float row's
`shaders/matmul_<dtype>.wgsl`, or `dequant.wgsl`'s decode of the quantised types): every weight type of kernels/qtypes.py, f32/f16/bf16 rows included.
select.py decides when this family runs (`default_config`, its family switch and the tuned profile);
`default_variant` is the built-in choice before any measurement. Page code: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import FeatureSupportError
from ...gpu import Device
from ...gpu.shaders import load_shader_source
from ..common import Op, Tensor, check
from ..qtypes import QTYPE
from .codegen import weight_pipeline
from .dispatch import dispatch_parts, operands
from .layout import MAX_GROUPS, QWeight

MAX_DECODE_T = 8           # activation rows the decode kernel holds in registers
_WG_BYTES = 16384          # workgroup memory every WebGPU device offers


@dataclass(frozen=True)
class Decode:
    """The decode kernel: `rr` weight rows (1, 2, 4) per row group of `ln` lanes (a power of two
    dividing `wg`), `wg` invocations per workgroup; `sg`: the lanes' sums reduced by subgroup
    shuffles instead of workgroup memory."""

    rr: int = 2
    ln: int = 32
    wg: int = 64
    sg: bool = False

    @property
    def key(self) -> str:
        return f"decode-r{self.rr}-l{self.ln}-w{self.wg}" + ("-sg" if self.sg else "")


@dataclass(frozen=True)
class Gemm:
    """The tiled GEMM: `bt` x `bt` output tiles (32 or 64), (bt / 4)^2 invocations."""

    bt: int = 64

    @property
    def key(self) -> str:
        return f"gemm-{self.bt}"


# the candidates a tuner times (kernels/tune.py), built-in defaults among them
DECODE_VARIANTS = tuple(Decode(rr, ln, 64) for rr in (1, 2, 4) for ln in (16, 32, 64))
GEMM_VARIANTS = (Gemm(64), Gemm(32))
# subgroup reductions: timed only where the device has subgroups and `ln` fits its smallest subgroup
SUBGROUP_DECODE_VARIANTS = tuple(Decode(rr, ln, 64, sg=True) for rr in (1, 2, 4) for ln in (4, 8, 16, 32))


def subgroups_ok(dev: Device, v: Decode) -> bool:
    """Whether `v`'s subgroup reduction is valid on `dev`: the feature, and a row group's lanes
    inside the smallest subgroup the adapter may run."""
    return dev.has_subgroups and v.ln <= dev.subgroup_min_size


def decode_variants(dev: Device) -> tuple:
    """The decode variants a tuner times on `dev`: DECODE_VARIANTS, and the subgroup ones it can run."""
    return DECODE_VARIANTS + tuple(v for v in SUBGROUP_DECODE_VARIANTS if subgroups_ok(dev, v))


def variant(key: str) -> "Decode | Gemm":
    """The variant a profile names by its key (ValueError for an unknown key)."""
    parts = key.split("-")
    try:
        if parts[0] == "decode" and (len(parts) == 4 or len(parts) == 5 and parts[4] == "sg"):
            return Decode(int(parts[1][1:]), int(parts[2][1:]), int(parts[3][1:]), sg=len(parts) == 5)
        if parts[0] == "gemm" and len(parts) == 2:
            return Gemm(int(parts[1]))
    except ValueError:
        pass
    raise ValueError(f"matmul_gpu: unknown variant {key!r}")


def default_variant(w: QWeight, T: int, row_invariant: bool) -> "Decode | Gemm":
    """Before any measurement: the decode kernel for 1..8 rows that need not be row-invariant,
    with a lane per chunk of a 32-chunk span (fewer lanes for short rows, so that lanes are not
    idle), 2 rows per group; else the 64-wide GEMM."""
    if row_invariant or T > MAX_DECODE_T:
        return Gemm(64)
    nch = max(1, w.k // 32)
    ln = 16 if nch < 32 else 32
    return Decode(2, ln, 64)


def fits(v: "Decode | Gemm", T: int, row_invariant: bool) -> bool:
    """Whether variant `v` serves T rows (the decode kernel: 1..8 rows that need not be row-invariant)."""
    return isinstance(v, Gemm) or not row_invariant and T <= MAX_DECODE_T


def bucket(T: int) -> int:
    """The activation rows a decode pipeline holds for T rows: 1, 2, 4 or 8."""
    return 1 << (T - 1).bit_length()


def _pipeline(dev: Device, w: QWeight, dtype: str, v: "Decode | Gemm", T: int):
    if isinstance(v, Decode):
        tt = bucket(T)
        consts = f"const LN: u32 = {v.ln}u;\nconst TT: u32 = {tt}u;\n"
        reduce = load_shader_source("matmul_gpu_sg.wgsl" if v.sg else "matmul_gpu_wg.wgsl")
        return weight_pipeline(dev, "matmul_gpu", w, dtype, v.wg, v.rr,
                               consts + load_shader_source("matmul_gpu.wgsl") + reduce)
    consts = f"const BT: u32 = {v.bt}u;\nconst NTH: u32 = {v.bt // 4}u;\n"
    return weight_pipeline(dev, "matmul_gemm", w, dtype, (v.bt // 4) ** 2, 1,
                           consts + load_shader_source("matmul_gemm.wgsl"))


def _check_variant(dev: Device, v, T: int) -> None:
    if isinstance(v, Decode):
        check(v.rr in (1, 2, 4) and v.wg in (32, 64, 128, 256) and v.ln in (4, 8, 16, 32, 64, 128, 256)
              and v.ln <= v.wg and (v.sg or v.wg * bucket(T) * 16 <= _WG_BYTES), "matmul_gpu",
              f"unsupported decode variant {v} for T={T}")
        if v.sg and not dev.has_subgroups:
            raise FeatureSupportError("subgroups", f"matmul_gpu: {v.key} needs the WebGPU feature "
                                      "subgroups, which this device lacks; use a variant without -sg")
        check(not v.sg or subgroups_ok(dev, v), "matmul_gpu",
              f"{v.key}: {v.ln} lanes exceed the adapter's smallest subgroup ({dev.subgroup_min_size})")
        check(T <= MAX_DECODE_T, "matmul_gpu", f"the decode kernel takes 1..{MAX_DECODE_T} rows, got T={T}")
    else:
        check(isinstance(v, Gemm) and v.bt in (32, 64), "matmul_gpu", f"unsupported GEMM variant {v}")


def matmul(dev: Device, x: Tensor, w: QWeight, y: Tensor, *, bias: Tensor | None = None,
           accumulate: bool = False, variant: "Decode | Gemm | None" = None,
           row_invariant: bool = False) -> Op:
    """y = x·Wᵀ (+ bias); with `accumulate`, y += x·Wᵀ (+ bias). x (T, K), W (N, K), y (T, N): the
    semantics of matmul.matmul without fused inputs or epilogues. `variant` (default:
    `default_variant`) picks the kernel; `row_invariant` asks for a kernel whose rows do not depend
    on T (the GEMM)."""
    check(len(x.shape) == 2 and len(y.shape) == 2, "matmul_gpu", f"x {x.shape} and y {y.shape} must be 2-D")
    T = x.shape[0]
    check(not w.subs and w.qtype in QTYPE, "matmul_gpu", f"{w.label}: one weight type per matmul")
    v = variant or default_variant(w, T, row_invariant)
    check(not row_invariant or isinstance(v, Gemm), "matmul_gpu", "row_invariant needs the GEMM")
    _check_variant(dev, v, T)
    io = operands(dev, x, w, y, bias, "matmul_gpu")
    pipe = _pipeline(dev, w, x.dtype, v, T)
    if isinstance(v, Decode):
        def grid(rows: int) -> tuple[int, int]:
            groups = -(-rows // (v.rr * (v.wg // v.ln)))
            return min(groups, MAX_GROUPS), -(-groups // MAX_GROUPS)
    else:
        def grid(rows: int) -> tuple[int, int]:
            gx, gy = -(-rows // v.bt), -(-T // v.bt)
            check(gx <= MAX_GROUPS and gy <= MAX_GROUPS, "matmul_gpu",
                  f"{rows} rows x {T} activation rows need more than 65535 tiles")
            return gx, gy
    # matmul.wgsl's MatmulParams
    return dispatch_parts(dev, Op(name=f"matmul_gpu[{w.label}]"), pipe, w, y, io, "matmul_gpu", grid,
                          accumulate=accumulate)


__all__ = ["MAX_DECODE_T", "Decode", "Gemm", "DECODE_VARIANTS", "GEMM_VARIANTS", "SUBGROUP_DECODE_VARIANTS",
           "subgroups_ok", "decode_variants", "variant", "default_variant", "fits", "bucket", "matmul"]
