"""The matmul tuner (kernels/tune.py, `python -m webgpu_engine tune`) on a tiny random Llama GGUF:
the profile it stores in the artifact cache (profiles scope), its choices against its own recorded
timings, and a model loaded with WEBGPU_ENGINE_KERNELS=tuned giving the CPU family's greedy tokens
when the profile sends every plain matmul to the GPU kernels."""
from __future__ import annotations

import json

import pytest

from webgpu_engine.cli import main as cli_main
from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.kernels import matmul as mm
from webgpu_engine.kernels.matmul import gpu as mg
from webgpu_engine.kernels import profiles, tune
from webgpu_engine.pipelines.llm import LLMChatPipeline

import tinymodels


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path / "cache"))
    profiles.forget()
    info = tinymodels.write_tiny_llama_gguf(tmp_path / "tiny.gguf", qtype="q4_1", embed_qtype="q8_0")
    yield info["path"]
    profiles.forget()


def test_tune_stores_a_profile(device, tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "tune.json"
    monkeypatch.setenv(mm.FAMILY_ENV, "cpu")   # the command sets "tuned" for its process: undone after
    assert cli_main(["tune", "--model", str(tiny), "--budget-s", "8", "--prefill-t", "16",
                     "--dtype", "f32", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "profile:" in printed
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert results and doc["adapter"]["device"] == device.info.device
    stored = json.loads(profiles.path(device).read_text())
    assert profiles.path(device).parent.parent.name == "profiles"
    assert stored["adapter"] == profiles.adapter_fields(device)
    for r in results:
        assert stored["choices"][r["key"]] == r["choice"]
        times = r["times"]
        if r["choice"] != profiles.BASE:       # a variant replaces base only by the margin
            assert times[r["choice"]] < tune.MARGIN * times[profiles.BASE]
            assert r["choice"] in {v.key for v in mg.decode_variants(device) + mg.GEMM_VARIANTS}
    rows = {r["key"].split("|")[-1] for r in results}
    assert rows <= {"t1", "t2", "t4", "t8", "prefill"} and "t1" in rows


async def test_tuned_profile_runs_the_model(device, tiny, monkeypatch):
    """Every weight's decode and prefill sent to the GPU kernels by a stored profile: the same
    greedy tokens as the CPU family."""
    gen = GenerationConfig(temperature=0.0, max_tokens=6, ignore_eos=True)
    msgs = [{"role": "user", "content": "Hello world! The quick brown fox"}]

    async def greedy():
        pipe = await LLMChatPipeline.load(device, tiny, ChatConfig(dtype="f32", context_window_size=128,
                                                                   prefill_chunk_size=8))
        try:
            await pipe.prefill_step(msgs, gen)
            while not pipe.stopped:
                await pipe.decode_step()
            return list(pipe.output_ids), tune.model_weights(pipe.model)
        finally:
            pipe.dispose()

    monkeypatch.setenv(mm.FAMILY_ENV, "cpu")
    want, weights = await greedy()
    choices = {}
    for w in weights:
        for T in (1, 2, 4, 8):
            choices[profiles.shape_key(w.qtype, w.n, w.k, T, False)] = mg.Decode(4, 16, 64).key
        choices[profiles.shape_key(w.qtype, w.n, w.k, 8, True)] = mg.Gemm(32).key
    profiles.save(device, choices)
    monkeypatch.setenv(mm.FAMILY_ENV, "tuned")
    got, _ = await greedy()
    assert got == want
    assert "matmul_gemm" in {k.entry for k in device._pipelines}
