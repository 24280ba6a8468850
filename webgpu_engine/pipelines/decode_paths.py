"""The decode step's other paths, for LLMChatPipeline (llm.py): which cache rows a prompt reuses, a
context shift when the cache is full (context_overflow "shift"), steps submitted one ahead of the
host (decode_ahead), and speculative steps (a verify forward over the last token and k guesses;
speculation.py says how they stay exact). A mixin: it reads and writes the pipeline's own state.
Page code: standard library only.
"""
from __future__ import annotations

import asyncio
import struct

from ..config import GREEDY, ChatConfig
from ..errors import UnsupportedChatOptionError
from ..kernels.logit_mask import LogitMask
from ..kernels.sampling import RESULT_BYTES
from .speculation import (SpeculationStats, grammar_row_masks, penalty_free, propose, same_vocabulary,
                          shared_prefix, slower_than_decode)
from .stats import now


class DecodePaths:
    """Mixed into LLMChatPipeline: decode_step picks one of these paths or the plain fused step;
    and the draft model speculation "draft" loads beside the pipeline."""

    async def _load_draft(self, progress, model_id: str | None) -> "DecodePaths":
        """speculation "draft": load the draft model (a local path: the engine resolves references)
        beside this one, with this model's context window, and check that it shares the vocabulary."""
        spec, cc = self.speculation, self.chat_config
        if progress:
            progress(1.0, f"loading the draft model {spec.model}")
        dcc = ChatConfig(context_window_size=self.model.ctx, max_num_sequences=1, dtype=cc.dtype,
                         compile_at_load=cc.compile_at_load, compile_in_background=cc.compile_in_background,
                         prefill_chunk_size=cc.prefill_chunk_size)
        draft = await type(self).load(self.dev, spec.model, dcc,
                                      model_id=f"{model_id}.draft" if model_id else None)
        if not same_vocabulary(self.tokenizer, draft.tokenizer):
            draft.dispose()
            raise UnsupportedChatOptionError("speculation", spec.describe(), (
                f"the draft model's vocabulary ({draft.tokenizer.vocab_size} tokens) differs from this "
                f"model's ({self.tokenizer.vocab_size}): a draft model must share the tokenizer"))
        draft.sampler.configure(GREEDY)
        return draft

    def _reuse_prefix(self, ids: list[int]) -> int:
        """Keep the longest prefix of `ids` the KV cache holds, less at least the last id (its logits
        are needed) and, unless reuse_decoded_kv, the rows a decode step wrote (the decode kernels
        round otherwise than the prefill's: an answer would depend on the cache's history)."""
        keep = shared_prefix(self.kv_ids, ids)
        if self.vision is not None:       # an image's rows only where the request has the same image
            keep = self.vision.reusable(self.kv_ids, keep)
        exact = len(self.kv_ids) if self.chat_config.reuse_decoded_kv else self.kv_exact
        keep = min(keep, len(ids) - 1, exact)                 # decoded rows are computed again
        m = self.model
        if m.recurrent and keep < len(self.kv_ids):
            keep = 0                         # the recurrent states hold all of kv_ids, not a shorter prefix
        if m.ring is not None and len(self.kv_ids) > m.ctx and len(self.kv_ids) - 1 - keep >= m.chunk:
            # a ring that went round since position `keep` no longer holds the window before it
            # (it can go back fewer positions than the rows of one forward): compute all again
            keep = 0
        self.kv_ids, self.kv_exact = ids[:keep], keep
        return keep

    async def _shift_context(self) -> None:
        """context_overflow "shift" (llama.cpp's context shift): the cache is full; keep its first
        n_keep tokens, drop the older half of the rest, and compute the kept tail again at its new
        positions (the cache then holds what a prompt of those tokens would give it)."""
        keep = min(max(self.chat_config.n_keep, 0), len(self.kv_ids) - 1)
        drop = max((len(self.kv_ids) - keep) // 2, 1)
        tail = self.kv_ids[keep + drop:]
        self.kv_ids, self.kv_exact = self.kv_ids[:keep], min(self.kv_exact, keep)
        m, P = self.model, self.model.chunk
        for i in range(0, len(tail), P):
            batch = self.dev.batch()
            m.record_prefill(batch, tail[i:i + P], keep + i, with_head=False)
            self.dev.submit(batch)
        self.kv_ids += tail
        # the prefill rows wrote the input ids: the next step's input is the last token again
        self.dev.write(m.ids.buf, struct.pack("<I", self._last_token))
        self._req.context_shifts += 1

    def _decodes_ahead(self) -> bool:
        """Whether this request's decode steps run one ahead of the host (decode_ahead): not under a
        grammar or logit processor (their next step needs this step's token on the host), not
        speculating, not batching."""
        ahead = self.chat_config.decode_ahead
        if ahead is None:
            ahead = not self._software
        return (ahead and self.scheduler is None and self.seq.matcher is None
                and self.logit_processor is None and self._req.spec is None)

    async def _step_ahead(self) -> None:
        """A decode step whose GPU work runs one step ahead of the host: submit the step after it
        first (its input id is the token this step samples, which the sampler writes on the GPU),
        then read this step's token. The host records and submits step n + 1 while the GPU runs
        step n; the same kernels in the same order as the serial path, so the same tokens. A step
        past the request's last token (a stop, max_tokens, the context's end) is never accepted:
        its work is discarded (_drop_ahead)."""
        seq, t0 = self.seq, now()
        pos = len(self.kv_ids)              # this step's input: the last accepted token, at pos
        rb = self._ahead if self._ahead is not None else await self._submit_decode(pos, threaded=False)
        self._ahead = None
        last_possible = (seq.max_tokens is not None and len(seq.output_ids) + 1 >= seq.max_tokens) \
            or pos + 1 >= self.cache_end or seq.interrupted     # (a shift comes first: not ahead)
        if not last_possible:
            self._ahead = await self._submit_decode(pos + 1, threaded=True)
        res = self.sampler.result(await self.dev.collect(rb))
        self.kv_ids.append(self._last_token)
        self._count_decode(now() - t0, 1)
        self._accept(res)
        if seq.stopped:
            self._drop_ahead()

    async def _submit_decode(self, pos: int, threaded: bool):
        """Record and submit one decode step at `pos` with its sampling and a readback of its result.
        `threaded`: the GPU is busy with the step before; on a software adapter a submit then blocks
        until it drains, so it goes through a worker thread (the event loop serves others)."""
        t0 = now()
        batch = self.dev.batch()
        self.model.record_decode(batch, pos)
        self._sample_op.record(batch)
        rb = batch.readback(self.sampler.io, 0, self.sampler._result_size(None))
        self.host_s += now() - t0
        await self.dev.ready(batch)        # kernels still compiling in the background
        if threaded and self._software:
            await self.dev.submit_async(batch)
        else:
            self.dev.submit(batch)
        return rb

    def _drop_ahead(self) -> None:
        """Discard the step in flight (past the request's end): its token is never read; its staging
        buffer returns to the pool once it has run."""
        rb, self._ahead = self._ahead, None
        if rb is None:
            return

        async def drain():
            try:
                await self.dev.collect(rb)
            except Exception:  # noqa: BLE001 - a lost device or a disposed model: nothing to keep
                pass
        asyncio.ensure_future(drain())

    def _auto_off(self, spec: SpeculationStats) -> str:
        """"speculate", "off" (auto_off: after `probe` verify steps this request's speculative
        tokens come slower than fused decode steps) or "time" (no fused step of this model timed yet:
        decode one fused step to time it)."""
        if not self.speculation.auto_off or spec.steps < self.speculation.probe:
            return "speculate"
        if self._decode_step_s is None:
            return "time"
        return "off" if slower_than_decode(spec, self.speculation.probe, self._decode_step_s) else "speculate"

    def _speculates(self, gen: GenerationConfig) -> bool:
        """Whether this request decodes speculatively: speculation is on, and the request has no
        penalties or logit processor (speculation.py says why); greedy or sampled, grammar or not."""
        return (self.speculation is not None and self.scheduler is None and penalty_free(gen)
                and self.logit_processor is None)

    async def _speculative_step(self) -> None:
        """One verify forward: the last token and up to k guesses (prompt lookup, or the draft model's
        greedy tokens) at once; each row samples as a decode step would (greedy, or the request's
        sampling with the next draws of its seed); keep the tokens up to the first guess that differs
        from its row's token, plus that token (speculative sampling for a guess made with certainty:
        speculation.py)."""
        spec, m, dev, seq = self.speculation, self.model, self.dev, self.seq
        t0 = now()
        pos0, last = len(self.kv_ids), self._last_token
        k = min(spec.k, m.ctx - pos0 - 1, m.chunk - 1, m.VERIFY_ROWS - 1)
        if seq.max_tokens is not None:
            k = min(k, seq.max_tokens - len(seq.output_ids) - 1)
        guess = await self._guesses(self.kv_ids + [last], k) if k > 0 else []
        masks = None
        if seq.matcher is not None:
            guess, masks = grammar_row_masks(seq.matcher, guess)
        if not guess and (m.exact_verify or spec.auto_off):
            # nothing to check: a plain decode step (with exact_verify the same bits as a verify row;
            # elsewhere auto_off lets the fused path make tokens); verify steps are guessing steps
            self._count_spec(SpeculationStats(plain=1))
            return await self._fused_step()
        ids = [last] + guess
        T = len(ids)
        batch = dev.batch()
        rows = m.record_verify(batch, ids, pos0)
        while len(self._row_sample_ops) < T:
            r = len(self._row_sample_ops)
            self._row_sample_ops.append(self.sampler.op(rows[r].view((self.vocab_size,))))
        if self._row_results is None:
            self._row_results = dev.buffer(m.VERIFY_ROWS * RESULT_BYTES, owner=self.owner, label="row_results")
        for r in range(T):
            if masks is not None:
                self._row_mask(r, rows[r], masks[r]).record(batch)
            self._row_sample_ops[r].record(batch)
            self.sampler.copy_result(batch, self._row_results, r * RESULT_BYTES)
        await dev.ready(batch)
        dev.submit(batch)
        raw = await dev.read(self._row_results, 0, T * RESULT_BYTES)
        self.kv_ids.append(last)
        n = 0
        for r in range(T):
            res = self.sampler.result(raw[r * RESULT_BYTES:(r + 1) * RESULT_BYTES])
            self._accept(res)
            n += 1
            if seq.stopped or r == T - 1 or res.token != guess[r]:
                break
            self.kv_ids.append(guess[r])          # the guess was right: its K/V row stays
        dt = now() - t0
        self._count_decode(dt, n)
        self._count_spec(SpeculationStats(1, len(guess), n - 1, n, dt))

    def _count_spec(self, step: SpeculationStats) -> None:
        """A speculative step's figures, in the request's and the model's."""
        self._req.spec.add(step)
        self.spec_stats.add(step)

    async def _guesses(self, context: list[int], k: int) -> list[int]:
        """Up to k guesses of the tokens after `context`: under a grammar the tokens it forces
        first (nearly always right), else the draft model's or prompt lookup's."""
        m = self.seq.matcher
        if m is not None:
            forced = m.forced()[:k]
            if forced:
                return forced
        if self.draft is not None:
            return await self._draft_guess(context, k)
        return propose(context, k, self.speculation.n, self.speculation.n_min)

    def _row_mask(self, r: int, logits, bits: bytes):
        """Verify row r's grammar mask (made on first use), loaded with `bits`; its op."""
        while len(self._row_masks) <= r:
            mk = LogitMask(self.dev, self.vocab_size, owner=self.owner, label=f"row_mask{len(self._row_masks)}")
            self._row_masks.append((mk, None))
        mk, op = self._row_masks[r]
        if op is None:
            op = mk.op(logits.view((self.vocab_size,)))
            self._row_masks[r] = (mk, op)
        mk.write(bits)
        return op

    async def _draft_guess(self, context: list[int], k: int) -> list[int]:
        """Up to k greedy tokens of the draft model after `context`. Its KV cache keeps the longest
        prefix it shares with the context (rejected guesses are overwritten by position); the new
        tokens are prefilled, then each guess is a fused decode step (a guess's bits do not matter:
        the target checks it)."""
        d = self.draft
        k = min(k, d.model.ctx - len(context))
        if k <= 0:
            return []
        keep = d._reuse_prefix(context)
        new = context[keep:]
        if len(new) == 1:        # one row: the fused decode kernels read their input id on the GPU
            d.dev.write(d.model.ids.buf, struct.pack("<I", new[0]))
            res = await d._forward(new, keep, decode=True)
        else:
            res = await d._forward(new, keep)
        out = [res.token]
        while len(out) < k and res.token not in self.eos_ids:
            res = await d._forward([res.token], len(d.kv_ids), decode=True)
            out.append(res.token)
        return out
