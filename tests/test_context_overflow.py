"""context_overflow: a conversation longer than the context window is a 400 naming the limit
("error", the default) or loses its oldest turns after the system prompt until it fits ("truncate",
reported in usage.extra), on the one-request path and in the batch scheduler; the system prompt and
the latest turn are always kept. A tiny chat model with a 96-token window on the real adapter."""
from __future__ import annotations

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
from webgpu_engine.errors import ChatOptionTypeError, ContextWindowTooLargeError

SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [m for i in range(6) for m in ({"role": "user", "content": f"Question {i}: the quick brown fox?"},
                                       {"role": "assistant", "content": f"Answer {i}: the lazy dog."})]
LAST = {"role": "user", "content": "And the last one?"}


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
            await eng.reload("tiny", {"compile_at_load": False, "context_overflow": "shift"})
    finally:
        await eng.unload()
