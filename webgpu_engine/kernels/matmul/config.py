"""The matmul kernels' strategy per device: `MatmulConfig` and the one switch between kernel
families (cpu / gpu / tuned), read by every matmul through `default_config`. Page code: standard
library only."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...gpu import Device
from .. import profiles
from ..common import check
from ..qtypes import QTYPE


@dataclass
class MatmulConfig:
    """Per-device kernel strategy: `wg` invocations per workgroup, each owning `rr` weight rows
    (1, 2 or 4) of one activation row; for T > 1 with `tm` = 4, the tile kernel gives each
    invocation `prr` weight rows (1, 2 or 4) x 4 activation rows so a weight chunk is decoded once
    per 4 rows of x (`tm` = 1: the row kernel over every t). No barriers anywhere: on CPU Vulkan
    (lavapipe) barriers are expensive, and several rows per invocation share each x load."""

    wg: int = 32     # small: a 576-row weight still makes 5 workgroups for the driver's threads
    rr: int = 4
    tm: int = 4
    prr: int = 4
    unroll: bool = True   # T = 1: the K loop unrolled by the host (matmul_decode.wgsl) ...
    unroll_max_k: int = 1024   # ... up to this K and N rows (longer straight-line code and the
    unroll_max_n: int = 16384  # 49152-row LM head ran slower unrolled on lavapipe)
    fuse: bool = False    # models fuse RMSNorm into the decode matmul after it (measured: a loss
    fuse_silu: bool = False    # on lavapipe) / SiLU·up into down (its exp per lane: a larger loss)
    tiled: bool = True    # T > 1: matmul/tiled.py (host-unrolled K, shared-memory x tiles);
    # measured 3-4x on lavapipe, but its unrolled pipelines compile so slowly on SwiftShader (the
    # browser) that the first prefill there took minutes: on only where measured to win
    epilogue: bool = True   # T = 1 with rr = 4: models may fold SiLU·up and RoPE + KV-cache write
    # into the decode matmul's stores (matmul_epilogue.wgsl): 60 fewer dispatches per token
    res_norm: bool = True   # with epilogue: models fold the RMSNorm after a residual matmul into its
    # stores (norm_out) and the next matmul (rms_from): 60 fewer dispatches per token
    interleave: bool = True   # with v4: single-buffer weights of a vec4 type stored in interleaved
    # 4-row spans (copy.wgsl span_map) so a SIMD group's lanes read contiguous memory (lavapipe,
    # streaming a decode step's weights: ~10% per matmul); every kernel reads them through wmap4
    xs_fold: bool = True   # v4 Q4_0/Q4_1: quants masked in place (scaled by 256^j) are dotted with
    # unscaled x and the partial sums scaled when reduced, instead of scaling x per chunk (v4_xs)
    v4: bool = True       # T = 1 with rr = 4 and a vec4 type (QType.v4_args): weights read as vec4<u32> from
    v4_max_k: int = 1024  # the GGUF layout (matmul_decode_v4.wgsl), up to this K and N (the K loop
    v4_max_n: int = 1 << 30   # unrolled as in matmul_decode); only where `unroll` is on. lavapipe:
    # 1.2-1.5x per matmul, the 49152-row LM head too. Uncached compile (Mesa caches on disk): K = 576
    # 1.8 s (3.2 s for matmul_decode), K = 1536 9 s for ~0.07 ms per matmul: not worth it
    batch_max_t: int = 16   # 2 <= T <= this (decode of several sequences): matmul/batch.py,
    # each weight chunk decoded once for all T rows (0: off, the row / tiled kernels as before)
    family: str = "cpu"   # "gpu" / "tuned": plain matmuls (no fused input or epilogue) may run
    # matmul/gpu.py (see _family_variant); "cpu": the kernels of select.py and its helpers

    def reads_v4(self, qtype: str, n: int, k: int) -> bool:
        """Whether the T = 1 decode of a (n, k) weight reads it as vec4<u32> (matmul_decode_v4.wgsl)."""
        t = QTYPE.get(qtype)
        return (self.unroll and self.v4 and self.rr == 4 and t is not None and bool(t.v4_args)
                and k % 32 == 0 and k <= self.v4_max_k and n <= self.v4_max_n)


FAMILY_ENV = "WEBGPU_ENGINE_KERNELS"

FAMILIES = ("cpu", "gpu", "tuned")


def is_cpu_adapter(dev: Device) -> bool:
    """lavapipe (adapter type CPU, name llvmpipe): the CPU strategy (unrolled decode, tiled
    prefill) was measured there."""
    return dev.info.cpu


def is_software_adapter(dev: Device) -> bool:
    """A rasteriser on the CPU: lavapipe, or a browser's fallback adapter (Chromium's SwiftShader:
    isFallbackAdapter, architecture swiftshader). Both keep the CPU family; SwiftShader with the
    plain kernels it ran before the families (its compiler stalls on the unrolled ones)."""
    info = dev.info
    return is_cpu_adapter(dev) or info.adapter_type.lower() == "fallback" or \
        "swiftshader" in info.architecture.lower()


def kernel_family(dev: Device) -> str:
    """The matmul kernel family for `dev`: $WEBGPU_ENGINE_KERNELS when set, else "cpu" on CPU
    adapters (their strategy was measured there) and on other adapters "tuned" where the tuner has
    stored a profile for this adapter, else "gpu"."""
    env = os.environ.get(FAMILY_ENV, "").strip().lower()
    if env:
        check(env in FAMILIES, "matmul", f"{FAMILY_ENV}={env!r}: expected one of {', '.join(FAMILIES)}")
        return env
    if is_software_adapter(dev):
        return "cpu"
    return "tuned" if profiles.has_profile(dev) else "gpu"


def default_config(dev: Device) -> MatmulConfig:
    """The strategy for `dev`. CPU family, measured on lavapipe (bench/kernels.py): 4 rows per
    invocation halves decode cost against 1 (each x load serves 4 rows), the 4x4 tile beats the
    row kernel for prefill, the host-unrolled decode kernel serves CPU drivers' uniform-load
    detection (matmul_decode.wgsl). GPU family: plain matmuls go to matmul/gpu.py and
    nothing is fused (no unrolled kernels). Tuned: the adapter type's strategy, with the profile's
    kernel per shape for plain matmuls."""
    family = kernel_family(dev)
    cpu = family in ("cpu", "tuned") and is_cpu_adapter(dev)
    return MatmulConfig(**{"unroll": cpu, "tiled": cpu, "family": family, **CONFIG_OVERRIDES})


# field -> value applied by default_config (benchmarks' A/B switches, e.g. {"fuse": False})
CONFIG_OVERRIDES: dict = {}
