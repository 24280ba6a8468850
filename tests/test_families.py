"""The chat families beyond Llama against transformers: for each, a tiny random model that
tests/fixtures/make_<family>.py ran through transformers once (its JSON committed). The same tiny
model is written here (tests/tinymodels.py, deterministic) as HF safetensors and as GGUF, opened
through models.registry.open_model like any user file, and must give transformers' token ids for
a non-ASCII text, its logits at positions up to 319 within 1e-3 (relative to the largest logit)
and its 16 greedy tokens after 300."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

import tinymodels
from decoder_runner import DecoderRunner
from webgpu_engine.loaders.tokenizer import load_tokenizer
from webgpu_engine.models.registry import open_model

FIXTURES = Path(__file__).parent / "fixtures"


def _ref(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}_transformers.json").read_text())


def run_golden(device, cfg, weights, ref: dict, chunk: int = 128, dtype: str = "f32") -> tuple[dict, list]:
    """({row: logits}, greedy) of our model over ref's sequence: one chunked prefill up to
    prompt_len (chunks end at the rows kept, so each of those logits is a prefill's last row), 16
    greedy decode steps, then the sequence's own tokens decoded from prompt_len on (rows past it
    through the decode path; the greedy steps' rows are written again). The forward every request
    runs: one sequence over the paged pool (tests/decoder_runner.py)."""
    ids, P = ref["text_ids"][:ref["seq_len"]], ref["prompt_len"]
    run = DecoderRunner(device, cfg, weights, owner="test:families", chunk=chunk, dtype=dtype)
    try:
        rows = run.prefill(ids, {r + 1 for r in ref["rows"] if r < P} | {P})
        greedy = run.greedy(rows[P - 1], P, len(ref["greedy"]))
        for pos in range(P, len(ids)):
            rows[pos] = run.decode(ids[pos], pos)
    finally:
        run.release()
    return rows, greedy


def assert_runs_agree(got: tuple, want: tuple, rows, tol: float = 1e-3) -> None:
    """Two ({row: logits}, greedy) results (run_golden's) agree: the logits at `rows` within tol of the
    largest, the greedy tokens equal."""
    for r in rows:
        err = np.abs(got[0][r] - want[0][r]).max() / np.abs(want[0][r]).max()
        assert err <= tol, f"position {r}: relative error {err:.2e}"
    assert got[1] == want[1]


def values_golden(device, folder, weights: dict, config: dict, dims: dict, ref: dict, run=run_golden) -> tuple:
    """run(...)'s ({row: logits}, greedy) of an HF folder written at `folder` holding `weights` ({HF
    name: values}, e.g. what a quantised file encodes) under config.json's `config` (the tiny
    byte-level BPE vocabulary of `dims`)."""
    from tinyfamilies import _write_hf
    tokens, merges = tinymodels.tiny_bpe_vocab(dims["vocab_size"], "smollm")
    _write_hf(folder, {n: np.asarray(a, np.float32) for n, a in weights.items()}, config, tokens, merges, dims)
    opened = open_model(folder)
    try:
        return run(device, opened.config, opened.weights, ref)
    finally:
        opened.close()


def check_golden(device, path, ref: dict) -> None:
    """Open `path` (HF folder or GGUF) as a user would, compare tokens, logits and greedy with ref."""
    opened = open_model(path)
    try:
        assert opened.arch.name == ref["arch"]
        for native in (True, False):
            tok = load_tokenizer(path if Path(path).is_dir() else str(path), native=native)
            assert tok.encode(ref["text"]) == ref["text_ids"], f"native={native}"
        rows, greedy = run_golden(device, opened.config, opened.weights, ref)
        for r, want in zip(ref["rows"], ref["logits"]):
            want = np.asarray(want)
            err = np.abs(rows[r] - want).max() / np.abs(want).max()
            assert err <= 1e-3, f"position {r}: relative error {err:.2e}"
        assert greedy == ref["greedy"]
    finally:
        opened.close()


def _tiny_files(tmp_path, family: str, fmt: str, dims: dict) -> Path:
    """tests/tinyfamilies.py's tiny `family` model as an HF folder or as a GGUF file."""
    import tinyfamilies
    if fmt == "safetensors":
        return getattr(tinyfamilies, f"write_tiny_{family}_safetensors")(tmp_path / family, **dims)["folder"]
    return getattr(tinyfamilies, f"write_tiny_{family}_gguf")(tmp_path / f"{family}.gguf", **dims)["path"]


# --------------------------------------------------------------------------- Qwen3
@pytest.fixture(scope="module")
def qwen3_ref():
    return _ref("qwen3")


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_qwen3_matches_transformers(device, tmp_path, qwen3_ref, fmt):
    """Per-head q/k RMSNorm before RoPE, explicit head_dim (32, with hidden 64 / 4 heads), no bias."""
    dims = qwen3_ref["dims"]
    if fmt == "safetensors":
        path = tinymodels.write_tiny_llama_safetensors(tmp_path / "qwen3", arch="qwen3", **dims)["folder"]
    else:
        path = tinymodels.write_tiny_llama_gguf(tmp_path / "qwen3.gguf", arch="qwen3", **dims)["path"]
    check_golden(device, path, qwen3_ref)


# --------------------------------------------------------------------------- Phi-3 / Phi-4-mini
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_phi3_matches_transformers(device, tmp_path, fmt):
    """Fused q|k|v and gate|up split on load, longrope (long factors and the attention factor: the
    context window 512 exceeds the original 64) and partial rotary 0.75 (12 of 16 dims)."""
    ref = _ref("phi3")
    check_golden(device, _tiny_files(tmp_path, "phi3", fmt, ref["dims"]), ref)


def test_phi3_short_factors_below_the_original_context(device, tmp_path):
    """A context window within the original context rotates by the short factors (numpy reference),
    through prefill and decode."""
    import tinyfamilies
    from ref_llama import RefLlama, weights_from_infos
    info = tinyfamilies.write_tiny_phi3_gguf(tmp_path / "phi3.gguf", seed=6, context_length=512)
    opened = open_model(info["path"])
    try:
        cfg, ids = opened.config, [int(i) for i in np.random.default_rng(3).integers(3, 300, 40)]
        r = DecoderRunner(device, cfg, opened.weights, owner="test:families", context_window=64, chunk=32)
        try:
            assert r.model.rope_factors == cfg.rope_freq_factors != cfg.rope_long_factors
            got = [r.prefill(ids, [32])[31]] + [r.decode(ids[pos], pos) for pos in range(32, 40)]
        finally:
            r.release()
        want = RefLlama(cfg, weights_from_infos(opened.weights), context=64).forward(ids)[31:]
        np.testing.assert_allclose(np.array(got), want, atol=1e-3, rtol=0)
    finally:
        opened.close()


# --------------------------------------------------------------------------- Mistral
def test_mistral_sliding_window_matches_transformers(device, tmp_path):
    """A real sliding window (48 keys, every layer) over 320 positions, prefill and decode; without
    it the logits differ (numpy reference with the window removed)."""
    import dataclasses

    from ref_llama import RefLlama, weights_from_infos
    ref = _ref("mistral")
    info = tinymodels.write_tiny_llama_safetensors(tmp_path / "mistral", arch="mistral",
                                                   sliding_window=ref["sliding_window"], **ref["dims"])
    check_golden(device, info["folder"], ref)
    opened = open_model(info["folder"])
    try:
        assert opened.config.window_of(0) == ref["sliding_window"]
        assert ref["rows"][3] == 150
        w = weights_from_infos(opened.weights)
        ids = ref["text_ids"][:151]
        want = np.asarray(ref["logits"][3])
        with_window = RefLlama(opened.config, w).forward(ids)[-1]
        no_window = RefLlama(dataclasses.replace(opened.config, sliding_window=None), w).forward(ids)[-1]
        assert np.abs(with_window - want).max() < 1e-3 < 0.05 < np.abs(no_window - want).max()
    finally:
        opened.close()


# --------------------------------------------------------------------------- Gemma 1 / 2 / 3
def _gemma_files(tmp_path, arch: str, fmt: str, dims: dict):
    import tinyfamilies
    if fmt == "safetensors":
        return tinyfamilies.write_tiny_gemma_safetensors(tmp_path / arch, arch=arch, **dims)["folder"]
    return tinyfamilies.write_tiny_gemma_gguf(tmp_path / f"{arch}.gguf", arch=arch, **dims)["path"]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_gemma_matches_transformers(device, tmp_path, fmt):
    """Gemma 1: GeGLU (config.json's legacy "gelu" read as GELU-tanh), (1 + w) norms (HF stores w,
    GGUF 1 + w), sqrt(C) embeddings, tied head, 32-wide heads over hidden 64 / 4 heads, one KV head."""
    ref = _ref("gemma")
    check_golden(device, _gemma_files(tmp_path, "gemma", fmt, ref["dims"]), ref)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_gemma2_matches_transformers(device, tmp_path, fmt):
    """GeGLU, (1 + w) norms (HF stores w, GGUF 1 + w), sqrt(C) embeddings, post norms, soft-capped
    scores and logits, a 48-key window on layer 0 only, over 320 positions."""
    ref = _ref("gemma2")
    check_golden(device, _gemma_files(tmp_path, "gemma2", fmt, ref["dims"]), ref)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_gemma3_matches_transformers(device, tmp_path, fmt):
    """Gemma 2's layer plus q/k norms; five sliding layers (local rope base) and one global."""
    ref = _ref("gemma3")
    check_golden(device, _gemma_files(tmp_path, "gemma3", fmt, ref["dims"]), ref)


def test_gemma_decode_fuses_its_geglu(device, tmp_path):
    """On this adapter the decode step stores GELU-tanh(gate) * up from the gate_up matmul itself
    (the activation is a parameter of the fused paths), the path the golden tests above check."""
    import webgpu_engine.kernels.matmul as mm
    ref = _ref("gemma2")
    opened = open_model(_gemma_files(tmp_path, "gemma2", "gguf", ref["dims"]))
    run = DecoderRunner(device, opened.config, opened.weights, owner="test:families")
    m = run.model
    try:
        cfg = mm.default_config(device)
        assert opened.config.act == "gelu_tanh"
        ops = run.seq.fwd.ops("decode", 1)       # a decode step's row, as the scheduler runs it
        fused = [d[0].key.header for op in ops for d in op.dispatches if "ep_silu(" in d[0].key.header]
        if cfg.unroll and cfg.epilogue:       # the CPU family's strategy
            assert all(m.decode_plan.gate_out) and len(fused) == opened.config.n_layers
            assert all("return gelu_tanh_v2(g)" in h for h in fused)
        else:
            assert not any(m.decode_plan.gate_out) and not fused
    finally:
        run.release()
        opened.close()


def test_gemma2_with_geglu_fused_into_down_matches_transformers(device, tmp_path, monkeypatch):
    """The other fused path: GELU-tanh(gate) * up computed by the down matmul as it reads its input
    (off by default on CPU adapters, forced here), before Gemma's post-FFN norm."""
    import webgpu_engine.kernels.matmul as mm
    if not mm.default_config(device).unroll:
        pytest.fail("this test forces the CPU family's fused decode input; run it on a CPU adapter")
    monkeypatch.setitem(mm.CONFIG_OVERRIDES, "fuse_silu", True)
    monkeypatch.setitem(mm.CONFIG_OVERRIDES, "epilogue", False)     # no gate/up pairs: the input fusion
    ref = _ref("gemma2")
    path = _gemma_files(tmp_path, "gemma2", "gguf", ref["dims"])
    opened = open_model(path)
    run = DecoderRunner(device, opened.config, opened.weights, owner="test:families")
    try:
        assert run.model.decode_plan.gate_in_down and not any(run.model.decode_plan.gate_out)
    finally:
        run.release()
        opened.close()
    check_golden(device, path, ref)


def test_gemma_features_each_matter(tmp_path):
    """The golden tests would notice each Gemma feature missing: the numpy reference without it
    (GeGLU, sqrt(C) embeddings, 1 + w norms, caps, window, local rope base, query scale) moves row
    150 past the tolerance."""
    import dataclasses

    from ref_llama import RefLlama, weights_from_infos
    for arch, changes in [("gemma", [dict(act="silu"), dict(embed_scale=1.0), dict(norm_plus_one=False)]),
                          ("gemma2", [dict(attn_softcap=0.0), dict(final_softcap=0.0), dict(sliding_window=None)]),
                          ("gemma3", [dict(rope_local_base=0.0), dict(sliding_window=None),
                                      dict(attn_scale=0.1)])]:
        ref = _ref(arch)
        opened = open_model(_gemma_files(tmp_path, arch, "safetensors", ref["dims"]))
        try:
            w, ids, want = weights_from_infos(opened.weights), ref["text_ids"][:151], np.asarray(ref["logits"][3])
            assert np.abs(RefLlama(opened.config, w).forward(ids)[-1] - want).max() < 1e-3 * np.abs(want).max()
            for change in changes:
                got = RefLlama(dataclasses.replace(opened.config, **change), w).forward(ids)[-1]
                assert np.abs(got - want).max() > 5e-3 * np.abs(want).max(), (arch, change)
        finally:
            opened.close()


def test_transformers_5_rope_parameters_parse_like_the_legacy_keys(tmp_path):
    """config.json saved by transformers 5 keeps rope_theta / rope_scaling / partial_rotary_factor /
    Gemma 3's local base in `rope_parameters` (one dict, or one per layer type): same LlamaConfig."""
    import tinyfamilies
    from webgpu_engine.loaders.hf_config import llama_config_from_dict
    folders = [tinyfamilies.write_tiny_phi3_safetensors(tmp_path / "phi3", context_length=512)["folder"],
               tinyfamilies.write_tiny_gemma_safetensors(tmp_path / "gemma3", arch="gemma3")["folder"],
               tinymodels.write_tiny_llama_safetensors(tmp_path / "qwen3", arch="qwen3", rope_base=5e5)["folder"]]
    for folder in folders:
        legacy = json.loads((folder / "config.json").read_text())
        v5 = {k: v for k, v in legacy.items()
              if k not in ("rope_theta", "rope_scaling", "partial_rotary_factor", "rope_local_base_freq")}
        full = {"rope_type": "default", "rope_theta": legacy["rope_theta"]}
        if legacy.get("rope_scaling"):
            full.update(legacy["rope_scaling"], rope_type=legacy["rope_scaling"]["type"])
        if "partial_rotary_factor" in legacy:
            full["partial_rotary_factor"] = legacy["partial_rotary_factor"]
        v5["rope_parameters"] = full if "rope_local_base_freq" not in legacy else {
            "full_attention": full, "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": legacy["rope_local_base_freq"]}}
        want = llama_config_from_dict(legacy)
        assert llama_config_from_dict(v5) == want, want.arch
        if want.arch == "phi3":
            assert want.rot_dim == 12 and want.rope_long_factors and want.rope_scaling == "longrope"
        elif want.arch == "gemma3":
            assert (want.rope_base, want.rope_local_base) == (1e6, 10000.0)
        else:
            assert want.rope_base == 5e5


@pytest.mark.parametrize("arch,dtype,tol", [("gemma3", "f32", 1e-3), ("gemma2", "f16", 5e-2)])
def test_gemma_head_dim_256_matches_numpy(device, tmp_path, arch, dtype, tol):
    """Real Gemma heads are 256 wide: prefill (chunks of 16) and decode with a 16-key window, f32
    and f16 activations, against the numpy reference (relative to the largest logit)."""
    from ref_llama import RefLlama, weights_from_infos
    dims = dict(head_dim=256, context_length=128, attn_softcap=5.0, final_softcap=30.0) if arch == "gemma2" \
        else dict(head_dim=256, context_length=128)
    opened = open_model(_gemma_files(tmp_path, arch, "gguf", dict(seed=9, sliding_window=16, **dims)))
    try:
        cfg, ids = opened.config, [int(i) for i in np.random.default_rng(4).integers(3, 300, 40)]
        r = DecoderRunner(device, cfg, opened.weights, owner="test:families", context_window=64, chunk=16,
                          dtype=dtype)
        try:
            got = [r.prefill(ids, [32])[31]] + [r.decode(ids[pos], pos) for pos in range(32, 40)]
        finally:
            r.release()
        want = RefLlama(cfg, weights_from_infos(opened.weights)).forward(ids)[31:]
        assert np.abs(np.array(got) - want).max() <= tol * np.abs(want).max()
    finally:
        opened.close()


# --------------------------------------------------------------------------- OLMo 2
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_olmo2_matches_transformers(device, tmp_path, fmt):
    """Norms after the attention and the FFN only (none before), q / k norms over the whole
    projections (q heads of different scales: a per-head norm gives other logits), GQA 4 : 2."""
    ref = _ref("olmo2")
    check_golden(device, _tiny_files(tmp_path, "olmo2", fmt, ref["dims"]), ref)


# --------------------------------------------------------------------------- StableLM 2
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_stablelm_matches_transformers(device, tmp_path, fmt):
    """stablelm-2-zephyr-1_6b's layer: LayerNorms with biases (before attention, before the FFN, at
    the end), q/k/v biases, partial rotary 0.25 (4 of 16 dims), GQA 4 : 2."""
    ref = _ref("stablelm")
    check_golden(device, _tiny_files(tmp_path, "stablelm", fmt, ref["dims"]), ref)


@pytest.mark.parametrize("key", ["qk_layernorm", "use_parallel_residual"])
def test_stablelm_12b_options_refused_by_name(tmp_path, key):
    """The options only StableLM 2 12B sets are refused by their names, never run as the 1.6B layer."""
    import tinyfamilies
    from webgpu_engine.errors import UnsupportedModelError
    folder = tinyfamilies.write_tiny_stablelm_safetensors(tmp_path / "stablelm", seed=1)["folder"]
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, key: True}))
    with pytest.raises(UnsupportedModelError, match=key):
        open_model(folder)


# --------------------------------------------------------------------------- Phi-1 / 1.5 / 2
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_phi_matches_transformers(device, tmp_path, fmt):
    """Attention and a dense GELU-tanh FFN in parallel off one LayerNorm, biases on q/k/v, dense,
    fc1, fc2, the norms and the LM head, partial rotary 0.5 (8 of 16 dims), GQA 4 : 2."""
    ref = _ref("phi")
    check_golden(device, _tiny_files(tmp_path, "phi", fmt, ref["dims"]), ref)


def test_phi_gguf_with_fused_qkv_matches_transformers(device, tmp_path):
    """An older phi2 GGUF (attn_qkv weight and bias, from the msft layout) is the same model."""
    import tinyfamilies
    ref = _ref("phi")
    path = tinyfamilies.write_tiny_phi_gguf(tmp_path / "phi.gguf", fused_qkv=True, **ref["dims"])["path"]
    check_golden(device, path, ref)


# --------------------------------------------------------------------------- GPT-NeoX
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", ["gptneox", "gptneox_sequential"])
def test_gptneox_matches_transformers(device, tmp_path, fmt, name):
    """LayerNorms with biases, q|k|v per head in HF's layout (q|k|v in llama.cpp's), a dense GELU (erf)
    FFN, partial rotary 0.25 (4 of 16 dims), every bias of O(0.3); the attention and the FFN off two
    norms of the layer's input (use_parallel_residual, Pythia) and in sequence (RedPajama-INCITE)."""
    ref = _ref(name)
    check_golden(device, _tiny_files(tmp_path, "gptneox", fmt, ref["dims"]), ref)


# --------------------------------------------------------------------------- batched
@pytest.mark.parametrize("family,ref", [("olmo2", "olmo2"), ("stablelm", "stablelm"), ("phi", "phi"),
                                        ("gptneox", "gptneox")])
async def test_new_families_in_a_batch_answer_as_each_alone(device, tmp_path, family, ref):
    """Four requests at once through continuous batching (paged KV, every row mode) give the greedy
    tokens each gives alone through a scheduler of one slot: post norms, whole-projection q/k
    norms, LayerNorms, parallel layers, dense FFNs and head biases in the batched forward too."""
    path = str(_tiny_files(tmp_path, family, "gguf", _ref(ref)["dims"]))
    prompts = ["Grüße aus Köln", "The quick brown fox jumps over the lazy dog; naïve café owners",
               "東京で会いましょう 🌍", "12345 + 678 = 13023. " * 6]
    alone, batched = await batch_answers(path, prompts)
    assert alone == batched


async def batch_answers(path: str, prompts: list[str], context: int = 160) -> tuple[list, list]:
    """The 12 greedy tokens' texts of each prompt, all sent at once, with max_num_sequences 1 (a
    scheduler of one slot: one after another) and 4 (continuous batching). Both engines on one device
    of this call's own, closed at its end (the second engine finds the kernels both use compiled), and
    no load-time compile of every pipeline (test_correctness checks it): requests compile what they use."""
    from webgpu_engine import gpu
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.engine.engine import AsyncMLCEngine
    answers = []
    dev = await gpu.request_device()
    try:
        for n in (1, 4):
            eng = AsyncMLCEngine(EngineConfig(device=dev))
            await eng.reload(path, chat_opts={"dtype": "f32", "context_window_size": context, "prefill_chunk_size": 32,
                                              "max_num_sequences": n, "kv_block_size": 16, "compile_at_load": False})
            try:
                rs = await asyncio.gather(*(eng.completions.create(prompt=p, max_tokens=12, ignore_eos=True,
                                                                   temperature=0.0) for p in prompts))
                answers.append([r.choices[0].text for r in rs])
            finally:
                await eng.unload()
    finally:
        dev.close()
    return answers[0], answers[1]


@pytest.mark.parametrize("pre,twin", [("dbrx", "llama3"), ("stablelm2", "qwen2"), ("phi-2", "gpt-2"),
                                      ("olmo", "gpt-2"), ("mpt", "gpt-2")])
def test_gguf_pre_tokenizers_of_the_new_families(pre, twin):
    """The tokenizer.ggml.pre names llama.cpp's converter writes for OLMo 2 (cl100k: "dbrx"), StableLM 2,
    Phi-2 and GPT-NeoX-style vocabularies load (they were refused by name) and split text with the
    expression llama.cpp reads each with."""
    from webgpu_engine.loaders.bpe import BPETokenizer
    tokens, merges = tinymodels.tiny_bpe_vocab(300, "smollm")
    text = _ref("olmo2")["text"] + " it's 2024\n\n  done"
    assert BPETokenizer(tokens, merges, pre=pre).encode(text) == BPETokenizer(tokens, merges, pre=twin).encode(text)
