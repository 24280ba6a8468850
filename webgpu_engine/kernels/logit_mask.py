"""The allowed-token mask of constrained decoding on the GPU: `LogitMask` holds the bitmask buffer
(ceil(V/32) u32 words, uploaded each step) and the prebuilt in-place op that pushes the logits of
disallowed tokens far below every allowed one before the sampler runs (shaders/logit_mask.wgsl).

    lm = LogitMask(dev, vocab, owner="model:X")
    op = lm.op(logits)             # logits (V,) f32|f16, once
    lm.write(mask_bytes)           # each step: the matcher's bitmask
    op.record(batch)               # before the sampler's op
"""
from __future__ import annotations

from ..gpu import Device
from .common import Op, Tensor, act_header, check, params

# Far below any real logit yet finite, so that the sampler's arithmetic stays finite (see the WGSL).
MASKED = {"f32": -1.0e30, "f16": -65504.0}
_WGSL_MASKED = {"f32": "-1.0e30", "f16": "-65504.0"}
WORKGROUP = 64


class LogitMask:
    def __init__(self, dev: Device, vocab_size: int, *, owner: str, label: str = "logit_mask"):
        check(vocab_size > 0, "logit_mask", "vocab_size must be positive")
        self.dev, self.vocab, self.owner = dev, int(vocab_size), owner
        self.words = (self.vocab + 31) // 32
        self.mask = dev.buffer(self.words * 4, owner=owner, label=f"{label}.bits")
        self.params = params(dev, [self.vocab, self.words, 0, 0], owner=owner, label=label)

    def op(self, logits: Tensor) -> Op:
        check(logits.numel == self.vocab, "logit_mask",
              f"logits has {logits.numel} entries, the mask covers {self.vocab}")
        hdr = act_header(logits.dtype) + f"const MASKED: f32 = {_WGSL_MASKED[logits.dtype]};\n"
        pipe = self.dev.pipeline("logit_mask.wgsl", "logit_mask", header=hdr)
        bg = self.dev.bind(pipe, [self.params, logits.binding(), self.mask])
        return Op(name="logit_mask").add(pipe, bg, (self.words + WORKGROUP - 1) // WORKGROUP)

    def write(self, bits: bytes) -> None:
        """Upload one step's bitmask (llguidance may return a longer one: only our words count)."""
        check(len(bits) >= self.words * 4, "logit_mask",
              f"the mask has {len(bits)} bytes, {self.words * 4} needed")
        self.dev.write(self.mask, memoryview(bits)[:self.words * 4])

    def release(self) -> None:
        self.mask.release()
        self.params.release()


def logit_mask_ref(logits, bits: bytes, dtype: str = "f32"):
    """numpy reference: a copy of `logits` with disallowed tokens set to MASKED[dtype]."""
    import numpy as np
    v = len(logits)
    allowed = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")[:v].astype(bool)
    out = np.array(logits, dtype=np.float32, copy=True)
    out[~allowed] = MASKED[dtype]
    return out
