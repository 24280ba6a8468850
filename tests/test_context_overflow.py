"""context_overflow: a conversation longer than the context window is a 400 naming the limit
("error", the default) or loses its oldest turns after the system prompt until it fits ("truncate",
reported in usage.extra), with one sequence at a time and with several; the system prompt and
the latest turn are always kept; "shift" also lets a generation go past the window (llama.cpp's
context shift). A tiny chat model with a 96-token window on the real adapter."""
from __future__ import annotations

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
from webgpu_engine.errors import ChatOptionTypeError, ContextWindowTooLargeError, UnsupportedChatOptionError

SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [m for i in range(6) for m in ({"role": "user", "content": f"Question {i}: the quick brown fox?"},
                                       {"role": "assistant", "content": f"Answer {i}: the lazy dog."})]
LAST = {"role": "user", "content": "And the last one?"}
# tokens a shifting generation makes: past the 96-token window twice over, so at least three shifts
# (at 96 tokens, then every 45 with n_keep 5)
LONG = 200


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("overflow") / "m.gguf", qtype="q8_0",
                                     context_length=96)["path"])


async def _engine(device, path, **opts):
    app = default_app_config().with_records(ModelRecord("tiny", path, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny", {"compile_at_load": False, **opts})
    return eng


def ask(eng, messages, **kw):
    return eng.chat.completions.create(messages=messages, max_tokens=3, temperature=0, **kw)


@pytest.mark.parametrize("batched", [False, True])
async def test_truncate_drops_the_oldest_turns_and_keeps_system_and_latest(device, path, batched):
    eng = await _engine(device, path, context_overflow="truncate", **({"max_num_sequences": 2} if batched else {}))
    try:
        conv = [SYSTEM, *TURNS, LAST]
        r = await ask(eng, conv)
        dropped = r.usage.extra.model_dump()["truncated_messages"]
        assert dropped > 0 and dropped % 2 == 0 and r.usage.prompt_tokens < 96
        kept = [SYSTEM, *TURNS[dropped:], LAST]
        same = await ask(eng, kept)            # what was kept, sent as it is: the same prompt and answer
        assert same.usage.prompt_tokens == r.usage.prompt_tokens
        assert same.choices[0].message.content == r.choices[0].message.content
        assert "truncated_messages" not in same.usage.extra.model_dump()
        with pytest.raises(ContextWindowTooLargeError):   # the latest turn alone does not fit
            await ask(eng, [SYSTEM, {"role": "user", "content": "fox " * 200}])
        assert (await ask(eng, [LAST])).choices[0].finish_reason in ("stop", "length")
    finally:
        await eng.unload()


async def test_error_is_the_default_and_bad_policies_are_refused(device, path):
    eng = await _engine(device, path)
    try:
        with pytest.raises(ContextWindowTooLargeError) as e:
            await ask(eng, [SYSTEM, *TURNS, LAST])
        assert "96" in str(e.value)
        with pytest.raises(ChatOptionTypeError):
            await eng.reload("tiny", {"compile_at_load": False, "context_overflow": "slide"})
        with pytest.raises(UnsupportedChatOptionError):          # refused by name before the lock
            await eng.reload("tiny", {"compile_at_load": False, "context_overflow": "shift",
                                      "context_window_size": -1, "sliding_window_size": 32})
        with pytest.raises(ChatOptionTypeError):
            await eng.reload("tiny", {"compile_at_load": False, "context_overflow": "shift", "n_keep": -1})
    finally:
        await eng.unload()


async def _shift_run(device, path, ahead: bool, check: bool):
    """A greedy generation of LONG tokens (over 2x the 96-token window) with context_overflow "shift",
    n_keep 5, a lone sequence of the scheduler. `check`: after each shift, the token the step after it
    sampled equals a cold forward of exactly the tokens the cache then holds (a second pipeline on the
    same weights, with a pool of its own)."""
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    pipe = await LLMChatPipeline.load(device, path, ChatConfig(compile_at_load=False, context_overflow="shift",
                                                               n_keep=5, decode_ahead=ahead))
    try:
        await pipe.prefill_step([{"role": "user", "content": "Tell me a long story."}],
                                GenerationConfig(temperature=0.0, max_tokens=LONG, ignore_eos=True))
        shifts = 0
        while not pipe.stopped:
            before = list(pipe.kv_ids)
            await pipe.decode_step()
            if pipe._req.context_shifts == shifts:
                continue
            shifts = pipe._req.context_shifts
            drop = (96 - 5) // 2
            assert len(before) == 96 and pipe.kv_ids[:-1] == before[:5] + before[5 + drop:]
            if check:
                ref = LLMChatPipeline(pipe.dev, pipe.model, pipe.tokenizer, pipe.template, pipe.chat_config,
                                      pipe.owner, pipe.plan)
                got = pipe.output_ids[-1]
                assert await ref.forward_tokens_and_sample(list(pipe.kv_ids), True,
                                                           GenerationConfig(temperature=0.0)) == got
                ref.scheduler.close()
        assert pipe.finish_reason == "length" and len(pipe.output_ids) == LONG
        assert shifts >= 3 and pipe.usage()["extra"]["context_shifts"] == shifts
        return list(pipe.output_ids)
    finally:
        pipe.dispose()


async def test_shift_generates_past_the_window(device, path):
    """context_overflow "shift": a generation of over 2x the window goes on to max_tokens; after each
    shift the cache holds the first n_keep tokens and the newer half of the rest, computed again at
    their new positions, so the next token is the one a cold cache of those tokens gives; steps run
    one ahead of the host give the same answer."""
    serial = await _shift_run(device, path, ahead=False, check=True)
    assert await _shift_run(device, path, ahead=True, check=False) == serial


PROMPTS = ["Tell me a long story.", "Once upon a time", "The quick brown fox jumps over the lazy dog",
           "Count to one hundred, slowly."]


async def _long(eng, prompt: str, **kw):
    r = await eng.completions.create(prompt=prompt, max_tokens=LONG, ignore_eos=True, temperature=0, logprobs=1, **kw)
    c = r.choices[0]
    return c.logprobs.tokens, c.finish_reason, r.usage.extra.model_dump().get("context_shifts", 0)


async def test_shift_per_sequence_in_a_batch(device, path):
    """context_overflow "shift" with continuous batching (llama.cpp's per-slot shift): 4 generations of
    LONG tokens (over 2x the 96-token window) from prompts of different lengths run together, each shifting
    on its own when its cache is full (the others decode on meanwhile); each gives the tokens it gives
    alone in the batch and with one slot, whose shifts the cold-forward check above proves."""
    import asyncio
    batched = await _engine(device, path, context_overflow="shift", n_keep=5, max_num_sequences=4)
    try:
        sched = next(iter(batched.models.values())).pipeline.scheduler
        assert sched is not None and sched.max_seqs == 4
        alone = [await _long(batched, p) for p in PROMPTS]
        together = await asyncio.gather(*[_long(batched, p) for p in PROMPTS])
        assert sched.stats["context_shifts"] >= 2 * 3 * len(PROMPTS)
    finally:
        await batched.unload()
    for toks, finish, shifts in alone:
        assert len(toks) == LONG and finish == "length" and shifts >= 3
    assert together == alone
    single = await _engine(device, path, context_overflow="shift", n_keep=5)
    try:
        assert next(iter(single.models.values())).pipeline.scheduler.max_seqs == 1
        assert [await _long(single, p) for p in PROMPTS[:2]] == alone[:2]
    finally:
        await single.unload()
