"""Kernel tuning at load (kernels/tune.py tune_at_load, called by the chat and embedding pipelines):
a load on an adapter whose profile lacks the model's shapes times them within a budget and stores
the choices in the artifact cache (profiles scope); a later load times only what is still missing
and builds its kernels from the stored choices. Off by default on a software adapter (lavapipe,
the adapter here), off with a forced kernel family, and a failing tuner never fails the load.

The candidates are cut to one per shape and the decode rows to one sequence: this file checks the
load path, tests/test_kernels_tune.py the timings and choices."""
from __future__ import annotations

import logging

import pytest

from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import InvalidRequestError
from webgpu_engine.kernels import matmul as mm
from webgpu_engine.kernels.matmul import gpu as mg
from webgpu_engine.kernels import profiles, tune
from webgpu_engine.pipelines.embedding import EmbeddingPipeline
from webgpu_engine.pipelines.llm import LLMChatPipeline

import tinymodels


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return tinymodels.write_tiny_llama_gguf(d / "tiny.gguf", qtype="q4_1", embed_qtype="q8_0")["path"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty artifact cache, fewer candidates, and a spy on the measurements."""
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path / "cache"))
    for env in (tune.TUNE_ENV, tune.BUDGET_ENV, mm.FAMILY_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(tune, "DECODE_ROWS", (1,))
    monkeypatch.setattr(tune, "candidates", lambda case: [
        mg.DECODE_VARIANTS[0] if case.rows.startswith("t") and case.rows != "tn" else mg.GEMM_VARIANTS[0]])
    measured = []
    real = tune.measure_async

    async def spy(dev, case, *a, **kw):
        measured.append(case.key)
        return await real(dev, case, *a, **kw)
    monkeypatch.setattr(tune, "measure_async", spy)
    profiles.forget()
    yield measured
    profiles.forget()


async def _load(device, path, reports, **opts):
    profiles.forget()                          # as a new process would: the profile from the disk
    cc = ChatConfig(dtype="f32", context_window_size=64, prefill_chunk_size=8, compile_at_load=False, **opts)
    return await LLMChatPipeline.load(device, path, cc, progress=lambda f, t: reports.append((f, t)))


def _tuning(reports) -> list[str]:
    return [t for _, t in reports if t.startswith("Tuning kernels")]


async def test_first_load_tunes_and_the_next_uses_the_profile(device, tiny, cache, monkeypatch, caplog):
    """A budget that times one shape stores a partial profile; the next load times only the rest;
    the one after times nothing and its kernels read the stored choices."""
    monkeypatch.setenv(mm.FAMILY_ENV, "tuned")    # lavapipe reads a profile only when asked
    caplog.set_level(logging.INFO, logger="webgpu_engine")
    reports: list = []
    pipe = await _load(device, tiny, reports, tune_kernels="on", tune_budget_s=1e-4)
    try:
        keys = {c.key for c in tune.model_cases(pipe.model, "llm")}
    finally:
        pipe.dispose()
    assert len(cache) == 1 and cache[0] in keys and len(keys) > 2
    assert profiles.path(device).parent.parent.name == "profiles"
    assert set(profiles.load(device)) == set(cache)          # partial, stored as such
    assert _tuning(reports)[0] == f"Tuning kernels [1/{len(keys)}]"
    assert _tuning(reports)[-1] == f"Tuning kernels [1/{len(keys)}] done"
    assert "1 of %d shapes timed" % len(keys) in caplog.text
    fractions = [f for f, _ in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0

    reports.clear()
    pipe = await _load(device, tiny, reports, tune_kernels="on", tune_budget_s=60)
    pipe.dispose()
    assert sorted(cache[1:]) == sorted(keys - {cache[0]})     # only what was missing
    assert set(profiles.load(device)) == keys
    assert _tuning(reports)[-1] == f"Tuning kernels [{len(keys) - 1}/{len(keys) - 1}] done"

    reports.clear()
    asked = []
    real_choice = profiles.choice

    def choice(dev, *a):
        got = real_choice(dev, *a)
        asked.append(got)
        return got
    monkeypatch.setattr(profiles, "choice", choice)
    pipe = await _load(device, tiny, reports, tune_kernels="on", tune_budget_s=60)
    try:
        pipe.scheduler.fwd.ops("prefill", 8)      # prefill: plain matmuls, chosen per profile
    finally:
        pipe.dispose()
    assert len(cache) == len(keys) and not _tuning(reports)
    assert mm.kernel_family(device) == "tuned"
    assert asked and all(a is not None for a in asked)


async def test_off_on_a_software_adapter_and_with_a_forced_family(device, tiny, cache, monkeypatch):
    assert mm.is_software_adapter(device)
    assert not tune.tunes_at_load(device, "auto") and tune.tunes_at_load(device, "on")
    reports: list = []
    pipe = await _load(device, tiny, reports)                 # auto, the default
    pipe.dispose()
    monkeypatch.setenv(tune.TUNE_ENV, "on")
    monkeypatch.setenv(mm.FAMILY_ENV, "cpu")                  # a forced family reads no profile
    pipe = await _load(device, tiny, reports)
    pipe.dispose()
    monkeypatch.setenv(mm.FAMILY_ENV, "tuned")
    pipe = await _load(device, tiny, reports, tune_kernels="off")   # the chat config wins
    pipe.dispose()
    assert not cache and not _tuning(reports) and not profiles.path(device).exists()


async def test_settings_are_checked(device, tiny, cache, monkeypatch):
    assert tune.load_settings() == ("auto", tune.LOAD_BUDGET_S)
    monkeypatch.setenv(tune.TUNE_ENV, "On")
    monkeypatch.setenv(tune.BUDGET_ENV, "7.5")
    assert tune.load_settings() == ("on", 7.5)
    assert tune.load_settings("off", 2) == ("off", 2.0)
    with pytest.raises(InvalidRequestError, match="tune_kernels"):
        await _load(device, tiny, [], tune_kernels="sometimes")
    monkeypatch.setenv(tune.BUDGET_ENV, "soon")
    with pytest.raises(InvalidRequestError, match="WEBGPU_ENGINE_TUNE_BUDGET"):
        tune.load_settings()


async def test_a_failing_tuner_still_loads(device, tiny, cache, monkeypatch, caplog):
    async def broken(*a, **kw):
        raise RuntimeError("no timer today")
    monkeypatch.setattr(tune, "measure_async", broken)
    monkeypatch.setenv(mm.FAMILY_ENV, "tuned")
    reports: list = []
    pipe = await _load(device, tiny, reports, tune_kernels="on")
    try:
        assert pipe.scheduler.fwd.ops("decode", 1)
    finally:
        pipe.dispose()
    assert "kernel tuning failed (RuntimeError: no timer today)" in caplog.text
    assert not profiles.path(device).exists() and reports[-1][1].startswith("loaded")


async def test_an_embedder_tunes_its_batch_shapes(device, cache, tmp_path, monkeypatch):
    monkeypatch.setenv(mm.FAMILY_ENV, "tuned")
    folder = tinymodels.write_tiny_bert(tmp_path / "bert")["folder"]
    reports: list = []
    pipe = await EmbeddingPipeline.load(device, folder, ChatConfig(tune_kernels="on", tune_budget_s=60,
                                                                   compile_at_load=False),
                                        progress=lambda f, t: reports.append((f, t)))
    try:
        keys = {c.key for c in tune.model_cases(pipe.model, "embedding")}
        vec = (await pipe.embed_step(["tuned kernels"])).embeddings[0]
    finally:
        pipe.dispose()
    assert keys and all(k.endswith("|tn") for k in keys)
    assert set(cache) == keys == set(profiles.load(device))
    assert f"Tuning kernels [{len(keys)}/{len(keys)}] done" in _tuning(reports)
    assert [f for f, _ in reports] == sorted(f for f, _ in reports)
    assert abs(sum(v * v for v in vec) - 1.0) < 1e-4
