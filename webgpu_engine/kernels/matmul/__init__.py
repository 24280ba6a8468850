"""Weights on the GPU (GGUF blocks or HF float rows), y = x·Wᵀ matmul, embedding gather, vectors.

Weights keep their file layout: the host never dequantizes. Block types whose size is not a multiple
of 4 bytes (Q4_0 / IQ4_NL 18 B, Q5_0 22 B, Q8_0 34 B, Q3_K 110 B, Q6_K 210 B) get a one-off GPU
repack at upload that inserts 2 zero bytes per block so that kernels read whole u32 words. A weight
above the device's max storage binding size is split by rows across several buffers; matmul and
embedding dispatch once per buffer.

Kernels: `shaders/matmul.wgsl` (generic loop) and `shaders/embedding.wgsl`, each compiled together
with the file that reads the weight: float rows' `shaders/matmul_<dtype>.wgsl`, or for every
quantised type (DEQUANT_WGSL) `shaders/matmul_words.wgsl` plus the decode every kernel shares,
`shaders/dequant.wgsl`.
Weight types and their block geometry: `kernels/qtypes.py`.
2 ≤ T ≤ 16 (a decode step of several sequences): `batch.py`; T > 1 on CPU adapters (prefill): `tiled.py`.
T = 1 on CPU adapters: `shaders/matmul_decode.wgsl` (the K loop unrolled by the host) and, for
the 32-weight-block types (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL), `shaders/matmul_decode_v4.wgsl`
(the same, weights read as vec4<u32>).
Kernel families (`default_config`, one switch for every matmul): "cpu" — the kernels above, shaped
by CPU Vulkan; "gpu" — `gpu.py` (coalesced decode, workgroup-tiled GEMM) for plain
matmuls; "tuned" — per shape, what the adapter's profile (kernels/profiles.py, written by
kernels/tune.py) measured fastest. `WEBGPU_ENGINE_KERNELS=cpu|gpu|tuned` forces one; unset, CPU
adapters run "cpu" and other adapters "tuned" where a profile is stored, else "gpu".
The package: `qtypes` (kernels/qtypes.py, the one table of weight types), `config` (the strategy and
the kernel family per device), `layout` (weights on the GPU), `codegen` (WGSL per weight type and the
generated decode entry points), `epilogues` (fused stores), `dispatch` (the operand checks and
windows and the per-buffer dispatch loop every strategy shares), the strategies `gpu` (the GPU
family), `batch` (few rows) and `tiled` (prefill tiles), and `select` (`matmul`, `embedding`: the
one place that picks a kernel). Imports run one way: codegen and layout know no strategy, the
strategies use them, select uses the strategies. Everything a model uses is imported from here.
Page code: standard library only.
"""
from __future__ import annotations

from ..qtypes import QTYPES
from .codegen import DEQUANT_WGSL
from .config import (CONFIG_OVERRIDES, FAMILIES, FAMILY_ENV, MatmulConfig, default_config, is_cpu_adapter,
                     is_software_adapter, kernel_family)
from .epilogues import NormOut, RopeKV, epilogue_ok
from .layout import (MIXED, QWeight, file_row_bytes, gpu_row_bytes, interleave_pairs, upload_vector,
                     upload_weight)
from .select import MAX_DECODE_ROWS, _family_variant, embedding, fusable, fused_rows_max, fused_rows_ok, matmul

__all__ = ["QTYPES", "MIXED", "QWeight", "MatmulConfig", "RopeKV", "NormOut", "FAMILY_ENV", "FAMILIES",
           "CONFIG_OVERRIDES", "DEQUANT_WGSL", "kernel_family", "is_cpu_adapter", "is_software_adapter",
           "default_config", "upload_weight", "matmul", "fusable", "epilogue_ok", "interleave_pairs",
           "embedding", "upload_vector", "file_row_bytes", "gpu_row_bytes", "_family_variant",
           "fused_rows_ok", "fused_rows_max", "MAX_DECODE_ROWS"]
