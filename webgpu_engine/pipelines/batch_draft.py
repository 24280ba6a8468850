"""A draft model's guesses for speculation inside continuous batching (batch_speculation.py).

The draft keeps a paged KV cache of its own (models/paged.py over the draft's weights, a
models/kv_pool.py pool of private blocks) holding, per speculating sequence, the rows of the tokens
it has computed. Each decode step of the target:

    1. catch up: every sequence's draft cache is cut back to the longest prefix it shares with the
       sequence's context (its tokens and last sampled token; the guesses the target rejected go)
       and brought up to the context: the few new rows of all sequences (the tokens accepted since
       its last guesses) in one forward, a longer stretch (a new prompt) by prefill chunks;
       each sequence's last row is sampled greedily on the GPU: its first guess;
    2. k - 1 more decode steps for all the sequences at once, each step's input ids copied on the
       GPU from the samples of the step before (no host round trip between them);
    3. one readback of every guess; a sequence's guesses end at the first end-of-sequence token.

A guess's bits do not matter (the target checks each one, batch_speculation.py), so the draft's
rows go through whatever kernels its batch picks. A sequence the draft pool has no room for guesses
nothing this step (a plain row). Standard library only (runs in the page).
"""
from __future__ import annotations

from ..config import GREEDY
from ..kernels.sampling import RESULT_BYTES
from ..models.kv_pool import KVPool, PoolExhaustedError
from ..models.paged import PagedForward
from .slots import Slot
from .speculation import shared_prefix

CATCH_UP_ROWS = 4      # new rows of a sequence that go into the joint catch-up forward; more: prefill


class DraftGuesser:
    """Greedy guesses of a draft pipeline (an LLMChatPipeline) for many sequences at once."""

    def __init__(self, draft, max_seqs: int, k: int, n_blocks: int, block_size: int):
        m, dev = draft.model, draft.dev
        self.model, self.dev, self.k = m, dev, int(k)
        self.max_seqs = int(max_seqs)
        rows = min(m.chunk, self.max_seqs * CATCH_UP_ROWS)
        self.fwd = PagedForward(m, max_seqs=self.max_seqs, n_blocks=n_blocks, block_size=block_size,
                                owner=draft.owner, max_rows=rows)
        self.pool = KVPool(n_blocks, block_size, share=False)
        # one greedy sampler per sequence of a step, on its own copy of its last row's logits
        self.slots = [Slot(dev, draft.vocab_size, m.dtype, draft.owner, i, label="draft")
                      for i in range(self.max_seqs)]
        for slot in self.slots:
            slot.sampler.configure(GREEDY)
        self.results = dev.buffer(self.max_seqs * self.k * RESULT_BYTES, owner=draft.owner, label="draft.results")
        self.eos_ids = draft.eos_ids

    def leave(self, seq_id) -> None:
        if seq_id in self.pool:
            self.pool.free(seq_id)

    async def guesses(self, wanted: list) -> dict:
        """wanted: (seq_id, context token ids, k) -> {seq_id: up to k greedy guesses after context}."""
        dev, pool, fwd = self.dev, self.pool, self.fwd
        todo = []                               # (seq_id, context, k, first new position)
        for sid, ctx, k in wanted[:self.max_seqs]:
            k = min(k, self.k, self.model.ctx - len(ctx) + 1)
            if k <= 0:
                continue
            if sid not in pool:
                pool.add_sequence(sid, [])
            keep = min(shared_prefix(pool.tokens(sid), ctx), len(ctx) - 1)
            pool.truncate(sid, keep)
            try:
                pool.reserve(sid, len(ctx) + k - 1)
            except PoolExhaustedError:          # no room now: this sequence guesses nothing
                continue
            todo.append((sid, ctx, k, keep))
        if not todo:
            return {}
        # 1. catch up: long stretches by prefill (each its own submission), the rest in one forward
        joint, at = [], []
        for i, (sid, ctx, k, start) in enumerate(todo):
            if len(ctx) - start > CATCH_UP_ROWS or len(at) + len(ctx) - start > fwd.max_rows:
                await self._prefill(i, sid, ctx, start)
            else:
                joint.append(i)
                at += [(sid, p) for p in range(start, len(ctx))]
        if joint:
            batch = dev.batch()
            feed = [t for i in joint for t in todo[i][1][todo[i][3]:]]
            fwd.record_decode(batch, feed, pool.decode_rows(at, len(at), fwd.max_blocks))
            row = -1
            for i in joint:
                sid, ctx, k, start = todo[i]
                row += len(ctx) - start
                self._sample(batch, i, row, 0)
            await dev.ready(batch)
            dev.submit(batch)
        for sid, ctx, k, start in todo:
            pool.append_tokens(sid, ctx[start:], decoded=True)
        # 2. the other guesses: a decode step per guess, its input ids the samples of the one before
        for j in range(1, max(k for _, _, k, _ in todo)):
            rows = [(i, sid) for i, (sid, ctx, k, _) in enumerate(todo) if k > j]
            batch = dev.batch()
            for r, (i, _) in enumerate(rows):
                batch.copy(self.slots[i].next_id.buf, fwd.ids.buf, 4, self.slots[i].next_id.offset,
                           fwd.ids.offset + 4 * r)
            fwd.record_decode(batch, None, pool.decode_rows([(sid, len(todo[i][1]) + j - 1) for i, sid in rows],
                                                            len(rows), fwd.max_blocks))
            for r, (i, _) in enumerate(rows):
                self._sample(batch, i, r, j)
            await dev.ready(batch)
            dev.submit(batch)
        # 3. every guess at once
        raw = await dev.read(self.results, 0, self.max_seqs * self.k * RESULT_BYTES)
        out = {}
        for i, (sid, ctx, k, _) in enumerate(todo):
            toks = [self.slots[i].sampler.result(raw[a:a + RESULT_BYTES]).token
                    for a in ((j * self.max_seqs + i) * RESULT_BYTES for j in range(k))]
            pool.append_tokens(sid, toks[:k - 1], decoded=True)       # the rows steps 2.. wrote
            end = next((j + 1 for j, t in enumerate(toks) if t in self.eos_ids), k)
            out[sid] = toks[:end]
        return out

    async def _prefill(self, i: int, sid, ctx: list, start: int) -> None:
        """Sequence i's context from `start` by prefill chunks; its last row sampled (guess 1)."""
        dev, fwd, pool, P = self.dev, self.fwd, self.pool, self.model.chunk
        for s in range(start, len(ctx), P):
            e = min(s + P, len(ctx))
            batch = dev.batch()
            fwd.record_prefill(batch, ctx[s:e], s, pool.slots(sid, s, e - s), pool.block_table(sid),
                               with_head=e == len(ctx))
            if e == len(ctx):
                self._sample(batch, i, 0, 0)
            await dev.ready(batch)
            dev.submit(batch)

    def _sample(self, batch, i: int, row: int, j: int) -> None:
        """Logits row `row` -> sequence i's greedy sampler: its token to its next_id (the next
        step's input) and to the results at guess j's place."""
        slot = self.slots[i]
        slot.copy_in(batch, self.fwd.logits, row, self.model.cfg.vocab_size)
        slot.op.record(batch)
        slot.sampler.copy_result(batch, self.results, (j * self.max_seqs + i) * RESULT_BYTES)

    def close(self) -> None:
        self.fwd.release()
        for slot in self.slots:
            slot.release()
