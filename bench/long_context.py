"""Long contexts: decode speed and memory at several cache positions for each KV cache dtype, and what
a quantised cache costs in accuracy, in one run. Greedy, one request at a time, the default chat
model (or --model: a file or folder).

    python bench/long_context.py [--model PATH] [--positions 512 2048 8192] [--kv auto q8_0 q4_0]
                                 [--window 512] [--decode 32] [--answer-tokens 64] [--out PATH]
    python bench/long_context.py --smoke [--model PATH] [--out PATH]

Speed: for each KV dtype the model is loaded once with a window of the largest position plus the
decode; at each position the cache is taken to hold that many tokens (their positions only: a decode
step's time depends on how many keys it reads, not on their values, and filling 8k positions by
prefill would take minutes on a software adapter) and `--decode` greedy tokens are timed. Memory: the
KV cache's bytes (what the load allocated for it: the scheduler's pool) and all the model's GPU bytes.
`--window W` (0: none) adds a row per unquantised KV dtype for WebLLM's sliding window with 4
attention sinks (context_window_size -1, sliding_window_size W): a ring of W positions plus a prefill
chunk, whatever the position (a quantised KV cache with a ring is refused at load).
Accuracy, against the default cache on fixed prompts: how many `--answer-tokens`-token greedy answers
are identical, the mean length of the common start, and the mean |delta logprob| of the greedy tokens
over that common start (the same tokens scored by both caches).
llama.cpp's figures with its `-ctk/-ctv` cache types (f16, q8_0) on the same GGUF in the same run,
where the `bench` extra has llama-cpp-python (CPU).
Prints a table and writes bench/results/long_context.json. --smoke: positions 64 and 128, 4 tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["What is the capital of France? Answer and tell me one fact about it.",
           "Write a short poem about the sea.",
           "Explain what a prime number is, with examples.",
           "Give me three tips for learning to cook.",
           "Summarise the plot of a detective story in a few sentences.",
           "How does a bicycle stay upright?"]


async def _answer(pipe, prompt: str, tokens: int) -> tuple[list[int], list[float]]:
    from webgpu_engine.config import GenerationConfig
    pipe.reset_chat()
    await pipe.prefill_step([{"role": "user", "content": prompt}],
                            GenerationConfig(temperature=0.0, max_tokens=tokens, logprobs=True))
    while not pipe.stopped:
        await pipe.decode_step()
    return list(pipe.output_ids), [e["logprob"] for e in pipe.token_logprobs]


async def _decode_at(pipe, pos: int, n: int) -> float:
    """tok/s of n greedy one-row decode steps of the scheduler's paged forward (record, submit, read
    the token) with the cache counting `pos` positions (see the module's note)."""
    from llm import _HandLoop
    loop = _HandLoop.at(pipe, pos, pipe.prompt_ids(None, "Hello")[-1])
    try:
        pipe.dev.submit(loop.step())            # warm: pipelines for this key count
        await loop.read()
        t = time.perf_counter()
        for _ in range(n):
            pipe.dev.submit(loop.step())
            await loop.read()
        return n / (time.perf_counter() - t)
    finally:
        loop.close()


async def run_kv(path: Path, kv: str, positions: list[int], decode: int, answer_tokens: int,
                 window: int = 0) -> dict:
    from webgpu_engine import gpu
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    dev = await gpu.request_device()
    ctx = max(positions) + decode + 8
    slide = dict(context_window_size=-1, sliding_window_size=window, attention_sink_size=4) if window else \
        dict(context_window_size=ctx)
    pipe = await LLMChatPipeline.load(dev, path, ChatConfig(compile_at_load=False, kv_cache_dtype=kv, **slide))
    try:
        cfg = pipe.model.cfg
        row = {"kv_cache_dtype": kv, "sliding_window": window, "dtype": pipe.plan.dtype, "context": pipe.model.ctx,
               "kv_cache_bytes": sum(t.nbytes for kv in pipe.scheduler.fwd.pools for t in kv),
               "kv_bytes_per_token": pipe.plan.kv_bytes_per_token(cfg),
               "model_gpu_bytes": dev.allocated_bytes(pipe.owner), "decode_tok_s": {}}
        for pos in positions:
            row["decode_tok_s"][str(pos)] = await _decode_at(pipe, pos, decode)
        row["answers"] = [await _answer(pipe, p, answer_tokens) for p in PROMPTS]
        return row
    finally:
        pipe.dispose()
        dev.close()


def _accuracy(base: list, other: list) -> dict:
    same, common, deltas = 0, [], []
    for (ids_a, lp_a), (ids_b, lp_b) in zip(base, other):
        n = 0
        while n < min(len(ids_a), len(ids_b)) and ids_a[n] == ids_b[n]:
            n += 1
        same += ids_a == ids_b
        common.append(n)
        deltas += [abs(a - b) for a, b in zip(lp_a[:n], lp_b[:n])]
    return {"identical_answers": same, "answers": len(base), "mean_common_tokens": sum(common) / len(common),
            "mean_abs_delta_logprob": sum(deltas) / len(deltas) if deltas else 0.0}


def llama_cpp_rows(path: Path, positions: list[int], decode: int) -> list[dict] | dict | None:
    """llama.cpp's decode tok/s at the positions with f16, q8_0 and q4_0 caches (a child process per cache
    type, so a crash of the native library is reported); None when llama_cpp does not import."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    rows = []
    for kv in ("f16", "q8_0", "q4_0"):
        cmd = [sys.executable, __file__, "--llama-cpp-child", kv, "--model", str(path),
               "--positions", *map(str, positions), "--decode", str(decode)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            rows.append({"kv_cache_dtype": kv, "error": f"llama.cpp exited {r.returncode}: {r.stderr.strip()[-300:]}"})
        else:
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return rows


def _llama_cpp_child(path: Path, kv: str, positions: list[int], decode: int) -> dict:
    import llama_cpp
    ggml = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}[kv]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(positions) + decode + 8, n_threads=2, verbose=False,
                          type_k=ggml, type_v=ggml, flash_attn=True)      # a quantised V needs flash attention
    out = {"kv_cache_dtype": kv, "version": getattr(llama_cpp, "__version__", "?"), "decode_tok_s": {}}
    for pos in positions:
        llm.reset()
        llm.eval([1] * pos)             # llama.cpp fills the positions by prefill (its own, on the CPU)
        t = time.perf_counter()
        for _ in range(decode):         # a step's time does not depend on the token fed
            llm.eval([1])
        out["decode_tok_s"][str(pos)] = decode / (time.perf_counter() - t)
    return out


async def main_async(a) -> dict:
    from webgpu_engine import cache
    path = Path(a.model) if a.model else Path(cache.default_model_path("SmolLM2-135M-Instruct-Q4_1"))
    # a sliding window's ring is kept in the activations' dtype (a quantised KV cache with one is refused)
    rows = [await run_kv(path, kv, a.positions, a.decode, a.answer_tokens, w)
            for w in ([0, a.window] if a.window else [0]) for kv in a.kv if not (w and kv in ("q8_0", "q4_0"))]
    base = rows[0]["answers"]
    for r in rows:
        r["accuracy_vs_" + a.kv[0]] = _accuracy(base, r.pop("answers"))
    from webgpu_engine import gpu
    dev = await gpu.request_device()
    adapter = f"{dev.info.vendor} {dev.info.device} ({dev.info.adapter_type})"
    dev.close()
    return {"model": str(path), "positions": a.positions, "decode_tokens": a.decode,
            "answer_tokens": a.answer_tokens, "machine": platform.processor() or platform.machine(),
            "adapter": adapter, "rows": rows, "llama_cpp": llama_cpp_rows(path, a.positions, a.decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a chat model file or folder (default: SmolLM2-135M-Instruct-Q4_1)")
    ap.add_argument("--positions", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--kv", nargs="+", default=["auto", "q8_0", "q4_0"], help="KV cache dtypes; the first is the reference")
    ap.add_argument("--window", type=int, default=512, help="sliding window rows too (0: none)")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="positions 64 and 128, 4 tokens: checks the script")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "long_context.json")
    ap.add_argument("--llama-cpp-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.llama_cpp_child:
        print(json.dumps(_llama_cpp_child(Path(a.model), a.llama_cpp_child, a.positions, a.decode)))
        return
    if a.smoke:
        a.positions, a.decode, a.answer_tokens, a.window = [64, 128], 4, 4, min(a.window, 48)
    data = asyncio.run(main_async(a))
    ref = a.kv[0]
    pos_cols = " ".join(f"{f'tok/s @{p}':>11}" for p in a.positions)
    print(f"{'kv cache':8} {'window':>6} {'dtype':5} {'KV MiB':>8} {'B/token':>8} {'model MiB':>9} {pos_cols} "
          f"{'same answers':>12} {'common tok':>10} {'|d logprob|':>11}")
    for r in data["rows"]:
        acc = r[f"accuracy_vs_{ref}"]
        speeds = " ".join(f"{r['decode_tok_s'][str(p)]:11.2f}" for p in a.positions)
        print(f"{r['kv_cache_dtype']:8} {r['sliding_window'] or '-':>6} {r['dtype']:5} "
              f"{r['kv_cache_bytes'] / 2 ** 20:8.1f} "
              f"{r['kv_bytes_per_token']:8d} {r['model_gpu_bytes'] / 2 ** 20:9.1f} {speeds} "
              f"{acc['identical_answers']:>5}/{acc['answers']:<6} {acc['mean_common_tokens']:10.1f} "
              f"{acc['mean_abs_delta_logprob']:11.4f}")
    lc = data["llama_cpp"]
    if lc is None:
        print("llama.cpp: llama-cpp-python is not installed (pip install -e '.[bench]')")
    else:
        for r in lc:
            if "error" in r:
                print(f"llama.cpp {r['kv_cache_dtype']}: {r['error']}")
            else:
                print(f"llama.cpp {r['kv_cache_dtype']:5} " + " ".join(
                    f"{r['decode_tok_s'][str(p)]:11.2f}" for p in a.positions))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
