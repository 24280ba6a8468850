"""Mixtures of experts against transformers: Qwen3-MoE, OLMoE and Mixtral as tiny random models that
tests/fixtures/make_moe.py ran through transformers once (JSON committed), written here
(tests/tinymoe.py, deterministic) as an HF folder (one tensor per expert) and as a GGUF laid out as
llama.cpp's converter writes it (stacked ffn_*_exps, ffn_gate_inp). Each must give transformers'
token ids, its logits at positions up to 319 within 1e-3 of the largest and its 16 greedy tokens;
through continuous batching, three requests together give each one's tokens alone; the memory
estimate counts every expert."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

import test_families as families
import tinymoe
from webgpu_engine.models.registry import open_model

FIXTURES = Path(__file__).parent / "fixtures"
# our architecture of each file: llama.cpp's converter writes Mixtral as `llama`
GGUF_ARCH = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama"}


def _ref(kind: str) -> dict:
    return json.loads((FIXTURES / f"{kind}_transformers.json").read_text())


def _files(tmp_path, kind: str, fmt: str, dims: dict) -> Path:
    if fmt == "safetensors":
        return tinymoe.write_tiny_moe_safetensors(kind, tmp_path / kind, **dims)["folder"]
    dims = {k: v for k, v in dims.items() if k != "norm_topk_prob"}    # the GGUF's graph decides
    return tinymoe.write_tiny_moe_gguf(kind, tmp_path / f"{kind}.gguf", **dims)["path"]


def check_golden(device, kind: str, path: Path, fmt: str) -> None:
    """test_families' check (token ids, logits at the kept rows, 16 greedy tokens) of our `kind` file."""
    families.check_golden(device, path, {**_ref(kind), "arch": kind if fmt == "safetensors" else GGUF_ARCH[kind]})


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_qwen3moe_matches_transformers(device, tmp_path, fmt):
    """Qwen 3's per-head q/k norms; 8 experts, 2 per token, renormalised (norm_topk_prob)."""
    check_golden(device, "qwen3moe", _files(tmp_path, "qwen3moe", fmt, _ref("qwen3moe")["dims"]), fmt)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_olmoe_matches_transformers(device, tmp_path, fmt):
    """Whole-projection q/k norms, pre norms; 8 experts, 2 per token, not renormalised."""
    check_golden(device, "olmoe", _files(tmp_path, "olmoe", fmt, _ref("olmoe")["dims"]), fmt)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_mixtral_matches_transformers(device, tmp_path, fmt):
    """A Llama layer with 8 experts, top-2 renormalised; its GGUF is general.architecture llama."""
    check_golden(device, "mixtral", _files(tmp_path, "mixtral", fmt, _ref("mixtral")["dims"]), fmt)


def test_mixtral_gguf_with_a_tensor_per_expert_matches_transformers(device, tmp_path):
    """Mixtral GGUFs written before llama.cpp's converter stacked the experts (blk.i.ffn_gate.j.weight,
    one tensor per expert, as most early-2024 Mixtral files are) are the same model."""
    path = tinymoe.write_tiny_moe_gguf("mixtral", tmp_path / "mixtral.gguf", per_expert=True,
                                       **_ref("mixtral")["dims"])["path"]
    check_golden(device, "mixtral", path, "gguf")


def test_experts_split_across_buffers_match_transformers(device, tmp_path, monkeypatch):
    """A layer's experts larger than one binding go in buffers of whole experts (here 3 of gate|up and
    6 of down per buffer, as a 128 MB binding splits Qwen3-30B-A3B's): the same tokens and logits."""
    import webgpu_engine.models.llama as llama
    upload, parts = llama.upload_experts, []

    def split(*args, **kw):
        experts = upload(*args, max_binding=3 * 96 * 64 * 4, **kw)      # 3 experts' gate|up in f32
        parts.append((len(experts.gate_up.parts), len(experts.down.parts)))
        return experts
    monkeypatch.setattr(llama, "upload_experts", split)
    check_golden(device, "qwen3moe", _files(tmp_path, "qwen3moe", "gguf", _ref("qwen3moe")["dims"]), "gguf")
    assert set(parts) == {(3, 2)}


def test_quantized_experts_as_their_floats(device, tmp_path):
    """Q8_0 experts from a GGUF (each expert a slice of the stacked blocks) give the logits and greedy
    tokens of the same file with the experts' dequantised values in f32."""
    dims = dict(context_length=512, seed=5, expert_ffn=64)
    check_quantized_as_floats(device, lambda deq: tinymoe.write_tiny_moe_gguf(
        "qwen3moe", tmp_path / f"q8_{deq}.gguf", expert_qtype="Q8_0", dequantized=deq, **dims)["path"],
        "q8_0", families._ref("qwen3"))              # its text and positions; the tokens are ours


def check_quantized_as_floats(device, write, qtype: str, ref: dict) -> None:
    """write(dequantized) -> a GGUF path: the file with `qtype` experts gives, at 3 positions, the
    logits (within 1e-4 of the largest) and the greedy tokens of the one holding their values in f32."""
    outs = []
    for deq in (False, True):
        m = open_model(write(deq))
        try:
            assert {m.weights[f"layers.0.{p}_exps"].qtype for p in ("gate", "up", "down")} == \
                {"f32" if deq else qtype}
            outs.append(families.run_golden(device, m.config, m.weights, {**ref, "rows": [0, 150, 299]}))
        finally:
            m.close()
    (rows_q, greedy_q), (rows_f, greedy_f) = outs
    for r in (0, 150, 299):
        assert np.abs(rows_q[r] - rows_f[r]).max() <= 1e-4 * np.abs(rows_f[r]).max()
    assert greedy_q == greedy_f


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_prefill_rows_do_not_depend_on_the_chunking(device, tmp_path, dtype):
    """A position's logits are the same bits whether the prompt ran as one chunk of 64 rows or as
    chunks of 16, 5 or 1 (the rows grouped by expert differently each time)."""
    from decoder_runner import DecoderRunner
    m = open_model(_files(tmp_path, "qwen3moe", "gguf", _ref("qwen3moe")["dims"]))
    ids = _ref("qwen3moe")["text_ids"][:64]
    try:
        got = []
        for chunk in (64, 16, 5, 1):
            run = DecoderRunner(device, m.config, m.weights, owner="test:moe", context_window=128, chunk=chunk,
                                dtype=dtype)
            try:
                got.append(run.prefill(ids, [64])[63].tobytes())
            finally:
                run.release()
    finally:
        m.close()
    assert got[1:] == got[:1] * 3


def test_decode_reads_the_chosen_experts_bytes(device, tmp_path):
    """decode_weight_bytes (bench/llm.py's weight MB per decode token): the dense matrices, one
    embedding row and k / E of every layer's experts, which the estimate counts whole."""
    from webgpu_engine.models.experts import decode_weight_bytes
    from webgpu_engine.models.paged_sequence import PagedSequence
    m = open_model(_files(tmp_path, "qwen3moe", "gguf", _ref("qwen3moe")["dims"]))
    try:
        seq = PagedSequence.build(device, m.config, m.weights, owner="test:moe", context_window=64, prefill_chunk=16)
        model = seq.model
        try:
            read, experts = decode_weight_bytes(model)
            c = model.cfg
            assert experts == c.n_layers * c.n_experts * 3 * c.ffn_size * c.hidden_size * 4      # f32
            dense = sum(L.qkv.nbytes + L.o.nbytes + L.experts.router.nbytes for L in model.layers)
            assert read == dense + model.lm_head.nbytes + c.hidden_size * 4 + experts * c.n_experts_used // c.n_experts
        finally:
            seq.release()
    finally:
        m.close()


def test_memory_estimate_counts_every_expert(tmp_path):
    """Stacked (E, N, K) expert tensors count E * N rows: the GGUF's estimate equals the HF folder's,
    whose experts are separate tensors, and both exceed the dense part by every expert's bytes."""
    from webgpu_engine.models.memory import estimate_llm
    from webgpu_engine.models.plan import DecoderPlan
    dims = _ref("qwen3moe")["dims"]
    plan = DecoderPlan("f32", 512, 32, 1)
    est = {}
    for fmt in ("safetensors", "gguf"):
        m = open_model(_files(tmp_path, "qwen3moe", fmt, dims))
        try:
            est[fmt] = estimate_llm(m.config, m.weights, plan, max_binding=1 << 30)
            c = m.config
        finally:
            m.close()
    experts = c.n_layers * c.n_experts * 3 * c.ffn_size * c.hidden_size * 4
    assert est["gguf"].weights == est["safetensors"].weights
    assert est["gguf"].weights > experts


@pytest.mark.parametrize("kind", ["qwen3moe", "olmoe", "mixtral"])
async def test_moe_in_a_batch_answers_as_alone(device, tmp_path, kind):
    """Three requests together through continuous batching (max_num_sequences 4: paged KV, the ROWS
    and PREFILL row modes) give each one's greedy tokens alone: routing and the expert kernels
    compute every row by itself."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    path = str(_files(tmp_path, kind, "gguf", _ref(kind)["dims"]))
    prompts = ["Grüße aus Köln", "The quick brown fox jumps over the lazy dog; naïve café owners",
               "東京で会いましょう 🌍 12345 + 678 = 13023."]
    eng = AsyncMLCEngine()
    await eng.reload(path, chat_opts={"dtype": "f32", "context_window_size": 160, "prefill_chunk_size": 32,
                                      "max_num_sequences": 4, "kv_block_size": 16})
    try:
        async def one(p):
            r = await eng.completions.create(prompt=p, max_tokens=12, ignore_eos=True, temperature=0.0)
            return r.choices[0].text
        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts]
    finally:
        await eng.unload()
    assert together == alone


async def test_a_moe_model_over_the_budget_is_refused_with_the_figures(device, tmp_path):
    """A mixture of experts whose dense part fits the memory budget but whose experts do not is
    refused before anything is allocated (the estimate counts every expert, though a decode step
    reads k of E), with the figures: weights, the budget and where it came from."""
    import re

    from webgpu_engine import errors as E
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.engine import memory
    from webgpu_engine.engine.engine import AsyncMLCEngine
    from webgpu_engine.engine.records import EngineConfig
    path = _files(tmp_path, "qwen3moe", "gguf", _ref("qwen3moe")["dims"])
    opts = {"dtype": "f32", "context_window_size": 160, "prefill_chunk_size": 32, "max_num_sequences": 1}
    est = memory.estimate_for("llm", path, ChatConfig(**opts), device)
    m = open_model(path)
    try:
        c = m.config
    finally:
        m.close()
    experts = c.n_layers * c.n_experts * 3 * c.ffn_size * c.hidden_size * 4
    assert est.total - experts // 2 < est.total                      # the budget below cuts into the experts
    before = device.allocated_bytes()
    eng = AsyncMLCEngine(EngineConfig(device=device, max_memory_bytes=before + est.total - experts // 2))
    with pytest.raises(E.GPUOutOfMemoryError) as ei:
        await eng.reload(str(path), chat_opts=opts)
    msg = str(ei.value)
    assert "max_memory_bytes" in msg and re.search(r"weights \d", msg) and ei.value.http_status == 507
    assert device.allocated_bytes() == before and eng.models == {}


@pytest.mark.parametrize("kind", ["qwen3moe", "olmoe", "mixtral"])
def test_llamacpp_converted_ggufs(device, kind):
    """GGUFs written by llama.cpp's own convert_hf_to_gguf.py from the tiny folders
    (tests/fixtures/moe_gguf, make_moe.py --llama-cpp) give transformers' token ids, logits and
    greedy tokens, as tests/tinymoe.py's GGUFs do."""
    check_golden(device, kind, FIXTURES / "moe_gguf" / f"{kind}.gguf", "gguf")
