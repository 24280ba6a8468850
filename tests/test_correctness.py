"""Correctness of what a response says on the default chat model (real adapter): every token a
response counts has its text in the response (stopped by length, stop strings, n > 1, streamed or
not); a position's logits do not depend on the cached prefix or the prefill chunking (cold and
warm caches, chunk sizes, f32 and f16); padded vocabularies; pipelines compiled at load; the
low-level forward_tokens_and_sample; extra_body fields reaching the pipeline.
"""
from __future__ import annotations

import pytest

from webgpu_engine import errors as E
from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.engine import DEFAULT_CHAT_MODEL as LLM_ID
from webgpu_engine.engine import DEFAULT_EMBED_MODEL as EMB_ID
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, create_mlc_engine
from webgpu_engine.pipelines.llm import LLMChatPipeline

pytestmark = pytest.mark.slow

# a faster load (no warm-up run of every pipeline) where a test asserts nothing on compiling:
# test_no_shader_compiles_after_load checks compile_at_load itself
FAST = {"compile_at_load": False}

PROMPTS = [   # even indices go through chat (non-ASCII there: its logprobs carry each token's bytes)
    "¿Dónde está la biblioteca?", "The capital of France is", "Translate 'good morning': おはよう means",
    "Count to ten", "Emoji time 😀👍🏽 — describe them", "Write a haiku about rain.",
    "中文：你好，世界。Answer in English:", "Name a fruit.", "Café, naïve, façade: these words are",
    "List three colours:", "What is 2 + 2?", "Tell me a joke about cats.", "Say hi",
    "Explain gravity in one sentence.", "Write the word 'done' five times.", "Once upon a time",
    "A short poem about the sea:", "What colour is the sky?", "Give me a number between 1 and 9.",
    "Finish this: the quick brown fox",
]


@pytest.fixture(scope="module")
async def engine(device, smollm2_gguf):
    eng = await create_mlc_engine(LLM_ID, EngineConfig(device=device), FAST)
    yield eng
    await eng.unload()


def _counted_text(entries) -> str:
    """The text of the tokens a response counts: their bytes joined, then decoded (a character split
    across tokens decodes whole)."""
    return bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace")


def _expected(entries, stop, finish, eos) -> tuple[str, int]:
    """The text a choice must show: its listed tokens' text (a final end-of-sequence token is counted
    in usage but neither shown nor listed, as OpenAI does), cut where a stop string starts; and the
    tokens usage counts for it."""
    assert not any(bytes(e.bytes) in eos for e in entries)
    text = _counted_text(entries)
    cut = [text.index(s) for s in stop or [] if s in text]
    return (text[:min(cut)] if cut else text), len(entries) + (finish == "stop" and not cut)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
async def test_text_holds_every_counted_token(engine, i):
    """Each prompt takes a different max_tokens (1..12), chat or completions, n 1 or 3, with or without
    a stop string; the non-streamed text of each choice is the text of the tokens it counts, and the
    streamed deltas (n = 1, the same seed) add up to the non-streamed text of choice 0."""
    max_tokens, chat, n = i % 12 + 1, i % 2 == 0, 3 if i // 2 % 2 else 1
    stop = ["."] if i % 5 == 4 else None
    kw = dict(model=LLM_ID, max_tokens=max_tokens, temperature=0.8, seed=100 + i, logprobs=True, stop=stop)
    if chat:
        create, kw["messages"] = engine.chat.completions.create, [{"role": "user", "content": PROMPTS[i]}]
    else:
        create, kw["prompt"] = engine.completions.create, PROMPTS[i]
    r = await create(n=n, **kw)
    assert len(r.choices) == n
    pipe = engine.models[LLM_ID].pipeline
    eos = {pipe.tokenizer.token_bytes(t) for t in pipe.eos_ids}
    counted = 0
    for c in r.choices:
        if chat:
            text, entries = c.message.content, c.logprobs.content
        else:
            text, entries = c.text, [_LegacyEntry(t, b) for t, b in zip(c.logprobs.tokens, _bytes_of(c))]
        want, n_counted = _expected(entries, stop, c.finish_reason, eos)
        counted += n_counted
        assert text == want, (c.finish_reason, text)
        if c.finish_reason == "length":
            assert len(entries) == max_tokens
    assert r.usage.completion_tokens == counted
    s = await create(stream=True, **kw)
    deltas, finish = [], None
    async for ch in s:
        if ch.choices:
            deltas.append((ch.choices[0].delta.content or "") if chat else ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
    first = r.choices[0]
    assert "".join(deltas) == (first.message.content if chat else first.text)
    assert finish == first.finish_reason


class _LegacyEntry:
    def __init__(self, token, raw):
        self.token, self.bytes = token, raw


def _bytes_of(choice) -> list:
    """Completions' legacy logprobs carry token strings only: their bytes through the tokenizer are
    what the chat entries carry; here the strings, which equal them for ASCII and whole characters."""
    return [list(t.encode("utf-8")) for t in choice.logprobs.tokens]


async def test_max_tokens_keeps_the_last_token(engine):
    """The report's cases: ' Paris.' for [' Paris', '.', '\\n'] and 'One two' for ['One', ' two', ' is']."""
    for max_tokens in (1, 2, 3, 5):
        r = await engine.completions.create(model=LLM_ID, prompt="The capital of France is",
                                            max_tokens=max_tokens, temperature=0, logprobs=True)
        c = r.choices[0]
        assert c.finish_reason == "length" and len(c.logprobs.tokens) == max_tokens
        assert c.text == "".join(c.logprobs.tokens)
        r = await engine.chat.completions.create(model=LLM_ID, max_tokens=max_tokens, temperature=0,
                                                 logprobs=True,
                                                 messages=[{"role": "user", "content": "Count to ten"}])
        c = r.choices[0]
        assert c.message.content == _counted_text(c.logprobs.content) and r.usage.completion_tokens == max_tokens


async def test_latency_breakdown_and_enable_thinking_reach_the_pipeline(engine):
    r = await engine.chat.completions.create(model=LLM_ID, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0, ignore_eos=True,
                                             extra_body={"enable_latency_breakdown": True})
    lb = r.usage.extra.latency_breakdown
    assert len(lb["total_time"]) == r.usage.completion_tokens == 4       # the prefill step + 3 decodes
    assert all(t > 0 for t in lb["total_time"]) and lb["logit_processor_time"] == [0.0] * 4
    r = await engine.chat.completions.create(model=LLM_ID, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=1, temperature=0)
    assert getattr(r.usage.extra, "latency_breakdown", None) is None
    # enable_thinking goes to the template's render, as transformers passes it
    from webgpu_engine.loaders.chat_template import ChatTemplate
    pipe = engine.models[LLM_ID].pipeline
    saved = pipe.template
    pipe.template = ChatTemplate("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                 "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
                                 "{% if enable_thinking is defined and not enable_thinking %}"
                                 "<think>\n\n</think>\n\n{% endif %}")
    try:
        sizes = {}
        for flag in (None, True, False):
            await pipe.prefill_step([{"role": "user", "content": "Hi"}],
                                    GenerationConfig(temperature=0, max_tokens=1, enable_thinking=flag))
            sizes[flag] = pipe.usage()["prompt_tokens"]
        assert sizes[None] == sizes[True] < sizes[False]
    finally:
        pipe.template = saved
        pipe.reset_chat()


async def test_forward_tokens_and_sample_appends_and_counts(engine):
    """WebLLM's forwardTokensAndSample: is_prefill only picks the statistics; the cache is kept."""
    pipe = engine.models[LLM_ID].pipeline
    await engine.reset_chat(model=LLM_ID)
    ids = pipe.tokenizer.encode("The capital of France is", add_special_tokens=True)
    t1 = await engine.forward_tokens_and_sample(ids[:3], True, model=LLM_ID)
    t2 = await engine.forward_tokens_and_sample(ids[3:], True, model=LLM_ID)    # continues, no reset
    assert pipe.kv_ids == ids and 0 <= t1 < pipe.vocab_size
    t3 = await engine.forward_tokens_and_sample([t2], False, model=LLM_ID)
    assert pipe.kv_ids == ids + [t2]
    assert pipe.stats.prefill_tokens == len(ids) and pipe.stats.decode_tokens == 1
    assert (await engine.runtime_stats_text(LLM_ID)).startswith("prefill: ")
    # greedy, the same tokens as the prompt computed in one go
    await engine.reset_chat(model=LLM_ID)
    g = GenerationConfig(temperature=0)
    t2 = await pipe.forward_tokens_and_sample(ids[:3], True, g)
    t2 = await pipe.forward_tokens_and_sample(ids[3:], True, g)
    t3 = await pipe.forward_tokens_and_sample([t2], False, g)
    r = await engine.completions.create(model=LLM_ID, prompt="The capital of France is", max_tokens=2,
                                        temperature=0, logprobs=True)
    assert r.choices[0].logprobs.tokens == [pipe.tokenizer.token_bytes(t).decode() for t in (t2, t3)]
    with pytest.raises(E.InvalidRequestError, match="outside"):
        await engine.forward_tokens_and_sample([10 ** 9], False, model=LLM_ID)
    await engine.reset_chat(model=LLM_ID)


async def test_padded_vocabulary_ids_are_never_sampled(device, tmp_path):
    """A tiny model whose LM head has 40 rows past its tokenizer, scaled so they win the argmax: the
    sampler never gives one (greedy, sampled, logprobs) and nothing fails."""
    from tinymodels import write_tiny_llama_gguf
    info = write_tiny_llama_gguf(tmp_path / "padded.gguf", pad_rows=40)
    n_tok = len(info["tokens"])
    pipe = await LLMChatPipeline.load(device, info["path"], ChatConfig(dtype="f32", context_window_size=128))
    try:
        assert pipe.model_config.vocab_size == n_tok + 40 and pipe.vocab_size == n_tok
        msgs = [{"role": "user", "content": "Hello world"}]
        await pipe.prefill_step(msgs, GenerationConfig(temperature=0, max_tokens=1))
        lg = pipe.scheduler.fwd.logits_row(0)      # the prompt's last row, every row of the LM head
        import numpy as np
        raw = np.frombuffer(await device.read(lg.buf, lg.offset, lg.nbytes), np.float32)
        assert raw.argmax() >= n_tok          # unmasked, a padding row would win
        for gen in (GenerationConfig(temperature=0, max_tokens=12, ignore_eos=True),
                    GenerationConfig(temperature=1.5, seed=3, max_tokens=12, ignore_eos=True, logprobs=True,
                                     top_logprobs=5),
                    GenerationConfig(temperature=1.0, top_p=0.5, seed=4, max_tokens=12, ignore_eos=True)):
            pipe.reset_chat()
            await pipe.prefill_step(msgs, gen)
            while not pipe.stopped:
                await pipe.decode_step()
            assert len(pipe.output_ids) == 12 and max(pipe.output_ids) < n_tok
            for e in pipe.token_logprobs:
                assert all(isinstance(t["token"], str) for t in e["top_logprobs"])
            assert isinstance(pipe.get_message(), str)
        # the detokenizer gives no text for an id it cannot decode instead of raising
        from webgpu_engine.pipelines.detokenizer import StreamDetokenizer
        d = StreamDetokenizer(pipe.tokenizer.token_bytes)
        d.add(n_tok + 5)
        assert d.finish() == ""
    finally:
        pipe.dispose()


async def test_no_shader_compiles_after_load(fresh_device, smollm2_gguf, minilm_dir):
    """On a device with no pipelines yet, reload() compiles every pipeline its models use ("Loading
    GPU shader modules" in the progress): the first requests, whatever their length, compile none."""
    reports = []
    eng = await create_mlc_engine([LLM_ID, EMB_ID], EngineConfig(device=fresh_device,
                                                                 init_progress_callback=reports.append),
                                  [{"prefill_chunk_size": 32}, None])
    try:
        assert any("Loading GPU shader modules" in r["text"] for r in reports)
        loaded = fresh_device.compile_count
        long_prompt = " ".join(PROMPTS[:6])                      # several prefill chunks
        for prompt in ("Hi", "Name a fruit.", long_prompt):
            await eng.completions.create(model=LLM_ID, prompt=prompt, max_tokens=2, temperature=0)
        await eng.chat.completions.create(model=LLM_ID, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0.7, seed=1, logprobs=True, top_logprobs=2)
        await eng.embeddings.create(model=EMB_ID, input=["a", "a longer sentence " * 20, "b", "c", "d"])
        assert fresh_device.compile_count == loaded
    finally:
        await eng.unload()


async def test_same_text_on_cold_and_warm_caches_and_any_chunking(device, smollm2_gguf):
    """The report's case (seed 7, temperature 1, n 2, "Name a fruit.") and a greedy request with
    prefill_chunk_size 16, 64 and the default, in f32 and f16, and sent again with the default chunk
    (a warm KV prefix: only the last prompt position is computed, one row, whatever the chunk size):
    the same tokens and the same logprobs every time."""
    eng = AsyncMLCEngine(EngineConfig(device=device))      # each case below loads the model itself
    system = ("You are a helpful assistant who answers in one short sentence. " * 4).strip()
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    try:
        with pytest.raises(E.UnsupportedChatOptionError, match="sliding_window_size"):
            await eng.reload(LLM_ID, {"sliding_window_size": 1024, **FAST})
        for dtype in ("f32", "f16"):
            seen = {}
            for chunk in (16, 64, None):
                opts = {"dtype": dtype, **({"prefill_chunk_size": chunk} if chunk else {}), **FAST}
                await eng.reload(LLM_ID, opts)
                for rep in ("cold", "warm") if chunk is None else ("cold",):   # warm: one row, any chunk
                    seeded = await eng.chat.completions.create(
                        model=LLM_ID, messages=msgs, seed=7, temperature=1.0, n=2, max_tokens=6, logprobs=True)
                    greedy = await eng.chat.completions.create(
                        model=LLM_ID, messages=msgs, temperature=0, max_tokens=6, logprobs=True)
                    out = [(c.message.content, [e.logprob for e in c.logprobs.content])
                           for c in seeded.choices + greedy.choices]
                    seen[(chunk, rep)] = out
                    assert seeded.usage.prompt_tokens > 64            # several chunks of 16, two of 64
            first = next(iter(seen.values()))
            for key, out in seen.items():
                assert out == first, (dtype, key)
    finally:
        await eng.unload()
