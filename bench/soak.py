"""Soak: concurrent clients against `serve` on 127.0.0.1 for a set time — throughput, errors by kind,
latency and the server's memory over time.

    python bench/soak.py [--duration 300] [--clients 16] [--max-queue 8] [--request-timeout 120]
                         [--seed 0] [--out bench/results/soak.json] [--chat-model REF] [--embed-model REF]
    python bench/soak.py --smoke [--chat-model REF] [--embed-model REF] [--out PATH]

Starts `python -m webgpu_engine serve` with both default models on a free port of 127.0.0.1 (or uses
`--url http://127.0.0.1:PORT` of a server already running there), then runs `clients` loops, each
drawing requests at random: streamed chats (a fifth of them hang up after a few chunks), plain chats,
completions, embeddings, and over-limit requests (n=17, five stop strings, 301 logit_bias entries,
2049 embedding inputs, NaN, a bogus charset, a text/plain body) that must be refused with a 4xx.
A 429 (full queue) waits its Retry-After. Prints a table and writes bench/results/soak.json:
requests served, answers by kind and status, p50/p95 latency, the server's RSS sampled every
`--rss-every` seconds, and how long it took to exit after SIGTERM. --chat-model / --embed-model:
other models (any model reference: an app-config id, a .gguf file, a model folder), served under the
default models' ids so that the request mix is unchanged. --smoke: 2 clients for 4 s, RSS every
second: checks that the script runs to the end (with small models, quickly); measures nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

# the server spawner of bench/serve.py (its stderr into a file, never a pipe nobody reads)
_spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).with_name("serve.py"))
serve_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_bench)

LLM_ID, EMB_ID = "SmolLM2-135M-Instruct-Q4_1", "all-MiniLM-L6-v2"
TOPICS = ["the sea", "a red fox", "bread", "rain in spring", "an old clock", "mountains", "tea",
          "a library", "the moon", "bicycles", "a small town", "winter birds"]
JSON = {"Content-Type": "application/json"}

# (name, path, body or raw bytes, headers): every one must be answered 4xx, never served
OVER_LIMIT = [
    ("n=17", "/v1/chat/completions", {"model": LLM_ID, "messages": [{"role": "user", "content": "hi"}],
                                      "n": 17, "max_tokens": 2}, JSON),
    ("5 stop strings", "/v1/chat/completions",
     {"model": LLM_ID, "messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}, JSON),
    ("301 logit_bias", "/v1/completions", {"model": LLM_ID, "prompt": "a",
                                           "logit_bias": {str(i): 1 for i in range(301)}}, JSON),
    ("2049 inputs", "/v1/embeddings", {"model": EMB_ID, "input": ["x"] * 2049}, JSON),
    ("NaN temperature", "/v1/chat/completions",
     b'{"model": "' + LLM_ID.encode() + b'", "messages": [{"role": "user", "content": "hi"}], '
     b'"temperature": NaN}', JSON),
    ("charset bogus", "/v1/embeddings", {"model": EMB_ID, "input": "a"},
     {"Content-Type": "application/json; charset=bogus"}),
    ("text/plain", "/v1/chat/completions", {"model": LLM_ID, "messages": []}, {"Content-Type": "text/plain"}),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Stats:
    def __init__(self):
        self.answers: Counter = Counter()              # (kind, status) -> count
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.unexpected: list[str] = []

    def add(self, kind: str, status: str, seconds: float, expected: bool) -> None:
        self.answers[(kind, status)] += 1
        if status in ("200", "disconnect"):
            self.latency[kind].append(seconds)
        if not expected:
            self.unexpected.append(f"{kind}: {status}")


# --------------------------------------------------------------------------- one client
async def client(i: int, base: str, stop_at: float, stats: Stats, seed: int) -> None:
    import aiohttp
    rng = random.Random(seed * 1000 + i)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        while time.monotonic() < stop_at:
            r = rng.random()
            t0 = time.perf_counter()
            retry = None
            if r < 0.35:
                kind = "chat stream"
                call = _chat_stream(s, base, rng)
            elif r < 0.55:
                kind = "chat"
                call = _post(s, base, "/v1/chat/completions", _chat_body(rng, 4, 12))
            elif r < 0.68:
                kind = "completion"
                call = _post(s, base, "/v1/completions", {
                    "model": LLM_ID, "prompt": f"A short story about {rng.choice(TOPICS)}:",
                    "max_tokens": rng.randint(4, 12), "temperature": 0.8, "seed": rng.randint(0, 99)})
            elif r < 0.90:
                kind = "embeddings"
                n = rng.choice([1, 1, 2, 4, 8, 16])
                call = _post(s, base, "/v1/embeddings",
                             {"model": EMB_ID, "input": [f"{rng.choice(TOPICS)} #{k}" for k in range(n)]})
            else:
                kind = "over-limit"
                _, path, body, headers = rng.choice(OVER_LIMIT)
                call = _post(s, base, path, body, headers)
            try:
                status, retry = await call
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = f"client {type(e).__name__}"
            dt = time.perf_counter() - t0
            if kind == "over-limit":
                expected = status.startswith("4") and status != "429"
            else:
                expected = status in ("200", "disconnect", "429")
            stats.add(kind, status, dt, expected)
            if retry is not None:
                await asyncio.sleep(min(10.0, float(retry)))


def _chat_body(rng: random.Random, lo: int, hi: int, **kw) -> dict:
    return {"model": LLM_ID, "max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0, 0.7, 1.0]),
            "messages": [{"role": "user", "content": f"Write one sentence about {rng.choice(TOPICS)}."}],
            **kw}


async def _post(s, base: str, path: str, body, headers=None) -> tuple[str, str | None]:
    """(HTTP status, Retry-After of a 429 or None)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with s.post(base + path, data=data, headers=headers or JSON) as resp:
        await resp.read()
        return str(resp.status), resp.headers.get("Retry-After") if resp.status == 429 else None


async def _chat_stream(s, base: str, rng: random.Random) -> tuple[str, str | None]:
    hang_up_after = rng.randint(1, 3) if rng.random() < 0.2 else None
    body = _chat_body(rng, 8, 24, stream=True)
    async with s.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return str(resp.status), resp.headers.get("Retry-After") if resp.status == 429 else None
        events = 0
        async for line in resp.content:
            if not line.strip():
                continue
            events += 1
            if line.strip() == b"data: [DONE]":
                return "200", None
            if b'"error"' in line:
                return "in-stream error", None
            if hang_up_after is not None and events >= hang_up_after:
                resp.close()                       # the client goes away mid-stream
                return "disconnect", None
        return "stream cut", None


# --------------------------------------------------------------------------- server
def start_server(port: int, a) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "webgpu_engine", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-queue", str(a.max_queue), "--request-timeout", str(a.request_timeout),
           "--shutdown-grace", "30"]
    if a.chat_model or a.embed_model:
        cmd += ["--model", a.chat_model or LLM_ID, "--model-id", LLM_ID,
                "--model", a.embed_model or EMB_ID, "--model-id", EMB_ID]
    return serve_bench.spawn_server(cmd)


async def wait_ready(base: str, proc: subprocess.Popen | None, limit: float = 600) -> None:
    import aiohttp
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while True:
            try:
                async with s.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"server exited: {serve_bench.server_log(proc, 2000)}")
            if time.monotonic() - t0 > limit:
                raise SystemExit("server did not become ready")
            await asyncio.sleep(0.5)


async def sample_rss(pid: int | None, every: float, stop_at: float, t0: float, out: list) -> None:
    while time.monotonic() < stop_at:
        if pid is not None:
            out.append((round(time.monotonic() - t0, 1), _rss_mib(pid)))
        await asyncio.sleep(every)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default 300)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue (default 8)")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--rss-every", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None,
                    help="a server already running on 127.0.0.1 (its RSS is not sampled)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    ap.add_argument("--chat-model", default=None, help=f"chat model reference, served as {LLM_ID}")
    ap.add_argument("--embed-model", default=None, help=f"embedding model reference, served as {EMB_ID}")
    ap.add_argument("--smoke", action="store_true", help="2 clients for 4 s: checks the script, measures nothing")
    a = ap.parse_args()
    if a.smoke:
        a.duration, a.clients, a.rss_every = 4.0, 2, 1.0
    proc = None
    if a.url:
        if not a.url.startswith(("http://127.0.0.1:", "http://localhost:")):
            raise SystemExit("--url must be a server on this machine (http://127.0.0.1:PORT)")
        base = a.url.rstrip("/").removesuffix("/v1")
    else:
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(port, a)
    try:
        t_load = time.monotonic()
        await wait_ready(base, proc)
        load_s = time.monotonic() - t_load
        stats, rss = Stats(), []
        load_start = os.getloadavg()[0]
        t0 = time.monotonic()
        stop_at = t0 + a.duration
        sampler = asyncio.create_task(sample_rss(proc.pid if proc else None, a.rss_every, stop_at, t0, rss))
        await asyncio.gather(*(client(i, base, stop_at, stats, a.seed) for i in range(a.clients)))
        wall = time.monotonic() - t0
        await sampler
        if proc is not None:
            rss.append((round(time.monotonic() - t0, 1), _rss_mib(proc.pid)))
    finally:
        exit_s = None
        if proc is not None and proc.poll() is None:
            t = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
                exit_s = time.monotonic() - t
            except subprocess.TimeoutExpired:
                proc.kill()

    kinds = sorted({k for k, _ in stats.answers})
    served = sum(n for (k, st), n in stats.answers.items() if st == "200")
    print(f"\n{a.clients} clients for {wall:.0f} s against {base} (models loaded in {load_s:.0f} s); "
          f"load average {load_start:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'kind':12s} {'requests':>8s} {'200':>6s} {'p50 s':>7s} {'p95 s':>7s}  other answers")
    rows = []
    for k in kinds:
        by = {st: n for (kk, st), n in stats.answers.items() if kk == k}
        p50, p95 = _pct(stats.latency[k], 0.5), _pct(stats.latency[k], 0.95)
        other = ", ".join(f"{st}: {n}" for st, n in sorted(by.items()) if st != "200")
        cells = [f"{'':7s}" if p is None else f"{p:7.2f}" for p in (p50, p95)]
        print(f"{k:12s} {sum(by.values()):8d} {by.get('200', 0):6d} {cells[0]} {cells[1]}  {other}")
        rows.append({"kind": k, "requests": sum(by.values()), "answers": by, "p50_s": p50, "p95_s": p95})
    print(f"served {served} requests ({served / wall:.2f}/s); unexpected answers: {len(stats.unexpected)}"
          + (f" ({Counter(stats.unexpected).most_common(5)})" if stats.unexpected else ""))
    if rss:
        first = rss[0][1]
        print("server RSS (MiB) over time: "
              + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in rss if m is not None))
        last = rss[-1][1]
        if first and last:
            print(f"RSS {first:.0f} -> {last:.0f} MiB ({100 * (last / first - 1):+.1f}%)")
    if exit_s is not None:
        print(f"exit after SIGTERM: {exit_s:.1f} s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "host": platform.platform(), "cpus": os.cpu_count(),
        "load_average_1m": [load_start, os.getloadavg()[0]],
        "config": {"duration_s": a.duration, "clients": a.clients, "max_queue": a.max_queue,
                   "request_timeout_s": a.request_timeout, "seed": a.seed},
        "wall_s": wall, "served": served, "unexpected": len(stats.unexpected),
        "unexpected_kinds": dict(Counter(stats.unexpected)), "results": rows,
        "rss_mib": rss, "exit_after_sigterm_s": exit_s}, indent=2))
    print(f"wrote {a.out.relative_to(ROOT) if a.out.is_relative_to(ROOT) else a.out}")


if __name__ == "__main__":
    asyncio.run(main())
