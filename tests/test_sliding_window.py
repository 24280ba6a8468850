"""WebLLM's sliding window with attention sinks (context_window_size -1, sliding_window_size W,
attention_sink_size S) as a ring cache: a tiny decoder against the numpy reference model run as MLC
runs that mode (the query at pos sees positions < S, scored with the query rotated at min(pos, W), and
the W - S positions before it), past the cache's end in prefill and decode, with adjacent and neox
RoPE; and through the engine: a conversation of 3x the window, a generation 400 tokens past it, a
warm turn that equals a cold one, what /v1/models reports, and the typed errors."""
from __future__ import annotations

import numpy as np
import pytest

from decoder_runner import DecoderRunner
from ref_llama import RefLlama, weights_from_infos
from tinymodels import write_tiny_llama_gguf
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
from webgpu_engine.errors import ChatOptionTypeError, UnsupportedChatOptionError
from webgpu_engine.kernels.common import Ring
from webgpu_engine.loaders.gguf import GGUFFile

SYSTEM = {"role": "system", "content": "You are terse."}
LAST = {"role": "user", "content": "And the last one?"}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ring_model_matches_the_reference(device, tmp_path, arch):
    """300 positions through a ring of W = 64 (S = 4) and 32 rows (the paged pool of one sequence, as
    a load with those options plans it): prefill forwards ending at 100, 200 and 290, then decode
    steps; every kept row's logits against RefLlama with the ring, which differs from plain causal
    attention there."""
    info = write_tiny_llama_gguf(tmp_path / "m.gguf", arch=arch, seed=3, context_length=512)
    f = GGUFFile(info["path"])
    try:
        cfg, infos = f.model_config(), f.weights()
        ids = [int(i) for i in np.random.default_rng(8).integers(3, cfg.vocab_size, 300)]
        r = DecoderRunner(device, cfg, infos, owner="test:ring", ring=Ring(4, 64), chunk=32)
        try:
            assert r.model.ctx == 96
            got = r.prefill(ids, [100, 200, 290])
            for pos in range(290, 299):
                got[pos] = r.decode(ids[pos], pos)
        finally:
            r.release()
        weights = weights_from_infos(infos)
        want = RefLlama(cfg, weights, np.float64, ring=(4, 64)).forward(ids)
        rows = sorted(got)
        np.testing.assert_allclose(np.array([got[p] for p in rows]), want[rows], atol=2e-3, rtol=0)
        plain = RefLlama(cfg, weights, np.float64).forward(ids)
        assert np.abs(plain[rows] - want[rows]).max() > 50 * 2e-3
    finally:
        f.close()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A tiny model with 32-dim heads (one block of a q8_0 cache)."""
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("ring") / "m.gguf", qtype="q8_0",
                                     context_length=512, n_heads=2, n_kv_heads=1)["path"])


async def _engine(device, path, **opts):
    app = default_app_config().with_records(ModelRecord("tiny", path, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny", {"compile_at_load": False, **opts})
    return eng


def _conversation(turns: int) -> list[dict]:
    return [SYSTEM] + [m for i in range(turns) for m in (
        {"role": "user", "content": f"Question {i}: the quick brown fox jumps?"},
        {"role": "assistant", "content": f"Answer {i}: over the lazy dog."})] + [LAST]


async def _cold(device, path, opts, messages, **kw):
    eng = await _engine(device, path, **opts)
    try:
        return await eng.chat.completions.create(messages=messages, temperature=0, logprobs=True, **kw)
    finally:
        await eng.unload()


def _same(a, b) -> None:
    assert a.choices[0].message.content == b.choices[0].message.content
    assert [t.logprob for t in a.choices[0].logprobs.content] == [t.logprob for t in b.choices[0].logprobs.content]


async def test_a_ring_runs_conversations_and_generations_past_the_window(device, path, kv="auto"):
    """W = 256, S = 4: a conversation of over 3x the window answers whole (nothing truncated), a
    generation runs 400 tokens past the window, the cache is the window plus one prefill chunk; after
    the ring went round, a prompt is computed again from its start (the ring no longer holds the
    window before the rows it shares) and so is a follow-up turn (the pool shares no ring's rows):
    both answer, bit for bit, as a cold engine does."""
    opts = dict(context_window_size=-1, sliding_window_size=256, attention_sink_size=4, prefill_chunk_size=64,
                kv_cache_dtype=kv)
    conv = _conversation(24)
    eng = await _engine(device, path, **opts)
    try:
        pipe = eng.models["tiny"].pipeline
        assert pipe.model.ring == Ring(4, 256) and pipe.model.ctx == 256 + 64
        # /v1/models: the cache's rows, what they hold, the window
        info = eng.models["tiny"].describe(device)
        c = pipe.model.cfg
        assert info["context_window"] == 320 and info["sliding_window"] == {"sliding_window_size": 256,
                                                                            "attention_sink_size": 4}
        pool = pipe.scheduler.fwd.pools            # a lone sequence's ring of 320 rows and a block
        assert info["memory"]["kv_cache_bytes"] == sum(t.nbytes for kv in pool for t in kv) \
            == (320 + 16) * pipe.plan.kv_bytes_per_token(c)
        keeps = []                                 # the prompt rows each request takes from the cache

        def kept():
            keeps.append(pipe._req.prompt_tokens - pipe._req.prefill_tokens)
        r = await eng.chat.completions.create(messages=conv, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens > 3 * 256 and "truncated_messages" not in r.usage.extra.model_dump()
        kept()
        r = await eng.chat.completions.create(messages=[LAST], max_tokens=656, temperature=0, ignore_eos=True)
        assert r.usage.completion_tokens == 656 and r.choices[0].finish_reason == "length"
        kept()
        first = await eng.chat.completions.create(messages=conv, max_tokens=6, temperature=0, logprobs=True)
        kept()
        follow = conv + [{"role": "assistant", "content": first.choices[0].message.content}, LAST]
        warm = await eng.chat.completions.create(messages=follow, max_tokens=12, temperature=0, logprobs=True)
        kept()
        assert keeps == [0, 0, 0, 0], keeps       # a ring's rows are computed again for every request
    finally:
        await eng.unload()
    _same(first, await _cold(device, path, opts, conv, max_tokens=6))
    _same(warm, await _cold(device, path, opts, follow, max_tokens=12))


async def test_steps_ahead_of_the_host_give_the_same_answer_past_the_window(device, path):
    """decode_ahead (steps submitted before the last token is read) through the ring: the same
    tokens and logprobs as the serial loop, 300 tokens past a window of 64."""
    opts = dict(context_window_size=-1, sliding_window_size=64, attention_sink_size=2, prefill_chunk_size=16)
    got = []
    for ahead in (False, True):
        got.append(await _cold(device, path, {**opts, "decode_ahead": ahead}, [LAST], max_tokens=300,
                               ignore_eos=True))
    assert got[0].usage.completion_tokens == 300
    _same(*got)


async def test_bad_sliding_windows_are_typed_errors(device, path):
    eng = await _engine(device, path)
    try:
        ring = {"context_window_size": -1, "sliding_window_size": 128}
        for opts, err, param in [
                ({"sliding_window_size": 128}, UnsupportedChatOptionError, "sliding_window_size"),   # context 4096 too
                ({"context_window_size": -1, "sliding_window_size": 1024}, UnsupportedChatOptionError,
                 "sliding_window_size"),                                                         # > trained 512
                ({**ring, "attention_sink_size": 128}, ChatOptionTypeError, "attention_sink_size"),
                ({**ring, "max_num_sequences": 2, "kv_cache_dtype": "q8_0"}, UnsupportedChatOptionError,
                 "kv_cache_dtype"),                                          # a ring: f16 / f32 pools
                ({**ring, "kv_cache_dtype": "q4_0"}, UnsupportedChatOptionError, "kv_cache_dtype"),   # one slot too
                ({**ring, "speculation": "ngram"}, UnsupportedChatOptionError, "speculation"),
                ({**ring, "context_overflow": "shift"}, UnsupportedChatOptionError, "context_overflow"),
                ({"attention_sink_size": 4}, UnsupportedChatOptionError, "attention_sink_size")]:
            with pytest.raises(err) as e:
                await eng.reload("tiny", {"compile_at_load": False, **opts})
            assert e.value.param == param, (opts, e.value)
        await eng.reload("tiny", {"compile_at_load": False})
        r = await eng.chat.completions.create(messages=[LAST], max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        await eng.unload()
