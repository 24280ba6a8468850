"""Continuous batching for one chat model: many generations share each forward pass.

The engine admits up to `max_num_sequences` requests at once (the model's FIFO lock has that many
places, so admission stays in arrival order; one place: one request at a time, WebLLM's default).
This is the only decode loop. Each admitted choice is a `BatchSequence` with the pipeline's
request-level interface (prefill_step, decode_step, take_delta, ...).
One task per model runs iterations while sequences are active:

    1. drop sequences that were interrupted or whose caller left;
    2. decode rows: every sequence past its prompt feeds its last token (KV blocks reserved first,
       oldest first; when the pool runs out the newest sequence is preempted: its blocks are freed
       and it recomputes its tokens later, with prefix hits for its full blocks: its prompt's rows
       by prefill, its decoded rows by decode steps feeding its own tokens (replay), as they were
       computed, so its answer is that of a run never preempted);
    3. prefill chunks: prompts (and preempted sequences' tokens) in admission order, up to
       `prefill_chunk` tokens per iteration, so a long prompt delays the running streams by at most
       one chunk per token they produce;
    4. one submission per forward (the decode rows together, each prefill chunk alone), each with
       the samplers of the rows it ends (each slot has its own GPU sampler: temperature, top-p/k,
       penalties over its own history, logit_bias, seed, logprobs); when a sequence needs the host
       between its logits and its sampler (a grammar mask, a logit processor) the samplers go in one
       more submission after the forwards instead; then one readback of all results;
    5. the stop rules per sequence (pipelines/sequence.py); finished sequences leave the batch and
       their KV blocks stay cached for prefix sharing (models/kv_pool.py).

context_overflow "shift": a sequence whose cache is full (its next row would pass the window) keeps
its first n_keep tokens and the newer half of the rest, computed again at their new positions as a
prefill that samples nothing, and decodes on; the others in the batch are not touched.

decode_ahead (ChatConfig; on except on software adapters): while only decode rows run, each
sampler also copies its token into the next step's input row on the GPU, and the step after (same
rows, next positions, KV slots reserved ahead) is submitted before this one's tokens are read, so
the host's recording and stop rules overlap the GPU's work; its rows of sequences that stopped are
discarded. Any change of the rows (a prompt waiting, a stop, max_tokens, the pool) plans again.

A sequence's tokens do not depend on what else runs (models/paged.py). Page code: standard library
only (in the browser, grammar masks are computed inline instead of in a worker thread).
"""
from __future__ import annotations

import asyncio
import hashlib

from ..config import GenerationConfig
from ..gpu import IN_BROWSER
from ..kernels.logit_mask import LogitMask
from ..kernels.lora import NONE
from ..kernels.sampling import RESULT_BYTES
from ..models.kv_pool import KVPool, PoolExhaustedError
from ..models.paged import PagedForward
from ..models.recurrent_snapshots import StateSnapshots, model_snapshot_slots
from .batch_sequence import BatchSequence, SeqRecord
from .batch_speculation import BatchSpeculation
from .sequence import configure_sampler, process_logits
from .slots import Slot
from .stats import now

CALLER_WAIT_S = 0.01      # the longest a step waits for callers on a CPU adapter (Scheduler.handed)


class SchedulerClosedError(RuntimeError):
    """The model was released while the request ran (the engine reports ModelUnloadedError)."""


class Scheduler:
    """Continuous batching over `pipe`'s model (an LLMChatPipeline) with a paged KV cache."""

    def __init__(self, pipe, plan):
        """`plan`: the load's models/plan.py DecoderPlan (sequences, block size, pool blocks)."""
        m, dev = pipe.model, pipe.dev
        self.pipe, self.dev, self.model = pipe, dev, m
        self.max_seqs, self.chunk = plan.max_sequences, m.chunk
        owner = pipe.owner
        bs, n_blocks = plan.kv_block_size, plan.kv_pool_blocks
        # speculation: each sequence guesses (prompt lookup, or the draft model once it has loaded:
        # LLMChatPipeline._load), one step checks all (batch_speculation.py)
        spec = pipe.speculation
        self.spec = BatchSpeculation(pipe, spec, self.max_seqs) if spec else None
        rows = self.spec.rows_cap if self.spec else self.max_seqs
        # a model with recurrent states (Qwen3.5) keeps snapshots of them (models/recurrent_snapshots.py)
        verify = rows if self.spec else 0
        self.fwd = PagedForward(m, max_seqs=self.max_seqs, n_blocks=n_blocks, block_size=bs, owner=owner,
                                max_rows=rows, snapshots=model_snapshot_slots(m, self.max_seqs, verify))
        self.snapshots = StateSnapshots(self.fwd, bs, verify) if m.recurrent else None
        # a ring's (a sliding window with sinks) tables are rings over their blocks, shared by none
        self.pool = KVPool(n_blocks, bs, ring_rows=self.fwd.ring_rows, ring_sinks=m.ring.sinks if m.ring else 0,
                           partial=self.snapshots is None and self.fwd.rows_copyable)
        vocab = pipe.vocab_size
        self.slots = [Slot(dev, vocab, m.dtype, owner, i) for i in range(self.max_seqs)]
        # each slot's sampler copies its step's result here (RESULT_BYTES at slot * RESULT_BYTES;
        # a verify step's guess rows after the slots' places, in row order)
        self._results_bytes = (self.max_seqs + (rows if self.spec else 0)) * RESULT_BYTES
        self.results = dev.buffer(self._results_bytes, owner=owner, label="scheduler.results")
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))
        self.running: list[SeqRecord] = []              # admission order
        self._just_preempted: set = set()
        self._task: asyncio.Task | None = None
        self._closed = False
        ahead = pipe.chat_config.decode_ahead
        self.decode_ahead = (not pipe._software) if ahead is None else bool(ahead)
        self._ahead = None                          # a decode step in flight: (rows, readback, t0)
        self._lp_s = 0.0
        # A CPU adapter shares the cores with the host: callers' work on their tokens (a stream's
        # chunk and its write) beside a step slows the step by more than it costs alone, so there the
        # next step waits (at most CALLER_WAIT_S) until the callers given a token ask for the next
        self.handed: set = set()                    # handles given a token this iteration
        self._taken = asyncio.Event()               # set when none of them is left
        self._wait_callers = pipe._software
        # preemptions: the pool's; ahead_steps: decode steps submitted before the tokens they take were read
        self.stats = {"iterations": 0, "decode_rows": 0, "prefill_tokens": 0, "ahead_steps": 0,
                      "context_shifts": 0}
        # context_overflow "shift": a sequence whose cache is full shifts (_shift) and goes on past
        # the window; otherwise the window's end ends it
        self.shifts, self.positions = pipe.shifts, pipe.positions

    def taken(self, handle: BatchSequence) -> None:
        """`handle`'s caller has taken its token (asks for the next one, or is done)."""
        self.handed.discard(handle)
        if not self.handed:
            self._taken.set()

    # ------------------------------------------------------------------ admission
    def sequence(self) -> BatchSequence:
        return BatchSequence(self)

    def add(self, handle: BatchSequence, prompt: list[int], gen: GenerationConfig) -> SeqRecord:
        if self._closed:
            raise SchedulerClosedError("the model was released")
        if not self._free_slots:
            raise RuntimeError("more sequences than max_num_sequences were admitted")
        # a LoRA adapter's slot in the model's pool (uploaded now where it is not on the GPU)
        lora_slot = self.pipe.lora.acquire(handle.adapter) if handle.adapter is not None else None
        rec = SeqRecord(handle, prompt, gen, self._free_slots.pop())
        rec.lora, rec.lora_slot = handle.adapter, lora_slot
        slot = self.slots[rec.slot]
        configure_sampler(slot.sampler, gen, prompt)
        if rec.seq.matcher is not None and slot.mask is None:
            slot.mask = LogitMask(self.dev, self.pipe.vocab_size, owner=self.pipe.owner)
            slot.mask_op = slot.mask.op(slot.logits)
        self.running.append(rec)
        self._enter_pool(rec)
        if self.spec is not None:
            self.spec.admit(rec)
        proc = self.pipe.logit_processor
        if proc is not None and hasattr(proc, "reset_state"):
            proc.reset_state()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())
        return rec

    def _enter_pool(self, rec: SeqRecord) -> None:
        # an adapter's rows are its own: prefixes are shared between sequences of the same adapter
        root = b"" if rec.lora is None else hashlib.sha256(b"lora:" + rec.lora.encode()).digest()
        tiles = getattr(rec.handle, "tiles", None)
        if tiles:        # and an image's rows are its content's (vision/runner.py), never copied in part
            root = hashlib.sha256(root + self.pipe.vision.root(tiles)).digest()
        cached = self.pool.add_sequence(rec.id, rec.toks, root=root, rows=not tiles) if self.snapshots is None else \
            self.snapshots.admit(self.pool, rec.id, rec.slot, rec.toks, root)
        rec.in_pool = True
        if rec.sample_at_end and not rec.decoding:
            rec.seq.req.prefill_tokens = len(rec.toks) - cached

    def cancel(self, rec: SeqRecord) -> None:
        """The caller left: the sequence leaves the batch now (its slot and blocks are free for the
        next request; GPU work already submitted for it finishes first, in queue order, and its
        results are dropped)."""
        if not rec.seq.stopped:
            rec.seq.finish("abort")
        rec.cancelled = True
        self._leave(rec)

    def interrupt(self) -> None:
        for rec in self.running:
            rec.seq.interrupted = True

    def _leave(self, rec: SeqRecord) -> None:
        if rec in self.running:
            self.running.remove(rec)
            self._free_slots.append(rec.slot)
            if self.spec is not None:
                self.spec.leave(rec)
            if rec.lora is not None:
                self.pipe.lora.release(rec.lora)
        if rec.in_pool:
            self.pool.free(rec.id)
            rec.in_pool = False

    def _preempted(self, seq_id) -> None:
        self._just_preempted.add(seq_id)
        for rec in self.running:
            if rec.id == seq_id:
                return rec.preempt()

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        try:
            while (self.running or self._ahead is not None) and not self._closed:
                self.handed.clear()
                await self._iteration()
                if self._wait_callers and self.handed:
                    self._taken.clear()
                    try:
                        await asyncio.wait_for(self._taken.wait(), CALLER_WAIT_S)
                    except asyncio.TimeoutError:
                        pass
                await asyncio.sleep(0)
            self.handed.clear()
        except BaseException as e:  # noqa: BLE001 - every waiting request gets the error
            self._ahead = None
            for rec in list(self.running):
                rec.handle._notify(e)
                self._leave(rec)
            if isinstance(e, asyncio.CancelledError):
                raise

    def _drop_finished(self) -> None:
        for rec in list(self.running):
            if rec.seq.interrupted and not rec.seq.stopped:
                rec.seq.finish("abort")
                self.pipe.finished(rec.seq, rec.toks)
                self._leave(rec)
                rec.handle._notify()

    def _reserve_decode(self, rec: SeqRecord) -> None:
        """A block for rec's next token; when the pool is out of blocks, the newest sequence goes
        (rec itself when it is the newest)."""
        for victim in self.pool.reserve_or_preempt(rec.id, rec.next_pos() + 1):
            self._preempted(victim)

    def _shift(self, rec: SeqRecord) -> None:
        """context_overflow "shift" for one sequence (llama.cpp's per-slot context shift): its cache
        is full; keep its first n_keep tokens, drop the older half of the rest, and compute the kept
        tail again at its new positions by prefill, sampling nothing (what a prompt of those tokens
        would give the cache), then decode on from its last token. Its blocks go back to the
        pool; the kept prefix's full blocks come back as prefix hits."""
        keep = min(max(self.pipe.chat_config.n_keep, 0), len(rec.toks) - 1)
        drop = max((len(rec.toks) - keep) // 2, 1)
        if getattr(rec.handle, "tiles", None):   # an image the shift would cut goes whole, the kept move
            keep, drop, rec.handle.tiles = self.pipe.vision.shift(rec.handle.tiles, keep, drop)
        self.pool.free(rec.id)
        rec.toks = rec.toks[:keep] + rec.toks[keep + drop:]
        rec.in_pool, rec.decoding, rec.sample_at_end = False, False, False
        rec.prompt_len, rec.replay = len(rec.toks), None
        rec.seq.req.context_shifts += 1
        self.stats["context_shifts"] += 1

    def _plan(self) -> tuple[list, list]:
        pool = self.pool
        self._just_preempted = set()
        if self.shifts:                       # a full cache shifts before its next decode row
            for rec in self.running:
                if rec.decoding and rec.in_pool and rec.replay is None and len(rec.toks) + 1 > self.model.ctx:
                    self._shift(rec)
        for rec in list(self.running):        # oldest first: the newest is preempted first
            if rec.decoding and rec.in_pool:
                self._reserve_decode(rec)
        decode = [r for r in self.running if r.decoding and r.in_pool]
        chunks, budget = [], self.chunk
        for rec in self.running:
            if rec.decoding or budget <= 0 or rec.id in self._just_preempted:
                continue
            if not rec.in_pool:
                if rec.preempted and decode and not pool.fits(len(rec.toks) + 1, spare=len(decode)):
                    break                     # waits for blocks, and the sequences after it behind it
                self._enter_pool(rec)
            start = pool.num_tokens(rec.id)
            if start >= rec.prefill_end():    # a replay whose prompt rows are cached: decodes next time
                rec.start_decoding(start)
                continue
            end = min(rec.prefill_end(), start + budget)
            tiles = getattr(rec.handle, "tiles", None)
            if tiles and (end := self.pipe.vision.chunk_end(tiles, start, end)) == start:
                continue                      # its next image's rows wait for a chunk that holds them
            try:
                pool.reserve(rec.id, end)
            except PoolExhaustedError:
                break                         # waits for blocks (decode rows free them as they finish)
            chunks.append((rec, start, end))
            budget -= end - start
        if not decode and not chunks:
            # every sequence waits for blocks that only a newer one holds: preempt from the newest
            oldest = next((r for r in self.running if not r.decoding), None)
            if oldest is None:                # all were preempted just now: they re-enter next time
                return decode, chunks
            victim = pool.preempt_newest(keep=(oldest.id,))
            if victim is None:
                raise RuntimeError("the KV pool cannot hold one sequence")   # sized to prevent this
            self._preempted(victim)
        return decode, chunks

    async def _iteration(self) -> None:
        self._lp_s = 0.0                      # the logit processor's time this iteration (latency breakdown)
        self._drop_finished()
        if self._ahead is not None:
            return await self._finish_ahead()
        if not self.running:
            return
        dev, fwd, pool = self.dev, self.fwd, self.pool
        decode, chunks = self._plan()
        t0 = now()
        sampled = [(r, i) for i, r in enumerate(decode) if r.replay is None]
        sampled += [(r, 0) for r, s, e in chunks if e == len(r.toks) and r.sample_at_end]
        # each speculating sequence's guesses, checked by rows of this step, and the grammar masks
        # of the rows of those under a grammar (made here, before the step)
        guesses, row_masks = {}, {}
        # a prompt's last chunk under a grammar has its mask made beside the forwards: then the step
        # is not inline and takes no guesses, so none are made (a draft's forwards included)
        chunk_mask = any(r.seq.matcher is not None for r, _ in sampled if not r.decoding)
        if self.spec is not None and decode and self.pipe.logit_processor is None and not chunk_mask:
            guesses, row_masks = await self.spec.guesses(decode, pool, self.model.ctx)
            if self.spec.draft is not None:
                # the draft's forwards let callers run meanwhile: a sequence whose caller left is not fed
                decode = [r for r in decode if not r.cancelled]
                chunks = [c for c in chunks if not c[0].cancelled]
                sampled = [(r, i) for r, i in sampled if not r.cancelled]
                guesses = {r: g for r, g in guesses.items() if not r.cancelled}
        masks = {}
        for rec, _ in sampled:               # the other grammar masks while the forwards run
            m = rec.seq.matcher
            if m is not None and rec not in row_masks:
                masks[rec] = m.mask() if IN_BROWSER else asyncio.ensure_future(asyncio.to_thread(m.mask))
        # no mask to make beside the forwards and no logit processor: each row's sampler (and mask)
        # goes in its forward's own submission (one wait per iteration, at the readback, instead of
        # one more between); guesses only so (a guess row's sampler follows its logits there)
        inline = not masks and self.pipe.logit_processor is None
        if not inline and (guesses or row_masks):   # every sampler after the forwards: no guess rows
            for rec in guesses:
                pool.trim(rec.id, len(rec.toks) + 1)
            masks.update({rec: ms[0] for rec, ms in row_masks.items() if not rec.cancelled})
            guesses, row_masks = {}, {}
        rb = None
        if decode:
            # with no chunk after it, its results are read from this point (a step may follow)
            batch, rb = self._decode_batch(decode, [r.feed_token() for r in decode], 0, inline,
                                           inline and not chunks, guesses, row_masks)
            await dev.ready(batch)          # kernels still compiling in the background
            dev.submit(batch)
            if rb is not None and not guesses and self._can_go_ahead(decode):
                self._ahead = (decode, await self._submit_ahead(decode), now())
        for rec, start, end in chunks:
            if decode or rec is not chunks[0][0]:
                # a submit while the GPU is busy can block until it drains (lavapipe): wait for the
                # work before off the event loop, so other requests and /health go on meanwhile
                await dev.sync()
            if rec.t_prefill is None:
                rec.t_prefill = now()
            head = end == len(rec.toks) and rec.sample_at_end
            tiles = getattr(rec.handle, "tiles", None)
            if tiles:                         # its images' tiles in this chunk through the tower
                await self.pipe.vision.stage_chunk(tiles, start, end)
            batch = dev.batch()
            fwd.copy_pending(batch, pool, rec.id)          # its first rows, from a cached block
            state = rec.slot if self.snapshots is None else self.snapshots.prefill_slots(rec.id, rec.slot, start, end)
            fwd.record_prefill(batch, rec.toks[start:end], start, pool.slots(rec.id, start, end - start),
                               pool.block_table(rec.id), with_head=head, lora=rec.lora_slot, state_slot=state)
            if head:
                self._copy_logits(batch, 0, rec.slot)
                if inline:
                    self._record_sampler(batch, rec)
            await dev.ready(batch)
            dev.submit(batch)
            self.stats["prefill_tokens"] += end - start
        if sampled and not inline:
            await dev.sync()
            if self.pipe.logit_processor is not None:
                t_lp = now()
                await self._process_logits([r for r, _ in sampled])
                self._lp_s = now() - t_lp
            batch = dev.batch()
            for rec, _ in sampled:
                if rec.cancelled:                 # its slot may hold a new sequence already
                    continue
                if rec in masks:
                    slot = self.slots[rec.slot]
                    bits = masks[rec]
                    slot.mask.write(await bits if asyncio.isfuture(bits) else bits)
                    slot.mask_op.record(batch)
                self._record_sampler(batch, rec)
            dev.submit(batch)
        if rb is not None:
            raw = await dev.collect(rb)
        elif sampled:
            raw = await dev.read(self.results, 0, self._results_bytes)
        else:
            await dev.sync()
        dt = now() - t0
        if self.spec is not None and not chunks:
            self.spec.timed(dt, bool(guesses), len(decode))
        self._finish(decode, chunks, sampled, raw if sampled else b"", dt, guesses)

    def _finish(self, decode: list, chunks: list, sampled: list, raw: bytes, dt: float,
                guesses: dict | None = None) -> None:
        """After an iteration's work has run: record the fed tokens' KV, accept the sampled tokens
        (a speculating sequence's row 0, then the guesses its rows kept)."""
        pool = self.pool
        self.stats["iterations"] += 1
        self.stats["decode_rows"] += len(decode)
        for rec in decode:
            if rec.in_pool:                       # not cancelled (or preempted) meanwhile
                tok = rec.feed_token()
                # decoded blocks are shared only with reuse_decoded_kv (read live: a chat's config may change)
                pool.append_tokens(rec.id, [tok], decoded=not self.pipe.chat_config.reuse_decoded_kv)
                if rec.replay is not None:        # a decoded row computed again: on to the next
                    rec.start_decoding(rec.replay + 1)
                else:
                    rec.toks.append(tok)
        for rec, start, end in chunks:
            if rec.in_pool:
                pool.append_tokens(rec.id, rec.toks[start:end])
                if end == rec.prefill_end():
                    rec.start_decoding(end)
            if self.snapshots is not None:        # the states its rows saved, under their blocks' keys
                self.snapshots.prefilled(rec.id, pool.block_keys(rec.id) if rec.in_pool else None)
        for rec, _ in sampled:
            if rec.cancelled or not rec.in_pool:
                continue
            self._accept(rec, raw[rec.slot * RESULT_BYTES:(rec.slot + 1) * RESULT_BYTES], dt, rec in decode)
        at = self.max_seqs                        # the guess rows' results, in row order
        for rec in decode if guesses else ():
            guess = guesses.get(rec)
            if not guess:
                continue
            res = [raw[(at + j) * RESULT_BYTES:(at + j + 1) * RESULT_BYTES] for j in range(len(guess))]
            at += len(guess)
            if not rec.cancelled:
                self.spec.keep(self, rec, guess, res, dt)

    # ------------------------------------------------------------------ decode_ahead
    def _can_go_ahead(self, rows: list) -> bool:
        """Whether the decode step after the one in flight (same rows, same order) may be submitted
        before that one's tokens are read: decode_ahead on, every running sequence decoding in
        `rows` (none waits for its prompt: it joins at the next planned iteration), none needing the
        host between steps (a grammar, a logit processor), none whose step in flight may be its last
        (max_tokens, the context's end) and a KV slot for each (reserved now; never preempting)."""
        if not self.decode_ahead or self.pipe.logit_processor is not None or len(rows) != len(self.running):
            return False
        for rec in rows:
            seq = rec.seq
            if (rec not in self.running or not rec.in_pool or not rec.decoding or rec.cancelled
                    or rec.replay is not None
                    or seq.stopped or seq.interrupted or seq.matcher is not None
                    or (seq.max_tokens is not None and len(seq.output_ids) + 2 > seq.max_tokens)
                    or len(rec.toks) + 2 > self.pipe.cache_end):
                return False
        try:
            for rec in rows:
                self.pool.reserve(rec.id, len(rec.toks) + 2)
        except PoolExhaustedError:
            return False
        return True

    def _decode_batch(self, rows: list, tokens: list | None, ahead: int, sample: bool, read: bool,
                      guesses: dict | None = None, row_masks: dict | None = None):
        """(batch, readback or None): one decode step of `rows` feeding `tokens` (None: the ids the
        samplers of the step in flight wrote, `ahead` = 1 step past the pool's record), each row's
        logits to its slot, with `sample` its sampler (and its token into the next step's row i),
        with `read` a readback of the results at this point of the batch. `guesses` (rec -> guesses):
        a row after rec's for each guess, at the next positions, its logits sampled by rec's slot
        right after the row before it (results after the slots' places, in row order); `row_masks`
        (rec -> bytes per row): each of rec's rows masked before its sampler."""
        fwd, batch, pool = self.fwd, self.dev.batch(), self.pool
        for r in rows:       # a replay whose prompt rows came whole from the pool, a part copied: its
            fwd.copy_pending(batch, pool, r.id)     # first forward is this decode row
        # each row's LoRA slot, where a row has an adapter (else the base's op lists)
        lora = [NONE if r.lora_slot is None else r.lora_slot for r in rows
                for _ in range(1 + len((guesses or {}).get(r, ())))]
        lora = lora if any(s != NONE for s in lora) else None
        if guesses:
            feed, at = [], []
            for r, tok in zip(rows, tokens):
                g = guesses.get(r, [])
                feed += [tok] + g
                at += [(r.id, len(r.toks) + j) for j in range(1 + len(g))]
            states = self.snapshots and self.snapshots.verify_step([(r.slot, 1 + len(guesses.get(r, [])))
                                                                    for r in rows])
            fwd.record_decode(batch, feed, pool.decode_rows(at, len(at), fwd.max_blocks), lora, states)
        else:
            fwd.record_decode(batch, tokens, pool.decode_inputs([r.id for r in rows], len(rows), fwd.max_blocks,
                                                                ahead=ahead), lora, [r.slot for r in rows])
        i, extra = 0, self.max_seqs
        for r in rows:
            ms = (row_masks or {}).get(r)
            self._copy_logits(batch, i, r.slot)
            if ms:
                self.slots[r.slot].row_mask(0, ms[0]).record(batch)
            if sample and r.replay is None:       # a replayed row samples nothing
                self._record_sampler(batch, r, row=i)
            i += 1
            for j, _ in enumerate((guesses or {}).get(r, ()), 1):
                self._copy_logits(batch, i, r.slot)
                if ms:
                    self.slots[r.slot].row_mask(j, ms[j]).record(batch)
                self._record_sampler(batch, r, at=extra * RESULT_BYTES)
                i, extra = i + 1, extra + 1
        return batch, batch.readback(self.results, 0, self._results_bytes) if read else None

    async def _submit_ahead(self, rows: list):
        """Record and submit the decode step after the one in flight: row i's input id is the token
        row i of that step samples (its slot's sampler put it into the step's ids on the GPU), at
        the next position; its samplers and a readback of their results. Returns the readback."""
        dev = self.dev
        batch, rb = self._decode_batch(rows, None, 1, True, True)
        self.stats["ahead_steps"] += 1
        await dev.ready(batch)
        if self.pipe._software:         # a submit while the GPU is busy blocks until it drains there
            await dev.submit_async(batch)
        else:
            dev.submit(batch)
        return rb

    async def _finish_ahead(self) -> None:
        """The iteration of a decode step submitted ahead: submit the one after it where that may go
        (no row left meanwhile), then read this one's tokens. A row whose sequence stopped (or left)
        at the step before is discarded: its token is never accepted or streamed."""
        rows, rb, t0 = self._ahead
        self._ahead = None
        live = [r for r in rows if r in self.running and r.in_pool and not r.cancelled and not r.seq.stopped]
        if len(live) == len(rows) and self._can_go_ahead(rows):
            self._ahead = (rows, await self._submit_ahead(rows), now())
        raw = await self.dev.collect(rb)
        self._finish(live, [], [(r, i) for i, r in enumerate(rows) if r in live], raw, now() - t0)

    def _accept(self, rec: SeqRecord, raw: bytes, dt: float, decoded: bool) -> None:
        seq, req = rec.seq, rec.seq.req
        res = self.slots[rec.slot].sampler.result(raw)
        tok, lp, top = res.token, res.logprob, res.top
        if decoded:
            req.decode_s += dt
            req.decode_tokens += 1
        else:
            req.prefill_s = now() - (rec.t_prefill or req.t_start)
            req.t_first_token = now()
        if req.breakdown:
            req.step_s.append(dt if decoded else req.prefill_s)
            req.logit_processor_s.append(self._lp_s)
        try:
            seq.accept(tok, lp, top, len(rec.toks), self.positions)
        except Exception as e:  # noqa: BLE001 - a grammar that refuses the token fails this sequence
            seq.finish("abort")
            self._leave(rec)
            rec.handle._notify(e)
            return
        proc = self.pipe.logit_processor
        if proc is not None and hasattr(proc, "process_sampled_token"):
            proc.process_sampled_token(tok)
        if seq.stopped:
            self.pipe.finished(seq, rec.toks)     # get_message() gives the last finished answer
            self._leave(rec)
        rec.handle._notify()

    def _record_sampler(self, batch, rec: SeqRecord, row: int | None = None, at: int | None = None) -> None:
        """rec's slot sampler on its logits, its result to rec.slot's place in `results` (or `at`);
        with `row`, its token also into the decode input ids' row `row` (the next step's input,
        decode_ahead)."""
        slot = self.slots[rec.slot]
        slot.op.record(batch)
        slot.sampler.copy_result(batch, self.results, rec.slot * RESULT_BYTES if at is None else at)
        if row is not None and self.decode_ahead:
            batch.copy(slot.next_id.buf, self.fwd.ids.buf, 4, slot.next_id.offset, self.fwd.ids.offset + 4 * row)

    def _copy_logits(self, batch, row: int, slot_i: int) -> None:
        """Logits row `row` -> the slot's own logits (its sampler and mask are bound to it)."""
        self.slots[slot_i].copy_in(batch, self.fwd.logits, row, self.model.cfg.vocab_size)

    async def _process_logits(self, recs) -> None:
        """A WebLLM logit processor, per sampling sequence (a host round trip each)."""
        for rec in recs:
            await process_logits(self.dev, self.pipe.logit_processor, self.slots[rec.slot].logits)

    def describe(self) -> dict:
        """For /v1/models: the batch's size and use so far (where the time went)."""
        p = self.pool
        return {"max_num_sequences": self.max_seqs, "running": len(self.running),
                "kv_block_size": p.block_size, "kv_pool_blocks": p.n_blocks, "kv_free_blocks": p.n_free,
                **self.stats, "preemptions": p.stats["preemptions"], "prefix_hit_tokens": p.stats["hit_tokens"],
                "evictions": p.stats["evictions"]}

    # ------------------------------------------------------------------ warm-up, release
    def compile_ops(self) -> list:
        """(kind, rows) of the op lists a request uses, for LLMChatPipeline._compile: decode of 1 ..
        max_seqs rows, prefill of the model's warm-up heights."""
        return [("decode", T) for T in range(1, self.fwd.max_rows + 1)] + \
            [("prefill", T) for T in self.model.warm_heights()]

    def close(self) -> None:
        """The model is being released: fail every waiting request, stop the loop."""
        self._closed = True
        err = SchedulerClosedError("the model was released")
        for rec in list(self.running):
            rec.handle._notify(err)
        self.running.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.spec is not None:
            self.spec.close()
        self.fwd.release()
        for slot in self.slots:
            slot.release()
