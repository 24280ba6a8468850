"""Serving throughput on Ray Serve replicas: `python -m webgpu_engine serve --ray-replicas R` (a local
Ray instance started by the server, R replicas each with its own engine and WebGPU device) under C
concurrent streaming clients, for R = 1 and 2, in the same run.

    python bench/ray_serve.py [--model REF] [--replicas 1,2] [--clients 8,16] [--max-tokens 64]
                              [--batch 8] [--context 1024] [--smoke] [--out PATH]

Clients and prompts as bench/serve.py (client k sends prompt k mod 8, temperature 0, ignore_eos,
`max_tokens` output tokens): per level aggregate output tok/s (all tokens / wall time), time to first
token and inter-token latency p50/p95. On one machine the replicas share its cores (and, on a CPU
adapter such as lavapipe, the device is those cores): a second replica adds throughput only where
the first leaves the hardware idle. Prints a table and writes bench/results/ray_serve.json. Needs
the [ray] extra and `openai`. --smoke: clients 8, 4 tokens each, batch 2: checks that the script runs
to the end (with a small model, quickly); its figures mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

# the clients, prompts and readiness wait of bench/serve.py
_spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).with_name("serve.py"))
serve_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_bench)


async def run_replicas(args, replicas: int) -> list[dict]:
    port = serve_bench.free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}     # a local instance of its own
    cmd = [sys.executable, "-m", "webgpu_engine", "serve", "--model", args.model, "--port", str(port),
           "--ray-replicas", str(replicas), "--max-queue", "none", "--context-window", str(args.context),
           "--max-num-sequences", str(args.batch)]
    t0 = time.perf_counter()
    proc = serve_bench.spawn_server(cmd, env)

    async def bounded(step):
        """A step under --step-timeout: past it the server's log is printed and the run fails (a
        hang then says where it hung, within the caller's patience)."""
        try:
            return await asyncio.wait_for(step, args.step_timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"replicas={replicas}: a step took over {args.step_timeout:.0f} s; the "
                               f"server's log ends:\n{serve_bench.server_log(proc)}") from None
    try:
        print(f"  replicas={replicas}: starting the server", flush=True)
        await serve_bench.wait_ready(base, proc, args.step_timeout)
        ready_s = time.perf_counter() - t0
        print(f"  replicas={replicas}: ready in {ready_s:.1f} s", flush=True)
        model_id = await bounded(serve_bench.served_id(base))
        # warm-up: every replica at every batch width it will see (first uses compile their shaders)
        await bounded(serve_bench.level(base, model_id, args.batch * replicas, 4))
        rows = []
        for c in args.clients:
            r = await bounded(serve_bench.level(base, model_id, c, args.max_tokens))
            r.update(replicas=replicas, ready_s=ready_s)
            rows.append(r)
            print(f"  replicas={replicas} clients={c:2d}: {r['tok_s']:7.1f} tok/s  ttft p50 {r['ttft_p50']:.2f} s "
                  f"p95 {r['ttft_p95']:.2f} s  itl p50 {r['itl_p50'] * 1e3:.0f} ms p95 {r['itl_p95'] * 1e3:.0f} ms",
                  flush=True)
        return rows
    finally:
        proc.terminate()          # SIGTERM: the server deletes its deployment and stops its Ray instance
        t1 = time.perf_counter()
        try:
            proc.wait(timeout=120)
            print(f"  replicas={replicas}: the server stopped in {time.perf_counter() - t1:.1f} s", flush=True)
        except subprocess.TimeoutExpired:
            print(f"replicas={replicas}: the server did not stop in 120 s after SIGTERM; killed. Its log "
                  f"ends:\n{serve_bench.server_log(proc)}", file=sys.stderr, flush=True)
            proc.kill()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct-Q4_1")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="max_num_sequences of each replica")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ray_serve.json"))
    ap.add_argument("--step-timeout", type=float, default=1800.0,
                    help="seconds a server start or a level may take before the run fails, printing the server's log")
    ap.add_argument("--smoke", action="store_true", help="clients 8, 4 tokens, batch 2: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.max_tokens, args.batch, args.step_timeout = "8", 4, 2, 150.0
    args.clients = [int(c) for c in args.clients.split(",")]
    replica_counts = [int(r) for r in args.replicas.split(",")]
    rows = []
    for n in replica_counts:
        rows += await run_replicas(args, n)
    by = {(r["replicas"], r["clients"]): r for r in rows}
    print(f"\n{'clients':>7} | " + " ".join(f"{f'tok/s x{n}':>10}" for n in replica_counts)
          + " | " + " ".join(f"{f'ttft p95 x{n}':>12}" for n in replica_counts))
    for c in args.clients:
        print(f"{c:>7} | " + " ".join(f"{by[n, c]['tok_s']:10.1f}" for n in replica_counts) + " | "
              + " ".join(f"{by[n, c]['ttft_p95']:11.2f}s" for n in replica_counts))
    out = {"model": args.model, "max_tokens": args.max_tokens, "batch": args.batch, "context": args.context,
           "host": platform.node(), "cpus": os.cpu_count(), "rows": rows, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
