"""gpt-oss against transformers: a tiny random GptOssForCausalLM (tests/tinygptoss.py, written here as
transformers saves one; tests/fixtures/make_gptoss.py ran transformers on it once) must give
transformers' token ids, its logits at positions up to 319 within 1e-3 of the largest and its 16
greedy tokens (attention sinks, alternating sliding-window layers, q/k/v/o biases, YaRN, a router
with a bias, experts with biases and a clamped SwiGLU); three requests through continuous batching
give transformers' greedy tokens of each, as each gives alone. The GGUF llama.cpp's converter writes of
it (general.architecture gpt-oss) gives the same; with its experts in MXFP4 (ggml's blocks: an E8M0
scale byte and 16 bytes of E2M1 codes per 32) the logits and tokens of a GGUF holding those values
in f32."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import numpy as np
import test_families as families
import tinygptoss
from webgpu_engine.models.registry import open_model

REF = json.loads((Path(__file__).parent / "fixtures" / "gptoss_transformers.json").read_text())


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return tinygptoss.write_tiny_gptoss_safetensors(tmp_path_factory.mktemp("gptoss") / "f32", seed=REF["seed"])["folder"]


def test_gptoss_matches_transformers(device, hf_folder):
    families.check_golden(device, hf_folder, REF)


async def test_gptoss_in_a_batch_answers_as_transformers(device, hf_folder):
    """Three requests together (max_num_sequences 4: paged KV with sinks, the ROWS and PREFILL row
    modes) and each alone give transformers' 12 greedy tokens."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    tok = load_tokenizer(hf_folder)
    eng = AsyncMLCEngine()
    await eng.reload(str(hf_folder), chat_opts={"dtype": "f32", "context_window_size": 160, "prefill_chunk_size": 32,
                                                "max_num_sequences": 4, "kv_block_size": 16})
    try:
        async def one(b):
            assert tok.encode(b["prompt"]) == b["ids"]
            r = await eng.completions.create(prompt=b["prompt"], max_tokens=len(b["greedy"]), ignore_eos=True,
                                             temperature=0.0)
            return r.choices[0].text
        together = await asyncio.gather(*(one(b) for b in REF["batch"]))
        alone = [await one(b) for b in REF["batch"]]
    finally:
        await eng.unload()
    assert together == alone
    assert alone == [tok.decode(b["greedy"]) for b in REF["batch"]]


def test_gptoss_gguf_matches_transformers(device, tmp_path):
    """The converter's layout: gate / up de-interleaved and transposed to ffn_{gate,up}_exps, biases
    beside, attn_sinks, post_attention_norm as the FFN's norm, YaRN and the window in the metadata."""
    path = tinygptoss.write_tiny_gptoss_gguf(tmp_path / "gptoss.gguf", seed=REF["seed"])["path"]
    families.check_golden(device, path, REF)


def test_mxfp4_experts_as_their_floats(device, tmp_path):
    """MXFP4 experts (each expert a slice of the stacked blocks, read by the MoE kernels through
    dequant.wgsl's dq_mxfp4) give the logits and greedy tokens of the same file with the experts'
    dequantised values in f32."""
    outs = []
    for deq in (False, True):
        path = tinygptoss.write_tiny_gptoss_gguf(tmp_path / f"mxfp4_{deq}.gguf", seed=REF["seed"], expert_qtype="MXFP4",
                                                 dequantized=deq)["path"]
        m = open_model(path)
        try:
            assert {m.weights[f"layers.0.{p}_exps"].qtype for p in ("gate", "up", "down")} == {"f32" if deq else "mxfp4"}
            outs.append(families.run_golden(device, m.config, m.weights, {**REF, "rows": [0, 150, 299]}))
        finally:
            m.close()
    (rows_q, greedy_q), (rows_f, greedy_f) = outs
    for r in (0, 150, 299):
        assert np.abs(rows_q[r] - rows_f[r]).max() <= 1e-4 * np.abs(rows_f[r]).max()
    assert greedy_q == greedy_f
