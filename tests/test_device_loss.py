"""Device loss on the real adapter with the real default models, through the engine API.

The device is destroyed (gpu `Device.destroy`, what a driver reset does) at four points: during
reload (weight upload), during prefill, mid-stream in decode, during an embedding batch. Each time:
the request fails with DeviceLostError saying what happened and what to try, no lock is held, the
other model's requests get ModelNotLoadedError, and a manual reload (reload, prefill, decode) or
auto_recover (reload and prefill after a second loss at the same point, embedding) brings both
models back and the model that was hit answers exactly as before the loss (the same greedy text,
the same embeddings).
An intentional unload() is never reported as a loss. To hit a precise point, a pipeline or device
method is wrapped to destroy the device and then call through; the GPU work itself is real.
"""
from __future__ import annotations

import asyncio
import gc

import pytest

from webgpu_engine import errors as E
from webgpu_engine.engine import DEFAULT_CHAT_MODEL as LLM_ID
from webgpu_engine.engine import DEFAULT_EMBED_MODEL as EMB_ID
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, create_mlc_engine

# each test leaves up to three devices with their compiled pipelines behind: freed after it
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("return_host_memory")]

Q = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["The cat sits on the mat.", "Stock markets fell sharply today."]
MAX_TOKENS = 6
BOTH = [LLM_ID, EMB_ID]
# no test here asserts on compiling: every load skips the load-time warm-up run of every pipeline
# (tests/test_correctness.py checks it), which would otherwise dominate the time of these loads
FAST = [{"compile_at_load": False}] * 2


async def greedy(eng) -> str:
    r = await eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0, max_tokens=MAX_TOKENS)
    return r.choices[0].message.content


async def embed(eng) -> list[list[float]]:
    r = await eng.embeddings.create(model=EMB_ID, input=TEXTS)
    return [d.embedding for d in r.data]


@pytest.fixture(scope="module")
async def reference(device, smollm2_gguf, minilm_dir):
    """Greedy answer and embeddings of the default models before any loss (session device)."""
    eng = await create_mlc_engine(BOTH, EngineConfig(device=device), FAST)
    ref = (await greedy(eng), await embed(eng))
    await eng.unload()
    assert ref[0].strip() and len(ref[1]) == 2
    return ref


async def new_engine(**kw) -> AsyncMLCEngine:
    """An engine with both models on a device of its own (the test destroys it)."""
    from webgpu_engine import gpu
    return await create_mlc_engine(BOTH, EngineConfig(device=await gpu.request_device(), **kw), FAST)


def destroy_on_next(dev, method: str, fired: list):
    """Make the next call of `dev.<method>` destroy the device first, then call through (so the call
    meets a destroyed device, as when a driver resets in the middle of GPU work)."""
    orig = getattr(dev, method)

    def wrapper(*a, **kw):
        delattr(dev, method)           # one shot: back to the class method
        fired.append(method)
        dev.destroy()
        return orig(*a, **kw)
    setattr(dev, method, wrapper)


def before_step(pipe, step: str, hook) -> None:
    """Call `hook()` at the start of every `step` (prefill_step, decode_step, embed_jobs) of `pipe`: a
    chat model's steps are those of each request's sequence of its scheduler (pipe.sequence())."""
    def wrap(obj):
        orig = getattr(obj, step)

        async def wrapped(*a, **kw):
            hook()
            return await orig(*a, **kw)
        setattr(obj, step, wrapped)
        return obj
    if hasattr(pipe, "sequence"):
        make = pipe.sequence
        pipe.sequence = lambda: wrap(make())
    else:
        wrap(pipe)


def wrap_step(eng, model_id: str, step: str, dev_method: str, fired: list) -> None:
    """Arm a destroy on the device's next `dev_method` call inside the model's `step` (prefill_step,
    embed_jobs)."""
    before_step(eng.models[model_id].pipeline, step, lambda: destroy_on_next(eng.device, dev_method, fired))


async def until_queued(lock, n: int = 1) -> None:
    for _ in range(1000):
        if lock.queue_length >= n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the request never queued on the lock")


def check_lost(eng, exc: BaseException, phase: str, locks, lost_dev) -> None:
    """The typed error, its message, the freed locks and the dropped state after a loss."""
    assert isinstance(exc, E.DeviceLostError), repr(exc)
    msg = str(exc)
    assert "device was lost" in msg and "destroyed" in msg        # what happened
    assert phase in msg                                         # ... during what
    assert "reload()" in msg                                    # what to try
    assert all(not lk.locked for lk in locks)
    assert eng.models == {} and eng.state == "device_lost" and lost_dev.lost
    assert eng.device is None or eng.device is not lost_dev


async def check_not_loaded(eng) -> None:
    """Without auto_recover, every model's requests report that nothing is loaded."""
    with pytest.raises(E.ModelNotLoadedError):
        await eng.embeddings.create(model=EMB_ID, input=TEXTS)
    with pytest.raises(E.ModelNotLoadedError):
        await eng.chat.completions.create(model=LLM_ID, messages=Q, max_tokens=2)


def same_vectors(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


async def check_served(eng, ref, lost_dev, which: str) -> None:
    """The model that lost the device answers as before the loss, on a new device, with the other
    model loaded again too. (Each point checks the answers of the model it hit: a first request on
    a new device compiles that model's kernels, which costs seconds on a CPU adapter.)"""
    if which == "embed":
        same_vectors(await embed(eng), ref[1])
    else:
        assert await greedy(eng) == ref[0]
    assert set(eng.models) == set(BOTH) and eng.state == "ready"
    assert eng.device is not lost_dev and not eng.device.lost


async def run_point(ref, lose, phase: str, which: str, recover=(False, True)) -> None:
    """Lose the device with `lose(eng)` (returns the exception the request got), then recover by a
    manual reload; lose it again the same way and recover with auto_recover (the next request — to
    the model `which` — reloads both models). `recover`: the passes, manual (False) and auto (True):
    a point may take one of them (each pass costs a device and its kernels' compiles)."""
    eng = await new_engine()
    try:
        for auto in recover:
            eng.config.auto_recover = auto
            dev = eng.device
            locks = [lm.lock for lm in eng.models.values()]
            exc = await lose(eng)
            check_lost(eng, exc, phase, locks, dev)
            if auto:
                assert "auto_recover is on" in str(exc)
                await check_served(eng, ref, dev, which)    # the next request reloads
            else:
                await check_not_loaded(eng)
                assert eng.state == "device_lost"
                await eng.reload(BOTH, FAST)
                await check_served(eng, ref, dev, which)
            dev.close()             # the lost device's pipelines (its driver code) go now, not
            gc.collect()            # with the test's garbage: at most two devices live at once
    finally:
        await eng.unload()
        if eng.device is not None and not eng.device.lost:
            eng.device.close()


# --------------------------------------------------------------------------- the four points
async def test_loss_during_reload_weight_upload(reference):
    async def lose(eng):
        dev = eng.device
        fired = []

        def cb(report):
            # the LLM's weight upload is under way (phase 1 — files, memory check — is done)
            if not fired and report["text"].startswith(f"[{LLM_ID}]") and report["progress"] > 0.1:
                fired.append(report["text"])
                dev.destroy()
        eng.set_init_progress_callback(cb)
        try:
            with pytest.raises(E.DeviceLostError) as ei:
                await eng.reload(BOTH, FAST)
        finally:
            eng.set_init_progress_callback(None)
        assert fired and set(dev.allocations()) <= {"kernels"}     # the partial load was freed
        return ei.value
    await run_point(reference, lose, f"loading (weight upload) of model {LLM_ID}", "chat")


async def test_loss_during_prefill(reference):
    async def lose(eng):
        fired = []
        # destroyed at the prefill's readback: its forward was already submitted to the GPU
        wrap_step(eng, LLM_ID, "prefill_step", "read", fired)
        with pytest.raises(E.DeviceLostError) as ei:
            await eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0, max_tokens=MAX_TOKENS)
        assert fired == ["read"]
        return ei.value
    await run_point(reference, lose, f"prefill of model {LLM_ID}", "chat")


async def test_loss_mid_stream_in_decode(reference):
    async def lose(eng):
        stream = await eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0,
                                                   max_tokens=MAX_TOKENS, stream=True)
        chunks = []
        with pytest.raises(E.DeviceLostError) as ei:
            async for ch in stream:
                chunks.append(ch)
                if len(chunks) == 1:
                    eng.device.destroy()          # after the first streamed chunk
        assert len(chunks) == 1 and chunks[0].choices[0].delta.content
        return ei.value
    # a manual reload only: auto_recover after a chat model's loss in a request is the prefill point's
    # (its second pass also loses a device that a recovery brought, mid-request)
    await run_point(reference, lose, f"decode of model {LLM_ID}", "chat", recover=(False,))


async def test_loss_during_embedding_batch(reference):
    async def lose(eng):
        fired = []
        # destroyed as the batch's forward is submitted
        wrap_step(eng, EMB_ID, "embed_jobs", "submit", fired)
        with pytest.raises(E.DeviceLostError) as ei:
            await eng.embeddings.create(model=EMB_ID, input=TEXTS)
        assert fired == ["submit"]
        return ei.value
    # auto_recover only: the recovery an embeddings request starts (a manual reload is the same call
    # whichever model was hit: the other points')
    await run_point(reference, lose, f"embedding of model {EMB_ID}", "embed", recover=(True,))


async def test_loss_seen_by_one_request_fails_the_queued_ones(reference):
    """Requests waiting on the lost model's lock (and on the other model) fail with DeviceLostError,
    not with a hang or a stale answer; every lock ends free."""
    eng = await new_engine()
    try:
        dev = eng.device
        lm = eng.models[LLM_ID]
        stream = await eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0,
                                                   max_tokens=MAX_TOKENS, stream=True)
        queued = asyncio.create_task(eng.chat.completions.create(model=LLM_ID, messages=Q, max_tokens=2))
        await until_queued(lm.lock)
        dev.destroy()
        with pytest.raises(E.DeviceLostError):
            async for _ in stream:
                pass
        with pytest.raises(E.DeviceLostError, match="destroyed"):
            await queued
        assert not lm.lock.locked and eng.state == "device_lost"
    finally:
        await eng.unload()


# --------------------------------------------------------------------------- intentional unload
async def test_unload_is_never_a_device_loss(device, reference):
    before = device.allocated_bytes()
    eng = await create_mlc_engine(BOTH, EngineConfig(device=device, auto_recover=True), FAST)
    try:
        lm = eng.models[LLM_ID]
        # a stream in flight when the model is unloaded
        stream = await eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0,
                                                   max_tokens=MAX_TOKENS, stream=True)
        queued = asyncio.create_task(eng.chat.completions.create(model=LLM_ID, messages=Q, max_tokens=2))
        await until_queued(lm.lock)
        first = await stream.__anext__()
        assert first.choices[0].delta.content
        await eng.unload()
        assert device.allocated_bytes() == before
        with pytest.raises(E.ModelUnloadedError, match="unloaded") as ei:
            async for _ in stream:
                pass
        assert not isinstance(ei.value, E.DeviceLostError)
        with pytest.raises(E.ModelUnloadedError) as ei:      # it was waiting for the lock
            await queued
        assert not isinstance(ei.value, E.DeviceLostError)
        assert not lm.lock.locked
        assert eng.state == "idle" and eng.device_lost_reason is None
        assert not device.lost and eng.device is device
        # not a loss, so auto_recover does not bring the models back
        with pytest.raises(E.ModelNotLoadedError):
            await eng.embeddings.create(model=EMB_ID, input=TEXTS)
        assert eng.models == {} and eng.state == "idle"
        assert device.allocated_bytes() == before
        # a non-streaming request running when reload() replaces the models
        await eng.reload(BOTH, FAST)
        started = asyncio.Event()
        before_step(eng.models[LLM_ID].pipeline, "decode_step", started.set)
        task = asyncio.create_task(eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0,
                                                               max_tokens=MAX_TOKENS))
        await started.wait()
        await eng.reload(BOTH, FAST)
        with pytest.raises(E.ModelUnloadedError):
            await task
        assert eng.state == "ready" and not device.lost
        assert await greedy(eng) == reference[0]          # the same device still serves
    finally:
        await eng.unload()
    assert not device.lost and device.allocated_bytes() == before
