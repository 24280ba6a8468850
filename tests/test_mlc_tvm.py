"""MLC artifacts written by TVM's own tensor-cache writer (tvm.contrib.tvmjs.dump_tensor_cache, as
MLC-LLM's converter calls it: every record marked f32-to-bf16, float32 tensors stored as bf16),
quantised by MLC's GroupQuantize (tests/fixtures/make_mlc_tvm.py): for Llama and Qwen2 and each of
q0f32, q0f16, q4f16_1 and q4f32_1, the engine's greedy tokens and last-row logits equal
transformers run on the weights as the files encode them (tests/fixtures/mlc_tvm_transformers.json)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.pipelines.llm import LLMChatPipeline

FIX = Path(__file__).parent / "fixtures"
REF = json.loads((FIX / "mlc_tvm_transformers.json").read_text())


@pytest.mark.parametrize("name", sorted(REF["models"]))
async def test_tvm_written_artifact_equals_transformers(device, name):
    ref = REF["models"][name]
    pipe = await LLMChatPipeline.load(device, FIX / "mlc_tvm" / name,
                                      ChatConfig(context_window_size=64, compile_at_load=False, dtype="f32"))
    try:
        gen = GenerationConfig(temperature=0.0)
        ids = ref["prompt_ids"]
        out = [await pipe.forward_tokens_and_sample(ids, True, gen)]
        lg = pipe.scheduler.fwd.logits_row(0)          # the prompt's last row
        raw = await device.read(lg.buf, lg.offset, lg.nbytes)
        logits = np.frombuffer(raw, np.float32)[:len(ref["logits"])]
        want = np.asarray(ref["logits"], np.float32)
        np.testing.assert_allclose(logits, want, atol=2e-4 * np.abs(want).max())
        while len(out) < len(ref["greedy"]):
            out.append(await pipe.forward_tokens_and_sample([out[-1]], False, gen))
        assert out == ref["greedy"]
    finally:
        pipe.dispose()
