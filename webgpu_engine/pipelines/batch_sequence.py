"""One generation in the batch scheduler (pipelines/scheduler.py): the scheduler's record of a
sequence (SeqRecord: its tokens, slot, place in the pool, recomputation state) and the caller's
handle (BatchSequence: the pipeline's request-level interface, each step a wait for the scheduler).
Standard library only."""
from __future__ import annotations

import asyncio
import itertools

from ..config import GenerationConfig
from .stats import RequestStats, now

_ids = itertools.count()


class SeqRecord:
    """The scheduler's record of one sequence."""

    def __init__(self, handle: "BatchSequence", prompt: list[int], gen: GenerationConfig, slot: int):
        self.id = next(_ids)
        self.handle, self.gen, self.slot = handle, gen, slot
        self.seq = handle.seq
        self.toks = list(prompt)          # tokens whose KV the next decode step needs
        self.in_pool = False
        self.decoding = False             # past its prompt: feeds seq.last_token each step
        self.sample_at_end = True         # the prompt's last chunk samples (not a recomputation)
        self.cancelled = False
        self.t_prefill = None
        self.prompt_len = len(prompt)     # rows a prefill computes; the rest, decode steps
        self.replay: int | None = None    # after a preemption: the next decoded row computed again
        self.preempted = False            # preempted at least once: comes back only with room to stay
        self.lora: str | None = None      # its LoRA adapter's name (None: the base) ...
        self.lora_slot: int | None = None  # ... and its slot in the model's LoraPool

    # A preempted sequence computes its rows again as they were computed: the prompt's by prefill, the
    # decoded ones by decode steps that feed its own tokens and sample nothing (replay), so its
    # later tokens are those of a run never preempted, bit for bit.
    def prefill_end(self) -> int:
        return self.prompt_len if self.replay is not None else len(self.toks)

    def next_pos(self) -> int:
        return self.replay if self.replay is not None else len(self.toks)

    def feed_token(self) -> int:
        return self.toks[self.replay] if self.replay is not None else self.seq.last_token

    def preempt(self) -> None:
        """Its blocks went back to the pool: its prompt's rows come again by prefill, its decoded
        ones by replay; it comes back once the pool holds it with room to spare (scheduler `_plan`:
        with less, an older answer crossing into a new block would preempt it again at once)."""
        self.in_pool, self.preempted = False, True
        if self.decoding:                 # its last sampled token is fed after the recomputation
            self.decoding, self.sample_at_end = False, False
        if len(self.toks) > self.prompt_len:
            self.replay = self.prompt_len

    def start_decoding(self, pos: int) -> None:
        self.decoding = True
        if self.replay is not None:
            self.replay = pos if pos < len(self.toks) else None


class BatchSequence:
    """One generation served by the scheduler, with the pipeline's request-level interface."""

    def __init__(self, sched):              # the Scheduler (pipelines/scheduler.py)
        self._sched = sched
        self.seq = None
        self._rec: SeqRecord | None = None
        self._event = asyncio.Event()
        self.error: BaseException | None = None
        self.adapter: str | None = None     # the LoRA adapter it generates with (None: the base)
        self.tiles: list = []               # its images' tiles (start, end, sha256, patch rows)

    stopped = property(lambda self: self.seq is not None and self.seq.stopped)
    finish_reason = property(lambda self: self.seq.finish_reason if self.seq else None)
    stop_str = property(lambda self: self.seq.stop_str if self.seq else None)
    token_logprobs = property(lambda self: self.seq.token_logprobs if self.seq else [])
    output_ids = property(lambda self: self.seq.output_ids if self.seq else [])

    async def prefill_step(self, messages, gen: GenerationConfig, prompt: str | None = None) -> None:
        pipe = self._sched.pipe
        req = RequestStats(t_start=now(), breakdown=gen.latency_breakdown)
        ids = await pipe.prompt_tokens(messages, gen, prompt, req=req)
        if pipe.vision is not None:          # its images' tiles, preprocessed (vision/runner.py)
            from ..vision.requests import images_of
            self.tiles = await pipe.vision.batch_tiles(ids, images_of(messages))
        await self.prefill_ids(ids, gen, raw=prompt is not None, req=req)

    async def prefill_ids(self, ids: list[int], gen: GenerationConfig, raw: bool = True,
                          req: RequestStats | None = None, stats=None) -> None:
        """Generate after prompt token ids `ids` (checked by the caller); raw: they continue a
        completion (not a chat reply); stats: where the sequence's figures go (default the model's)."""
        req = req if req is not None else RequestStats(t_start=now(), breakdown=gen.latency_breakdown)
        self.seq = self._sched.pipe.new_sequence(gen, req, raw=raw, stats=stats)
        req.prompt_tokens = len(ids)
        if self.adapter is not None:         # every LoRA slot held by running sequences' adapters: wait
            await self._sched.pipe.lora.slot_free(self.adapter)
        self._rec = self._sched.add(self, ids, gen)
        await self._wait()

    def tokens(self) -> list[int]:
        """The tokens whose K/V the pool holds (or will) for this sequence: its prompt and the
        answer's tokens fed back so far."""
        return list(self._rec.toks) if self._rec is not None else []

    async def decode_step(self) -> None:
        self._sched.taken(self)
        if self.seq is None or self.seq.stopped:
            return
        await self._wait()

    async def _wait(self) -> None:
        await self._event.wait()
        self._event.clear()
        if self.error is not None:
            raise self.error

    def _notify(self, error: BaseException | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self._sched.handed.add(self)
        self._event.set()

    def take_delta(self) -> str:
        return self.seq.take_delta() if self.seq else ""

    def get_message(self) -> str:
        return self.seq.get_message() if self.seq else ""

    def usage(self) -> dict:
        return self.seq.usage() if self.seq else {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}

    def interrupt(self) -> None:
        if self.seq is not None:
            self.seq.interrupted = True

    def close(self) -> None:
        """The caller is done (finished, failed or gone): the sequence leaves the batch."""
        self._sched.taken(self)
        if self._rec is not None:
            self._sched.cancel(self._rec)
