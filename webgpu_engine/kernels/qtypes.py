"""The weight types the matmul and embedding kernels read: one row per type, the rest derived.

A quantised type is stored in blocks of `block` weights: `file_bytes` per block in the GGUF file,
`gpu_bytes` on the GPU. Where they differ, the upload repack (copy.wgsl repack_blocks) inserts
gpu_bytes - file_bytes zero bytes at byte `pad_at` of each block so that kernels read whole u32
words. Every quantised type's WGSL decode is `dq_<qtype>` in `shaders/dequant.wgsl`, shared by every
kernel; float rows (f32, f16, bf16) are blocks of one weight, read by `shaders/matmul_<dtype>.wgsl`
and `shaders/matmul_tiled.wgsl`'s `wb_<dtype>`. The 32-weight-block types with `v4_args` also have
a vec4 decode (`dq_<qtype>_w`, read by `shaders/matmul_decode_v4.wgsl`). Page code: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QType:
    name: str
    block: int                # weights per block
    file_bytes: int           # bytes per block in the file
    gpu_bytes: int            # bytes per block on the GPU
    pad_at: int | None = None  # byte where the upload repack inserts the padding
    # how the vec4 decode kernel passes a block's u32 words (block_words of them) to dq_<qtype>_w:
    # 1 = one u32 argument, 4 = one vec4<u32>; empty: no vec4 decode
    v4_args: tuple = ()

    @property
    def quantized(self) -> bool:
        return self.block > 1

    @property
    def chunk_words(self) -> int:
        """u32 words per 32 weights (types with 32-weight or smaller blocks)."""
        return 32 * self.gpu_bytes // self.block // 4

    @property
    def block_words(self) -> int:
        """u32 words per block on the GPU."""
        return self.gpu_bytes // 4


_TYPES = [
    QType("f32", 1, 4, 4),
    QType("f16", 1, 2, 2),
    QType("bf16", 1, 2, 2),
    QType("q4_0", 32, 18, 20, 2, (1, 4)),  # d | pad | qs[16]
    QType("q4_1", 32, 20, 20, None, (1, 4)),
    QType("q8_0", 32, 34, 36, 2, (1, 4, 4)),  # d | pad | qs[32]
    QType("q4_k", 256, 144, 144),
    QType("q6_k", 256, 210, 212, 210),     # ql | qh | scales | d | pad
    QType("q5_0", 32, 22, 24, 2, (1, 1, 4)),  # d | pad | qh | qs[16]
    QType("q5_1", 32, 24, 24, None, (1, 1, 4)),
    QType("iq4_nl", 32, 18, 20, 2, (1, 4)),  # d | pad | qs[16]
    QType("q5_k", 256, 176, 176),
    QType("q3_k", 256, 110, 112, 110),     # hmask | qs | scales | d | pad
    QType("q2_k", 256, 84, 84),
    QType("iq4_xs", 256, 136, 136),
    QType("q4_0f32", 32, 20, 20, None, (1, 4)),  # d f32 | qs[16] as Q4_0's: MLC's q4f32_1, repacked (loaders/mlc.py)
    QType("mxfp4", 32, 17, 20, 1, (1, 4)),  # e E8M0 | pad | qs[16] of E2M1 codes (gpt-oss's experts)
]
QTYPE = {t.name: t for t in _TYPES}
QTYPES = tuple(QTYPE)

__all__ = ["QType", "QTYPE", "QTYPES"]
