"""Cold start: how long `reload` takes and how long the first request then waits, for the default
chat model and embedder, each in a fresh process (so nothing is cached in the process).

    python bench/first_request.py [--no-shader-cache] [--tokens 8] [--chat-model REF] [--embed-model REF]
    python bench/first_request.py --smoke [--chat-model REF] [--embed-model REF] [--out PATH]

`--no-shader-cache` sets MESA_SHADER_CACHE_DISABLE=true in the children (lavapipe), the state of a
fresh clone. Since pipelines are created and run once while a model loads ("Loading GPU shader
modules"), the first request should cost what the second does. Prints a table and writes
bench/results/first_request.json. --chat-model / --embed-model: other models (any model reference:
an app-config id, a .gguf file, a model folder) instead of the engine's defaults. --smoke: 2 tokens
per chat request: checks that the script runs to the end (with small models, quickly).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import asyncio, json, sys, time
from webgpu_engine.engine import EngineConfig, create_mlc_engine
from webgpu_engine.engine import DEFAULT_CHAT_MODEL as LLM, DEFAULT_EMBED_MODEL as EMB
kind, n_tok = sys.argv[1], int(sys.argv[2])
ref = sys.argv[3] if len(sys.argv) > 3 else LLM if kind == "chat" else EMB
async def main():
    t = time.perf_counter()
    eng = await create_mlc_engine(ref, EngineConfig(log_level="ERROR"))
    out = {"reload_s": time.perf_counter() - t}
    prompts = ["What is the capital of France?", "Name three colours."]
    for name, p in zip(("first", "second"), prompts):
        t = time.perf_counter()
        if kind == "chat":
            r = await eng.chat.completions.create(messages=[{"role": "user", "content": p}],
                                                  max_tokens=n_tok, temperature=0, ignore_eos=True)
            out[name + "_ttft_s"] = r.usage.extra.time_to_first_token_s
        else:
            await eng.embeddings.create(input=[p, p + " again"])
        out[name + "_request_s"] = time.perf_counter() - t
    out["adapter"] = eng.device.info.name
    print(json.dumps(out))
asyncio.run(main())
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-shader-cache", action="store_true")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--chat-model", default=None, help="chat model reference (default: the engine's)")
    ap.add_argument("--embed-model", default=None, help="embedding model reference (default: the engine's)")
    ap.add_argument("--smoke", action="store_true", help="2 tokens per chat request: checks the script")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "first_request.json")
    a = ap.parse_args()
    if a.smoke:
        a.tokens = 2
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    if a.no_shader_cache:
        env["MESA_SHADER_CACHE_DISABLE"] = "true"
    rows = []
    for kind, ref in (("chat", a.chat_model), ("embed", a.embed_model)):
        res = subprocess.run([sys.executable, "-c", CHILD, kind, str(a.tokens)] + ([ref] if ref else []),
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if res.returncode:
            raise SystemExit(f"{kind}: {res.stderr[-2000:]}")
        rows.append({"model": kind, **json.loads(res.stdout.strip().splitlines()[-1])})
    print(f"{'model':6} {'reload s':>9} {'1st req s':>10} {'2nd req s':>10} {'1st ttft s':>11} {'2nd ttft s':>11}")
    for r in rows:
        print(f"{r['model']:6} {r['reload_s']:9.2f} {r['first_request_s']:10.2f} {r['second_request_s']:10.2f} "
              f"{r.get('first_ttft_s', float('nan')):11.2f} {r.get('second_ttft_s', float('nan')):11.2f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                                 "shader_cache": not a.no_shader_cache, "tokens": a.tokens,
                                 "results": rows}, indent=2))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
