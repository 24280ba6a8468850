"""The golden SmolLM2 greedy tokens and MiniLM vectors with the GPU kernel family forced
(WEBGPU_ENGINE_KERNELS=gpu): coalesced decode and tiled GEMM (kernels/matmul/gpu.py) in place of the
CPU-shaped kernels, on the real adapter. A short run (one prompt, 8 tokens) keeps the test small on
a CPU adapter, where these kernels are slow (and no load-time warm-up run of every pipeline: the
pipelines asserted below are then the ones the forward itself built); test_llama.py and
test_embedding_pipeline.py check the full goldens with the default family."""
from __future__ import annotations

import numpy as np

from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.kernels import matmul as mm
from webgpu_engine.pipelines.embedding import EmbeddingPipeline
from webgpu_engine.pipelines.llm import LLMChatPipeline

N_TOKENS = 8


async def test_smollm2_golden_greedy_gpu_family(fresh_device, smollm2_gguf, smollm2_reference, monkeypatch):
    monkeypatch.setenv(mm.FAMILY_ENV, "gpu")
    dev = fresh_device
    pipe = await LLMChatPipeline.load(dev, smollm2_gguf,
                                      ChatConfig(dtype="f32", context_window_size=128, prefill_chunk_size=64,
                                                 compile_at_load=False))
    try:
        assert mm.default_config(dev).family == "gpu"
        case = min(smollm2_reference["greedy"], key=lambda c: len(c["prompt_ids"]))
        gen = GenerationConfig(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=True,
                               top_logprobs=5)
        await pipe.prefill_step(case["messages"], gen)
        while not pipe.stopped:
            await pipe.decode_step()
        assert pipe.kv_ids[:len(case["prompt_ids"])] == case["prompt_ids"]
        assert list(pipe.output_ids) == case["greedy_ids_no_eos_stop"][:N_TOKENS], case["messages"]
        top = pipe.token_logprobs[0]["top_logprobs"]
        ref = case["first_step_top5"]
        assert [t["token"] for t in top] == [pipe.tokenizer.token_bytes(i).decode("utf-8", "replace")
                                             for i in ref["ids"]]
        np.testing.assert_allclose([t["logprob"] for t in top], ref["logprobs"], atol=0.01)
        # the forward ran the GPU family's kernels: decode and GEMM pipelines were built (by the
        # requests: compile_at_load is off)
        entries = {k.entry for k in dev._pipelines}
        assert {"matmul_gpu", "matmul_gemm"} <= entries, entries
    finally:
        pipe.dispose()


async def test_minilm_golden_vectors_gpu_family(fresh_device, minilm_dir, minilm_reference, monkeypatch):
    monkeypatch.setenv(mm.FAMILY_ENV, "gpu")
    dev = fresh_device
    pipe = await EmbeddingPipeline.load(dev, minilm_dir,
                                        ChatConfig(dtype="f32", max_batch_size=8, compile_at_load=False))
    try:
        items = minilm_reference["items"]
        res = await pipe.embed_step([it["text"] for it in items])
        for v, it in zip(res.embeddings, items):
            a, b = np.asarray(v, np.float64), np.asarray(it["embedding"], np.float64)
            assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) >= 0.9999, it["text"][:40]
        assert "matmul_gemm" in {k.entry for k in dev._pipelines}
    finally:
        pipe.dispose()
