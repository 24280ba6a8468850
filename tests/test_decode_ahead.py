"""Decode steps one ahead of the host (ChatConfig.decode_ahead, pipelines/scheduler.py _submit_ahead):
the device's Batch.readback takes its bytes at its point in the batch, whatever is submitted after; a
lone request (the pipeline's own request-level methods, one sequence of the scheduler) gets the same
tokens, logprobs, finish reasons and cached tokens with and without it (greedy, seeded sampling,
penalties, stop strings, max_tokens, the context's end, an abort), and a step left in flight by a
finished or abandoned request never leaks into the next one."""
from __future__ import annotations

import struct

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.pipelines.llm import LLMChatPipeline

PROMPTS = ["Hello world! The quick brown fox jumps.", "user assistant system " * 3]


async def test_readback_takes_its_bytes_at_its_point_in_the_batch(device):
    buf = device.buffer(16, owner="test:readback", label="rb_src")
    try:
        device.write(buf, struct.pack("<4I", 1, 2, 3, 4))
        b1 = device.batch()
        first = b1.readback(buf, 4, 8)
        device.submit(b1)
        device.write(buf, struct.pack("<4I", 5, 6, 7, 8))        # after the first batch, in queue order
        b2 = device.batch()
        second = b2.readback(buf)
        device.submit(b2)
        assert struct.unpack("<4I", await device.collect(second)) == (5, 6, 7, 8)
        assert struct.unpack("<2I", await device.collect(first)) == (2, 3)
        assert first.staging is None and second.staging is None         # back in the pool
    finally:
        device.release_owner("test:readback")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("ahead") / "m.gguf", arch="llama", qtype="q8_0",
                                 context_length=256)["path"]


async def _run(pipe, msgs, **gen):
    await pipe.prefill_step(msgs, GenerationConfig(**gen))
    while not pipe.stopped:
        await pipe.decode_step()
    return list(pipe.output_ids), pipe.finish_reason, list(pipe.token_logprobs), pipe.get_message()


@pytest.fixture(scope="module")
async def pipes(device, tiny):
    """The same model twice: decode_ahead on and off."""
    on = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=160, compile_at_load=False,
                                                             decode_ahead=True))
    off = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=160, compile_at_load=False,
                                                              decode_ahead=False))
    yield on, off
    on.dispose()
    off.dispose()


GENS = [dict(temperature=0.0, max_tokens=20, ignore_eos=True),
        dict(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=3),
        dict(temperature=0.7, top_k=20, seed=9, max_tokens=16, ignore_eos=True, frequency_penalty=0.8,
             presence_penalty=0.3, repetition_penalty=1.2),
        dict(temperature=0.0, max_tokens=1),
        dict(temperature=0.0, max_tokens=200, ignore_eos=True)]       # runs into the context's end


@pytest.mark.parametrize("k", range(len(GENS)))
async def test_same_answers_with_and_without(pipes, k):
    on, off = pipes
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        before = on.scheduler.stats["ahead_steps"]
        got, want = await _run(on, msgs, **GENS[k]), await _run(off, msgs, **GENS[k])
        assert got == want, (k, p[:10])
        assert on.kv_ids == off.kv_ids              # the cache holds the same tokens
        if len(want[0]) > 2:
            assert on.scheduler.stats["ahead_steps"] > before      # the steps went ahead
        assert off.scheduler.stats["ahead_steps"] == 0


async def test_stop_strings_and_what_follows_a_stop(pipes):
    """A stop string mid-answer: the step already in flight is discarded; the next request (which
    reuses the cache) answers as the serial path does."""
    on, off = pipes
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    full = await _run(off, msgs, temperature=0.0, max_tokens=24, ignore_eos=True)
    stop = full[3][len(full[3]) // 2:len(full[3]) // 2 + 2]
    gen = dict(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert await _run(on, msgs, **gen) == await _run(off, msgs, **gen)
    assert on.finish_reason == "stop" and stop not in on.get_message()
    follow = msgs + [{"role": "assistant", "content": on.get_message()}, {"role": "user", "content": "more"}]
    g = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert await _run(on, follow, **g) == await _run(off, follow, **g)


async def test_abandoned_and_aborted_requests(pipes):
    """A request left after a few steps (a client gone) and an interrupted one: the step in flight
    never reaches the next request's answer."""
    on, off = pipes
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    await on.prefill_step(msgs, GenerationConfig(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        await on.decode_step()
    assert on.scheduler._ahead is not None         # abandoned with a step in flight
    g = dict(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True)
    assert await _run(on, msgs, **g) == await _run(off, msgs, **g)
    await on.prefill_step(msgs, GenerationConfig(temperature=0.0, max_tokens=30, ignore_eos=True))
    await on.decode_step()
    on.interrupt()
    await on.decode_step()
    assert on.finish_reason == "abort" and on.scheduler._ahead is None
    assert await _run(on, msgs, **g) == await _run(off, msgs, **g)


async def test_default_is_on_except_on_software_adapters(device, tiny):
    from webgpu_engine.kernels.matmul import is_software_adapter
    pipe = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=160, compile_at_load=False))
    try:
        await pipe.prefill_step([{"role": "user", "content": "hi"}], GenerationConfig(temperature=0.0, max_tokens=4))
        assert pipe.scheduler.decode_ahead is (not is_software_adapter(device))
    finally:
        pipe.dispose()


async def test_submit_async_after_a_release_is_typed(device):
    """A batch recorded before its buffers were released (a model unloaded meanwhile) fails typed in
    submit_async, and its readbacks' staging buffers are not handed out again."""
    from webgpu_engine.errors import GPUValidationError
    a = device.buffer(16, owner="test:sa", label="sa_a")
    b = device.buffer(16, owner="test:sa", label="sa_b")
    batch = device.batch()
    batch.copy(a, b)
    rb = batch.readback(b)
    device.release_owner("test:sa")
    with pytest.raises(GPUValidationError, match="released"):
        await device.submit_async(batch)
    assert rb.staging is None


async def test_dispose_with_a_step_in_flight(device, tiny):
    pipe = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=160, compile_at_load=False,
                                                               decode_ahead=True))
    await pipe.prefill_step([{"role": "user", "content": "hi"}],
                            GenerationConfig(temperature=0.0, max_tokens=50, ignore_eos=True))
    await pipe.decode_step()
    assert pipe.scheduler._ahead is not None
    owner = pipe.owner
    pipe.dispose()
    assert owner not in device.allocations() and not device.lost
