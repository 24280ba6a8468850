"""Drive a hand-built decoder for golden tests through the forward every request runs (the paged
forward of one sequence, models/paged_sequence.py): a chunked prefill whose chunks end at the rows
kept (so each kept row's logits are a prefill's last row) and single decode steps, logits read back
as float64. Shared by the transformers goldens (test_families.py and the family modules), llama.cpp's
(test_llamacpp_goldens.py) and MLC's (test_mlc.py)."""
from __future__ import annotations

import numpy as np

from webgpu_engine.models.paged_sequence import PagedSequence


class DecoderRunner:
    def __init__(self, device, cfg, weights, *, owner: str, context_window: int = 512, chunk: int = 128,
                 dtype: str = "f32", ring=None, kv_cache_dtype: str = "auto"):
        self.device, self.chunk = device, chunk
        self.seq = PagedSequence.build(device, cfg, weights, owner=owner, context_window=context_window,
                                       prefill_chunk=chunk, dtype=dtype, ring=ring, kv_cache_dtype=kv_cache_dtype)
        self.model = self.seq.model

    def logits(self) -> np.ndarray:
        t = self.seq.logits
        np_type = np.float16 if t.dtype == "f16" else np.float32
        return np.frombuffer(self.device.read_sync(t.buf, t.offset, t.nbytes), np_type).astype(np.float64)

    def prefill(self, tokens: list[int], ends, pos0: int = 0) -> dict:
        """tokens[pos0:max(ends)] from position pos0 (an earlier one than the sequence's end: the rows
        after it are written again) in chunks ending at each of `ends`: {end - 1: logits}."""
        out = {}
        for end in sorted(ends):
            self.seq.prefill(tokens[pos0:end], pos0)
            out[end - 1], pos0 = self.logits(), end
        return out

    def decode(self, token: int, pos: int) -> np.ndarray:
        """One decode step (a batch of one sequence's row) feeding `token` at `pos`: its logits."""
        self.seq.decode(token, pos)
        return self.logits()

    def greedy(self, logits: np.ndarray, pos: int, n: int) -> list[int]:
        """n greedy tokens from `logits` (the row before position pos), fed back one step at a time."""
        out = []
        for p in range(pos, pos + n):
            out.append(int(np.argmax(logits)))
            logits = self.decode(out[-1], p)
        return out

    def release(self) -> None:
        self.seq.release()
