"""Coalesced embedding batches (engine/coalesce.py) on a tiny BERT: concurrent embeddings.create calls
share forwards, and each caller still gets exactly the vectors, order, usage and errors it gets alone."""
from __future__ import annotations

import asyncio

import pytest

from tinymodels import write_tiny_bert
from webgpu_engine.engine import EngineConfig, create_mlc_engine
from webgpu_engine.errors import EmbeddingDimensionsUnsupportedError, InvalidRequestError, RequestTimeoutError

MID = "tiny-coalesce"
CARD = "---\ntags:\n- sentence-transformers\n- loss:MatryoshkaLoss\n---\n"
# callers of different sizes and lengths, so a shared plan pads and batches them differently
CALLS = [
    dict(input="a cat"),
    dict(input=["the quick brown fox jumps over the lazy dog " * 3, "hi", "a somewhat longer sentence here"]),
    dict(input=[f"sentence number {i} about {'cats ' * (i % 5)}" for i in range(12)]),
    dict(input=[[2, 40, 41, 42, 3], [2, 50, 3]]),                  # token ids
    dict(input=["short", "a little longer text to embed"], dimensions=16),
    dict(input="world " * 40),                                      # truncated to max_seq_length
]


@pytest.fixture(scope="module")
async def engine(tmp_path_factory, device):
    folder = tmp_path_factory.mktemp("coalesce") / MID
    write_tiny_bert(folder, hidden_size=64, max_seq_length=48)
    (folder / "README.md").write_text(CARD)          # Matryoshka: callers may ask their own `dimensions`
    eng = await create_mlc_engine(str(folder), EngineConfig(device=device))
    lm = eng.models[MID]
    lm.pipeline.chat_config.max_batch_size = 4       # several batches per group
    yield eng
    await eng.unload()


async def _alone(engine, calls):
    return [await engine.embeddings.create(model=MID, **c) for c in calls]


async def _held(engine):
    """Take the model's lock, so requests gather in its coalescer (see _release_when_waiting)."""
    lm = engine.models[MID]
    await lm.lock.acquire()
    return lm


async def _release_when_waiting(lm, n: int):
    """Once `n` requests wait in the coalescer, release the lock: they run as one group."""
    for _ in range(2000):
        if lm.coalescer is not None and lm.coalescer.waiting() == n:
            break
        await asyncio.sleep(0.005)
    assert lm.coalescer.waiting() == n
    lm.lock.release()


def _same(a, b):
    assert [d.index for d in a.data] == list(range(len(b.data)))
    assert [d.embedding for d in a.data] == [d.embedding for d in b.data]    # bit for bit
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == a.usage.total_tokens
    assert a.model == MID


async def test_one_group_gives_each_caller_what_it_gets_alone(engine):
    alone = await _alone(engine, CALLS)
    lm = await _held(engine)
    groups = lm.coalescer.groups
    tasks = [asyncio.create_task(engine.embeddings.create(model=MID, **c)) for c in CALLS]
    for _ in range(2000):
        if lm.coalescer.waiting() == len(CALLS) and lm.coalescer.leader_on_lock:
            break
        await asyncio.sleep(0.005)
    assert engine.queue_lengths()[MID] == len(CALLS) + 1      # /metrics: six waiting, one holder
    await _release_when_waiting(lm, len(CALLS))
    together = await asyncio.gather(*tasks)
    assert lm.coalescer.groups == groups + 1            # all six shared one plan of batches
    for a, b in zip(together, alone):
        _same(a, b)
    assert len(together[4].data[0].embedding) == 16 and len(together[0].data[0].embedding) == 64


async def test_callers_arriving_together_share_forwards(engine):
    lm = engine.models[MID]
    alone = await _alone(engine, CALLS * 2)
    groups = lm.coalescer.groups
    together = await asyncio.gather(*[engine.embeddings.create(model=MID, **c) for c in CALLS * 2])
    assert lm.coalescer.groups - groups < len(CALLS) * 2    # within the window, or queued behind the lock
    for a, b in zip(together, alone):
        _same(a, b)


async def test_a_bad_input_fails_only_its_caller(engine):
    good = CALLS[:3]
    alone = await _alone(engine, good)
    bad = [dict(input=[[2, 10_000, 3]]), dict(input=["a", 5]), dict(input="a", dimensions=65), dict(input=[])]
    lm = await _held(engine)
    tasks = [asyncio.create_task(engine.embeddings.create(model=MID, **c)) for c in good + bad]
    await _release_when_waiting(lm, len(good))          # the bad ones never join: refused on the spot
    res = await asyncio.gather(*tasks, return_exceptions=True)
    for a, b in zip(res, alone):
        _same(a, b)
    errs = res[len(good):]
    assert all(isinstance(e, InvalidRequestError) for e in errs), errs
    assert isinstance(errs[2], EmbeddingDimensionsUnsupportedError)
    assert [e.param for e in errs] == ["input", "input", "dimensions", "input"]


async def test_a_cancelled_caller_leaves_the_others_running(engine):
    alone = await _alone(engine, CALLS)
    lm = await _held(engine)
    tasks = [asyncio.create_task(engine.embeddings.create(model=MID, **c)) for c in CALLS]
    for _ in range(2000):                               # all have joined the waiting group
        if lm.coalescer.waiting() == len(CALLS):
            break
        await asyncio.sleep(0.005)
    tasks[2].cancel()                                   # a client disconnect while queued
    await _release_when_waiting(lm, len(CALLS) - 1)
    res = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(res[2], asyncio.CancelledError)
    for k, (a, b) in enumerate(zip(res, alone)):
        if k != 2:
            _same(a, b)


async def test_a_caller_cancelled_while_its_group_runs(engine):
    alone = await _alone(engine, CALLS)
    lm = engine.models[MID]
    steps = []
    real = lm.pipeline.embed_jobs

    async def watched(jobs, **kw):                      # tells the test when the group's step began
        steps.append(len(jobs))
        await asyncio.sleep(0.05)                       # long enough for the cancel to land inside it
        return await real(jobs, **kw)
    lm.pipeline.embed_jobs = watched
    try:
        lm = await _held(engine)
        tasks = [asyncio.create_task(engine.embeddings.create(model=MID, **c)) for c in CALLS]
        await _release_when_waiting(lm, len(CALLS))
        for _ in range(2000):
            if steps:
                break
            await asyncio.sleep(0.001)
        tasks[1].cancel()
        res = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        del lm.pipeline.embed_jobs
    assert steps == [len(CALLS)]
    assert isinstance(res[1], asyncio.CancelledError)
    for k, (a, b) in enumerate(zip(res, alone)):
        if k != 1:
            _same(a, b)
    # every caller gone: the group stops and the model keeps serving
    lm = await _held(engine)
    tasks = [asyncio.create_task(engine.embeddings.create(model=MID, **c)) for c in CALLS[:2]]
    await _release_when_waiting(lm, 2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    _same(await engine.embeddings.create(model=MID, **CALLS[2]), alone[2])


async def test_a_caller_past_its_deadline_times_out_alone(engine):
    alone = await _alone(engine, CALLS[:2])
    lm = await _held(engine)
    try:
        engine.config.request_timeout_s = 0.2          # for the next request only
        late = asyncio.create_task(engine.embeddings.create(model=MID, **CALLS[2]))
        await asyncio.sleep(0)
        engine.config.request_timeout_s = None
        tasks = [asyncio.create_task(engine.embeddings.create(model=MID, **c)) for c in CALLS[:2]]
        with pytest.raises(RequestTimeoutError, match=f"the wait for {MID}"):
            await late
    finally:
        engine.config.request_timeout_s = None
        await _release_when_waiting(lm, 2)
    for a, b in zip(await asyncio.gather(*tasks), alone):
        _same(a, b)
