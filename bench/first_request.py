"""Cold start: from process start to the first token (or vector), for the default chat model and
embedder, each in a fresh process (so nothing is cached in the process), in each compile mode.

    python bench/first_request.py [--no-shader-cache] [--tokens 8] [--modes background,at_load,lazy]
                                  [--models chat,embed] [--rounds 1] [--chat-model REF] [--embed-model REF]
    python bench/first_request.py --smoke [--chat-model REF] [--embed-model REF] [--out PATH]

Compile modes (chat options): `background` (the default: compile_at_load with compile_in_background;
the load returns once the weights are up and the kernels compile on worker threads, a request
compiling side by side what no worker has reached), `at_load` (compile_in_background off: every
kernel compiled and run once before the load returns) and `lazy` (compile_at_load off: each request
compiles what it uses). Each process times, from its own start (the parent's clock before it
launched the child): the load, the first request's first token, a second request of another
length right after it, the moment every queued kernel is compiled, and a third and fourth request
(short and long prompts) after that; and how many pipelines each request had to compile or wait
for (Device.compile_waits; in the lazy mode the pipelines each request created), how many of those
it dispatched empty to have the driver compile them early (Device.warmed, lavapipe), and the
process's CPU seconds up to the first request's end (all threads: the driver's compiles are ours,
so this does not move with the host's load as wall time does). --rounds N repeats every mode N
times, the modes interleaved (A/B in one window on a shared host). Prints a table and writes
bench/results/first_request.json. `--no-shader-cache` gives each child an empty Mesa shader cache
(MESA_SHADER_CACHE_DIR, a new temporary folder: a fresh machine's state, the cache on and empty);
`--shader-cache-off` sets MESA_SHADER_CACHE_DISABLE=true instead (nothing cached at all, so no
twin device: gpu/twin.py). "twin": of the pipelines the first request dispatched empty ("warm"), those it had compiled on the
twin device. --smoke: 2 tokens per chat request, the
background mode only: checks that the script runs to the end (with small models, quickly).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"background": {}, "at_load": {"compile_in_background": False}, "lazy": {"compile_at_load": False}}

CHILD = r'''
import asyncio, json, sys, time
t_launch, kind, n_tok, opts = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
from webgpu_engine.engine import EngineConfig, create_mlc_engine
from webgpu_engine.engine import DEFAULT_CHAT_MODEL as LLM, DEFAULT_EMBED_MODEL as EMB
ref = sys.argv[5] if len(sys.argv) > 5 else LLM if kind == "chat" else EMB
since = lambda: time.time() - t_launch
async def main():
    out = {"python_ready_s": since(), "python_ready_cpu_s": time.process_time()}
    eng = await create_mlc_engine(ref, EngineConfig(log_level="ERROR"), chat_opts=opts)
    dev = eng.device
    out["loaded_s"], out["queued_at_load"] = since(), dev.compiles_pending()
    async def request(name, prompt, chat=True):
        waits, count, warmed, t = dev.compile_waits, dev.compile_count, getattr(dev, "warmed", 0), time.perf_counter()
        twin = dev.twin_compiled
        if kind == "embed":
            await eng.embeddings.create(input=[prompt, prompt + " again"])
            out[name + "_first_s"] = since()
        else:
            if chat:
                r = await eng.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=n_tok, temperature=0, ignore_eos=True)
            else:
                r = await eng.completions.create(prompt=prompt, max_tokens=n_tok, temperature=0, ignore_eos=True)
            out[name + "_first_s"] = since() - (time.perf_counter() - t) + r.usage.extra.time_to_first_token_s
        out[name + "_request_s"] = time.perf_counter() - t
        # pipelines this request compiled or waited for: queued ones it needed, or (lazy) new ones
        out[name + "_compiles"] = dev.compile_waits - waits + dev.compile_count - count
        out[name + "_warmed"] = getattr(dev, "warmed", 0) - warmed
        out[name + "_twin"] = dev.twin_compiled - twin
        out[name + "_cpu_s"] = time.process_time()
    await request("first", "What is the capital of France?")
    await request("second", "Name three colours.", chat=False)
    await dev.compiled()
    out["all_compiled_s"] = since()
    await request("third", "Hi", chat=False)
    await request("fourth", "Write one sentence about the sea, the wind and the stars over a quiet harbour.")
    out["adapter"] = dev.info.name
    print(json.dumps(out))
asyncio.run(main())
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-shader-cache", action="store_true", help="an empty Mesa shader cache per child")
    ap.add_argument("--shader-cache-off", action="store_true", help="Mesa's shader cache disabled")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--models", default="chat,embed", help="which default models to start: chat, embed or both")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every mode this many times, interleaved")
    ap.add_argument("--chat-model", default=None, help="chat model reference (default: the engine's)")
    ap.add_argument("--embed-model", default=None, help="embedding model reference (default: the engine's)")
    ap.add_argument("--smoke", action="store_true", help="2 tokens per chat request, background mode only")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "first_request.json")
    a = ap.parse_args()
    modes = ["background"] if a.smoke else a.modes.split(",")
    if a.smoke:
        a.tokens = 2
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    if a.shader_cache_off:
        env["MESA_SHADER_CACHE_DISABLE"] = "true"
    rows = []
    kinds = [(k, ref) for k, ref in (("chat", a.chat_model), ("embed", a.embed_model))
             if k in a.models.split(",")]
    for mode in [m for _ in range(a.rounds) for m in modes]:
        for kind, ref in kinds:
            cache = tempfile.mkdtemp(prefix="mesa-cache-") if a.no_shader_cache else None
            t = time.time()
            try:
                res = subprocess.run([sys.executable, "-c", CHILD, repr(t), kind, str(a.tokens),
                                      json.dumps(MODES[mode])] + ([ref] if ref else []),
                                     env=dict(env, MESA_SHADER_CACHE_DIR=cache) if cache else env,
                                     cwd=ROOT, capture_output=True, text=True, timeout=1800)
            finally:
                if cache:
                    shutil.rmtree(cache, ignore_errors=True)
            if res.returncode:
                raise SystemExit(f"{kind} ({mode}): {res.stderr[-2000:]}")
            rows.append({"model": kind, "mode": mode, **json.loads(res.stdout.strip().splitlines()[-1])})
    print("seconds from process start; comp: pipelines the request compiled or waited for; later comp: "
          "the third and fourth requests, after every queued kernel compiled")
    print(f"{'model':6} {'mode':10} {'loaded':>7} {'1st token':>9} {'1st comp':>8} {'1st warm':>8} {'1st twin':>8} "
          f"{'1st cpu s':>9} {'2nd req s':>9} {'2nd comp':>8} {'all compiled':>12} {'later comp':>10}")
    for r in rows:
        print(f"{r['model']:6} {r['mode']:10} {r['loaded_s']:7.2f} {r['first_first_s']:9.2f} "
              f"{r['first_compiles']:8d} {r['first_warmed']:8d} {r['first_twin']:8d} {r['first_cpu_s']:9.2f} "
              f"{r['second_request_s']:9.2f} {r['second_compiles']:8d} "
              f"{r['all_compiled_s']:12.2f} {r['third_compiles'] + r['fourth_compiles']:10d}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                                 "adapter": rows[0]["adapter"],
                                 "shader_cache": "off" if a.shader_cache_off else "empty" if a.no_shader_cache else "as left",
                                 "tokens": a.tokens, "results": rows}, indent=2))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
