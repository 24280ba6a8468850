"""MLC's q3f16_1 (WebLLM's Llama-3-70B ids), read as f16 weights.

mlc-llm's GroupQuantize of q3f16_1: int3 values in uint32 words, groups of 40 along K, f16 scales.
A row's K values are padded to whole groups: `q_weight` (N, 4 G) u32 with G = ceil(K / 40), each word
holding 10 elements (element r at bits 3r, the top two bits unused; the padding's bits zero);
`q_scale` (N, G) f16; value = (q - 3) * scale, which MLC's dequantize computes in f16: one rounding of
the exact product, as here. No kernel reads 3-bit words: each weight is dequantised to f16 when its
bytes are first read (the model's upload, not when headers are read), the padding dropped, so a
q3f16_1 model takes f16's memory (2 bytes a value, 5.3 times its files'). Needs numpy.
"""
from __future__ import annotations

from ..errors import ModelFormatError, UnsupportedModelError
from .tensor_info import LazyTensorInfo, TensorInfo

GROUP, PER_WORD, BITS, MAX_INT = 40, 10, 3, 3
WORDS = GROUP // PER_WORD                       # u32 words per group


def dequantize_q3(q_weight, q_scale, n: int, k: int):
    """(n, k) f16 values of q3f16_1's q_weight (n, 4 G) u32 and q_scale (n, G) f16 (bytes-like), G =
    ceil(k / 40): (q - 3) * scale rounded once to f16."""
    try:
        import numpy as np
    except ImportError as e:
        raise UnsupportedModelError("q3f16_1 artifacts need numpy (their weights are dequantised on load)") from e
    g = -(-k // GROUP)
    words = np.frombuffer(q_weight, np.uint32, n * g * WORDS).reshape(n, g * WORDS)
    q = (words[:, :, None] >> (BITS * np.arange(PER_WORD, dtype=np.uint32))) & ((1 << BITS) - 1)
    q = q.reshape(n, g, GROUP).astype(np.float32) - MAX_INT
    scale = np.frombuffer(q_scale, np.float16, n * g).reshape(n, g, 1).astype(np.float32)
    return (q * scale).astype(np.float16).reshape(n, g * GROUP)[:, :k]


def q3_width(groups: int, widths) -> int:
    """The K of a weight with `groups` groups per row: the one of the model's row widths (hidden size,
    q heads x head_dim, FFN sizes) that pads to that many groups, else ModelFormatError."""
    ks = {int(w) for w in widths if -(-int(w) // GROUP) == groups}
    if len(ks) != 1:
        raise ModelFormatError(f"q3f16_1: {groups} groups of {GROUP} per row match "
                               f"{'none' if not ks else sorted(ks)} of the model's widths {sorted(set(widths))}")
    return ks.pop()


def model_widths(cfg) -> list[int]:
    """The K a decoder's matrices may have (LlamaConfig): its hidden size, q heads x head_dim and FFN
    sizes, per layer."""
    return [cfg.hidden_size, *(cfg.n_heads * cfg.head_dim_of(i) for i in range(cfg.n_layers)),
            *(cfg.ffn_of(i) for i in range(cfg.n_layers))]


class DequantizedQ3(LazyTensorInfo):
    """An MLC q3f16_1 weight as (n, k) f16, dequantised when its bytes are first read."""

    def __init__(self, q_weight: TensorInfo, q_scale: TensorInfo, widths, where: str):
        n, words = (int(x) for x in q_weight.shape) if len(q_weight.shape) == 2 else (0, 0)
        groups = words // WORDS
        if q_weight.qtype != "u32" or not n or words % WORDS or q_scale.qtype != "f16" \
                or tuple(q_scale.shape) != (n, groups):
            raise ModelFormatError(f"{where}: {q_weight.name} {q_weight.qtype} {list(q_weight.shape)} / {q_scale.name} "
                                   f"{q_scale.qtype} {list(q_scale.shape)} are not q3f16_1's (N, 4 G) u32 / (N, G) f16")
        self._src = (q_weight, q_scale)
        super().__init__(q_weight.name, "f16", (n, q3_width(groups, widths)), None, q_weight.offset)

    def _make(self) -> memoryview:
        qw, qs = self._src
        return memoryview(dequantize_q3(qw.data, qs.data, self.shape[0], self.shape[1]).tobytes())


__all__ = ["GROUP", "DequantizedQ3", "dequantize_q3", "model_widths", "q3_width"]
