"""Llama-family forward pass on the real adapter: golden greedy tokens and logprobs of SmolLM2 (f32 and
f16 activations), and agreement with the numpy reference on tiny random Llama / Qwen2 models
(GGUF and safetensors)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from decoder_runner import DecoderRunner
from ref_llama import RefLlama, weights_from_infos
from webgpu_engine.config import ChatConfig, GenerationConfig, SamplingParams
from webgpu_engine.errors import ContextWindowTooLargeError, GPUOutOfMemoryError
from webgpu_engine.kernels.sampling import Sampler
from webgpu_engine.models.paged_sequence import PagedSequence
from webgpu_engine.pipelines.llm import LLMChatPipeline


# --------------------------------------------------------------------------- golden SmolLM2
async def _greedy_run(pipe, messages, n):
    gen = GenerationConfig(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=5)
    pipe.reset_chat()
    await pipe.prefill_step(messages, gen)
    while not pipe.stopped:
        await pipe.decode_step()
    return list(pipe.output_ids), pipe.token_logprobs[0]["top_logprobs"]


@pytest.mark.parametrize("dtype,n_tokens,lp_tol", [("f32", 32, 0.01), ("f16", 16, 0.05)])
async def test_smollm2_golden_greedy(device, smollm2_gguf, smollm2_reference, dtype, n_tokens, lp_tol):
    pipe = await LLMChatPipeline.load(device, smollm2_gguf,
                                      ChatConfig(dtype=dtype, context_window_size=256, prefill_chunk_size=64,
                                                 compile_at_load=False))   # no warm-up run: test_correctness checks it
    try:
        assert pipe.model.dtype == dtype
        for case in smollm2_reference["greedy"]:
            ids, top = await _greedy_run(pipe, case["messages"], n_tokens)
            assert pipe.kv_ids[:len(case["prompt_ids"])] == case["prompt_ids"]
            assert ids == case["greedy_ids_no_eos_stop"][:n_tokens], case["messages"]
            ref = case["first_step_top5"]
            assert [t["token"] for t in top] == [pipe.tokenizer.token_bytes(i).decode("utf-8", "replace")
                                                 for i in ref["ids"]]
            np.testing.assert_allclose([t["logprob"] for t in top], ref["logprobs"], atol=lp_tol)
    finally:
        owner = pipe.owner
        pipe.dispose()
        assert device.allocated_bytes(owner) == 0


# --------------------------------------------------------------------------- tiny random models
def _tiny_cases():
    import tinymodels
    return tinymodels


def _gpu_logits(device, cfg, infos, ids, dtype="f32", chunk=8):
    """Logits (len(ids) - chunk + 1, V) from the GPU model: the first chunk's last row by prefill,
    then one decode step per token (both paths checked)."""
    r = DecoderRunner(device, cfg, infos, owner="test:llama", context_window=64, chunk=chunk, dtype=dtype)
    try:
        return np.array([r.prefill(ids, [chunk])[chunk - 1]]
                        + [r.decode(t, pos) for pos, t in enumerate(ids[chunk:], chunk)])
    finally:
        r.release()


@pytest.mark.parametrize("arch,fmt,wtype,act,tol", [
    ("llama", "gguf", "f32", "f32", 1e-3),
    ("qwen2", "gguf", "f32", "f32", 1e-3),          # q/k/v bias, neox rope
    ("qwen3", "gguf", "q8_0", "f32", 1e-3),         # per-head q/k norms before rope
    ("qwen3", "safetensors", "bf16", "f32", 1e-3),
    ("llama", "gguf", "q8_0", "f32", 1e-3),
    ("llama", "gguf", "q4_1", "f32", 1e-3),
    ("llama", "safetensors", "f32", "f32", 1e-3),   # HF layout: neox rope
    ("qwen2", "safetensors", "bf16", "f32", 1e-3),
    ("llama", "gguf", "f32", "f16", 3e-2),          # f16 activations and KV cache
])
def test_tiny_model_matches_numpy(device, tmp_path, arch, fmt, wtype, act, tol):
    tm = _tiny_cases()
    kw = {"qtype": wtype} if fmt == "gguf" else {"dtype": wtype}
    cfg, infos, closer = tm.open_tiny(tmp_path, arch=arch, fmt=fmt, **kw)
    try:
        ids = [int(i) for i in np.random.default_rng(0).integers(0, cfg.vocab_size, 12)]
        got = _gpu_logits(device, cfg, infos, ids, dtype=act, chunk=8)   # rows 7, 8, 9, 10, 11
        ref = RefLlama(cfg, weights_from_infos(infos), np.float64)
        want = ref.forward(ids)                                          # (12, V)
        np.testing.assert_allclose(got, want[7:], atol=tol, rtol=0)
    finally:
        closer()


@pytest.mark.parametrize("wtype,embed_qtype", [
    ("q5_k", "q6_k"),      # as in Q5_K_M files
    ("iq4_xs", "iq4_nl"),  # IQ4_XS
    ("q3_k", "q2_k"),      # Q3_K_M / Q2_K
    ("q5_0", "q5_1"),
])
def test_tiny_model_k_and_iq_quants_match_numpy(device, tmp_path, wtype, embed_qtype):
    """Every matrix (the untied LM head too) in `wtype`, the embedding table in `embed_qtype`: the
    GPU forward (tiled prefill, fused decode) against numpy on the same dequantized weights."""
    from webgpu_engine.loaders.gguf import GGUFFile
    tm = _tiny_cases()
    info = tm.write_tiny_llama_gguf(tmp_path / f"tiny-{wtype}.gguf", qtype=wtype, embed_qtype=embed_qtype,
                                    seed=2, hidden_size=256, ffn_size=512)
    f = GGUFFile(info["path"])
    try:
        cfg, infos = f.model_config(), f.weights()
        assert infos["layers.1.down"].qtype == wtype and infos["embed"].qtype == embed_qtype
        ids = [int(i) for i in np.random.default_rng(1).integers(0, cfg.vocab_size, 12)]
        got = _gpu_logits(device, cfg, infos, ids, dtype="f32", chunk=8)   # rows 7, 8, 9, 10, 11
        want = RefLlama(cfg, weights_from_infos(infos), np.float64).forward(ids)
        assert np.abs(want[7:]).max() > 0.1
        np.testing.assert_allclose(got, want[7:], atol=1e-3, rtol=0)
    finally:
        f.close()


async def test_pipeline_loads_hf_folder_and_matches_numpy_greedy(device, tmp_path):
    from ref_llama import greedy
    tm = _tiny_cases()
    info = tm.write_tiny_llama_safetensors(tmp_path / "tiny-qwen2", arch="qwen2")
    pipe = await LLMChatPipeline.load(device, info["folder"], ChatConfig(dtype="f32", context_window_size=64,
                                                                         compile_at_load=False))
    try:
        gen = GenerationConfig(temperature=0.0, max_tokens=6, ignore_eos=True)
        await pipe.prefill_step([{"role": "user", "content": "Hello world!"}], gen)
        while not pipe.stopped:
            await pipe.decode_step()
        prompt = pipe.kv_ids[:pipe.usage()["prompt_tokens"]]
        assert pipe.output_ids == greedy(info["config"], info["weights"], prompt, 6)
    finally:
        pipe.dispose()


def test_memory_errors_name_bytes(device, smollm2_gguf):
    from webgpu_engine.loaders.gguf import GGUFFile
    g = GGUFFile(smollm2_gguf)
    cfg = g.model_config()
    with pytest.raises(GPUOutOfMemoryError, match=r"\d+ bytes"):
        PagedSequence.build(device, cfg, g.weights(), owner="test:llama-oom", context_window=8192,
                            max_total_bytes=50 << 20)
    assert device.allocated_bytes("test:llama-oom") == 0
    cfg.context_length = 1 << 22
    with pytest.raises(ContextWindowTooLargeError, match="bytes per layer"):
        PagedSequence.build(device, cfg, g.weights(), owner="test:llama-oom", context_window=1 << 22)
    assert device.allocated_bytes("test:llama-oom") == 0
    g.close()


def test_sampler_on_model_logits_keeps_next_id(device, smollm2_gguf):
    """A sampler on the paged forward's logits row writes the id it samples into the forward's input
    ids on the GPU (no host write of ids)."""
    from webgpu_engine.loaders.gguf import GGUFFile
    g = GGUFFile(smollm2_gguf)
    cfg = g.model_config()
    seq = PagedSequence.build(device, cfg, g.weights(), owner="test:llama-ids", context_window=64, prefill_chunk=16)
    try:
        s = Sampler(device, cfg.vocab_size, owner="test:llama-ids")
        op = s.op(seq.logits, seq.fwd.ids)
        s.configure(SamplingParams(temperature=0.0))
        s.reset_history()
        b = device.batch()
        seq.record_prefill(b, [1, 4093, 198, 6004], 0)
        op.record(b)
        device.submit(b)
        tok = s.read_sync().token
        assert struct.unpack("<I", device.read_sync(seq.fwd.ids.buf, 0, 4))[0] == tok
    finally:
        seq.release()
        g.close()


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("fmt,scaling", [("gguf", LLAMA3_SCALING), ("safetensors", LLAMA3_SCALING),
                                         ("safetensors", {"rope_type": "linear", "factor": 4.0})])
def test_rope_scaling_over_300_positions(device, tmp_path, fmt, scaling):
    """Llama 3.1+ RoPE scaling (GGUF rope_freqs.weight as llama.cpp's converter writes it; HF
    rope_scaling "llama3") and linear scaling: the loaded factors, and the GPU forward over 300
    positions (prefill chunks, then decode) against numpy with the same scaling; without the scaling
    the logits would differ."""
    import dataclasses

    from webgpu_engine.loaders.gguf import GGUFFile
    from webgpu_engine.loaders.hf_config import load_llama_config
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    tm = _tiny_cases()
    dims = dict(context_length=512, seed=4)
    if fmt == "gguf":
        info = tm.write_tiny_llama_gguf(tmp_path / "scaled.gguf", rope_scaling=scaling, **dims)
        f = GGUFFile(info["path"])
        cfg, infos = f.model_config(), f.weights()
    else:
        info = tm.write_tiny_llama_safetensors(tmp_path / "scaled", rope_scaling=scaling, **dims)
        f = SafetensorsFolder(info["folder"])
        cfg, infos = load_llama_config(info["folder"]), f.weights("llama")
    try:
        assert cfg.rope_freq_factors == pytest.approx(info["config"].rope_freq_factors, rel=1e-6)
        assert cfg.rope_scaling == scaling["rope_type"] and max(cfg.rope_freq_factors) == scaling["factor"]
        ids = [int(i) for i in np.random.default_rng(5).integers(3, cfg.vocab_size, 303)]
        r = DecoderRunner(device, cfg, infos, owner="test:llama", context_window=512, chunk=128)
        try:
            got = [r.prefill(ids, [300])[299]] + [r.decode(ids[pos], pos) for pos in range(300, 303)]
        finally:
            r.release()
        weights = weights_from_infos(infos)
        want = RefLlama(cfg, weights, np.float64).forward(ids)[299:]
        np.testing.assert_allclose(np.array(got), want, atol=2e-3, rtol=0)
        plain = RefLlama(dataclasses.replace(cfg, rope_freq_factors=None), weights, np.float64).forward(ids)[299:]
        assert np.abs(plain - want).max() > 50 * 2e-3
    finally:
        f.close()


def test_llama3_rope_scaling_matches_transformers(device, tmp_path):
    """The tiny Llama with rope_type llama3 of tests/fixtures/make_llama3_rope.py: our logits at
    positions up to 319 (five times the scaling's original context) within 1e-3 of transformers'
    (relative to the largest logit), and the same 16 greedy tokens after 300."""
    import json
    from pathlib import Path

    from test_families import run_golden
    from webgpu_engine.loaders.hf_config import load_llama_config
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    ref = json.loads((Path(__file__).parent / "fixtures" / "llama3_rope_transformers.json").read_text())
    tm = _tiny_cases()
    info = tm.write_tiny_llama_safetensors(tmp_path / "llama3", rope_scaling=ref["scaling"], **ref["dims"])
    cfg = load_llama_config(info["folder"])
    ids = [int(i) for i in np.random.default_rng(ref["seq_seed"]).integers(3, cfg.vocab_size, ref["seq_len"])]
    f = SafetensorsFolder(info["folder"])
    try:
        rows, greedy = run_golden(device, cfg, f.weights("llama"), {**ref, "text_ids": ids})
    finally:
        f.close()
    for r, want in zip(ref["rows"], ref["logits"]):
        want = np.asarray(want)
        assert np.abs(rows[r] - want).max() <= 1e-3 * np.abs(want).max(), f"position {r}"
    assert greedy == ref["greedy"]


@pytest.mark.parametrize("mix", [{"v": "q6_k", "down": "q6_k"},            # as in Q4_K_M files
                                 {"v": "q8_0", "up": "q5_k"}])
def test_tiny_model_with_a_k_quant_mix_matches_numpy(device, tmp_path, mix):
    """K-quant mixes store some tensors of a fused matrix wider (Q4_K_M: attn_v in Q6_K beside Q4_K
    attn_q / attn_k): the model uploads those as one weight of several types (decode falls back from
    the fused RoPE epilogue) and matches numpy through prefill and decode."""
    from webgpu_engine.loaders.gguf import GGUFFile
    tm = _tiny_cases()
    info = tm.write_tiny_llama_gguf(tmp_path / "mix.gguf", qtype="q4_k", tensor_qtypes=mix, seed=3,
                                    hidden_size=256, ffn_size=512)
    f = GGUFFile(info["path"])
    try:
        cfg, infos = f.model_config(), f.weights()
        assert {infos["layers.0." + n].qtype for n in ("q", "k", "v")} == {"q4_k", mix["v"]}
        ids = [int(i) for i in np.random.default_rng(2).integers(0, cfg.vocab_size, 12)]
        got = _gpu_logits(device, cfg, infos, ids, dtype="f32", chunk=8)
        want = RefLlama(cfg, weights_from_infos(infos), np.float64).forward(ids)
        np.testing.assert_allclose(got, want[7:], atol=1e-3, rtol=0)
    finally:
        f.close()
