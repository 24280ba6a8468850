"""Speculative decoding inside continuous batching (pipelines/scheduler.py): each sequence guesses
its own next tokens (prompt lookup, speculation.py `propose`; or a draft model's greedy tokens,
batch_draft.py, for all the sequences at once), and one decode step checks every sequence's guesses
at once.

A sequence with k guesses takes k + 1 rows of the step: its last token and the guesses, at
consecutive positions, each row reading the keys up to its own position (the rows before it in
the same step write theirs first: models/kv_pool.py `decode_rows`). The rows go through the decode
kernels the batch's plain rows go through, so row r's logits are those a plain decode step at its
position computes, bit for bit; each row samples as that step would (greedy; a sampled request
with the next draws of its seed, as speculation.py says). The tokens up to the first guess that
differs from its row's token, plus that token, are kept: a greedy answer equals the same request
without speculation. The rejected rows' KV slots go back to the pool (`trim`).

The rows one step takes are bounded (`rows_cap`: max_num_sequences x (k + 1), at most a prefill
chunk); when guesses would pass it, the older sequences guess first. Which sequences speculate:
those without penalties (their counts would take in rejected rows), and
not while the model has a logit processor (its host work sits between a row's logits and its
sampler). Under a grammar a sequence guesses the tokens the grammar forces first, its other guesses
are cut where the grammar refuses one, and each of its rows is masked with the grammar's state after
the guesses before it (the masks made on the host before the step, `grammar_row_masks`); a step
whose other sequences still wait for a grammar mask made beside the forwards (a prompt's last chunk)
takes no guesses. auto_off per sequence: after `probe` verify steps, a sequence whose tokens
come slower than one per plain decode step (the model's, measured on steps without guesses) stops
guessing. Standard library only (runs in the page).
"""
from __future__ import annotations

from ..errors import UnsupportedChatOptionError
from ..models.kv_pool import PoolExhaustedError
from .batch_draft import DraftGuesser
from .speculation import SpeculationStats, grammar_row_masks, penalty_free, propose, slower_than_decode

_EMA = 0.2            # weight of a new plain step's time in the model's yardstick


class BatchSpeculation:
    """The scheduler's speculation: guesses per sequence, their rows, and what a step kept."""

    def __init__(self, pipe, spec, max_seqs: int):
        self.pipe, self.spec, self.max_seqs = pipe, spec, max_seqs
        self.draft: DraftGuesser | None = None        # method "draft": set once the draft has loaded
        self.rows_cap = min(pipe.model.chunk, max_seqs * (spec.k + 1))
        self.plain_step_s: float | None = None       # a decode step without guesses (auto_off's yardstick)

    def admit(self, rec) -> None:
        """A new sequence guesses when its request has no penalties (speculation.py says why) and
        the model no logit processor; its figures go to usage.extra."""
        if penalty_free(rec.gen) and self.pipe.logit_processor is None:
            rec.seq.req.spec = SpeculationStats()

    def use_draft(self, draft, n_blocks: int, block_size: int) -> None:
        """speculation "draft": `draft` (its loaded LLMChatPipeline) guesses, with a paged cache of
        n_blocks blocks (the target pool's size) of its own."""
        if draft.model.recurrent:           # that cache is cut back to each step's context
            raise UnsupportedChatOptionError("speculation", self.spec.describe(), (
                "the draft model's layers keep a recurrent state per sequence (Gated DeltaNet), which its "
                "cache, cut back to each step's context, cannot step back: choose a draft model without them"))
        self.draft = DraftGuesser(draft, self.max_seqs, self.spec.k, n_blocks, block_size)

    async def guesses(self, decode: list, pool, ctx: int) -> tuple[dict, dict]:
        """(rec -> its guesses this step, their KV slots reserved (oldest sequences first, within
        rows_cap); rec -> its rows' grammar masks, for each guessing sequence under a grammar: its
        last token's row, then one per guess). A sequence without a guess gets a plain row."""
        out, masks = {}, {}
        if self.spec.method == "draft" and self.draft is None:
            return out, masks
        budget, wanted = self.rows_cap - len(decode), []
        for rec in decode:
            st = rec.seq.req.spec
            if budget <= 0 or st is None or st.off or rec.replay is not None:
                continue
            seq = rec.seq
            k = min(self.spec.k, budget, ctx - len(rec.toks) - 1)
            if seq.max_tokens is not None:
                k = min(k, seq.max_tokens - len(seq.output_ids) - 1)
            # under a grammar, the tokens it forces are the first guesses (nearly always right)
            forced = seq.matcher.forced()[:k] if seq.matcher is not None and k > 0 else []
            if k <= 0 or forced or self.draft is None:
                guess = forced or (propose(rec.toks + [seq.last_token], k, self.spec.n, self.spec.n_min)
                                   if k > 0 else [])
                budget -= self._take(rec, guess, pool, out, masks)
            else:                               # the draft guesses for all of them at once, below
                wanted.append((rec, k))
                budget -= k
        if wanted:
            made = await self.draft.guesses([(r.id, r.toks + [r.seq.last_token], k) for r, k in wanted])
            for rec, _ in wanted:
                self._take(rec, made.get(rec.id, []), pool, out, masks)
        return out, masks

    @staticmethod
    def _take(rec, guess: list[int], pool, out: dict, masks: dict) -> int:
        """rec's guesses into `out` (cut where its grammar refuses one; its rows' masks into
        `masks`), their KV slots reserved; how many rows they take."""
        m = rec.seq.matcher
        if m is not None:
            guess, masks[rec] = grammar_row_masks(m, guess)
        if guess:
            try:
                pool.reserve(rec.id, len(rec.toks) + 1 + len(guess))
                out[rec] = guess
                return len(guess)
            except PoolExhaustedError:         # no room for guesses now: a plain row
                pass
        else:
            rec.seq.req.spec.plain += 1
        if m is not None:
            masks[rec] = masks[rec][:1]
        return 0

    def leave(self, rec) -> None:
        """rec left the batch: its draft rows go."""
        if self.draft is not None:
            self.draft.leave(rec.id)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()

    def timed(self, dt: float, guessed: bool, rows: int) -> None:
        """A decode step's time: steps without guesses set the yardstick (per step)."""
        if not guessed and rows:
            self.plain_step_s = dt if self.plain_step_s is None else (1 - _EMA) * self.plain_step_s + _EMA * dt

    def keep(self, sched, rec, guess: list[int], results: list[bytes], dt: float) -> None:
        """After row 0's token was accepted: accept each guess its row agreed with, and the token of
        the row after it, up to the first disagreement; record the step; give back the rest."""
        seq, pool, n = rec.seq, sched.pool, 1
        for g, raw in zip(guess, results):
            if seq.stopped or not rec.in_pool or seq.last_token != g:
                break
            pool.append_tokens(rec.id, [g], decoded=not sched.pipe.chat_config.reuse_decoded_kv)
            rec.toks.append(g)
            sched._accept(rec, raw, 0.0, True)
            n += 1
        if rec.in_pool:
            pool.trim(rec.id, len(rec.toks) + 1)
        if sched.snapshots is not None:       # recurrent states: back to those after the kept rows
            sched.snapshots.rolled_back(rec.slot, n)
        step = SpeculationStats(1, len(guess), n - 1, n, dt)
        seq.req.spec.add(step)
        self.pipe.spec_stats.add(step)
        st = seq.req.spec
        if self.spec.auto_off and not st.off and slower_than_decode(st, self.spec.probe, self.plain_step_s):
            st.off = 1
            self.pipe.spec_stats.off += 1
