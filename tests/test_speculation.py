"""Speculative decoding by prompt lookup (pipelines/speculation.py) on the real adapter: greedy answers
equal one-token-per-forward decoding through the same row-invariant kernels, for several prompts and
k (a tiny Llama, a tiny Qwen 3 with q/k norms, SmolLM2 on a RAG-style prompt); guesses are accepted
(the path is exercised) and rejected ones leave no trace in the KV cache (the next request reuses the
cache as its prefix); stop strings, max_tokens and logprobs behave as without guesses; the engine
reports the figures in usage.extra and decodes other requests as before."""
from __future__ import annotations

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.errors import ChatOptionTypeError
from webgpu_engine.pipelines.llm import LLMChatPipeline
from webgpu_engine.pipelines.speculation import Speculation, propose

REPEAT = "Hello world! The quick brown fox jumps over the lazy dog. "
PROMPTS = [REPEAT * 3, "user assistant system " * 4 + "Hello"]


def test_propose_takes_the_latest_longest_match():
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose(ctx, 3, n=3) == [7, 8, 5]            # the latest earlier [1, 2, 3]
    assert propose(ctx, 1, n=3) == [7]
    assert propose([5, 6, 7], 4, n=2) == []              # no earlier occurrence
    assert propose([4, 1, 2, 4], 2, n=3) == [1, 2]       # falls back to the 1-gram [4]
    assert propose([4, 1, 2, 4], 2, n=3, n_min=2) == []
    assert propose([1, 1, 1, 1], 5, n=2) == [1]          # what followed stops at the end of the context
    assert propose([1, 2], 0, n=2) == []


@pytest.mark.parametrize("opt", [{"method": "draft"}, {"k": 0}, {"k": 17}, {"n": True}, {"x": 1},
                                 {"n": 2, "n_min": 3}, 5, "lookahead"])
def test_bad_speculation_options_are_refused_by_name(opt):
    with pytest.raises(ChatOptionTypeError) as e:
        Speculation.parse(opt)
    assert e.value.param == "speculation"


def test_speculation_option_forms():
    assert Speculation.parse(None) is None
    assert Speculation.parse("ngram") == Speculation()
    assert Speculation.parse({"k": 6, "n": 2}).describe() == {"method": "ngram", "k": 6, "n": 2, "n_min": 1}


async def _reference(pipe, messages, n: int) -> list[int]:
    """n greedy tokens, one forward each through the prefill's kernels (no guesses)."""
    gen = GenerationConfig(temperature=0.0)
    pipe.reset_chat(keep_stats=True)
    out = [await pipe.forward_tokens_and_sample(pipe.prompt_ids(messages, None), True, gen)]
    while len(out) < n:
        out.append(await pipe.forward_tokens_and_sample([out[-1]], False, gen))
    pipe.reset_chat(keep_stats=True)
    return out


async def _generate(pipe, messages, **gen):
    await pipe.prefill_step(messages, GenerationConfig(temperature=0.0, **gen))
    while not pipe.stopped:
        await pipe.decode_step()
    return list(pipe.output_ids)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, device, tmp_path_factory):
    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("spec") / "m.gguf", arch=request.param,
                                 qtype="q8_0", context_length=512)["path"]
    return path


async def test_greedy_answers_equal_one_token_per_forward(device, tiny):
    pipe = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=512, compile_at_load=False,
                                                               prefill_chunk_size=64))
    accepted = 0
    try:
        for p in PROMPTS:
            msgs = [{"role": "user", "content": p}]
            ref = await _reference(pipe, msgs, 32)
            for k in (1, 3, 6):
                pipe.speculation = Speculation(k=k, n=3)
                got = await _generate(pipe, msgs, max_tokens=32, ignore_eos=True)
                assert got == ref, (p[:20], k)
                st = pipe._req.spec
                assert st.steps + st.accepted == 31 and st.accepted <= st.proposed
                accepted += st.accepted
                # the KV cache holds exactly prompt + answer less the last token: a follow-up request
                # reuses it as its prefix and answers as from a cold cache
                assert len(pipe.kv_ids) == len(pipe.prompt_ids(msgs, None)) + 31
            pipe.speculation = None
    finally:
        pipe.dispose()
    assert accepted > 0                      # guesses were taken, not only rejected


async def test_stop_strings_max_tokens_and_logprobs(device, tiny):
    pipe = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=512, compile_at_load=False,
                                                               speculation={"k": 5}))
    try:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        ref = await _reference(pipe, msgs, 30)
        for n in (1, 2, 7, 13):             # max_tokens inside, at and past a verify step's guesses
            assert await _generate(pipe, msgs, max_tokens=n, ignore_eos=True) == ref[:n]
            assert pipe.finish_reason == "length"
        text = pipe.tokenizer.decode(ref[:30])
        stop = text[len(text) // 2:len(text) // 2 + 3]
        got = await _generate(pipe, msgs, max_tokens=30, ignore_eos=True, stop=[stop])
        assert got == ref[:len(got)] and pipe.finish_reason == "stop" and stop not in pipe.get_message()
        # logprobs: the same entries as one-guess speculation gives (both check every token alike)
        await _generate(pipe, msgs, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
        many = list(pipe.token_logprobs)
        pipe.speculation = Speculation(k=1)
        await _generate(pipe, msgs, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
        assert pipe.token_logprobs == many and len(many) == 12
    finally:
        pipe.dispose()


async def test_smollm2_rag_prompt(device, smollm2_gguf):
    """The default model quoting a passage: the guesses are mostly right, the answer is the same."""
    passage = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is named "
               "after the engineer Gustave Eiffel, whose company designed and built the tower.")
    msgs = [{"role": "user", "content": passage + "\nRepeat the first sentence word for word."}]
    pipe = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(context_window_size=512,
                                                                       compile_at_load=False,
                                                                       speculation={"k": 6}))
    try:
        ref = await _reference(pipe, msgs, 20)
        got = await _generate(pipe, msgs, max_tokens=20, ignore_eos=True)
        assert got == ref
        st = pipe._req.spec
        assert st.accepted >= 8 and st.steps <= 12, st
    finally:
        pipe.dispose()


async def test_engine_reports_speculation_and_decodes_other_requests_as_before(device, tiny):
    from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
    app = default_app_config().with_records(ModelRecord("tiny-spec", str(tiny), "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny-spec", {"compile_at_load": False, "speculation": {"method": "ngram", "k": 4}})
    try:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        r = await eng.chat.completions.create(messages=msgs, max_tokens=16, temperature=0, ignore_eos=True)
        ex = r.usage.extra.model_dump()
        assert ex["speculation_steps"] >= 1 and ex["speculation_proposed_tokens"] >= ex["speculation_accepted_tokens"]
        assert ex["speculation_steps"] + ex["speculation_accepted_tokens"] == 15
        s = await eng.chat.completions.create(messages=msgs, max_tokens=4, temperature=0.8, seed=1)
        assert "speculation_steps" not in s.usage.extra.model_dump()    # sampled: decoded as before
        with pytest.raises(ChatOptionTypeError):
            await eng.reload("tiny-spec", {"compile_at_load": False, "speculation": {"method": "draft"}})
    finally:
        await eng.unload()
