"""GPU memory limits on the real adapter: estimates against real allocations, fail-fast checks before
any allocation (context window over the budget or over the device's per-buffer limit, a tiny budget,
the env setting), mid-load allocation failures leaving nothing behind, and memory returning to its
baseline over repeated load/unload cycles of the default LLM and embedder."""
from __future__ import annotations

import re
import time

import pytest

from webgpu_engine import errors as E
from webgpu_engine.config import ChatConfig
from webgpu_engine.engine import DEFAULT_CHAT_MODEL as LLM_ID
from webgpu_engine.engine import DEFAULT_EMBED_MODEL as EMB_ID
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config, memory

Q = [{"role": "user", "content": "What is the capital of France?"}]


class BufferCounter:
    """Counts `dev.buffer` calls (every GPU allocation goes through it); optionally fails the
    `fail_at`-th call with GPUOutOfMemoryError, as a real out-of-memory allocation would."""

    def __init__(self, dev, monkeypatch, fail_at: int | None = None):
        self.calls, self.fail_at, orig = 0, fail_at, dev.buffer

        def buffer(*a, **kw):
            self.calls += 1
            if self.fail_at is not None and self.calls >= self.fail_at:
                raise E.GPUOutOfMemoryError(f"forced allocation failure at buffer {self.calls}")
            return orig(*a, **kw)
        monkeypatch.setattr(dev, "buffer", buffer)


def numbers(msg: str) -> list[int]:
    return [int(x) for x in re.findall(r"(\d+) bytes", msg)]


# --------------------------------------------------------------------------- units and budgets
def test_parse_bytes_and_budget_sources(device, monkeypatch):
    assert memory.parse_bytes("512M") == 512 << 20
    assert memory.parse_bytes("1.5GiB") == 3 << 29
    assert memory.parse_bytes(" 4096 ") == 4096 and memory.parse_bytes(123) == 123
    with pytest.raises(ValueError, match="byte count"):
        memory.parse_bytes("lots")
    monkeypatch.delenv(memory.ENV_MAX_MEMORY, raising=False)
    budget, src = memory.memory_budget(device)
    assert budget == memory.default_budget(device) > 0 and "default" in src
    if device.info.adapter_type.upper() == "CPU":       # lavapipe: half of the RAM it draws on
        ram = memory._physical_memory()
        assert ram is None or budget == ram // 2
    monkeypatch.setenv(memory.ENV_MAX_MEMORY, "3G")
    assert memory.memory_budget(device) == (3 << 30, f"env {memory.ENV_MAX_MEMORY}")
    assert memory.memory_budget(device, "1G")[0] == 1 << 30          # the engine option wins


# --------------------------------------------------------------------------- estimates vs reality
@pytest.mark.slow
async def test_estimates_bound_the_real_allocations(device, smollm2_gguf, minilm_dir):
    """The estimate is an upper bound within 5% of what the pipelines really allocate."""
    from webgpu_engine.pipelines.embedding import EmbeddingPipeline
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    for ctx in (512, 2048):
        cc = ChatConfig(context_window_size=ctx)
        est = memory.estimate_for("llm", smollm2_gguf, cc, device)
        # the paged pool: a lone sequence's full context and a block (models/plan.py pool_blocks)
        assert est.context_window == ctx and est.kv_cache == (ctx + 16) * est.kv_per_token
        pipe = await LLMChatPipeline.load(device, smollm2_gguf, cc, model_id="memtest")
        real = device.allocated_bytes("model:memtest")
        pipe.dispose()
        assert real <= est.total <= real * 1.05, (ctx, real, est)
    cc = ChatConfig(max_batch_size=4, max_seq_length=64)
    est = memory.estimate_for("embedding", minilm_dir, cc, device)
    pipe = await EmbeddingPipeline.load(device, minilm_dir, cc)
    try:
        weights = device.allocated_bytes(pipe.owner)
        assert weights <= est.weights <= weights * 1.05
        await pipe.embed_step(["word " * 100] * 4)     # the largest batch: 4 x 64 tokens
        real = device.allocated_bytes(pipe.owner)
        assert real <= est.total <= real * 1.05, (real, est)
    finally:
        pipe.dispose()


# --------------------------------------------------------------------------- fail fast
@pytest.mark.slow
async def test_context_window_over_the_budget_fails_before_allocating(device, smollm2_gguf, monkeypatch):
    before = device.allocated_bytes()
    small = memory.estimate_for("llm", smollm2_gguf, ChatConfig(context_window_size=1024), device)
    big = memory.estimate_for("llm", smollm2_gguf, ChatConfig(context_window_size=8192), device)
    budget = before + small.total + 100 * small.kv_per_token     # room for ~1100 tokens
    eng = AsyncMLCEngine(EngineConfig(device=device, max_memory_bytes=budget))
    counter = BufferCounter(device, monkeypatch)
    with pytest.raises(E.ContextWindowTooLargeError) as ei:
        await eng.reload(LLM_ID, {"context_window_size": 8192})
    assert counter.calls == 0 and device.allocated_bytes() == before     # nothing was allocated
    assert eng.models == {} and eng.state == "idle"
    msg = str(ei.value)
    assert big.total in numbers(msg) and budget - before in numbers(msg)  # needed, available
    assert "context_window_size" in msg and ei.value.http_status == 400
    fit = int(re.search(r"context_window_size \(at most (\d+)\)", msg).group(1))
    assert 1024 <= fit < 8192 and fit % memory.CTX_STEP == 0
    # the suggested window loads, within the budget
    monkeypatch.undo()
    await eng.reload(LLM_ID, {"context_window_size": fit})
    assert eng.models[LLM_ID].pipeline.model.ctx == fit
    assert device.allocated_bytes() <= budget
    await eng.unload()
    assert device.allocated_bytes() == before


@pytest.mark.slow
async def test_tiny_budget_fails_fast_for_both_models(device, smollm2_gguf, minilm_dir, monkeypatch):
    before = device.allocated_bytes()
    counter = BufferCounter(device, monkeypatch)
    eng = AsyncMLCEngine(EngineConfig(device=device, max_memory_bytes=before + (1 << 20)))
    with pytest.raises(E.GPUOutOfMemoryError) as ei:
        await eng.reload([LLM_ID, EMB_ID])
    assert not isinstance(ei.value, E.ContextWindowTooLargeError)    # the weights alone do not fit
    msg = str(ei.value)
    assert LLM_ID in msg and 1 << 20 in numbers(msg) and "max_memory_bytes" in msg
    assert ei.value.http_status == 507
    # the budget from the environment; the second model of a reload counts the first one's bytes
    monkeypatch.setenv(memory.ENV_MAX_MEMORY, str(before + 200 * (1 << 20)))
    eng = AsyncMLCEngine(EngineConfig(device=device))
    with pytest.raises(E.GPUOutOfMemoryError) as ei:
        await eng.reload([LLM_ID, EMB_ID])
    msg = str(ei.value)
    assert EMB_ID in msg and "already in use" in msg and memory.ENV_MAX_MEMORY in msg
    assert counter.calls == 0 and device.allocated_bytes() == before and eng.models == {}


async def test_context_over_the_per_buffer_limit_fails_before_allocating(device, tmp_path, monkeypatch):
    """A model trained for 4M tokens: one layer's KV pool at 10M requested (clamped to 4M: the context
    and a block) would be a buffer larger than the device allows, whatever the budget."""
    from tinymodels import write_tiny_llama_gguf
    info = write_tiny_llama_gguf(tmp_path / "long.gguf", context_length=1 << 22)
    rec = ModelRecord("tiny-long", str(info["path"]), "llm")
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=default_app_config().with_records(rec),
                                      max_memory_bytes="1T"))
    before = device.allocated_bytes()
    counter = BufferCounter(device, monkeypatch)
    with pytest.raises(E.ContextWindowTooLargeError) as ei:
        await eng.reload("tiny-long", {"context_window_size": 10_000_000})
    assert counter.calls == 0 and device.allocated_bytes() == before
    msg = str(ei.value)
    limit = min(device.max_buffer_size, device.max_storage_binding)
    cfg = info["config"]
    per_tok = cfg.n_kv_heads * cfg.head_dim * (2 if device.has_f16 else 4)
    per_buf = per_tok * ((1 << 22) + 16)
    binds = limit // (16 * per_tok) * 16 * per_tok               # the whole blocks a binding holds
    assert per_buf in numbers(msg) and binds in numbers(msg) and "context_window_size" in msg
    fit = int(re.search(r"context_window_size \(at most (\d+)\)", msg).group(1))
    assert (fit + 16) * per_tok <= limit
    monkeypatch.undo()
    await eng.reload("tiny-long", {"context_window_size": 512})      # a small window loads
    assert eng.models["tiny-long"].pipeline.model.ctx == 512
    await eng.unload()
    assert device.allocated_bytes() == before


async def test_one_plan_is_estimated_allocated_and_reported(device, tmp_path):
    """A window above the model's trained context and continuous batching: the memory estimate, the
    loaded model, its paged pool and /v1/models all use the one load plan (models/plan.py): the
    clamped context, the pool's blocks, the KV bytes."""
    from tinymodels import write_tiny_llama_gguf
    info = write_tiny_llama_gguf(tmp_path / "short.gguf", context_length=256)
    rec = ModelRecord("tiny-short", str(info["path"]), "llm")
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=default_app_config().with_records(rec)))
    opts = {"context_window_size": 4096, "max_num_sequences": 2, "kv_block_size": 16, "compile_at_load": False}
    await eng.reload("tiny-short", opts)
    try:
        lm = eng.models["tiny-short"]
        plan, cfg = lm.pipeline.plan, info["config"]
        assert plan.context == 256 == lm.pipeline.model.ctx == lm.estimate.context_window
        assert plan.max_sequences == 2 and lm.pipeline.scheduler.fwd.n_blocks == plan.kv_pool_blocks > 256 // 16
        assert lm.estimate.kv_cache == plan.kv_cache_bytes(cfg) == plan.kv_bytes_per_token(cfg) * (
            16 * plan.kv_pool_blocks)                    # the pool only: the model has no cache of its own
        described = lm.describe(device)
        assert described["context_window"] == 256                   # what was allocated, not the 4096 asked
        assert described["memory"]["kv_cache_bytes"] == lm.estimate.kv_cache
    finally:
        await eng.unload()


# --------------------------------------------------------------------------- failures mid-load
@pytest.mark.slow
async def test_allocation_failure_mid_load_leaves_nothing(device, smollm2_gguf, minilm_dir, monkeypatch):
    """An allocation fails after some uploads — half-way through the LLM, then half-way through the
    embedder with the LLM already loaded: the reload raises that error and every byte is freed."""
    marks = {}

    def progress(report):
        if report["text"].startswith(f"Loading model {EMB_ID}"):
            marks["emb"] = counter.calls
    eng = AsyncMLCEngine(EngineConfig(device=device, init_progress_callback=progress))
    counter = BufferCounter(device, monkeypatch)
    await eng.reload([LLM_ID, EMB_ID])          # count the allocations of a whole load
    total = counter.calls
    await eng.unload()
    assert 10 < marks["emb"] < total - 10
    before, owners = device.allocated_bytes(), device.allocations()
    for fail_at in (marks["emb"] // 2, (marks["emb"] + total) // 2):
        counter.calls, counter.fail_at = 0, fail_at
        with pytest.raises(E.GPUOutOfMemoryError, match="forced allocation failure"):
            await eng.reload([LLM_ID, EMB_ID])
        assert counter.calls == fail_at
        assert device.allocated_bytes() == before and device.allocations() == owners
        assert eng.models == {} and eng.state == "idle" and not device.lost


# --------------------------------------------------------------------------- unload returns memory
CYCLES = 3
@pytest.mark.slow
async def test_memory_returns_to_baseline_over_load_unload_cycles(device, smollm2_gguf, minilm_dir):
    """After one warm-up cycle (which may leave the device's shared kernel state: a few placeholder
    bytes owned by "kernels", see engine.SHARED_OWNERS), every load + unload returns the device's
    allocated bytes exactly to the baseline. CYCLES cycles: each one's check is exact, so a leak
    fails the first cycle that leaks; the first and last cycle serve requests, those between only
    load and unload."""
    from webgpu_engine.engine.engine import SHARED_OWNERS
    eng = AsyncMLCEngine(EngineConfig(device=device))
    start = device.allocations()
    await eng.reload([LLM_ID, EMB_ID])
    r = await eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0, max_tokens=2)
    assert r.usage.completion_tokens >= 1
    await eng.unload()
    left = {o: b - start.get(o, 0) for o, b in device.allocations().items() if b != start.get(o, 0)}
    assert set(left) <= SHARED_OWNERS and sum(left.values()) <= 1024, left
    baseline, owners = device.allocated_bytes(), device.allocations()
    times, loaded_bytes = [], set()
    for i in range(CYCLES):
        t0 = time.perf_counter()
        await eng.reload([LLM_ID, EMB_ID])
        times.append(time.perf_counter() - t0)
        loaded_bytes.add(device.allocated_bytes() - baseline)
        if i in (0, CYCLES - 1):      # requests build more GPU state (prefill ops, the embedding arena)
            r = await eng.chat.completions.create(model=LLM_ID, messages=Q, temperature=0, max_tokens=2)
            assert r.usage.completion_tokens >= 1
            assert len((await eng.embeddings.create(model=EMB_ID, input="hello")).data) == 1
        await eng.unload()
        assert device.allocated_bytes() == baseline and device.allocations() == owners, i
    assert len(loaded_bytes) == 1 and min(loaded_bytes) > 200 << 20    # the same ~240 MB each time
    print(f"\n{CYCLES} reloads of {LLM_ID} + {EMB_ID}: first {times[0]:.2f}s, "
          f"median {sorted(times)[CYCLES // 2]:.2f}s, total {sum(times):.1f}s")


def test_memory_module_imports_only_the_standard_library():
    """memory.py runs in the page too (Pyodide)."""
    import ast
    import inspect
    import sys
    for n in ast.parse(inspect.getsource(memory)).body:
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and not n.level:
            names = [n.module]
        else:
            continue
        assert all(x.split(".")[0] in sys.stdlib_module_names for x in names), names
