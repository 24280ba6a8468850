"""A place of a batch (pipelines/scheduler.py; a draft model's guesses, batch_draft.py): a GPU sampler
with its own logits row, the id it samples (the next step's input) and its grammar masks. Standard
library only (runs in the page).
"""
from __future__ import annotations

from ..kernels import nn
from ..kernels.common import DTYPE_SIZE, new_tensor
from ..kernels.logit_mask import LogitMask
from ..kernels.sampling import Sampler


class Slot:
    """One place of the batch: a sampler (and grammar mask) with its own logits row."""

    def __init__(self, dev, vocab: int, dtype: str, owner: str, i: int, label: str = "slot"):
        self.dev = dev
        self.logits = new_tensor(dev, (vocab + 2,), dtype, owner=owner, label=f"{label}{i}.logits").view((vocab,))
        self.sampler = Sampler(dev, vocab, owner=owner, label=f"{label}{i}.sampler")
        # the sampled token also goes here, for a step submitted before it is read (decode_ahead)
        self.next_id = new_tensor(dev, (4,), "u32", owner=owner, label=f"{label}{i}.next_id")
        self.op = self.sampler.op(self.logits, self.next_id)
        self.mask: LogitMask | None = None
        self.mask_op = None
        self._copy_ops: dict = {}
        self._row_masks: list = []           # (LogitMask, op) of a verify step's guess rows, made on first use
        self._owner = owner

    def row_mask(self, j: int, bits: bytes):
        """The op masking this slot's logits with `bits` for row j of a verify step (row 0: the
        slot's own mask; a guess row: a mask buffer of its own, so that every row's bits are in
        place before the step runs)."""
        while len(self._row_masks) < j:
            mk = LogitMask(self.dev, self.logits.numel, owner=self._owner)
            self._row_masks.append((mk, mk.op(self.logits)))
        mk, op = (self.mask, self.mask_op) if j == 0 else self._row_masks[j - 1]
        mk.write(bits)
        return op

    def copy_in(self, batch, logits, row: int, row_elems: int) -> None:
        """Row `row` of `logits` (rows of row_elems entries, the model's whole vocabulary) -> this
        slot's logits (its sampler and mask are bound to them)."""
        n, size = self.logits.numel, DTYPE_SIZE[logits.dtype]
        src = logits.offset + row * row_elems * size
        if src % 4 == 0 and (n * size) % 4 == 0:
            batch.copy(logits.buf, self.logits.buf, n * size, src, self.logits.offset)
            return
        op = self._copy_ops.get(row)       # an odd f16 vocabulary: a copy kernel (x * 1 is exact)
        if op is None:
            op = self._copy_ops[row] = nn.scale(self.dev, logits.view((n,), row * row_elems), self.logits, 1.0)
        op.record(batch)

    def release(self) -> None:
        for op in self._copy_ops.values():
            op.release()
