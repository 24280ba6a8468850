"""Snapshots of a paged batch's recurrent states (Qwen3.5's Gated DeltaNet conv and delta states), so
that a sequence can start from a cached prefix and step back past rejected guesses.

A recurrent state holds one position's history: unlike a KV cache it cannot be cut at an earlier
position. So the states of a sequence are saved at chosen positions into snapshot slots beside the
sequence slots of models/paged.py (the same per-layer buffers: slots max_seqs ..), by the kernels
themselves (kernels/deltanet.py `row_slot`: the state after a row is copied into its save slot), and
restored by a copy (`state_copy`):

- prefix reuse: a prefill row that ends a KV block saves the state there, keyed by that block's
  hash-chain key (models/kv_pool.py: the whole token prefix up to the block's end, and the root:
  adapter, images). A new sequence takes the pool's cached blocks only up to the deepest one whose
  key has a snapshot (`reusable`), and that snapshot is copied into its slot (`admit`); prefill goes
  on from there. PREFIX_SNAPSHOTS per sequence slot are kept (fewer where a layer's state buffer
  would pass the device's binding limit), the least recently used evicted.
- speculation: a verify step's rows of a sequence advance its states token by token (the kernels
  run a slot's rows in order); each row but the last saves the state after it into a verify slot
  (`verify_step`), so when guesses are rejected the state after the last accepted row is copied back
  (`rolled_back`): the same state a plain decode of the accepted tokens leaves, bit for bit.

Standard library only (runs in the page).
"""
from __future__ import annotations

import math
import struct
from collections import OrderedDict

from ..errors import UnsupportedChatOptionError
from ..kernels import deltanet
from ..kernels.common import new_tensor

__all__ = ["PREFIX_SNAPSHOTS", "StateSnapshots", "model_snapshot_slots", "snapshot_slots"]

PREFIX_SNAPSHOTS = 4            # prefix snapshots kept per sequence slot


def snapshot_slots(max_seqs: int, verify_rows: int = 0, slot_bytes: int = 0, max_binding: int = 0) -> int:
    """The snapshot slots a batch of max_seqs sequences keeps beside their own: PREFIX_SNAPSHOTS per
    sequence, and one per row a verify step may save (verify_rows: its rows, 0 without speculation;
    a sequence's last row saves nothing and a step has at least one sequence). With slot_bytes (a
    layer's largest state of one sequence) and max_binding (the device's binding limit), the prefix
    snapshots are as many as every layer's state buffer can bind beside the others."""
    prefix, verify = PREFIX_SNAPSHOTS * int(max_seqs), max(0, int(verify_rows) - 1)
    if slot_bytes and max_binding:
        room = max_binding // slot_bytes - int(max_seqs) - verify
        if room < 0:
            raise UnsupportedChatOptionError("speculation", f"{verify_rows} verify rows", (
                f"a verify step's rows save this model's recurrent states into {verify} slots of {slot_bytes} bytes "
                f"beside the {max_seqs} sequences', more than one binding of this device holds ({max_binding} "
                f"bytes): lower the speculation's k or max_num_sequences"))
        prefix = min(prefix, room)
    return prefix + verify


def model_snapshot_slots(model, max_seqs: int, verify_rows: int = 0) -> int:
    """snapshot_slots for `model` (a LlamaModel) on its device: 0 without recurrent states."""
    if not model.recurrent:
        return 0
    slot = max(4 * math.prod(shape[1:]) for L in model.layers if L.mixer is not None
               for shape in L.mixer.state_shapes(1))
    return snapshot_slots(max_seqs, verify_rows, slot, model.dev.max_storage_binding)


class StateSnapshots:
    """The snapshot slots of `fwd` (a PagedForward built with model_snapshot_slots(max_seqs,
    verify_rows) extra state slots) over a KV pool of blocks of block_size tokens: the verify rows'
    first, then the prefix snapshots'."""

    def __init__(self, fwd, block_size: int, verify_rows: int = 0):
        self.fwd, self.dev, self.block_size = fwd, fwd.dev, int(block_size)
        base, n_verify = fwd.max_seqs, max(0, int(verify_rows) - 1)
        self.verify = list(range(base, base + n_verify))
        total = next(states for states in fwd.mixer_states if states is not None)[0].shape[0]
        self._free = list(range(total - 1, base + n_verify - 1, -1))
        self._by_key: OrderedDict[bytes, int] = OrderedDict()      # key -> slot; first: least recently used
        self._pending: dict = {}                                    # seq id -> [(block index, slot)]
        self._verify_of: dict = {}                                  # seq slot -> its verify rows' save slots
        self._max_pairs = fwd.max_seqs
        self.pairs = new_tensor(self.dev, (1 + 2 * self._max_pairs,), "u32", owner=fwd.owner,
                                label="snapshots.pairs")
        self._copies = None
        self.stats = {"saved": 0, "restored": 0, "evicted": 0, "rolled_back": 0}

    # ------------------------------------------------------------------ prefix reuse
    def reusable(self, key: bytes) -> bool:
        """Whether a cached prefix may end at the block of `key` (its state is kept)."""
        return key in self._by_key

    def admit(self, pool, seq_id, seq_slot: int, prompt: list, root: bytes) -> int:
        """pool.add_sequence for a new sequence (its cached tokens: up to a block whose state is kept),
        whose states start from the snapshot at the cached prefix's end: copied into its slot."""
        cached = pool.add_sequence(seq_id, prompt, root=root, reusable=self.reusable)
        if cached:
            key = pool.block_keys(seq_id)[cached // self.block_size - 1]
            self._by_key.move_to_end(key)
            self.restore([(self._by_key[key], seq_slot)])
            self.stats["restored"] += 1
        return cached

    def prefill_slots(self, seq_id, seq_slot: int, start: int, end: int) -> list[int]:
        """The slots entries of a prefill chunk's rows (positions start .. end-1): each row that ends a
        block saves the state after it into a snapshot slot (registered by `prefilled`)."""
        self._drop(seq_id)
        rows = [deltanet.row_slot(seq_slot)] * (end - start)
        bs, saves = self.block_size, []
        for p in range(start, end):
            if (p + 1) % bs == 0:
                slot = self._take()
                if slot is None:
                    break
                rows[p - start] = deltanet.row_slot(seq_slot, save=slot)
                saves.append(((p + 1) // bs - 1, slot))
        if saves:
            self._pending[seq_id] = saves
        return rows

    def prefilled(self, seq_id, keys: list | None) -> None:
        """The chunk of seq_id ran and its tokens are recorded: its saved states are kept under their
        blocks' keys (keys None: the sequence left the pool meanwhile, its saves are dropped)."""
        saves = self._pending.pop(seq_id, [])
        for block, slot in saves:
            if keys is None or block >= len(keys) or keys[block] in self._by_key:
                self._free.append(slot)               # an equal snapshot is kept already
                continue
            self._by_key[keys[block]] = slot
            self.stats["saved"] += 1

    def _drop(self, seq_id) -> None:
        self._free += [slot for _, slot in self._pending.pop(seq_id, [])]

    def _take(self) -> int | None:
        """A free snapshot slot, else the least recently used one's."""
        if self._free:
            return self._free.pop()
        if not self._by_key:
            return None
        self.stats["evicted"] += 1
        return self._by_key.popitem(last=False)[1]

    # ------------------------------------------------------------------ speculation
    def verify_step(self, rows: list) -> list[int]:
        """The slots entries of a verify step's rows, for each (seq_slot, n_rows) of `rows` in order (a
        sequence's last token and its guesses): each of its rows but the last saves its state into a
        verify slot."""
        self._verify_of.clear()
        out, free = [], list(self.verify)
        for seq_slot, n in rows:
            if n - 1 > len(free):
                raise ValueError(f"a verify step of {sum(k for _, k in rows)} rows: more saves than the "
                                 f"{len(self.verify)} verify slots")
            saves, free = free[:n - 1], free[n - 1:]
            self._verify_of[seq_slot] = saves
            out += [deltanet.row_slot(seq_slot, save=s) for s in saves] + [deltanet.row_slot(seq_slot)]
        return out

    def rolled_back(self, seq_slot: int, accepted: int) -> None:
        """After a verify step of the sequence in seq_slot kept `accepted` rows (its last token's and
        the guesses it agreed with): where guesses were rejected, the state after the last kept row
        goes back into its slot."""
        saves = self._verify_of.pop(seq_slot, [])
        if accepted <= len(saves):
            self.restore([(saves[accepted - 1], seq_slot)])
            self.stats["rolled_back"] += 1

    # ------------------------------------------------------------------ copies
    def restore(self, pairs: list) -> None:
        """Copies each (snapshot slot, sequence slot) of pairs, every layer's states, in one submission
        (in queue order: after the work submitted before, before the next step)."""
        for at in range(0, len(pairs), self._max_pairs):
            part = pairs[at:at + self._max_pairs]
            flat = [len(part)] + [s for pair in part for s in pair]
            self.dev.write(self.pairs.buf, struct.pack(f"<{len(flat)}I", *flat), self.pairs.offset)
            batch = self.dev.batch()
            for op in self._copy_ops():
                op.record(batch)
            self.dev.submit(batch)

    def _copy_ops(self) -> list:
        if self._copies is None:
            self._copies = [deltanet.state_copy(self.dev, t, self.pairs, self._max_pairs)
                            for states in self.fwd.mixer_states if states is not None for t in states]
        return self._copies
