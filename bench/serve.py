"""Serving throughput with concurrent clients: the OpenAI-compatible server (`python -m webgpu_engine
serve`) driven by the official `openai` async client, with continuous batching
(--max-num-sequences) and without it (max_num_sequences = 1: one request at a time), in the same run.

    python bench/serve.py [--model REF] [--clients 1,2,4,8,16] [--max-tokens 128] [--batch 0]
                          [--context 1024] [--window W] [--repeats 3] [--port 8391] [--smoke] [--out PATH]

Before the levels each server's background compiler is waited for (/v1/models kernels.compiling
== 0; the wait is printed), so that a level measures decoding, not kernels still compiling (a lone
request's decode steps otherwise ran on stand-ins and compiles: 5.7 instead of 11.6 tok/s).
Both servers run at once (an idle one costs nothing) and each level runs `--repeats` rounds with the
servers in turn (A B, B A, A B: this host's speed drifts over minutes, and a lone request's figure moved
by 30% between runs of one server after the other); a row gives the median round's tok/s and every
round's. Each level starts C streaming clients at once; client k sends prompt k mod 8 (fixed prompts of
mixed length, 5 .. ~230 tokens), temperature 0, ignore_eos, `max_tokens` output tokens. Per level:
aggregate output tok/s (all tokens / wall time), time to first token p50/p95 and inter-token latency
p50/p95 over all clients of all rounds, and the server process's CPU seconds per output token (best
round; Linux: a CPU adapter's threads are the server's, so it does not move with the host's load). After each level the batched server's scheduler figures from
/v1/models (`batching`: iterations, decode rows, prefill tokens, preemptions, prefix hits) say where the
time went: decode rows per iteration is the batch the matmuls saw. Prints a table and writes
bench/results/serve.json. Needs the `openai` package (bench extra). --model takes any model reference
(an app-config id, a .gguf file, a model folder); --port 0 serves on free ports. --smoke: clients 1,8, 4
tokens each, batch 2, 2 rounds: checks that the script runs to the end (with a small model, quickly);
its figures mean nothing. --window W: both servers load WebLLM's sliding window with sinks instead of a
context (context_window_size -1, sliding_window_size W, attention_sink_size 4): the ring, batched or not.

--lora PATH (a PEFT folder or a GGUF LoRA file; `random`: a random rank-16 adapter of all seven
projections written for --model, its tensors in --lora-dtype) measures instead what a decode row with
an adapter costs beside a base row: one batched server serving the adapter as `bench`, one streaming
client at a time on the base and on the adapter in turn (`--repeats` rounds each, A B, B A, ...), then
two at once, base + base and base + adapter in turn (`--repeats` rounds each); each round's
inter-token latency p50 (a decode step's time), the best round of each and the adapter's over the
base's; the same for the server process's CPU seconds per token (Linux: what a round cost whatever
else the host runs; a CPU adapter's threads are the server's). The adapter's
kernels are compiled (and waited for) before the rounds. Writes bench/results/serve_lora.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

BASE = ("Explain how a compiler turns source code into machine code, step by step, and say why each "
        "step exists. Mention lexing, parsing, type checking, optimisation and code generation. ")
PROMPTS = ["Hi!", "Name three colours.", "Write a haiku about rivers.",
           "What is the capital of France? Answer in one sentence.",
           BASE, BASE * 2, "Summarise: " + BASE * 3, "Translate into French: " + BASE * 4]


def spawn_server(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start a server process whose stderr goes to a temporary file, never to a pipe: a pipe nobody
    reads fills (64 KiB; Ray forwards every replica's log lines) and the server then blocks on a
    write, answering nothing. `server_log(proc)` reads the file's end."""
    import tempfile
    log = tempfile.TemporaryFile(mode="w+", prefix="webgpu-engine-serve-")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    proc.log = log
    return proc


def server_log(proc: subprocess.Popen, chars: int = 3000) -> str:
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read()[-chars:]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def wait_ready(base: str, proc, timeout: float = 600.0) -> None:
    import aiohttp
    t0 = time.time()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{server_log(proc)}")
            try:
                async with s.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(1.0)
    raise RuntimeError(f"the server did not become ready in {timeout:.0f} s:\n{server_log(proc)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def served_id(base: str) -> str:
    """The id the server knows its (one) model by: --model's id, or a file's or folder's name."""
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/models") as r:
            return (await r.json())["data"][0]["id"]


async def batching(base: str) -> dict | None:
    """The scheduler's figures of the served model (None without batching)."""
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/models") as r:
            data = (await r.json())["data"]
    return data[0].get("batching") if data else None


async def compiled(base: str, timeout: float = 1800.0) -> float:
    """Wait until the served model's background compiler has compiled every kernel its load queued
    (/v1/models kernels.compiling == 0), so that the levels measure decoding, not compiling.
    Returns the seconds waited."""
    import aiohttp
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        while time.perf_counter() - t0 < timeout:
            async with s.get(base + "/v1/models") as r:
                data = (await r.json())["data"]
            if not data or not data[0].get("kernels", {}).get("compiling"):
                break
            await asyncio.sleep(0.5)
    return time.perf_counter() - t0


async def one_client(client, model: str, k: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times = []
    stream = await client.completions.create(model=model, prompt=PROMPTS[k % len(PROMPTS)], max_tokens=max_tokens,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    n = len(times)
    return {"ttft": times[0] - t0 if times else 0.0, "itl": [b - a for a, b in zip(times, times[1:])],
            "chunks": n, "t_end": time.perf_counter()}


async def level(base: str, model: str, c: int, max_tokens: int, raw: bool = False) -> dict:
    """C clients at once; with `raw` the row keeps every TTFT and ITL (_ttft, _itl)."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    res = await asyncio.gather(*[one_client(client, model, k, max_tokens) for k in range(c)])
    wall = time.perf_counter() - t0
    await client.close()
    tokens = c * max_tokens               # ignore_eos: every client gets max_tokens tokens
    itl = [x for r in res for x in r["itl"]]
    ttft = [r["ttft"] for r in res]
    return {"clients": c, "wall_s": wall, "tok_s": tokens / wall, "ttft_p50": pct(ttft, 50),
            "ttft_p95": pct(ttft, 95), "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95),
            "chunks": sum(r["chunks"] for r in res), **({"_ttft": ttft, "_itl": itl} if raw else {})}


async def start_server(args, max_seqs: int) -> tuple:
    """A server with max_num_sequences = max_seqs, ready and done compiling: (process, base URL)."""
    port = args.port + max_seqs if args.port else free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "webgpu_engine", "serve", "--model", args.model, "--port", str(port),
           "--max-queue", "none", "--context-window", str(-1 if args.window else args.context),
           "--max-num-sequences", str(max_seqs)]
    if args.window:
        cmd += ["--chat-opts", json.dumps({"sliding_window_size": args.window, "attention_sink_size": 4})]
    proc = spawn_server(cmd)
    try:
        await wait_ready(base, proc)
        args.model_id = await served_id(base)
        waited = await compiled(base)
        print(f"  max_num_sequences={max_seqs:2d}: background compile done {waited:.1f} s after the server "
              "was ready", flush=True)
        await level(base, args.model_id, 1, 4)            # warm-up
    except BaseException:
        stop_server(proc)
        raise
    return proc, base


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def measured_level(base: str, model: str, c: int, max_tokens: int, max_seqs: int, pid: int) -> dict:
    """One level on one server, with its scheduler's figures and the server process's CPU seconds
    per output token over the level."""
    before = await batching(base)
    c0 = process_cpu_s(pid)
    r = await level(base, model, c, max_tokens, raw=True)
    r["cpu_s_per_token"] = (process_cpu_s(pid) - c0) / (c * max_tokens)
    r["max_num_sequences"] = max_seqs
    after = await batching(base)
    if before and after:
        r["scheduler"] = per_iteration({k: after[k] - before[k] for k in SCHEDULER_COUNTS})
    return r


SCHEDULER_COUNTS = ("iterations", "decode_rows", "prefill_tokens", "preemptions", "prefix_hit_tokens")


def per_iteration(counts: dict) -> dict:
    """Scheduler counts with decode rows per iteration (the batch the matmuls saw)."""
    return {**counts, "decode_rows_per_iteration": counts["decode_rows"] / max(1, counts["iterations"])}


def merged(runs: list[dict]) -> dict:
    """A level's rounds on one server as one row: the median round's tok/s (every round's kept),
    TTFT and ITL percentiles over all rounds' requests, the best round's server CPU per token."""
    row = {**runs[0], "tok_s": statistics.median(r["tok_s"] for r in runs),
           "tok_s_rounds": [r["tok_s"] for r in runs], "wall_s": sum(r["wall_s"] for r in runs),
           "cpu_s_per_token": min(r["cpu_s_per_token"] for r in runs),
           "cpu_s_per_token_rounds": [r["cpu_s_per_token"] for r in runs],
           "chunks": sum(r["chunks"] for r in runs)}
    for k in ("ttft", "itl"):
        xs = [x for r in runs for x in r["_" + k]]
        row[k + "_p50"], row[k + "_p95"] = pct(xs, 50), pct(xs, 95)
    for k in ("_ttft", "_itl"):
        row.pop(k, None)
    if "scheduler" in runs[0]:
        row["scheduler"] = per_iteration({k: sum(r["scheduler"][k] for r in runs) for k in SCHEDULER_COUNTS})
    return row


async def run_servers(args) -> list[dict]:
    """Both servers up at once (an idle one costs nothing), each level run `--repeats` rounds in
    turn (A B, B A, ...): host speed drifts over minutes, so the servers see the same drift."""
    servers = {}
    try:
        for max_seqs in (1, args.batch):
            servers[max_seqs] = await start_server(args, max_seqs)
        rows = []
        for c in args.clients:
            runs = {m: [] for m in servers}
            for k in range(args.repeats):
                for m in (list(servers) if k % 2 == 0 else list(servers)[::-1]):
                    runs[m].append(await measured_level(servers[m][1], args.model_id, c, args.max_tokens, m,
                                                        servers[m][0].pid))
            for m, rs in runs.items():
                r = merged(rs)
                rows.append(r)
                print(f"  max_num_sequences={m:2d} clients={c:2d}: {r['tok_s']:7.1f} tok/s (rounds "
                      + " ".join(f"{x:.1f}" for x in r["tok_s_rounds"])
                      + f")  ttft p50 {r['ttft_p50']:.2f} s p95 {r['ttft_p95']:.2f} s  itl p50 "
                      f"{r['itl_p50'] * 1e3:.0f} ms p95 {r['itl_p95'] * 1e3:.0f} ms  CPU "
                      f"{r['cpu_s_per_token'] * 1e3:.0f} ms/token"
                      + (f"  rows/iteration {r['scheduler']['decode_rows_per_iteration']:.1f}"
                         if "scheduler" in r else ""), flush=True)
        return rows
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


def random_adapter(model: str, folder: Path, rank: int = 16, dtype: str = "f32") -> str:
    """A PEFT folder with a random rank-`rank` adapter of q/k/v/o/gate/up/down for --model's dims,
    its tensors saved as `dtype` (f32, or f16 / bf16 as PEFT saves a 16-bit adapter)."""
    import numpy as np
    sys.path.insert(0, str(ROOT))
    from webgpu_engine.cache import default_model_path
    from webgpu_engine.loaders.safetensors import write_safetensors
    from webgpu_engine.models.lora import HALVES
    from webgpu_engine.models.registry import open_model
    path = Path(model) if Path(model).exists() else default_model_path(model)
    m = open_model(path)
    c = m.config
    m.close()
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(c.n_layers):
        D, F, C = c.head_dim_of(i), c.ffn_of(i), c.hidden_size
        shapes = {"self_attn.q_proj": (C, c.n_heads * D), "self_attn.k_proj": (C, c.n_kv_heads * D),
                  "self_attn.v_proj": (C, c.n_kv_heads * D), "self_attn.o_proj": (c.n_heads * D, C),
                  "mlp.gate_proj": (C, F), "mlp.up_proj": (C, F), "mlp.down_proj": (F, C)}
        for proj, (k, n) in shapes.items():
            for ab, shape in (("A", (rank, k)), ("B", (n, rank))):
                t = rng.standard_normal(shape) / np.sqrt(shape[1]) * 0.1
                t = t.astype(np.float32) if dtype == "f32" else HALVES[dtype][0](t)
                tensors[f"base_model.model.model.layers.{i}.{proj}.lora_{ab}.weight"] = (dtype, shape, t.tobytes())
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return str(folder)


async def lora_rows(args) -> dict:
    """A decode row with an adapter beside a base row (see the module's note on --lora)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        lora = (random_adapter(args.model, Path(tmp) / "lora", dtype=args.lora_dtype) if args.lora == "random"
                else args.lora)
        port = args.port if args.port else free_port()
        base = f"http://127.0.0.1:{port}"
        proc = spawn_server([sys.executable, "-m", "webgpu_engine", "serve", "--model", args.model, "--port",
                             str(port), "--context-window", str(args.context), "--max-num-sequences",
                             str(args.batch or 4), "--lora", f"bench={lora}"])
        try:
            await wait_ready(base, proc)
            model = await served_id(base)
            await compiled(base)
            for name in (model, "bench"):                  # warm-up: both op lists compiled and run
                await level(base, name, 1, 4)
            await compiled(base)                           # the adapter's kernels too
            itl, cpu = {model: [], "bench": []}, {model: [], "bench": []}
            for k in range(args.repeats):
                for name in ((model, "bench") if k % 2 == 0 else ("bench", model)):
                    c0 = process_cpu_s(proc.pid)
                    r = await level(base, name, 1, args.max_tokens, raw=True)
                    itl[name].append(pct(r["_itl"], 50))
                    cpu[name].append((process_cpu_s(proc.pid) - c0) / args.max_tokens)
            # two streams at once, the base beside the base and beside the adapter in turn
            pairs = {"base+base": (model, model), "base+adapter": (model, "bench")}
            both = {p: {"itl": [], "cpu": []} for p in pairs}
            for k in range(args.repeats):
                for p in (tuple(pairs) if k % 2 == 0 else tuple(pairs)[::-1]):
                    c0 = process_cpu_s(proc.pid)
                    r = await together(base, pairs[p], args.max_tokens)
                    both[p]["itl"].append(pct(r, 50))
                    both[p]["cpu"].append((process_cpu_s(proc.pid) - c0) / (2 * args.max_tokens))
        finally:
            stop_server(proc)
    # each round's ITL p50; the best round of each is the least disturbed by the host's other work
    row = {"base_itl_p50_rounds": itl[model], "lora_itl_p50_rounds": itl["bench"],
           "base_itl_p50": min(itl[model]), "lora_itl_p50": min(itl["bench"]),
           "base_cpu_per_token_rounds": cpu[model], "lora_cpu_per_token_rounds": cpu["bench"],
           "base_cpu_per_token": min(cpu[model]), "lora_cpu_per_token": min(cpu["bench"]),
           **{f"together_{p.replace('+', '_')}_{k}_rounds": v[k] for p, v in both.items() for k in ("itl", "cpu")}}
    row["lora_over_base"] = row["lora_itl_p50"] / row["base_itl_p50"]
    row["lora_over_base_cpu"] = row["lora_cpu_per_token"] / row["base_cpu_per_token"]
    print(f"decode step, one stream (best round's ITL p50): base {row['base_itl_p50'] * 1e3:.1f} ms, with the "
          f"adapter {row['lora_itl_p50'] * 1e3:.1f} ms ({row['lora_over_base']:.2f}x); rounds "
          + " ".join(f"{b * 1e3:.0f}/{a * 1e3:.0f}" for b, a in zip(itl[model], itl["bench"])))
    print(f"server CPU per token (best round): base {row['base_cpu_per_token'] * 1e3:.1f} ms, with the adapter "
          f"{row['lora_cpu_per_token'] * 1e3:.1f} ms ({row['lora_over_base_cpu']:.2f}x); rounds "
          + " ".join(f"{b * 1e3:.0f}/{a * 1e3:.0f}" for b, a in zip(cpu[model], cpu["bench"])))
    for p, v in both.items():
        print(f"two streams at once, {p}: ITL p50 rounds " + " ".join(f"{x * 1e3:.0f}" for x in v["itl"])
              + " ms; server CPU per token rounds " + " ".join(f"{x * 1e3:.0f}" for x in v["cpu"]) + " ms")
    return row


async def together(base: str, models: tuple, max_tokens: int) -> list:
    """The inter-token latencies of one stream on each of `models` at once (different prompts)."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
    res = await asyncio.gather(*[one_client(client, name, k, max_tokens) for k, name in enumerate(models)])
    await client.close()
    return [x for r in res for x in r["itl"]]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads: a CPU adapter's included) of process `pid` so far
    (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct-Q4_1")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=0, help="max_num_sequences of the batched server (0: as "
                    "serve picks for the adapter: 4 on a CPU one (or its measured width), 16 on a GPU)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--window", type=int, default=0, help="a sliding window of W positions with 4 sinks "
                    "(the ring) instead of --context")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per level, the servers in turn (median)")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve.json"))
    ap.add_argument("--lora", default=None, metavar="PATH|random",
                    help="measure a decode row with this LoRA adapter against a base row instead")
    ap.add_argument("--lora-dtype", default="f32", choices=("f32", "f16", "bf16"),
                    help="the tensors' dtype of --lora random (f16, bf16: as PEFT saves a 16-bit adapter)")
    ap.add_argument("--smoke", action="store_true",
                    help="clients 1,8, 4 tokens, batch 2: checks the script, measures nothing")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.max_tokens, args.batch, args.repeats = "1,8", 4, 2, 2
    args.clients = [int(c) for c in args.clients.split(",")]
    if args.lora:
        out = {"model": args.model, "lora": args.lora, "lora_dtype": args.lora_dtype, "max_tokens": args.max_tokens,
               "repeats": args.repeats,
               "host": platform.node(), **await lora_rows(args), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        path = Path(args.out).with_name("serve_lora.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
        return 0
    rows = await run_servers(args)
    one = {r["clients"]: r for r in rows if r["max_num_sequences"] == 1}
    bat = {r["clients"]: r for r in rows if r["max_num_sequences"] == args.batch}
    print(f"\n{'clients':>7} | {'tok/s x1':>9} {'tok/s batched':>13} {'gain':>5} | {'ttft p95 x1':>11} "
          f"{'batched':>8} | {'itl p50 batched':>15} | {'CPU ms/token x1':>15} {'batched':>8} {'gain':>5}")
    for c in args.clients:
        a, b = one[c], bat[c]
        print(f"{c:>7} | {a['tok_s']:9.1f} {b['tok_s']:13.1f} {b['tok_s'] / a['tok_s']:5.2f} | "
              f"{a['ttft_p95']:10.2f}s {b['ttft_p95']:7.2f}s | {b['itl_p50'] * 1e3:13.0f}ms | "
              f"{a['cpu_s_per_token'] * 1e3:15.1f} {b['cpu_s_per_token'] * 1e3:8.1f} "
              f"{a['cpu_s_per_token'] / max(b['cpu_s_per_token'], 1e-9):5.2f}")
    lone = bat[args.clients[0]]
    summary = {}
    if 8 in bat and 1 in bat:
        summary = {"tok_s_8_over_1": bat[8]["tok_s"] / bat[1]["tok_s"],
                   "ttft_p95_8_over_lone": bat[8]["ttft_p95"] / max(lone["ttft_p95"], 1e-9),
                   "cpu_per_token_8_x1_over_batched": one[8]["cpu_s_per_token"] / max(bat[8]["cpu_s_per_token"], 1e-9)}
        print(f"\nbatched: aggregate tok/s at 8 clients = {summary['tok_s_8_over_1']:.2f} x 1 client; "
              f"TTFT p95 at 8 = {summary['ttft_p95_8_over_lone']:.2f} x a lone request's")
    out = {"model": args.model, "max_tokens": args.max_tokens, "batch": args.batch, "context": args.context,
           "window": args.window,
           "host": platform.node(), "rows": rows, "summary": summary,
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
