"""Coalesced embedding batches: concurrent embeddings.create calls to one embedder share forwards.

Each request is checked and tokenised on its own first (pipeline.prepare_embed), so a bad input fails
only its caller. It then joins the embedder's pending group. The group's leader, a task of its own,
waits a few milliseconds for others to join, queues for the model's FIFO lock (requests that arrive
while the lock is held keep joining the same group), then runs every member's sequences through one
length-sorted plan of batches (pipeline.embed_jobs) and hands each caller its own vectors, in its own
order, with its own usage. A caller that is cancelled or times out leaves the group; the forwards stop
only when every member has left. Rerank requests are not coalesced: they take the lock one by one.
Standard library only (this runs in the browser too).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelBusyError, RequestTimeoutError

WINDOW_S = 0.003            # how long a group waits for more callers before it queues for the lock
MAX_GROUP_INPUTS = 1024     # inputs one group embeds at most; later callers form the next group


@dataclass
class _Member:
    job: Any                                   # the pipeline's EmbedJob
    future: asyncio.Future
    left: bool = False                         # its caller was cancelled or timed out
    started: bool = False                      # its group holds the lock


@dataclass
class EmbeddingCoalescer:
    """The group being formed for one loaded embedder (LoadedModel.coalescer)."""

    window_s: float = WINDOW_S
    max_inputs: int = MAX_GROUP_INPUTS
    pending: list[_Member] = field(default_factory=list)
    leader: asyncio.Task | None = None
    groups: int = 0                            # groups run so far (each one plan of batches)
    leader_on_lock: bool = False               # the leader waits in the model lock's queue

    def waiting(self) -> int:
        """Requests queued here that have not started."""
        return sum(1 for m in self.pending if not m.left)

    def queued_past_lock(self) -> int:
        """What to add to the lock's queue length to count waiting requests: the members, less the
        leader that stands for them in the lock's queue."""
        return self.waiting() - (1 if self.leader_on_lock else 0)

    def _take(self) -> list[_Member]:
        """The next group: pending members in arrival order up to max_inputs (the first always)."""
        group, n = [], 0
        live = [m for m in self.pending if not m.left]
        for k, m in enumerate(live):
            n += len(m.job.seqs)
            if group and n > self.max_inputs:
                self.pending = live[k:]
                return group
            group.append(m)
        self.pending = []
        return group


def coalescer_of(lm) -> EmbeddingCoalescer:
    if lm.coalescer is None:
        lm.coalescer = EmbeddingCoalescer()
    return lm.coalescer


async def embed_coalesced(engine, lm, req: dict, deadline: float | None):
    """One embeddings request through `lm`'s coalescer: (the EmbeddingResult, the model that ran it)."""
    co = coalescer_of(lm)
    timeout_s = engine.config.request_timeout_s         # the one `deadline` came from
    limit = engine.config.max_queue_length
    queued = lm.lock.queue_length + co.queued_past_lock()
    if limit is not None and lm.lock.locked and queued >= limit:
        raise ModelBusyError(lm.model_id, queued, lm.lock.retry_after())
    caller = asyncio.current_task()
    dims = {"dimensions": req["dimensions"]} if req.get("dimensions") is not None else {}
    job = await lm.pipeline.prepare_embed(
        req["input"], deadline=deadline, timeout_s=timeout_s,
        max_total_tokens=engine.config.limits.max_embedding_tokens,
        cancelled=lambda: caller is not None and caller.cancelling() > 0, **dims)
    member = _Member(job, asyncio.get_running_loop().create_future())
    co.pending.append(member)
    if co.leader is None:
        co.leader = asyncio.ensure_future(_lead(engine, lm, co))
    try:
        if deadline is None:
            return await asyncio.shield(member.future)
        timeout = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(member.future), max(timeout, 0.0))
        except asyncio.TimeoutError:
            during = "embedding" if member.started else f"the wait for {lm.model_id}"
            raise RequestTimeoutError(timeout_s, during) from None
    finally:
        if not member.future.done():
            member.left = True            # cancelled or timed out: the group goes on without it


async def _lead(engine, lm, co: EmbeddingCoalescer) -> None:
    """Form one group, run it under the model's lock, and start the next group's leader."""
    try:
        if co.window_s > 0:
            await asyncio.sleep(co.window_s)
        co.leader_on_lock = True
        try:
            run_on = await engine.acquire(lm, "EmbeddingCreateParams")
        except BaseException as e:          # dropped model, device lost without recovery
            group, co.pending = [m for m in co.pending if not m.left], []
            _settle(group, error=e)
            return
        finally:
            co.leader_on_lock = False
        try:
            group = co._take()
            for m in group:
                m.started = True
            if group:
                co.groups += 1
                await _run(engine, run_on, group)
        finally:
            run_on.lock.release()
    finally:
        co.leader = None
        if co.waiting():
            co.leader = asyncio.ensure_future(_lead(engine, lm, co))


async def _run(engine, lm, group: list[_Member]) -> None:
    try:
        results = await engine.guard(
            lm.pipeline.embed_jobs([m.job for m in group], cancelled=lambda: all(m.left for m in group)),
            lm, "embedding")
    except BaseException as e:              # noqa: BLE001 - each member gets the group's failure
        _settle(group, error=e)
        return
    for m, res in zip(group, results):
        if not m.future.done():
            m.future.set_result((res, lm))


def _settle(group: list[_Member], error: BaseException) -> None:
    for m in group:
        if m.left or m.future.done():
            continue
        if isinstance(error, asyncio.CancelledError):
            m.future.cancel()
        else:
            m.future.set_exception(error)
