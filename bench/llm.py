"""LLM benchmark: prefill and decode speed of LLMChatPipeline on a GGUF (default SmolLM2), where the time
goes (host encoding vs GPU wait vs readback, GPU time per kernel kind), and llama.cpp on the same file
when `llama_cpp` imports. Prints a table and writes bench/results/llm.json.

    python bench/llm.py [--model PATH] [--dtype f32|f16|auto] [--decode 128] [--prompts 128,512]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _prompt_ids(tok, n: int) -> list[int]:
    text = ("The history of the city begins with a small settlement on the river, where traders met "
            "to exchange salt, grain and stories. ") * (n // 8 + 8)
    return tok.encode(text)[:n]


async def bench_engine(path: Path, dtype: str, prompts: list[int], n_decode: int, reps: int) -> dict:
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.gpu import request_device
    from webgpu_engine.pipelines.llm import LLMChatPipeline

    dev = await request_device()
    ctx = max(prompts) + n_decode + 8
    t0 = time.perf_counter()
    pipe = await LLMChatPipeline.load(dev, path, ChatConfig(dtype=dtype, context_window_size=ctx,
                                                            prefill_chunk_size=256))
    out = {"adapter": dev.info.name, "dtype": pipe.model.dtype, "load_s": time.perf_counter() - t0,
           "dispatches_per_decode_step": sum(len(op.dispatches) for op in pipe.model.decode_ops) + 1}
    gen = GenerationConfig(temperature=0.0, ignore_eos=True)
    # warm-up: compiles every pipeline of the shapes used below
    for n in prompts:
        await pipe.forward_tokens_and_sample(_prompt_ids(pipe.tokenizer, n), True, gen)
    for n in prompts:
        ids = _prompt_ids(pipe.tokenizer, n)
        best = 1e9
        for _ in range(reps):
            t = time.perf_counter()
            await pipe.forward_tokens_and_sample(ids, True, gen)
            best = min(best, time.perf_counter() - t)
        out[f"prefill_{n}_tokens_per_s"] = n / best
        out[f"time_to_first_token_{n}_s"] = best
    # decode: host encoding vs submit vs GPU wait + readback, per step
    ids = _prompt_ids(pipe.tokenizer, 32)
    await pipe.forward_tokens_and_sample(ids, True, gen)
    m, s = pipe.model, pipe.sampler
    enc = sub = wait = 0.0
    pos = len(pipe.kv_ids)
    t_all = time.perf_counter()
    for i in range(n_decode):
        t = time.perf_counter()
        b = dev.batch()
        m.record_decode(b, pos + i)
        pipe._sample_op.record(b)
        t1 = time.perf_counter()
        dev.submit(b)
        t2 = time.perf_counter()
        await s.read(False)
        t3 = time.perf_counter()
        enc, sub, wait = enc + t1 - t, sub + t2 - t1, wait + t3 - t2
    total = time.perf_counter() - t_all
    out.update({"decode_tokens_per_s": n_decode / total, "decode_step_ms": 1e3 * total / n_decode,
                "host_record_ms": 1e3 * enc / n_decode, "host_submit_encode_ms": 1e3 * sub / n_decode,
                "gpu_wait_and_readback_ms": 1e3 * wait / n_decode})
    # readback alone (a 4-byte read after an empty submit)
    t = time.perf_counter()
    for _ in range(20):
        await dev.read(s.io, 0, 4)
    out["readback_only_ms"] = 1e3 * (time.perf_counter() - t) / 20
    out["gpu_ms_by_kernel_decode"] = _by_kind(dev, m.decode_ops + [pipe._sample_op], m.step)
    out["gpu_ms_by_kernel_prefill_128"] = _by_kind(dev, m.ops_for(min(128, m.chunk), True), m.step)
    pipe.dispose()
    return out


def _by_kind(dev, ops, sync_buf) -> dict:
    """GPU time per kernel kind: each kind's dispatches submitted alone (best of 3)."""
    kinds = defaultdict(list)
    for op in ops:
        kinds[(op.name or "op").split("[")[0]].append(op)
    res = {}
    for name, group in kinds.items():
        best = 1e9
        for _ in range(3):
            b = dev.batch()
            for op in group:
                op.record(b)
            t = time.perf_counter()
            dev.submit(b)
            dev.read_sync(sync_buf, 0, 4)
            best = min(best, time.perf_counter() - t)
        res[name] = round(1e3 * best, 2)
    return res


def bench_llama_cpp(path: Path, prompts: list[int], n_decode: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(prompts) + n_decode + 8, n_threads=2,
                          verbose=False)
    out = {"version": getattr(llama_cpp, "__version__", "?")}

    class Tok:       # llama.cpp's own tokenizer behind the interface _prompt_ids expects
        def encode(self, text):
            return llm.tokenize(text.encode(), add_bos=False)
    for n in prompts:
        ids = _prompt_ids(Tok(), n)
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        out[f"prefill_{n}_tokens_per_s"] = n / (time.perf_counter() - t)
        out[f"time_to_first_token_{n}_s"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_decode):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())     # greedy, like the engine run
        llm.eval([tok])
    out["decode_tokens_per_s"] = n_decode / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the SmolLM2 default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "llm.json"))
    a = ap.parse_args()
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    if a.model:
        path = Path(a.model)
    else:
        from webgpu_engine import cache
        path = Path(cache.default_model_path("SmolLM2-135M-Instruct-Q4_1"))
    prompts = [int(x) for x in a.prompts.split(",")]
    res = {"model": path.name, "engine": asyncio.run(bench_engine(path, a.dtype, prompts, a.decode, a.reps))}
    ref = bench_llama_cpp(path, prompts, a.decode)
    if ref:
        res["llama_cpp"] = ref
        res["ratio_engine_over_llama_cpp"] = {k: res["engine"][k] / ref[k] for k in ref
                                             if k.endswith("_per_s") and k in res["engine"]}
    e = res["engine"]
    rows = [(k, e[k]) for k in e if isinstance(e[k], (int, float))]
    w = max(len(k) for k, _ in rows)
    print(f"{'metric':<{w}}  webgpu_engine ({e['dtype']}, {e['adapter']})" + ("  llama.cpp" if ref else ""))
    for k, v in rows:
        print(f"{k:<{w}}  {v:>12.2f}" + (f"  {ref[k]:>10.2f}" if ref and k in ref else ""))
    for kind in ("gpu_ms_by_kernel_decode", "gpu_ms_by_kernel_prefill_128"):
        print(kind + ": " + ", ".join(f"{k} {v}" for k, v in e[kind].items()))
    if not ref:
        print("llama.cpp: not measured (llama_cpp does not import)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
