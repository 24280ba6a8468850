"""The decoder's forward over a paged KV cache, for many sequences at once (continuous batching).

A loaded LlamaModel's weights and activations, plus one K and one V pool per layer
(kernels/attention_paged.py; models/kv_pool.py decides which blocks a sequence owns) and, for layers
with a token mixer of their own (Qwen3.5's Gated DeltaNet), its states per sequence slot (the
scheduler's slot of the sequence; a row at position 0 starts its sequence's states over):

    decode step (rows = S running sequences, one token each):
        x = embed(ids)                                         # (S, C)
        per layer: models/decoder.py's recipe in its ROWS mode, with
            rope(q, k) at positions[s]; k, v -> pool rows slots[s]   # in the qkv matmul (fused rows)
            attention of row s over lens[s] keys of block table s
        logits = rms_norm(x) · Wheadᵀ                          # (S, V)
    prefill chunk (rows = T tokens of one sequence at positions pos0 ..):
        the same in its PREFILL mode, with causal attention over the sequence's table; logits of the
        last row only

A decode row's matmul sums do not depend on how many rows run: with up to 4 sequences on a CPU
adapter (16 where matmul/wide.py's kernel runs) each row goes through the fused one-row decode
kernels' sums (`fused_rows`: norms, gates, residual norms and the RoPE + KV write fused, each row summed as the one-row DECODE forward sums it, a
weight chunk decoded once for the rows: 183 dispatches a step for SmolLM2, as many as one row's
DECODE forward), else `decode_rows` (the GPU family's decode kernel in groups of 8 rows, the CPU family's
row-invariant tiled kernels, which share weights across many rows); prefill rows' neither on the
chunking (`row_invariant`), and a sequence's attention depends only on its own keys (the paged decode
kernel picks the short or the split-key form by each sequence's own length): a sequence's tokens are the same alone or in any batch. Op lists are built
once per row count and replayed; per step the host writes the small u32 inputs (ids, positions,
slots, lens, tables, step) in one write, which the step's batch copies into place. Standard library
only (runs in the page).

A model with a ring (WebLLM's sliding window with sinks, the plan's Ring) has each sequence's table of
max_blocks * block_size rows as its ring (models/kv_pool.py gives the slots by position): positions
grow past it, lens carry position + 1, and the RoPE kernel writes each row's sink query to q_sink.
"""
from __future__ import annotations

import struct
from dataclasses import replace

from ..kernels import attention_paged as ap
from ..kernels import lora as lk
from ..kernels import matmul as mm
from ..kernels.common import Op, OpCache, Tensor, new_tensor
from . import decoder

_MAX_CACHED = 24


class PagedForward:
    """Batched forward passes of `model` over a pool of n_blocks blocks of block_size tokens."""

    def __init__(self, model, *, max_seqs: int, n_blocks: int, block_size: int, owner: str,
                 max_rows: int | None = None, snapshots: int = 0):
        """`max_rows`: the decode rows one step takes (default max_seqs; more where verify steps
        check several guesses of a sequence at once). The kernels the rows go through are chosen
        by max_seqs alone, so a row's bits do not depend on it. `snapshots`: recurrent state slots
        kept beside the sequences' (models/recurrent_snapshots.py)."""
        c, dev, dt = model.cfg, model.dev, model.dtype
        max_rows = max(int(max_rows or max_seqs), int(max_seqs))
        if max_rows > model.chunk:
            raise ValueError(f"{max_rows} decode rows (max_num_sequences {max_seqs}) exceed the prefill "
                             f"chunk {model.chunk}")
        self.model, self.cfg, self.dev, self.owner = model, c, dev, owner
        self.max_seqs, self.block_size, self.n_blocks = int(max_seqs), int(block_size), int(n_blocks)
        self.max_rows = max_rows
        self.max_blocks = -(-model.ctx // self.block_size)        # blocks of one full context (or ring)
        P, S = model.chunk, self.max_rows
        self.ring = model.ring
        self.ring_rows = self.max_blocks * self.block_size if self.ring else 0
        # a ring's sink queries, written by paged_rope_kv beside qkv (a buffer of its own)
        self.q_sink = new_tensor(dev, (P, c.q_dim), dt, owner=owner, label="paged.q_sink") if self.ring else None
        self.ids = new_tensor(dev, (P,), "u32", owner=owner, label="paged.ids")
        self.positions = new_tensor(dev, (P,), "u32", owner=owner, label="paged.positions")
        self.slots = new_tensor(dev, (P,), "u32", owner=owner, label="paged.slots")
        self.lens = new_tensor(dev, (S,), "u32", owner=owner, label="paged.lens")
        self.tables = new_tensor(dev, (S * self.max_blocks,), "u32", owner=owner, label="paged.tables")
        self.step = dev.buffer(16, owner=owner, label="paged.step")              # (pos0, n_new, ., 0)
        # a step's inputs in one write, copied into place by the step's own batch (a write costs
        # 0.2-1 ms of host time each on lavapipe right after a step, a copy command next to nothing)
        self.inputs = dev.buffer(4 * (5 * P + S + S * self.max_blocks + 4), owner=owner, label="paged.inputs")
        self.logits = new_tensor(dev, (S, c.vocab_size), dt, owner=owner, label="paged.logits")
        self.pools = []
        for i in range(c.n_layers):          # a layer attending an earlier one's cache has no pool
            src = c.kv_source(i)
            self.pools.append(self.pools[src] if src != i else ap.new_kv_pool(
                dev, self.n_blocks, self.block_size, c.n_kv_heads, c.head_dim_of(i), model.kv_cache_dtype or dt,
                owner=owner, label=f"kv_pool.{i}"))
        if c.kv_sources:                     # rope_q: every row rotated, none written (slot 0xffffffff)
            self.no_slots = new_tensor(dev, (P,), "u32", owner=owner, label="paged.no_slots")
            dev.write(self.no_slots.buf, b"\xff" * 4 * P)
        self._ops = OpCache(_MAX_CACHED)                   # (kind, rows, LoRA groups) -> list[Op]
        self._rows_scratch = None                          # copy_rows' block of one pool
        # LoRA adapters (models/lora.py): each row's adapter slot; op lists with the deltas are
        # built apart and run only for steps with an adapter row (a base-only step is unchanged)
        self.lora_idx = new_tensor(dev, (P,), "u32", owner=owner, label="paged.lora_idx")
        # token mixers' recurrent states (Qwen3.5's Gated DeltaNet): one slot per sequence (the
        # scheduler's slot), beside the KV pool; each row's slot
        self.state_slots = new_tensor(dev, (P,), "u32", owner=owner, label="paged.state_slots")
        self.mixer_states = [[new_tensor(dev, shape, "f32", owner=owner, label=f"paged.mixer_state.{i}")
                              for shape in L.mixer.state_shapes(self.max_seqs + int(snapshots))]
                             if L.mixer is not None else None
                             for i, L in enumerate(model.layers)]
        self.recurrent = any(x is not None for x in self.mixer_states)
        self.lora = None                                   # a LoraRows once a pool is attached
        # up to fused_rows_max sequences (16 where the wide kernel runs, else 4): each decode row
        # through the fused one-row kernels' sums, as a one-row DECODE forward computes it; more:
        # the row-invariant kernels
        self.fused_rows = self.max_seqs <= mm.fused_rows_max(dev) and mm.fused_rows_ok(dev)

    # ------------------------------------------------------------------ decoder.KVAccess
    head_flags: dict = {}    # the prefill head's one-row matmul: the decode kernel (ContiguousKV's too)

    @property
    def images(self):
        """The model's ImageRows: PREFILL chunks splice their image features; where an image's rows
        attend each other both ways (Gemma 3) the paged prefill attention takes them as spans itself."""
        rows = self.model.images
        return rows if rows is None or not rows.bidirectional else _SpannedImages(rows)

    def logits_for(self, rows: int) -> Tensor:
        return self.logits.view((rows, self.cfg.vocab_size))

    def fused_rope(self, i: int):
        """Fused rows (activation-dtype pools): the qkv matmul rotates each row at its position and
        writes its k, v to its slot, as the contiguous decode's matmul does; else the paged kernel."""
        m, c = self.model, self.cfg
        if not self.fused_rows or m.kv_cache_dtype or self.ring:   # the epilogue writes no sink queries
            return None
        kp, vp = self.pools[i]
        P = m.chunk
        return mm.RopeKV(None, m.rope_freq, kp, vp, c.n_heads, c.n_kv_heads, c.head_dim_of(i), c.rot_dim_of(i), 0,
                         positions=self.positions.view((P,)), slots=self.slots.view((P,)))

    def rope_kv(self, i: int, qkv: Tensor, T: int, rope: dict) -> Op:
        kp, vp = self.pools[i]
        c = self.cfg
        return ap.paged_rope_kv(self.dev, qkv, kp, vp, self.positions.view((T,)), self.slots.view((T,)),
                                n_q_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim_of(i), **rope,
                                **self._ring())

    def _ring(self) -> dict:
        """The ring's arguments of the RoPE and attention kernels (none without one)."""
        return dict(ring=self.ring, q_sink=self.q_sink) if self.ring else {}

    def _masking(self, spec: decoder.Attention) -> dict:
        """The model's own masks (window, soft-cap), or a ring's in place of its window."""
        return {**spec.masking(), "window": 0, **self._ring()} if self.ring else spec.masking()

    def rope_q(self, i: int, qkv: Tensor, T: int, rope: dict) -> Op:
        """The rotation of rope_kv with no row written: the layer attends an earlier layer's pool (its
        k heads, rotated too, go unused)."""
        kp, vp = self.pools[i]
        c = self.cfg
        return ap.paged_rope_kv(self.dev, qkv, kp, vp, self.positions.view((T,)), self.no_slots.view((T,)),
                                n_q_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim_of(i), **rope)

    def attention(self, i: int, qkv: Tensor, attn: Tensor, T: int, mode: str, spec: decoder.Attention) -> Op:
        kp, vp = self.pools[i]
        if mode == decoder.ROWS:               # row s: sequence s's lens[s] keys of its block table
            return ap.paged_decode(self.dev, qkv, kp, vp, attn, self.lens.view((T,)),
                                   self.tables.view((T * self.max_blocks,)), **spec.heads(), max_seqs=T,
                                   max_blocks=self.max_blocks, scale=spec.scale, **self._masking(spec))
        rows = self.model.images
        spans = rows.rows.view((T, 2)) if rows is not None and rows.bidirectional else None
        return ap.paged_prefill(self.dev, qkv, kp, vp, attn, self.step, self.tables.view((self.max_blocks,)),
                                **spec.heads(), max_blocks=self.max_blocks, scale=spec.scale, max_t=T,
                                spans=spans, **self._masking(spec))

    def states(self, i: int, T: int):
        """Layer i's states of every sequence slot; each row's position and slot."""
        return self.mixer_states[i], self.step, (self.positions.view((T,)), self.state_slots.view((T,)))

    def _state_input(self, slots) -> list:
        """(state_slots, the rows' sequence slots) for _put where the model has recurrent states."""
        if not self.recurrent:
            return []
        if slots is None or any(not 0 <= s & 0xFFFF < self.max_seqs for s in slots):   # beside a save slot
            raise ValueError(f"rows of a model with recurrent states need their sequences' slots "
                             f"(0..{self.max_seqs - 1}), got {slots}")
        return [(self.state_slots.buf, slots)]

    # ------------------------------------------------------------------ op lists
    def ops(self, kind: str, T: int, lora: bool = False) -> list[Op]:
        """The forward of T rows: "decode" (one row per sequence, logits of every row) or "prefill"
        (T tokens of one sequence, the last row's logits into row 0); with `lora`, each row's
        adapter delta (lora_idx) added."""
        mode = decoder.ROWS if kind == "decode" else decoder.PREFILL
        if not lora:
            return self._ops.get((kind, T, None), lambda: decoder.forward(self.model, self, T, mode))
        # the deltas of the projections the registered adapters target (a list per such set)
        # (a prefill chunk's rows, one sequence's, 4 a LoRA workgroup where the adapter can: lora_rows)
        four = kind == "prefill" and lk.rows_ok(self.lora.pool.dev)
        rows = replace(self.lora, groups=self.lora.pool.targeted(), rows=4 if four else 1)
        key = (kind, T, rows.groups, self.lora.pool.layout)      # and per layout of the pool's tensors
        return self._ops.get(key, lambda: decoder.forward(self.model, self, T, mode, lora=rows))

    def attach_lora(self, pool) -> None:
        """Adapters of models/lora.py's LoraPool `pool` become available to the rows."""
        from .lora import LoraRows
        self.lora = LoraRows(pool, self.lora_idx)

    def _lora_input(self, slots) -> list:
        """(lora_idx, the rows' slots) for _put where a row has an adapter, else nothing."""
        return [(self.lora_idx.buf, slots)] if slots is not None else []

    # ------------------------------------------------------------------ steps
    def _put(self, batch, parts: list) -> None:
        """u32 values into the start of each (buffer, values) of `parts`: one write of them all to
        `inputs`, then a copy into each buffer at the start of `batch` (so in queue order, as a
        write to each: after the work submitted before, before this batch's dispatches)."""
        data = [list(v) for _, v in parts]
        flat = [x for v in data for x in v]
        self.dev.write(self.inputs, struct.pack(f"<{len(flat)}I", *flat))
        at = 0
        for (buf, _), v in zip(parts, data):
            if v:
                batch.copy(self.inputs, buf, 4 * len(v), src_offset=at)
            at += 4 * len(v)

    def record_decode(self, batch, tokens: list[int] | None, inputs: dict, lora: list[int] | None = None,
                      states: list[int] | None = None) -> None:
        """One token for each of S sequences; inputs: KVPool.decode_inputs(ids, S, max_blocks);
        tokens: their S input ids, or None where the work before wrote them into `ids` on the GPU
        (a step submitted ahead); lora: each row's adapter slot (kernels/lora.py NONE: the base), or
        None where no row has one; states: each row's sequence slot (a model with recurrent states).
        Logits rows 0 .. S-1."""
        S = len(inputs["lens"]) if tokens is None else len(tokens)
        self._put(batch, ([] if tokens is None else [(self.ids.buf, tokens)])
                  + [(self.positions.buf, inputs["positions"]), (self.slots.buf, inputs["slots"]),
                     (self.lens.buf, inputs["lens"]), (self.tables.buf, inputs["tables"])]
                  + self._lora_input(lora) + self._state_input(states))
        # the attention's combine only where a sequence needs it (a ring's rows: at most its table's)
        n_keys = min(max(inputs["lens"]), self.max_blocks * self.block_size)
        for op in self.ops("decode", S, lora is not None):
            op.record(batch, n_keys=n_keys)

    def record_prefill(self, batch, tokens: list[int], pos0: int, slots: list[int], table: list[int],
                       with_head: bool, lora: int | None = None, state_slot: int | list | None = None) -> None:
        """T = len(tokens) <= chunk tokens of one sequence at positions pos0 ..; their KV goes to
        `slots`; table: the sequence's block ids (those holding keys 0 .. pos0+T-1). With the head,
        the last row's logits go to row 0. lora: the sequence's adapter slot (None: the base);
        state_slot: its slot of the recurrent states (a model with them), or each row's slots entry
        (kernels/deltanet.py row_slot: a row may save its state into a snapshot slot)."""
        T = len(tokens)
        self._put(batch, [(self.ids.buf, tokens), (self.positions.buf, range(pos0, pos0 + T)),
                          (self.slots.buf, slots), (self.tables.buf, table), (self.step, (pos0, T, pos0 + T, 0))]
                  + self._lora_input(None if lora is None else [lora] * T)
                  + self._state_input([state_slot] * T if isinstance(state_slot, int) else state_slot))
        if self.images is not None:          # the chunk's image rows (staged by the scheduler), else none
            self.images.write(T)
        ops = self.ops("prefill", T, lora is not None)
        for op in (ops if with_head else ops.body()):       # a chunk before the last: no logits
            op.record(batch, n_keys=pos0 + T)               # the attention's windows of these keys

    @property
    def rows_copyable(self) -> bool:
        """Whether copy_rows can move a block's rows: pools of plain f32 / f16 rows (a quantised pool's
        codes and scales are laid out per block), no ring."""
        return not self.ring and all(p[0].dtype in ("f32", "f16") and p[0].nbytes % (4 * self.n_blocks * self.block_size) == 0
                                     for p in self.pools)

    def copy_rows(self, batch, src: int, dst: int, rows: int) -> None:
        """Record into `batch` a copy of the first `rows` rows of pool block `src` into block `dst`,
        in every layer's K and V pools (models/kv_pool.py take_copy), through a block-sized scratch
        buffer (WebGPU copies nothing within one buffer)."""
        pools = [t for pool in {id(p): p for p in self.pools}.values() for t in pool]
        block = max(t.nbytes // self.n_blocks for t in pools)
        if self._rows_scratch is None or self._rows_scratch.size < block:
            self._rows_scratch = self.dev.buffer(block, owner=self.owner, label="paged.rows_scratch")
        for t in pools:
            row = t.nbytes // (self.n_blocks * self.block_size)
            batch.copy(t.buf, self._rows_scratch, rows * row, src_offset=t.offset + src * self.block_size * row)
            batch.copy(self._rows_scratch, t.buf, rows * row, dst_offset=t.offset + dst * self.block_size * row)

    def copy_pending(self, batch, pool, seq_id) -> None:
        """Record the row copy `pool` holds for `seq_id` (KVPool.take_copy: rows of a cached partial
        block, due before the sequence's first forward), where it holds one."""
        if (cp := pool.take_copy(seq_id)) is not None:
            self.copy_rows(batch, *cp)

    def logits_row(self, r: int):
        return self.logits.view((self.cfg.vocab_size,), r * self.cfg.vocab_size)

    def release(self) -> None:
        self._ops.release()


class _SpannedImages:
    """ImageRows whose both-ways attention is paged_prefill's spans (PagedForward.attention): no pass
    over a contiguous cache follows the layer's attention."""

    def __init__(self, rows):
        self._rows = rows

    def __getattr__(self, name):
        return getattr(self._rows, name)

    def attention(self, *_) -> list:
        return []
