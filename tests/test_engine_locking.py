"""Engine tests with stub pipelines (on the real device): FIFO locks, streams releasing the lock,
reload rules and cancellation, model selection errors, device-loss policy, the sync facade."""
from __future__ import annotations

import asyncio

import pytest

from stub_pipelines import StubEmbedder, StubLLM, stub_config
from webgpu_engine import errors as E
from webgpu_engine.engine import AsyncMLCEngine, FIFOLock, create_mlc_engine
from webgpu_engine.gpu import request_device
from webgpu_engine.protocol import errors as PE

U = [{"role": "user", "content": "one two three"}]


@pytest.fixture(autouse=True)
def _reset_stub():
    StubLLM.load_delay, StubLLM.step_delay, StubLLM.lose_device_at_step = 0.0, 0.002, None
    StubLLM.instances.clear()
    yield


def _owners_bytes(dev, ids):
    return sum(dev.allocated_bytes(f"model:{i}") for i in ids)


# --------------------------------------------------------------------------- FIFO lock
async def test_fifo_lock_serves_in_arrival_order_and_survives_cancelled_waiters():
    lock, order = FIFOLock("t"), []

    async def worker(i):
        async with lock:
            order.append(i)
            await asyncio.sleep(0.001)
    await lock.acquire()
    tasks = [asyncio.create_task(worker(i)) for i in range(6)]
    await asyncio.sleep(0.01)
    assert lock.queue_length == 6
    tasks[2].cancel()                       # a waiter leaves the queue
    await asyncio.sleep(0)
    lock.release()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 1, 3, 4, 5] and not lock.locked and lock.queue_length == 0
    with pytest.raises(RuntimeError, match="released while not held"):
        lock.release()


# --------------------------------------------------------------------------- requests and locks
async def test_concurrent_chats_run_fifo_uninterleaved_while_embeddings_pass(device):
    engine = await create_mlc_engine(["stub-llm", "stub-emb"], stub_config(device))
    done: list[str] = []

    async def chat(i):
        r = await engine.chat.completions.create(
            model="stub-llm", messages=[{"role": "user", "content": f"request{i} x{i}"}], temperature=0)
        done.append(f"chat{i}")
        return r.choices[0].message.content

    async def embed(i):
        r = await engine.embeddings.create(model="stub-emb", input=[f"text {i}"])
        done.append(f"emb{i}")
        return r

    chats = [asyncio.create_task(chat(i)) for i in range(8)]
    await asyncio.sleep(0.005)
    embs = [asyncio.create_task(embed(i)) for i in range(3)]
    outs = await asyncio.gather(*chats)
    await asyncio.gather(*embs)
    for i, out in enumerate(outs):   # each answer is exactly its own, not mixed with another's words
        assert out == f"x{i} request{i} alpha beta gamma delta epsilon zeta"
    chat_order = [d for d in done if d.startswith("chat")]
    assert chat_order == [f"chat{i}" for i in range(8)]
    # embeddings do not wait for the chat queue: all finish before the last chat
    assert max(done.index(f"emb{i}") for i in range(3)) < done.index("chat7")
    await engine.unload()


async def test_stream_chunks_usage_and_lock_release_on_break(device):
    engine = await create_mlc_engine("stub-llm", stub_config(device))
    lm = engine.models["stub-llm"]
    stream = await engine.chat.completions.create(messages=U, stream=True, temperature=0,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "three two one alpha beta gamma delta epsilon zeta"
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert not lm.lock.locked

    # a consumer that stops early frees the lock at once, without finishing the generation
    stream = await engine.chat.completions.create(messages=U, stream=True, temperature=0)
    assert lm.lock.locked
    async for _ in stream:
        break
    await stream.aclose()
    assert not lm.lock.locked
    steps = StubLLM.instances[0].steps
    r = await asyncio.wait_for(engine.chat.completions.create(messages=U, temperature=0), 2)
    assert r.choices[0].finish_reason == "stop"
    assert StubLLM.instances[0].steps - steps == 8   # the abandoned stream decoded no further

    # a consumer task that is cancelled mid-stream also frees the lock within one step
    StubLLM.step_delay = 0.02
    stream = await engine.chat.completions.create(messages=U, stream=True, temperature=0)

    async def consume():
        async for _ in stream:
            pass
    t = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert not lm.lock.locked
    # a stream that is never iterated: closing it (or dropping it) frees the lock
    stream = await engine.chat.completions.create(messages=U, stream=True)
    await stream.aclose()
    assert not lm.lock.locked
    await engine.unload()


async def test_n_choices_seed_stop_max_tokens_logprobs_and_completions(device):
    engine = await create_mlc_engine("stub-llm", stub_config(device))
    r = await engine.chat.completions.create(messages=U, n=3, seed=11, temperature=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3           # one seed per request, distinct per choice
    r2 = await engine.chat.completions.create(messages=U, n=3, seed=11, temperature=1)
    assert [c.message.content for c in r2.choices] == texts
    assert r.usage.completion_tokens == sum(len(t.split()) for t in texts)
    assert r.usage.prompt_tokens == 3 and r.usage.extra.e2e_latency_s > 0
    # seed applies only to its request: the next unseeded request gets seed None
    await engine.chat.completions.create(messages=U, temperature=1)
    assert StubLLM.instances[0].prefills[-1]["gen"].seed is None

    r = await engine.chat.completions.create(messages=U, temperature=0, stop=["alpha"])
    assert r.choices[0].message.content == "three two one" and r.choices[0].finish_reason == "stop"
    r = await engine.chat.completions.create(messages=U, temperature=0, max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    r = await engine.chat.completions.create(messages=U, temperature=0, logprobs=True, top_logprobs=2,
                                             max_tokens=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 3 and lp[0].top_logprobs[0].logprob == lp[0].logprob

    c = await engine.completions.create(prompt="a b", temperature=0, max_tokens=3, echo=True, suffix="!")
    assert c.object == "text_completion" and c.choices[0].text == "a bb a alpha!"
    assert StubLLM.instances[0].prefills[-1]["prompt"] == "a b"
    s = await engine.completions.create(prompt="a b", temperature=0, max_tokens=3, stream=True,
                                        echo=True, suffix="!")
    parts = [ch.choices[0].text async for ch in s if ch.choices]
    assert "".join(parts) == "a bb a alpha!"
    c = await engine.completions.create(prompt="q", temperature=0, max_tokens=2, logprobs=1)
    assert c.choices[0].logprobs.tokens == ["q", "alpha"] and c.choices[0].logprobs.text_offset[0] == 0

    with pytest.raises(PE.RangeError, match="below 1000"):
        await engine.chat.completions.create(messages=U, logit_bias={"5000": 1})
    r = await engine.chat.completions.create(messages=U, logit_bias={"5": -100}, max_tokens=1)
    assert StubLLM.instances[0].prefills[-1]["gen"].logit_bias == {5: -100.0}
    await engine.unload()


async def test_interrupt_generate_aborts(device):
    StubLLM.step_delay = 0.01
    engine = await create_mlc_engine("stub-llm", stub_config(device))
    task = asyncio.create_task(engine.chat.completions.create(messages=U, temperature=0))
    await asyncio.sleep(0.03)
    engine.interrupt_generate()
    r = await task
    assert r.choices[0].finish_reason == "abort"
    assert len(r.choices[0].message.content.split()) < 9
    await engine.unload()


# --------------------------------------------------------------------------- reload and selection
async def test_reload_rules_and_progress(device):
    reports = []
    engine = AsyncMLCEngine(stub_config(device, init_progress_callback=reports.append))
    with pytest.raises(E.ReloadModelIdNotUniqueError, match="unique"):
        await engine.reload(["stub-llm", "stub-llm"])
    with pytest.raises(E.ReloadArgumentSizeUnmatchedError, match="2 model ids and 1 chat_opts"):
        await engine.reload(["stub-llm", "stub-emb"], [{}])
    with pytest.raises(E.ModelNotInAppConfigError, match="nope"):
        await engine.reload("nope")
    with pytest.raises(E.InvalidRequestError, match="Unknown chat_opts"):
        await engine.reload("stub-llm", {"no_such_field": 1})
    assert _owners_bytes(device, ["stub-llm"]) == 0
    await engine.reload(["stub-llm", "stub-emb"], [{"temperature": 0.3}, None])
    assert engine.models["stub-llm"].chat_config.temperature == 0.3
    assert engine.models["stub-llm"].chat_config.context_window_size == 4096
    progress = [r["progress"] for r in reports]
    assert progress == sorted(progress) and progress[-1] == 1.0
    assert reports[-1]["text"] == f"Finish loading on WebGPU - {device.info.name}"
    assert all(r["time_elapsed"] >= 0 for r in reports)
    assert await engine.get_gpu_vendor() == device.info.vendor
    assert await engine.get_max_storage_buffer_binding_size() == device.max_storage_binding
    assert await engine.forward_tokens_and_sample([1, 2], True, model="stub-llm") == 10
    assert "decode steps" in await engine.runtime_stats_text("stub-llm")
    await engine.unload()
    assert engine.models == {} and _owners_bytes(device, ["stub-llm", "stub-emb"]) == 0


async def test_cancelled_reload_leaves_nothing_loaded(device):
    StubLLM.load_delay = 0.05
    engine = AsyncMLCEngine(stub_config(device))
    task = asyncio.create_task(engine.reload(["stub-emb", "stub-llm", "stub-llm-2"]))
    await asyncio.sleep(0.12)             # inside stub-llm's load; stub-emb is done
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.models == {}
    assert _owners_bytes(device, ["stub-emb", "stub-llm", "stub-llm-2"]) == 0
    with pytest.raises(E.ModelNotLoadedError):
        await engine.chat.completions.create(messages=U)


async def test_model_selection_errors(device):
    engine = AsyncMLCEngine(stub_config(device))
    with pytest.raises(E.ModelNotLoadedError, match="reload"):
        await engine.chat.completions.create(messages=U)
    await engine.reload(["stub-llm", "stub-llm-2", "stub-emb"])
    with pytest.raises(E.UnclearModelToUseError, match="specify the model"):
        await engine.chat.completions.create(messages=U)
    with pytest.raises(E.SpecifiedModelNotFoundError, match="ghost"):
        await engine.chat.completions.create(messages=U, model="ghost")
    with pytest.raises(E.IncorrectPipelineLoadedError, match="stub-emb"):
        await engine.chat.completions.create(messages=U, model="stub-emb")
    with pytest.raises(E.IncorrectPipelineLoadedError, match="stub-llm"):     # as WebLLM's getEmbeddingStates
        await engine.embeddings.create(input="x", model="stub-llm")
    # validation comes before model selection and locking
    with pytest.raises(PE.StreamingCountError):
        await engine.chat.completions.create(messages=U, model="ghost", stream=True, n=2)
    r = await engine.chat.completions.create(messages=U, model="stub-llm-2", temperature=0, max_tokens=1)
    assert r.model == "stub-llm-2"
    await engine.reload("stub-emb")
    r = await engine.embeddings.create(input=["a", "bb"])   # one model loaded: `model` optional
    assert [d.index for d in r.data] == [0, 1] and r.data[1].embedding[0] == 2.0
    assert r.usage.prompt_tokens == 2 and r.usage.extra["prefill_tokens_per_s"] > 0
    await engine.unload()


async def test_required_features(fresh_device):
    engine = AsyncMLCEngine(stub_config(fresh_device))
    with pytest.raises(E.FeatureSupportError, match="foo-feature"):
        await engine.reload("stub-needs-foo")
    fresh_device.features = frozenset(f for f in fresh_device.features if f != "shader-f16")
    with pytest.raises(E.ShaderF16SupportError, match="f32 variant"):
        await engine.reload("stub-f16-only")
    with pytest.raises(E.ShaderF16SupportError):
        await engine.reload("stub-llm", {"dtype": "f16"})
    await engine.reload("stub-f16")               # falls back to its f32 variant, same id
    assert engine.models["stub-f16"].record.model_id == "stub-llm"
    await engine.unload()


# --------------------------------------------------------------------------- device loss
async def test_device_loss_fails_request_then_reports_not_loaded(fresh_device):
    engine = await create_mlc_engine(["stub-llm", "stub-emb"], stub_config(fresh_device))
    lm = engine.models["stub-llm"]
    StubLLM.lose_device_at_step = 2
    with pytest.raises(E.DeviceLostError):
        await engine.chat.completions.create(messages=U, model="stub-llm")
    assert not lm.lock.locked and engine.models == {} and engine.state == "device_lost"
    with pytest.raises(E.ModelNotLoadedError):
        await engine.chat.completions.create(messages=U, model="stub-llm")
    # an explicit reload brings a fresh device
    await engine.reload("stub-llm")
    assert engine.device is not fresh_device and not engine.device.lost
    r = await engine.chat.completions.create(messages=U, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    await engine.unload()
    engine.device.close()


async def test_device_loss_auto_recover(fresh_device):
    engine = await create_mlc_engine(["stub-llm", "stub-emb"], stub_config(fresh_device, auto_recover=True))
    StubLLM.lose_device_at_step = 1
    stream = await engine.chat.completions.create(messages=U, model="stub-llm", stream=True)
    with pytest.raises(E.DeviceLostError):
        async for _ in stream:
            pass
    assert engine.state == "device_lost"
    r1, r2 = await asyncio.gather(
        engine.chat.completions.create(messages=U, model="stub-llm", temperature=0),
        engine.embeddings.create(input="x", model="stub-emb"))
    assert r1.choices[0].finish_reason == "stop" and len(r2.data) == 1
    assert set(engine.models) == {"stub-llm", "stub-emb"} and engine.state == "ready"
    assert engine.device is not fresh_device
    await engine.unload()
    engine.device.close()


async def test_unload_is_not_a_device_loss(device):
    engine = await create_mlc_engine("stub-llm", stub_config(device))
    await engine.unload()
    assert engine.state == "idle" and not device.lost


async def test_logit_processor_registry_reaches_the_pipeline(device):
    class Proc:
        seen = []

        def process_logits(self, logits):
            return logits

        def process_sampled_token(self, t):
            self.seen.append(t)

        def reset_state(self):
            self.seen.clear()
    proc = Proc()
    engine = await create_mlc_engine("stub-llm", stub_config(device, logit_processor_registry={"stub-llm": proc}))
    assert engine.models["stub-llm"].pipeline.logit_processor is proc
    await engine.chat.completions.create(messages=U, max_tokens=2)
    assert proc.seen == [0, 1]
    await engine.unload()


def test_sync_facade(device):
    from webgpu_engine.engine import create_mlc_engine_sync
    eng = create_mlc_engine_sync(["stub-llm", "stub-emb"], stub_config(device))
    try:
        r = eng.chat.completions.create(model="stub-llm", messages=U, temperature=0)
        assert r.choices[0].message.content.startswith("three two one")
        words = []
        stream = eng.chat.completions.create(model="stub-llm", messages=U, temperature=0, stream=True)
        for ch in stream:
            words.append(ch.choices[0].delta.content)
            if len(words) == 2:
                break
        stream.close()
        assert not eng.models["stub-llm"].lock.locked
        assert len(eng.embeddings.create(model="stub-emb", input=["a"]).data) == 1
        assert eng.get_gpu_vendor() == device.info.vendor
    finally:
        eng.close()


def test_engine_core_imports_only_the_standard_library():
    """The engine runs in the page too (Pyodide): no numpy/pydantic/aiohttp at module level."""
    import ast
    import inspect
    import sys

    import webgpu_engine.engine.device_loss as m6
    import webgpu_engine.engine.engine as m1
    import webgpu_engine.engine.loading as m5
    import webgpu_engine.engine.lock as m2
    import webgpu_engine.engine.records as m3
    import webgpu_engine.engine.requests as m4
    for mod in (m1, m2, m3, m4, m5, m6, sys.modules["webgpu_engine.engine"]):
        for n in ast.parse(inspect.getsource(mod)).body:
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and not n.level:
                names = [n.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in sys.stdlib_module_names, f"{mod.__name__} imports {name}"


async def test_auto_recover_serves_requests_queued_at_the_loss(fresh_device):
    """With auto_recover, a request queued behind the one that lost the device started no GPU
    work: it waits for the reload and completes on the reloaded model (FIFO kept); without
    auto_recover the queued request fails with DeviceLostError."""
    for auto in (True, False):
        dev = fresh_device if auto else await request_device()
        engine = await create_mlc_engine("stub-llm", stub_config(dev, auto_recover=auto))
        StubLLM.lose_device_at_step = 2
        first = asyncio.ensure_future(engine.chat.completions.create(messages=U, temperature=0))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(engine.chat.completions.create(messages=U, temperature=0))
        res = await asyncio.gather(first, queued, return_exceptions=True)
        assert isinstance(res[0], E.DeviceLostError)
        if auto:
            assert res[1].choices[0].finish_reason == "stop"
            assert engine.state == "ready" and engine.device is not dev and set(engine.models) == {"stub-llm"}
        else:
            assert isinstance(res[1], E.DeviceLostError) and engine.state == "device_lost"
        await engine.unload()
        if engine.device is not None:
            engine.device.close()


# --------------------------------------------------------------------------- admission control
async def test_bounded_queue_refuses_with_retry_after_and_deadline_times_out(device):
    engine = await create_mlc_engine(["stub-llm", "stub-emb"],
                                     stub_config(device, max_queue_length=2, request_timeout_s=0.5))
    StubLLM.step_delay = 0.03
    lm = engine.models["stub-llm"]
    try:
        chats = [asyncio.create_task(engine.chat.completions.create(model="stub-llm", messages=U,
                                                                     max_tokens=4))
                 for _ in range(3)]          # one runs, two wait: the queue is full
        await asyncio.sleep(0.01)
        assert lm.lock.locked and lm.lock.queue_length == 2
        with pytest.raises(E.ModelBusyError) as ei:
            await engine.chat.completions.create(model="stub-llm", messages=U)
        assert ei.value.http_status == 429 and ei.value.retry_after >= 1
        assert "busy" in ei.value.message and "--max-queue" in ei.value.message
        # the other model is not affected by this model's queue
        assert (await engine.embeddings.create(model="stub-emb", input="a")).data
        assert all(r.choices for r in await asyncio.gather(*chats))
        assert lm.lock.mean_hold_s > 0
        # a generation past the deadline stops at a step boundary and frees the model
        StubLLM.step_delay = 0.1              # 9 words: 0.9 s > 0.5 s
        with pytest.raises(E.RequestTimeoutError) as ei:
            await engine.chat.completions.create(model="stub-llm", messages=U, max_tokens=100,
                                                 ignore_eos=True)
        assert ei.value.http_status == 504 and "decode" in ei.value.message
        assert not lm.lock.locked
        # a request that waits for the model past its deadline leaves the queue
        await lm.lock.acquire()
        with pytest.raises(E.RequestTimeoutError, match="wait for stub-llm"):
            await engine.chat.completions.create(model="stub-llm", messages=U, stream=True)
        assert lm.lock.queue_length == 0
        lm.lock.release()
        assert not lm.lock.locked
    finally:
        StubLLM.step_delay = 0.002
        await engine.unload()


async def test_queue_length_zero_means_none_may_wait(device):
    """max_queue_length=0 (serve --max-queue 0): a request is refused whenever the model is busy;
    None: any number may wait."""
    for limit, refused in ((0, True), (None, False)):
        engine = await create_mlc_engine(["stub-llm"], stub_config(device, max_queue_length=limit))
        lm = engine.models["stub-llm"]
        try:
            await lm.lock.acquire()           # the model is busy
            second = asyncio.create_task(engine.chat.completions.create(model="stub-llm", messages=U,
                                                                        max_tokens=2))
            await asyncio.sleep(0.05)
            assert second.done() == refused
            if refused:
                assert isinstance(second.exception(), E.ModelBusyError)
            else:
                assert lm.lock.queue_length == 1
            lm.lock.release()
            if not refused:
                assert (await second).choices
        finally:
            await engine.unload()


# --------------------------------------------------------------------------- WebLLM behaviours
async def test_interrupt_stops_every_choice_of_the_request(device):
    """WebLLM: one interruptGenerate() stops all n choices; the ones not yet begun come back empty
    with finish_reason "abort" (engine.ts, chatCompletion's loop over n)."""
    StubLLM.step_delay = 0.01
    engine = await create_mlc_engine("stub-llm", stub_config(device))
    task = asyncio.create_task(engine.chat.completions.create(messages=U, temperature=0, n=3))
    await asyncio.sleep(0.03)
    engine.interrupt_generate()
    r = await task
    assert [c.finish_reason for c in r.choices] == ["abort"] * 3
    assert [c.message.content for c in r.choices[1:]] == ["", ""]
    assert len(StubLLM.instances[0].prefills) == 1          # choices 1 and 2 never started
    # the next request is not interrupted
    r = await engine.chat.completions.create(messages=U, temperature=0, n=2)
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    await engine.unload()


async def test_unload_aborts_a_reload_in_progress(device):
    StubLLM.load_delay = 0.05
    engine = AsyncMLCEngine(stub_config(device))
    task = asyncio.create_task(engine.reload(["stub-emb", "stub-llm", "stub-llm-2"]))
    await asyncio.sleep(0.12)             # inside stub-llm's load; stub-emb is done
    await engine.unload()
    with pytest.raises(E.ReloadAbortedError, match="unload"):
        await task
    assert engine.models == {} and engine.state == "idle"
    assert _owners_bytes(device, ["stub-emb", "stub-llm", "stub-llm-2"]) == 0
    assert len(StubLLM.instances) == 0    # stub-llm's load stopped at its next progress report
    # a newer reload aborts an older one the same way, and then loads
    StubLLM.load_delay = 0.02
    old = asyncio.create_task(engine.reload(["stub-llm", "stub-llm-2"]))
    await asyncio.sleep(0.03)
    await engine.reload("stub-emb")
    with pytest.raises(E.ReloadAbortedError):
        await old
    assert list(engine.models) == ["stub-emb"]
    assert _owners_bytes(device, ["stub-llm", "stub-llm-2"]) == 0
    await engine.unload()


@pytest.mark.parametrize("level", ["TRACE", "DEBUG", "INFO", "WARN", "ERROR", "SILENT", "warning", "trace"])
def test_set_log_level_accepts_webllm_levels(level):
    import logging
    from webgpu_engine.logs import LOG_LEVELS
    engine = AsyncMLCEngine(EngineConfig_with(log_level="WARN"))
    try:
        engine.set_log_level(level)
        assert logging.getLogger("webgpu_engine").level == LOG_LEVELS[level.upper()]
        if level.upper() == "SILENT":
            assert not logging.getLogger("webgpu_engine").isEnabledFor(logging.CRITICAL)
    finally:
        engine.set_log_level("WARN")
    with pytest.raises(E.InvalidRequestError, match="Unknown log level 'LOUD'"):
        engine.set_log_level("LOUD")


def EngineConfig_with(**kw):
    from webgpu_engine.engine import EngineConfig
    return EngineConfig(**kw)


async def test_extra_body_fields_work_or_are_refused(device):
    engine = await create_mlc_engine("stub-llm", stub_config(device))
    await engine.chat.completions.create(messages=U, extra_body={"enable_thinking": False,
                                                                 "enable_latency_breakdown": True,
                                                                 "ignore_eos": True})
    gen = StubLLM.instances[0].prefills[-1]["gen"]
    assert gen.enable_thinking is False and gen.latency_breakdown and gen.ignore_eos
    await engine.chat.completions.create(messages=U, enable_thinking=True)     # the OpenAI client's way
    assert StubLLM.instances[0].prefills[-1]["gen"].enable_thinking is True
    with pytest.raises(PE.UnsupportedFieldsError, match="no_such_option"):
        await engine.chat.completions.create(messages=U, extra_body={"no_such_option": 1})
    with pytest.raises(PE.FieldTypeError, match="enable_thinking"):
        await engine.chat.completions.create(messages=U, extra_body={"enable_thinking": "yes"})
    with pytest.raises(PE.UnsupportedFieldsError, match="enable_thinking"):
        await engine.completions.create(prompt="a b", extra_body={"enable_thinking": True})
    with pytest.raises(PE.UnsupportedFieldsError, match="twice"):
        await engine.chat.completions.create(messages=U, temperature=0.5, extra_body={"temperature": 1.0})
    await engine.unload()
