"""Engine tests on the real default models and the real adapter: the OpenAI behaviours of
chat.completions / completions / embeddings (streaming, n, seeds, stop, max_tokens, logprobs,
logit_bias, ignore_eos, echo/suffix, usage) and the LLM + embedder sharing one engine.

Generations are kept to a few tokens: the CI adapter is a software rasterizer.
"""
from __future__ import annotations

import asyncio

import pytest

from webgpu_engine.engine import DEFAULT_CHAT_MODEL as LLM_ID
from webgpu_engine.engine import DEFAULT_EMBED_MODEL as EMB_ID
from webgpu_engine.engine import EngineConfig, create_mlc_engine

pytestmark = pytest.mark.slow

Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
async def engine(device, smollm2_gguf, minilm_dir):
    reports = []
    eng = await create_mlc_engine([LLM_ID, EMB_ID], EngineConfig(device=device,
                                                                 init_progress_callback=reports.append))
    assert reports[-1]["text"] == f"Finish loading on WebGPU - {device.info.name}"
    assert reports[-1]["progress"] == 1.0
    yield eng
    await eng.unload()
    assert device.allocated_bytes(f"model:{LLM_ID}") == 0
    assert device.allocated_bytes(f"model:{EMB_ID}") == 0


async def chat(engine, messages=Q, **kw):
    kw.setdefault("max_tokens", 8)
    return await engine.chat.completions.create(model=LLM_ID, messages=messages, **kw)


@pytest.fixture(scope="module")
async def greedy(engine):
    """The greedy 8-token answer to Q, with logprobs (the reference for several tests)."""
    return await chat(engine, temperature=0, logprobs=True, top_logprobs=3)


def _pipe(engine):
    return engine.models[LLM_ID].pipeline


async def test_chat_non_streaming_and_usage_counts(engine, greedy):
    c = greedy.choices[0]
    assert c.message.content.strip() and c.finish_reason in ("stop", "length")
    pipe = _pipe(engine)
    prompt_ids = pipe.tokenizer.encode(pipe.template.render(Q, add_generation_prompt=True))
    assert greedy.usage.prompt_tokens == len(prompt_ids)
    # the end-of-turn token is counted, never listed (its text is not in the content)
    assert greedy.usage.completion_tokens == len(c.logprobs.content) + (c.finish_reason == "stop") <= 8
    eot = {pipe.tokenizer.token_bytes(t) for t in pipe.eos_ids}
    assert not any(bytes(e.bytes) in eot for e in c.logprobs.content)
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + greedy.usage.completion_tokens
    ex = greedy.usage.extra
    assert ex.e2e_latency_s > 0 and ex.time_to_first_token_s > 0 and ex.decode_tokens_per_s > 0
    assert "Paris" in c.message.content


async def test_streaming_equals_non_streaming(engine, greedy):
    s = await chat(engine, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = [ch async for ch in s]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == greedy.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == greedy.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens


async def test_max_tokens_gives_length(engine):
    r = await chat(engine, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


async def test_n_choices_and_seeds(engine):
    r1 = await chat(engine, n=3, temperature=1.0, seed=1234, max_tokens=6, logprobs=True)
    assert [c.index for c in r1.choices] == [0, 1, 2]
    assert len({c.message.content for c in r1.choices}) > 1      # one seed, distinct choices
    assert r1.usage.completion_tokens == sum(len(c.logprobs.content) + (c.finish_reason == "stop")
                                             for c in r1.choices)
    r2 = await chat(engine, n=3, temperature=1.0, seed=1234, max_tokens=6)
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    r3 = await chat(engine, temperature=1.0, seed=98765, max_tokens=6)
    assert r3.choices[0].message.content != r1.choices[0].message.content


async def test_stop_string(engine, greedy):
    text = greedy.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    r = await chat(engine, temperature=0, stop=[stop])
    out = r.choices[0].message.content
    assert stop not in out and r.choices[0].finish_reason == "stop"
    assert text.startswith(out) and len(out) < len(text)


async def test_logprobs_consistent(engine, greedy):
    for e in greedy.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        # greedy: the chosen token is the most likely one, with the same logprob
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    r = await chat(engine, temperature=1.0, seed=7, logprobs=True, top_logprobs=5, max_tokens=4)
    for e in r.choices[0].logprobs.content:
        same = [t for t in e.top_logprobs if t.token == e.token]
        if same:
            assert same[0].logprob == pytest.approx(e.logprob, abs=1e-4)


async def test_logit_bias_changes_greedy_output(engine, greedy):
    first = greedy.choices[0].logprobs.content[0]
    tid = _pipe(engine).tokenizer.encode(first.token)
    assert len(tid) == 1
    r = await chat(engine, temperature=0, max_tokens=3, logit_bias={str(tid[0]): -100}, logprobs=True)
    assert r.choices[0].logprobs.content[0].token != first.token


async def test_ignore_eos_generates_exactly_max_tokens(engine):
    msgs = [{"role": "user", "content": "Reply with the single word: yes"}]
    r = await chat(engine, messages=msgs, temperature=0, max_tokens=12)
    r2 = await chat(engine, messages=msgs, temperature=0, max_tokens=12, ignore_eos=True)
    assert r2.usage.completion_tokens == 12 and r2.choices[0].finish_reason == "length"
    assert r2.usage.completion_tokens >= r.usage.completion_tokens


async def test_completions_echo_suffix_and_usage(engine):
    prompt = "The three primary colors are"
    r = await engine.completions.create(model=LLM_ID, prompt=prompt, max_tokens=5, temperature=0,
                                        echo=True, suffix=" [end]")
    text = r.choices[0].text
    assert r.object == "text_completion" and text.startswith(prompt) and text.endswith(" [end]")
    assert len(text) > len(prompt) + len(" [end]")
    pipe = _pipe(engine)
    assert r.usage.prompt_tokens == len(pipe.tokenizer.encode(prompt, add_special_tokens=True))
    assert r.usage.completion_tokens == 5
    s = await engine.completions.create(model=LLM_ID, prompt=prompt, max_tokens=5, temperature=0, stream=True)
    streamed = "".join([ch.choices[0].text async for ch in s if ch.choices])
    assert prompt + streamed + " [end]" == text


async def test_multi_round_chat_reuses_the_kv_cache(engine):
    r = await chat(engine, temperature=0, max_tokens=4)
    msgs = Q + [{"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    r2 = await chat(engine, messages=msgs, temperature=0, max_tokens=4)
    pipe = _pipe(engine)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert pipe._req.prefill_tokens < r2.usage.prompt_tokens   # only the new turn was computed


async def test_embeddings(engine):
    r = await engine.embeddings.create(model=EMB_ID, input=["The cat sits on the mat.", "A feline rests on a rug.",
                                                            "Stock markets fell sharply today."])
    v = [d.embedding for d in r.data]
    assert len(v) == 3 and len(v[0]) == 384
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731 - vectors are L2-normalised
    assert dot(v[0], v[0]) == pytest.approx(1.0, abs=1e-3)
    assert dot(v[0], v[1]) > dot(v[0], v[2]) + 0.2
    ids = engine.models[EMB_ID].pipeline.tokenize(["The cat sits on the mat."])[0]
    r2 = await engine.embeddings.create(model=EMB_ID, input=ids)
    assert r2.usage.prompt_tokens == len(ids)
    assert dot(r2.data[0].embedding, v[0]) == pytest.approx(1.0, abs=1e-3)


async def test_fifo_chats_with_embeddings_in_between(engine):
    prompts = [[{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "Name a color."}]]
    refs = [(await chat(engine, messages=p, temperature=0, max_tokens=4)).choices[0].message.content
            for p in prompts]
    assert refs[0] != refs[1]
    done = []

    async def one_chat(i):
        r = await chat(engine, messages=prompts[i % 2], temperature=0, max_tokens=4)
        done.append(f"chat{i}")
        return r.choices[0].message.content

    async def one_emb(i):
        r = await engine.embeddings.create(model=EMB_ID, input=f"passage number {i}")
        done.append(f"emb{i}")
        return r
    tasks = []
    for i in range(8):
        tasks.append(asyncio.create_task(one_chat(i)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.2)
    embs = [asyncio.create_task(one_emb(i)) for i in range(2)]
    outs = await asyncio.gather(*tasks)
    await asyncio.gather(*embs)
    assert outs == [refs[i % 2] for i in range(8)]           # correct and uninterleaved
    assert [d for d in done if d.startswith("chat")] == [f"chat{i}" for i in range(8)]
    assert max(done.index("emb0"), done.index("emb1")) < done.index("chat7")


async def test_forward_tokens_and_sample_and_stats(engine):
    pipe = _pipe(engine)
    ids = pipe.tokenizer.encode("The capital of France is")
    t = await engine.forward_tokens_and_sample(ids, True, model=LLM_ID)
    assert 0 <= t < pipe.model_config.vocab_size
    assert (await engine.runtime_stats_text(LLM_ID)).startswith("prefill: ")
    await engine.reset_chat(model=LLM_ID)
    assert await engine.get_message(LLM_ID) == ""


async def test_device_loss_on_the_real_adapter(fresh_device, minilm_dir):
    from webgpu_engine import errors as E
    for auto in (False, True):
        dev = fresh_device if not auto else None
        eng = await create_mlc_engine(EMB_ID, EngineConfig(device=dev, auto_recover=auto))
        first = eng.device
        assert len((await eng.embeddings.create(input="hello")).data) == 1
        first.destroy()                                  # what a driver reset does
        with pytest.raises(E.DeviceLostError):
            await eng.embeddings.create(input="hello")
        assert eng.models == {} and eng.state == "device_lost"
        assert eng.device_lost_reason is not None
        if not auto:
            with pytest.raises(E.ModelNotLoadedError):
                await eng.embeddings.create(input="hello")
        else:                                            # reloaded on a new device from the cache
            r = await eng.embeddings.create(input="hello")
            assert len(r.data[0].embedding) == 384 and eng.device is not first and not eng.device.lost
            await eng.unload()
            eng.device.close()


async def test_close_closes_only_the_device_the_engine_requested(device, minilm_dir):
    """close() unloads, then closes the device the engine requested itself (its compiled pipelines
    and buffers go; a later reload requests a new one); a device given in EngineConfig stays open."""
    fast = {"compile_at_load": False}
    eng = await create_mlc_engine(EMB_ID, EngineConfig(), fast)
    own = eng.device
    assert len((await eng.embeddings.create(input="hello")).data) == 1 and own.compile_count > 0
    await eng.close()
    assert eng.models == {} and eng.device is None
    assert own.allocations() == {} and own.forget_pipelines() == 0 and not own.lost
    await eng.reload(EMB_ID, fast)
    assert eng.device is not own and len((await eng.embeddings.create(input="hello")).data) == 1
    await eng.close()
    eng = await create_mlc_engine(EMB_ID, EngineConfig(device=device), fast)
    await eng.close()
    assert eng.device is device and not device.lost
    await eng.reload(EMB_ID, fast)                  # the given device still serves
    try:
        assert eng.device is device and len((await eng.embeddings.create(input="hello")).data) == 1
    finally:
        await eng.close()
