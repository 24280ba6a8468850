"""kv_cache_dtype "q8_0" and "q4_0" on a whole model (the kernels: tests/test_kv_quant.py): SmolLM2
keeps at least 3 of 4 greedy 16-token answers of its default cache with q8_0's KV bytes (about half)
and answers with q4_0's (0.28x), what the plan, the memory estimate and /v1/models report; its
answers do not depend on a cold or warm cache, the prefill chunking, decode_ahead or the batch they
decode in; bad combinations are typed errors that leave the engine usable."""
from __future__ import annotations

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
from webgpu_engine.errors import ChatOptionTypeError, UnsupportedChatOptionError
from webgpu_engine.kernels.kv_quant import KV_QUANTS, kv_row_bytes
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


@pytest.fixture(scope="module", params=list(KV_QUANTS))
async def quant(request, device, smollm2_gguf):
    pipe = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(context_window_size=512, compile_at_load=False,
                                                                       kv_cache_dtype=request.param))
    yield pipe
    pipe.dispose()


@pytest.fixture(scope="module")
async def default_answers(device, smollm2_gguf):
    """The default cache's answers and its plan."""
    default = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(context_window_size=512,
                                                                          compile_at_load=False))
    try:
        return await _answers(default), default.plan
    finally:
        default.dispose()


async def test_a_quantised_cache_answers_with_its_row_bytes(device, quant, default_answers):
    """q8_0 keeps 3 of 4 answers; q4_0 (coarser) answers, its first tokens mostly the default's."""
    base, default_plan = default_answers
    kind, c = quant.plan.kv_cache_dtype, quant.model.cfg
    got = await _answers(quant)
    same = sum(a == b for a, b in zip(base, got))
    assert all(got), got
    if kind == "q8_0":
        assert same >= 3, (same, base, got)
    else:
        assert sum(a[:2] == b[:2] for a, b in zip(base, got)) >= 2, (base, got)
    ratio = quant.plan.kv_cache_bytes(c) / default_plan.kv_cache_bytes(c)
    assert ratio == kv_row_bytes(kind, c.head_dim) / kv_row_bytes(default_plan.dtype, c.head_dim), ratio
    assert ratio <= {"q8_0": 0.56, "q4_0": 0.29}[kind], ratio
    # what is allocated is what the plan says: the scheduler's pool (the model has no cache of its own)
    pools = quant.scheduler.fwd.pools
    assert sum(t.nbytes for kv in pools for t in kv) == quant.plan.kv_cache_bytes(c)
    assert pools[0][0].dtype == "u32" and not hasattr(quant.model, "k_cache")


async def test_quantised_answers_do_not_depend_on_the_cache_chunking_or_decode_ahead(device, smollm2_gguf, quant):
    """A warm cache (a prefill's rows, bit for bit a cold prefill's: row-invariant kernels; the
    rows the first answer's decode steps wrote are computed again, as the decode kernels round
    otherwise), 7-row chunks and decode_ahead give the cold cache's tokens."""
    conv = [{"role": "user", "content": "Name a colour."}]
    quant.reset_chat()
    await _answer(quant, conv)
    n_prompt = quant._req.prompt_tokens
    text = quant.get_message()
    longer = conv + [{"role": "assistant", "content": text}, {"role": "user", "content": "And another one?"}]
    warm = await _answer(quant, longer)                   # the first turn's prompt rows from the cache
    assert 0 < quant._req.prompt_tokens - quant._req.prefill_tokens <= n_prompt     # no decoded row reused
    quant.reset_chat()
    cold = await _answer(quant, longer)
    assert warm == cold
    small = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(
        context_window_size=512, compile_at_load=False, kv_cache_dtype=quant.plan.kv_cache_dtype,
        prefill_chunk_size=7, decode_ahead=True))
    try:   # the longer conversation only: more 7-row chunks than the first turn's, every step one ahead
        assert await _answer(small, longer) == cold      # 7-row chunks, steps one ahead of the host
    finally:
        small.dispose()


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A tiny model whose heads (16 dims) are too narrow for the 32-value blocks of q8_0 and q4_0."""
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("kvq") / "m.gguf", qtype="q8_0",
                                     context_length=64, head_dim=16)["path"])


async def test_bad_kv_cache_dtypes_are_typed_errors(device, narrow):
    app = default_app_config().with_records(ModelRecord("tiny", narrow, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    try:
        cases = [({"kv_cache_dtype": "int8"}, ChatOptionTypeError, None),
                 ({"kv_cache_dtype": "q4_0"}, UnsupportedChatOptionError, "multiple of 32"),
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


@pytest.mark.parametrize("kind", list(KV_QUANTS))
def test_cli_kv_cache_dtype_flag(kind):
    from webgpu_engine.cli.models import chat_opts_for
    from webgpu_engine.cli.parser import build_parser
    args = build_parser().parse_args(["serve", "--model", "a.gguf", "--kv-cache-dtype", kind])
    assert chat_opts_for(args, 1) == [{"kv_cache_dtype": kind}]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny model with 32-dim heads (one block of q8_0 or q4_0)."""
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("kvq8") / "m.gguf", qtype="q8_0",
                                     context_length=256, n_heads=2, n_kv_heads=1)["path"])


@pytest.mark.parametrize("kind", list(KV_QUANTS))
async def test_quantised_pool_of_the_batch_scheduler_answers_alone_as_in_a_batch(device, wide, kind):
    """Continuous batching over quantised pools: each request's greedy answer is the same alone and
    among three at once; the pool is allocated as the plan (and /v1/models) says."""
    import asyncio
    app = default_app_config().with_records(ModelRecord("tiny", wide, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny", {"compile_at_load": False, "kv_cache_dtype": kind, "max_num_sequences": 3})
    try:
        pipe = eng.models["tiny"].pipeline
        assert pipe.scheduler is not None
        fwd = pipe.scheduler.fwd
        assert fwd.pools[0][0].dtype == "u32"
        c = pipe.model.cfg
        pool_bytes = sum(t.nbytes for kv in fwd.pools for t in kv)
        assert pool_bytes == pipe.plan.kv_bytes_per_token(c) * pipe.plan.kv_block_size * pipe.plan.kv_pool_blocks
        assert pipe.plan.kv_bytes_per_token(c) == 2 * c.n_layers * c.n_kv_heads * kv_row_bytes(kind, c.head_dim)
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
