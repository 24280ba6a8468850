"""gpt-oss against transformers: a tiny random GptOssForCausalLM (tests/tinygptoss.py, written here as
transformers saves one; tests/fixtures/make_gptoss.py ran transformers on it once) must give
transformers' token ids, its logits at positions up to 319 within 1e-3 of the largest and its 16
greedy tokens (attention sinks, alternating sliding-window layers, q/k/v/o biases, YaRN, a router
with a bias, experts with biases and a clamped SwiGLU); three requests through continuous batching
give transformers' greedy tokens of each, as each gives alone."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import test_families as families
import tinygptoss

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
