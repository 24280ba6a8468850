"""kv_cache_dtype "q8_0" on a whole model (the kernels: tests/test_kv_quant.py): SmolLM2 keeps at
least 3 of 4 greedy 16-token answers of its default cache with about half its KV bytes (what the plan,
the memory estimate and /v1/models report); its answers do not depend on a cold or warm cache, the
prefill chunking or decode_ahead; bad combinations are typed errors that leave the engine usable."""
from __future__ import annotations

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
from webgpu_engine.errors import ChatOptionTypeError, UnsupportedChatOptionError
from webgpu_engine.pipelines.llm import LLMChatPipeline

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain photosynthesis in one sentence."]
GREEDY = dict(temperature=0.0, max_tokens=16)


async def _answer(pipe, messages, **gen):
    await pipe.prefill_step(messages, GenerationConfig(**{**GREEDY, **gen}))
    while not pipe.stopped:
        await pipe.decode_step()
    return list(pipe.output_ids)


async def _answers(pipe) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        pipe.reset_chat()
        out.append(await _answer(pipe, [{"role": "user", "content": p}]))
    return out


@pytest.fixture(scope="module")
async def q8(device, smollm2_gguf):
    pipe = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(context_window_size=512, compile_at_load=False,
                                                                       kv_cache_dtype="q8_0"))
    yield pipe
    pipe.dispose()


async def test_q8_0_keeps_smollm2s_answers_with_half_the_kv_bytes(device, smollm2_gguf, q8):
    default = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(context_window_size=512,
                                                                          compile_at_load=False))
    try:
        base = await _answers(default)
        cfg = default.model.cfg
        ratio = q8.plan.kv_cache_bytes(cfg) / default.plan.kv_cache_bytes(cfg)
    finally:
        default.dispose()
    got = await _answers(q8)
    same = sum(a == b for a, b in zip(base, got))
    assert same >= 3, (same, base, got)
    assert ratio <= 0.56, ratio
    # what is allocated is what the plan says
    c = q8.model.cfg
    assert sum(t.nbytes for t in q8.model.k_cache + q8.model.v_cache) == q8.plan.kv_layer_bytes(c) * 2 * c.n_layers
    assert q8.model.k_cache[0].dtype == "u32"


async def test_q8_0_answers_do_not_depend_on_the_cache_chunking_or_decode_ahead(device, smollm2_gguf, q8):
    conv = [{"role": "user", "content": "Name a colour."}]
    q8.reset_chat()
    first = await _answer(q8, conv)
    text = q8.get_message()
    longer = conv + [{"role": "assistant", "content": text}, {"role": "user", "content": "And another one?"}]
    warm = await _answer(q8, longer)                      # the first turn's rows come from the cache
    assert q8._req.prefill_tokens < q8._req.prompt_tokens
    q8.reset_chat()
    cold = await _answer(q8, longer)
    assert warm == cold
    small = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(
        context_window_size=512, compile_at_load=False, kv_cache_dtype="q8_0", prefill_chunk_size=7,
        decode_ahead=True))
    try:
        assert await _answer(small, conv) == first
        small.reset_chat()
        assert await _answer(small, longer) == cold      # 7-row chunks, steps one ahead of the host
    finally:
        small.dispose()


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A tiny model whose heads (16 dims) are too narrow for q8_0's 32-value blocks."""
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("kvq") / "m.gguf", qtype="q8_0",
                                     context_length=64, head_dim=16)["path"])


async def test_bad_kv_cache_dtypes_are_typed_errors(device, narrow):
    app = default_app_config().with_records(ModelRecord("tiny", narrow, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    try:
        cases = [({"kv_cache_dtype": "int8"}, ChatOptionTypeError, None),
                 ({"kv_cache_dtype": "q4_0"}, UnsupportedChatOptionError, "no attention kernel"),
                 ({"kv_cache_dtype": "f16", "dtype": "f32"}, UnsupportedChatOptionError, "activations"),
                 ({"kv_cache_dtype": "q8_0"}, UnsupportedChatOptionError, "multiple of 32")]
        for opts, err, words in cases:
            with pytest.raises(err) as e:
                await eng.reload("tiny", {"compile_at_load": False, **opts})
            assert e.value.param == "kv_cache_dtype"
            if words:
                assert words in str(e.value)
        await eng.reload("tiny", {"compile_at_load": False, "kv_cache_dtype": "f32", "dtype": "auto"})
        r = await eng.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert eng.models["tiny"].pipeline.plan.dtype == "f32"      # the cache's dtype chose the activations'
    finally:
        await eng.unload()


def test_cli_kv_cache_dtype_flag():
    from webgpu_engine.cli.models import chat_opts_for
    from webgpu_engine.cli.parser import build_parser
    args = build_parser().parse_args(["serve", "--model", "a.gguf", "--kv-cache-dtype", "q8_0"])
    assert chat_opts_for(args, 1) == [{"kv_cache_dtype": "q8_0"}]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny model with 32-dim heads (q8_0's block)."""
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("kvq8") / "m.gguf", qtype="q8_0",
                                     context_length=256, n_heads=2, n_kv_heads=1)["path"])


async def test_q8_0_pool_of_the_batch_scheduler_answers_alone_as_in_a_batch(device, wide):
    """Continuous batching over q8_0 pools: each request's greedy answer is the same alone and among
    three at once; the pool is allocated as the plan (and /v1/models) says."""
    import asyncio
    app = default_app_config().with_records(ModelRecord("tiny", wide, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny", {"compile_at_load": False, "kv_cache_dtype": "q8_0", "max_num_sequences": 3})
    try:
        pipe = eng.models["tiny"].pipeline
        assert pipe.scheduler is not None
        fwd = pipe.scheduler.fwd
        assert fwd.pools[0][0].dtype == "u32"
        c = pipe.model.cfg
        pool_bytes = sum(t.nbytes for kv in fwd.pools for t in kv)
        assert pool_bytes == pipe.plan.kv_bytes_per_token(c) * pipe.plan.kv_block_size * pipe.plan.kv_pool_blocks
        assert eng.models["tiny"].describe(device)["memory"]["kv_cache_bytes"] == pipe.plan.kv_cache_bytes(c)

        async def ask(i):
            r = await eng.chat.completions.create(messages=[{"role": "user", "content": f"tell me about {i} cats"}],
                                                  max_tokens=12, temperature=0, ignore_eos=True)
            return r.choices[0].message.content
        alone = [await ask(i) for i in range(3)]
        together = await asyncio.gather(*(ask(i) for i in range(3)))
        assert list(together) == alone
    finally:
        await eng.unload()
