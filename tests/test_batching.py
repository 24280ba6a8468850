"""Continuous batching (pipelines/scheduler.py, models/paged.py): requests that run together give
the tokens they give alone, whatever joins or leaves the batch, with a pool small enough to preempt,
with shared prefixes; interrupts, disconnects and unloads touch only what they concern.

A tiny random-weight model (tests/tinymodels.py) keeps the steps cheap; its greedy answers are
arbitrary token strings, which makes any difference between runs visible.
"""
from __future__ import annotations

import asyncio

import pytest

from webgpu_engine.engine import EngineConfig
from webgpu_engine.engine.engine import AsyncMLCEngine
from webgpu_engine.errors import ModelUnloadedError
from webgpu_engine.kernels import matmul as mm
from webgpu_engine.models.paged import PagedForward

N = 24                           # tokens per answer
# no load-time compile of every pipeline: requests compile what they use (test_no_shader_compiles_after_load
# below loads with it)
OPTS = {"dtype": "f32", "context_window_size": 192, "prefill_chunk_size": 32, "max_num_sequences": 8,
        "kv_block_size": 16, "compile_at_load": False}
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing near the old river bank".split()


def _prompt(i: int) -> str:
    """Prompts of 1 .. 33 words (~3 .. 90 tokens): one chunk, several chunks, block boundaries."""
    n = [1, 3, 5, 6, 11, 17, 23, 33][i % 8]
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tinymodels import write_tiny_llama_gguf
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("batch") / "tinybatch.gguf", qtype="q8_0",
                                 seed=5)["path"]


@pytest.fixture(scope="module")
async def engine(device, tiny_path):
    eng = AsyncMLCEngine(EngineConfig(device=device))
    await eng.reload(str(tiny_path), chat_opts=OPTS)
    yield eng
    await eng.unload()


async def _load(device, tiny_path, name: str, **opts) -> AsyncMLCEngine:
    """The tiny model loaded under model id `name` by an engine of its own on the session device,
    where the module's pipelines are cached."""
    from webgpu_engine.engine import ModelRecord, default_app_config
    app = default_app_config().with_records(ModelRecord(name, str(tiny_path), "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload(name, chat_opts={**OPTS, **opts})
    return eng


def _sched(engine):
    (lm,) = engine.models.values()
    return lm.pipeline.scheduler


async def _complete(engine, i: int, max_tokens: int = N, **kw):
    """(text, completion tokens) of prompt i; the text of random tokens differs with any token."""
    r = await engine.completions.create(prompt=_prompt(i), max_tokens=max_tokens, ignore_eos=True,
                                        temperature=kw.pop("temperature", 0.0), **kw)
    return r.choices[0].text, r.usage.completion_tokens


@pytest.fixture(scope="module")
async def alone(engine):
    """Each prompt's greedy answer with nothing else running."""
    return {i: await _complete(engine, i) for i in range(8)}


@pytest.mark.parametrize("n", [1, 2, 5, 8])
async def test_greedy_tokens_equal_alone_in_any_batch(engine, alone, n):
    got = await asyncio.gather(*[_complete(engine, i) for i in range(n)])
    assert got == [alone[i] for i in range(n)]


async def test_joining_midway_and_stopping_early(engine, alone):
    """Requests join while others decode; some stop after a few tokens."""
    async def late(i, delay, max_tokens=N):
        await asyncio.sleep(delay)
        return await _complete(engine, i, max_tokens)
    short = await _complete(engine, 3, 5)
    assert short[1] == 5
    got = await asyncio.gather(late(0, 0), late(1, 0.05), late(3, 0.1, 5), late(5, 0.2), late(6, 0.3),
                               late(7, 0.3, 9), late(2, 0.5))
    assert got[0] == alone[0] and got[1] == alone[1] and got[3] == alone[5] and got[4] == alone[6]
    assert got[6] == alone[2] and got[2] == short
    assert got[5][1] == 9 and alone[7][0].startswith(got[5][0])


async def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    async def sampled(i):
        return await _complete(engine, i, temperature=0.9, seed=100 + i, top_p=0.9)
    solo = [await sampled(i) for i in range(4)]
    assert await asyncio.gather(*[sampled(i) for i in range(4)]) == solo


async def test_shared_prefix_blocks_are_reused(engine, alone):
    pool = _sched(engine).pool
    before = pool.stats["hit_tokens"]
    assert await asyncio.gather(_complete(engine, 7), _complete(engine, 7)) == [alone[7], alone[7]]
    assert pool.stats["hit_tokens"] - before >= 64          # the repeated prompt's full blocks
    pool.check()


async def test_on_a_cpu_adapter_a_step_waits_for_the_callers_given_a_token(engine, alone, monkeypatch):
    """Host work beside a step slows a CPU adapter's step by more than it costs alone, so there the
    next step waits until the callers given a token ask for the next one (at most CALLER_WAIT_S):
    a stream that takes 50 ms per chunk sees no step run meanwhile, and its answer is unchanged."""
    from webgpu_engine.pipelines import scheduler as sched_mod
    sched = _sched(engine)
    assert sched._wait_callers                       # lavapipe
    monkeypatch.setattr(sched_mod, "CALLER_WAIT_S", 5.0)
    stream = await engine.completions.create(prompt=_prompt(2), max_tokens=N, ignore_eos=True, temperature=0,
                                             stream=True)
    text, moved = [], []
    async for chunk in stream:
        text.append(chunk.choices[0].text)
        before = sched.stats["iterations"]
        await asyncio.sleep(0.05)                    # a tiny model's step is much shorter
        moved.append(sched.stats["iterations"] - before)
    assert "".join(text) == alone[2][0]
    assert moved == [0] * len(moved), moved


async def test_streams_and_a_client_leaving_early(engine, alone):
    """A stream closed after two chunks frees its place; the others finish unchanged."""
    stream = await engine.completions.create(prompt=_prompt(4), max_tokens=N, ignore_eos=True, temperature=0,
                                             stream=True)
    others = asyncio.gather(_complete(engine, 0), _complete(engine, 6))
    k = 0
    async for _ in stream:
        k += 1
        if k == 2:
            break
    await stream.aclose()
    assert await others == [alone[0], alone[6]]
    await asyncio.sleep(0.05)
    sched = _sched(engine)
    assert not sched.running and len(sched._free_slots) == sched.max_seqs
    sched.pool.check()


async def test_interrupt_stops_every_running_sequence(engine):
    streams = [await engine.completions.create(prompt=_prompt(i), max_tokens=150, ignore_eos=True,
                                               temperature=0, stream=True) for i in range(3)]
    for st in streams:                      # each has produced its first token
        await st.__anext__()
    engine.interrupt_generate()
    for st in streams:
        chunks = [c async for c in st]
        assert chunks[-1].choices[0].finish_reason == "abort"
    assert (await _complete(engine, 0, 4))[1] == 4          # the next request runs normally


async def test_up_to_four_sequences_take_the_fused_one_row_kernels(device, tiny_path, engine):
    """max_num_sequences <= 4 on a CPU adapter (up to 16 where the wide kernel runs: lavapipe's
    8-lane subgroups, unless WEBGPU_ENGINE_WIDE_ROWS=0): each decode row goes through the fused
    one-row kernels (norms, gates and residual norms inside the matmuls: fewer dispatches than the
    row-invariant kernels of a wider batch), and a request's greedy and seeded tokens are the same
    alone, with 1..3 others, and with others joining and leaving midway; its logprobs are those of
    a model loaded with one slot, bit for bit."""
    eng = await _load(device, tiny_path, "tiny-four", max_num_sequences=4)
    try:
        fwd = _sched(eng).fwd
        wide = _sched(engine).fwd
        assert fwd.fused_rows and wide.fused_rows == (mm.fused_rows_max(device) >= wide.max_seqs)
        tiled = PagedForward(fwd.model, max_seqs=17, n_blocks=4, block_size=16, owner="test:batching.tiled")
        try:
            assert not tiled.fused_rows and len(fwd.ops("decode", 4)) < len(tiled.ops("decode", 4))
        finally:
            tiled.release()
            device.release_owner("test:batching.tiled")
        solo = {i: await _complete(eng, i) for i in range(4)}
        for n in (2, 3, 4):
            assert await asyncio.gather(*[_complete(eng, i) for i in range(n)]) == [solo[i] for i in range(n)]

        async def late(i, delay, max_tokens=N):
            await asyncio.sleep(delay)
            return await _complete(eng, i, max_tokens)
        got = await asyncio.gather(late(0, 0), late(1, 0.05, 5), late(2, 0.1), late(3, 0.2))
        assert [got[0], got[2], got[3]] == [solo[0], solo[2], solo[3]] and solo[1][0].startswith(got[1][0])

        async def sampled(i):
            return await _complete(eng, i, temperature=0.9, seed=100 + i, top_p=0.9)
        alone = [await sampled(i) for i in range(4)]
        assert await asyncio.gather(*[sampled(i) for i in range(4)]) == alone

        # and as with one slot: the same logprobs, bit for bit, alone or 4 at once
        # (the fused kernels per row; each sequence's attention in the form its own length takes)
        async def logprobs(engine, i):
            r = await engine.completions.create(prompt=_prompt(i), max_tokens=12, ignore_eos=True, temperature=0,
                                                logprobs=2)
            lp = r.choices[0].logprobs
            return lp.tokens, lp.token_logprobs, lp.top_logprobs
        one = await _load(device, tiny_path, "tiny-one", max_num_sequences=1)
        try:
            ref = [await logprobs(one, i) for i in range(4)]
        finally:
            await one.unload()
        assert [await logprobs(eng, i) for i in range(4)] == ref
        assert await asyncio.gather(*[logprobs(eng, i) for i in range(4)]) == ref
    finally:
        await eng.unload()


async def test_queue_beyond_the_batch_is_served_in_order(device, tiny_path, alone):
    """max_num_sequences = 2 and six requests: all served, each with its solo tokens."""
    eng = await _load(device, tiny_path, "tiny-two", max_num_sequences=2)
    try:
        (lm,) = eng.models.values()
        order = []

        async def one(i):
            r = await _complete(eng, i)
            order.append(i)
            return r
        got = await asyncio.gather(*[one(i) for i in range(6)])
        assert got == [alone[i] for i in range(6)]
        assert lm.lock.capacity == 2 and lm.lock.held == 0
    finally:
        await eng.unload()


async def test_tiny_pool_preempts_and_still_gives_the_same_tokens(device, tiny_path, alone):
    """A pool of one context + one block for eight sequences: the newest are preempted and
    recomputed; every answer equals its solo run."""
    eng = await _load(device, tiny_path, "tiny-pool", kv_pool_tokens=192 + 16)
    try:
        got = await asyncio.gather(*[_complete(eng, i) for i in range(8)])
        sched = _sched(eng)
        assert sched.pool.stats["preemptions"] > 0 and sched.describe()["preemptions"] == sched.pool.stats["preemptions"]
        assert got == [alone[i] for i in range(8)]
        sched.pool.check()
    finally:
        await eng.unload()


async def test_a_preempted_sequence_gives_the_logprobs_of_a_run_never_preempted(device, smollm2_gguf):
    """SmolLM2, four sequences in a pool of 144 tokens: the newest are preempted mid-answer and
    compute their prompt's rows again by prefill and their decoded rows by decode steps that feed
    their own tokens (replay), as the rows were computed: every logprob equals, bit for bit, the same
    request's with nothing else running (recomputed by prefill, later tokens' logprobs moved, and
    answers left the solo ones). The prompts (20, 23, 26 and 29 tokens) fill 8 of the pool's 9
    blocks: within 24 tokens the newest is preempted 5 tokens in, the next one 22 tokens in (its
    replay crosses a block boundary). That one comes back with its prompt's rows all from the pool,
    the last 10 copied from the solo run's cached tail, so its first forward is a replayed decode
    row, which must record the copy too (before, only a prefill chunk did: the replay read the
    block's stale rows and the last token's logprob moved)."""
    eng = AsyncMLCEngine(EngineConfig(device=device))
    await eng.reload(str(smollm2_gguf), chat_opts={
        "context_window_size": 128, "prefill_chunk_size": 32, "max_num_sequences": 4, "kv_block_size": 16,
        "kv_pool_tokens": 128 + 16, "compile_at_load": False})

    async def logprobs(i):
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(20 + 3 * i))
        r = await eng.completions.create(prompt=prompt, max_tokens=24, ignore_eos=True, temperature=0, logprobs=True)
        return r.choices[0].logprobs.token_logprobs
    try:
        solo = [await logprobs(i) for i in range(4)]
        pool = _sched(eng).pool
        before, copied = pool.stats["preemptions"], pool.stats["copied_tokens"]
        assert await asyncio.gather(*[logprobs(i) for i in range(4)]) == solo
        # those two only: a preempted sequence comes back when the pool holds it and a block for each
        # sequence decoding (before, the newest came back at once and was preempted 4 times more)
        assert 0 < pool.stats["preemptions"] - before <= 2 and pool.stats["copied_tokens"] > copied
        pool.check()
    finally:
        await eng.unload()


async def test_multi_round_chat_reuses_the_conversation(engine):
    """The second turn's prompt starts with the first turn's blocks: they come from the pool."""
    pool = _sched(engine).pool
    msgs = [{"role": "user", "content": _prompt(5)}]
    r1 = await engine.chat.completions.create(messages=msgs, max_tokens=8, temperature=0)
    assert await engine.get_message() == r1.choices[0].message.content
    before = pool.stats["hit_tokens"]
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "and then?"}]
    r2 = await engine.chat.completions.create(messages=msgs, max_tokens=4, temperature=0)
    assert pool.stats["hit_tokens"] - before >= 32
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + 8


async def test_unload_fails_the_running_requests_with_model_unloaded(device, tiny_path):
    eng = await _load(device, tiny_path, "tiny-unload")
    streams = [await eng.completions.create(prompt=_prompt(i), max_tokens=150, ignore_eos=True, temperature=0,
                                            stream=True) for i in range(3)]
    for st in streams:
        await st.__anext__()
    await eng.unload()
    for st in streams:
        with pytest.raises(ModelUnloadedError):
            async for _ in st:
                pass
    await eng.reload("tiny-unload", chat_opts=OPTS)       # usable again
    try:
        assert (await _complete(eng, 0, 4))[1] == 4
    finally:
        await eng.unload()


async def test_request_features_per_sequence(engine):
    """Logprobs, stop strings, logit_bias, n > 1 and a JSON grammar, each running beside others,
    give what they give alone."""
    async def ask(kind):
        if kind == "logprobs":
            r = await engine.completions.create(prompt=_prompt(2), max_tokens=6, temperature=0, logprobs=True,
                                                top_logprobs=3, ignore_eos=True)
            return r.choices[0].text, r.choices[0].logprobs.top_logprobs
        if kind == "bias":
            r = await engine.completions.create(prompt=_prompt(3), max_tokens=6, temperature=0,
                                                logit_bias={"40": 100}, ignore_eos=True)
            return r.choices[0].text
        if kind == "n":
            r = await engine.completions.create(prompt=_prompt(4), max_tokens=6, temperature=0.8, seed=7, n=2,
                                                ignore_eos=True)
            return [c.text for c in r.choices]
        if kind == "json":
            r = await engine.chat.completions.create(
                messages=[{"role": "user", "content": "json"}], max_tokens=40, temperature=0,
                response_format={"type": "json_object"})
            return r.choices[0].message.content
        text, _ = await _complete(engine, 1)
        cut = text[3:6]
        r = await engine.completions.create(prompt=_prompt(1), max_tokens=N, temperature=0, stop=[cut],
                                            ignore_eos=True)
        return r.choices[0].text, r.choices[0].finish_reason
    kinds = ["logprobs", "bias", "n", "json", "stop"]
    solo = [await ask(k) for k in kinds]
    assert await asyncio.gather(*[ask(k) for k in kinds]) == solo
    import json as _json
    assert isinstance(_json.loads(solo[3]), dict)
    assert solo[4][1] == "stop" and len(solo[2]) == 2 and len(solo[0][1]) == 6
    tok40 = _sched(engine).pipe.tokenizer.token_bytes(40).decode("utf-8", "replace")
    assert solo[1] == tok40 * 6


async def test_device_loss_fails_every_sequence_of_the_model(tiny_path):
    """A loss mid-batch: every running sequence of the model fails with DeviceLostError and no place
    of its lock stays held."""
    from webgpu_engine import gpu
    from webgpu_engine.errors import DeviceLostError
    dev = await gpu.request_device()
    eng = AsyncMLCEngine(EngineConfig(device=dev))
    await eng.reload(str(tiny_path), chat_opts=OPTS)
    (lm,) = eng.models.values()
    streams = [await eng.completions.create(prompt=_prompt(i), max_tokens=150, ignore_eos=True, temperature=0,
                                            stream=True) for i in range(3)]
    for st in streams:
        await st.__anext__()
    dev.destroy()
    for st in streams:
        with pytest.raises(DeviceLostError):
            async for _ in st:
                pass
    assert eng.state == "device_lost" and lm.lock.held == 0


async def test_batch_size_options(device, tiny_path):
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.errors import ChatOptionTypeError
    from webgpu_engine.models.plan import resolve_max_sequences
    from webgpu_engine.kernels import profiles
    from webgpu_engine.models.plan import CPU_WIDTH
    cpu = device.info.adapter_type.upper() == "CPU"
    want = (profiles.load_width(device) or CPU_WIDTH) if cpu else 16
    assert resolve_max_sequences(device, ChatConfig(max_num_sequences=0)) == want
    assert resolve_max_sequences(device, ChatConfig(max_num_sequences=0, prefill_chunk_size=2)) == 2
    assert resolve_max_sequences(device, ChatConfig(max_num_sequences=1)) == 1
    eng = AsyncMLCEngine()          # a device of its own: a failed load frees its model id's buffers
    try:
        for bad in ({"kv_block_size": 12}, {"max_num_sequences": 300},
                    {"max_num_sequences": 64, "prefill_chunk_size": 32}, {"kv_pool_tokens": -1}):
            with pytest.raises(ChatOptionTypeError) as e:
                await eng.reload(str(tiny_path), chat_opts={**OPTS, **bad})
            assert e.value.param == next(iter(bad)) and not eng.models
    finally:
        await eng.close()


def test_measured_width(device, tmp_path, monkeypatch):
    """max_num_sequences 0 on a CPU adapter: the width bench/batch_width.py --store keeps in the
    adapter's profile, else CPU_WIDTH; a stored file that is not a width is ignored."""
    from webgpu_engine.cache.artifact import ROOT_ENV
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.kernels import profiles
    from webgpu_engine.models.plan import CPU_WIDTH, resolve_max_sequences
    if device.info.adapter_type.upper() != "CPU":
        pytest.fail("the width is measured on a CPU adapter: this test runs on lavapipe")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    profiles.forget()
    try:
        assert profiles.load_width(device) is None
        assert resolve_max_sequences(device, ChatConfig(max_num_sequences=0)) == CPU_WIDTH
        path = profiles.save_width(device, 12, {"steps": []})
        assert path.parent == profiles.path(device).parent and path.is_file()
        profiles.forget()                          # read back from the file, as a new process would
        assert resolve_max_sequences(device, ChatConfig(max_num_sequences=0)) == 12
        assert resolve_max_sequences(device, ChatConfig(max_num_sequences=0, prefill_chunk_size=8)) == 8
        assert resolve_max_sequences(device, ChatConfig(max_num_sequences=3)) == 3
        path.write_text('{"width": "many"}')
        profiles.forget()
        assert resolve_max_sequences(device, ChatConfig(max_num_sequences=0)) == CPU_WIDTH
        assert not profiles.has_profile(device)   # the matmul choices are another file
    finally:
        profiles.forget()


async def test_no_shader_compiles_after_load(fresh_device, tiny_path):
    """With batching, reload() compiles the scheduler's pipelines too: concurrent requests of any
    length, sampled or greedy, compile none."""
    eng = AsyncMLCEngine(EngineConfig(device=fresh_device))
    await eng.reload(str(tiny_path), chat_opts={**OPTS, "max_num_sequences": 3, "compile_at_load": True})
    try:
        loaded = fresh_device.compile_count
        await asyncio.gather(*[_complete(eng, i, 3, **({"temperature": 0.8, "seed": 1, "logprobs": True,
                                                       "top_logprobs": 2} if i % 2 else {})) for i in range(6)])
        assert fresh_device.compile_count == loaded
    finally:
        await eng.unload()


async def test_a_place_freed_by_a_leaving_client_is_usable_at_once(device, tiny_path, alone):
    """Every place taken; one client leaves mid-stream, another never iterates its stream: the
    requests waiting for those places start at once and get their solo tokens."""
    eng = await _load(device, tiny_path, "tiny-two", max_num_sequences=2)
    try:
        s1 = await eng.completions.create(prompt=_prompt(1), max_tokens=150, ignore_eos=True, temperature=0,
                                          stream=True)
        s2 = await eng.completions.create(prompt=_prompt(2), max_tokens=150, ignore_eos=True, temperature=0,
                                          stream=True)
        await s1.__anext__()
        waiting = [asyncio.ensure_future(_complete(eng, i)) for i in (3, 4)]
        await asyncio.sleep(0.05)
        await s1.aclose()                # left mid-stream
        await s2.aclose()                # never iterated
        assert await asyncio.gather(*waiting) == [alone[3], alone[4]]
        sched = _sched(eng)
        assert not sched.running and len(sched._free_slots) == 2
        sched.pool.check()
    finally:
        await eng.unload()


async def test_logit_processor_applies_to_every_sequence(engine):
    """A WebLLM logit processor runs per sampling sequence in the batch (host round trip each)."""
    class OnlyForty:
        seen = []

        def process_logits(self, logits):
            return [0.0 if i == 40 else -1e9 for i in range(len(logits))]

        def process_sampled_token(self, tok):
            self.seen.append(tok)
    (lm,) = engine.models.values()
    proc = OnlyForty()
    lm.pipeline.set_logit_processor(proc)
    try:
        got = await asyncio.gather(*[_complete(engine, i, 4) for i in range(2)])
    finally:
        lm.pipeline.set_logit_processor(None)
    tok40 = _sched(engine).pipe.tokenizer.token_bytes(40).decode("utf-8", "replace")
    assert got == [(tok40 * 4, 4)] * 2 and proc.seen == [40] * 8


async def test_decode_ahead_gives_the_same_tokens(device, tiny_path, engine, alone):
    """decode_ahead in the scheduler: each decode step is submitted before the tokens it takes are
    read (the samplers write them into its input ids on the GPU); the tokens, logprobs, stops and
    seeded draws equal the serial engine's, alone, together, with requests joining and stopping
    midway, a client leaving and max_tokens ending a step early; rows past a sequence's end are
    never accepted and the pool keeps no block of them."""
    eng = await _load(device, tiny_path, "tiny-ahead", decode_ahead=True)
    try:
        sched = _sched(eng)
        assert sched.decode_ahead and not _sched(engine).decode_ahead      # off by default on lavapipe
        assert [await _complete(eng, i) for i in (0, 7)] == [alone[0], alone[7]]
        assert await asyncio.gather(*[_complete(eng, i) for i in range(5)]) == [alone[i] for i in range(5)]
        assert sched.stats["ahead_steps"] > 0

        async def late(i, delay, max_tokens=N):
            await asyncio.sleep(delay)
            return await _complete(eng, i, max_tokens)
        got = await asyncio.gather(late(0, 0), late(1, 0.05, 5), late(2, 0.1), late(3, 0.2, 1), late(6, 0.3))
        assert [got[0], got[2], got[4]] == [alone[0], alone[2], alone[6]]
        assert got[1][1] == 5 and alone[1][0].startswith(got[1][0]) and got[3][1] == 1

        async def sampled(e, i):
            r = await e.completions.create(prompt=_prompt(i), max_tokens=8, temperature=0.9, seed=100 + i, top_p=0.9,
                                           logprobs=True, top_logprobs=2, ignore_eos=True, frequency_penalty=0.5)
            return r.choices[0].text, r.choices[0].logprobs.top_logprobs
        want = [await sampled(engine, i) for i in range(3)]
        assert await asyncio.gather(*[sampled(eng, i) for i in range(3)]) == want

        text = alone[1][0]
        r = await eng.completions.create(prompt=_prompt(1), max_tokens=N, temperature=0, stop=[text[3:6]],
                                         ignore_eos=True)
        assert r.choices[0].finish_reason == "stop" and text.startswith(r.choices[0].text)

        stream = await eng.completions.create(prompt=_prompt(4), max_tokens=N, ignore_eos=True, temperature=0,
                                              stream=True)
        others = asyncio.gather(_complete(eng, 0), _complete(eng, 6))
        async for k, _ in _aenumerate(stream):
            if k == 2:
                break
        await stream.aclose()
        assert await others == [alone[0], alone[6]]
        await asyncio.sleep(0.05)
        assert not sched.running and sched._ahead is None and len(sched._free_slots) == sched.max_seqs
        sched.pool.check()
    finally:
        await eng.unload()


async def _aenumerate(it):
    k = 0
    async for x in it:
        k += 1
        yield k, x


async def test_two_engines_loading_one_id_on_one_device_keep_their_own_buffers(device, tiny_path, alone):
    """Two engines on one device load the same model id: each load owns its buffers (the second is
    not "model:<id>", which the first holds), so unloading one leaves the other answering as alone."""
    a = await _load(device, tiny_path, "tiny-twin")
    b = await _load(device, tiny_path, "tiny-twin")
    try:
        owner_a, owner_b = (next(iter(e.models.values())).pipeline.owner for e in (a, b))
        assert owner_a == "model:tiny-twin" and owner_b != owner_a and device.allocated_bytes(owner_b) > 0
        await a.unload()
        assert device.allocated_bytes(owner_a) == 0 and device.allocated_bytes(owner_b) > 0
        assert await _complete(b, 3) == alone[3]
    finally:
        await a.unload()
        await b.unload()
    assert device.allocated_bytes(owner_b) == 0
