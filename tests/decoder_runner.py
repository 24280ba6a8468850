"""Drive a LlamaModel by hand for golden tests: a chunked prefill whose chunks end at the rows kept
(so each kept row's logits are a prefill's last row) and single decode steps, logits read back as
float64. Shared by the transformers goldens (test_families.py) and llama.cpp's
(test_llamacpp_goldens.py)."""
from __future__ import annotations

import struct

import numpy as np

from webgpu_engine.models.llama import LlamaModel


class DecoderRunner:
    def __init__(self, device, cfg, weights, *, owner: str, context_window: int = 512, chunk: int = 128,
                 dtype: str = "f32"):
        self.device, self.chunk = device, chunk
        self.model = LlamaModel(device, cfg, weights, owner=owner, context_window=context_window,
                                prefill_chunk=chunk, dtype=dtype)

    def logits(self) -> np.ndarray:
        m = self.model
        np_type = np.float16 if m.logits.dtype == "f16" else np.float32
        return np.frombuffer(self.device.read_sync(m.logits.buf, 0, m.logits.nbytes), np_type).astype(np.float64)

    def prefill(self, tokens: list[int], ends) -> dict:
        """tokens[0:max(ends)] from position 0 in chunks ending at each of `ends`: {end - 1: logits}."""
        dev, p0, out = self.device, 0, {}
        for end in sorted(ends):
            while p0 < end:
                n = min(self.chunk, end - p0)
                b = dev.batch()
                self.model.record_prefill(b, tokens[p0:p0 + n], p0, with_head=p0 + n == end)
                dev.submit(b)
                p0 += n
            out[end - 1] = self.logits()
        return out

    def decode(self, token: int, pos: int) -> np.ndarray:
        """One decode step (the fused decode path) feeding `token` at `pos`: its logits."""
        dev = self.device
        dev.write(self.model.ids.buf, struct.pack("<I", token))
        b = dev.batch()
        self.model.record_decode(b, pos)
        dev.submit(b)
        return self.logits()

    def greedy(self, logits: np.ndarray, pos: int, n: int) -> list[int]:
        """n greedy tokens from `logits` (the row before position pos), fed back one step at a time."""
        out = []
        for p in range(pos, pos + n):
            out.append(int(np.argmax(logits)))
            logits = self.decode(out[-1], p)
        return out

    def release(self) -> None:
        self.model.release()
