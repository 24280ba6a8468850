"""Prefill matmul benchmark: the tiled kernel (kernels/matmul/tiled.py) against matmul.matmul at the
default models' T > 1 shapes, timed A/B back to back, in wall time and in this process's CPU time.

    python bench/prefill.py [--quick] [--act f32|f16] [--T 128,512] [--runs 3] [--tm 16 --wg 64]
    python bench/prefill.py --smoke [--out PATH]   (smollm2.down at T = 16, one short run: checks that
                                                    the script runs to the end, measures nothing)

Prints a table and writes bench/results/prefill.json. Each measurement records the op many times
into one submit and waits on a readback; the best of --runs rounds is kept, and within a round the
two kernels run one right after the other so that they see the same machine load. On a CPU adapter
(lavapipe) the driver's threads belong to this process, so CPU time does not depend on what else
the machine runs; "GFLOP/cpu-s" is FLOPs per second of that CPU time (at most cores x wall rate).
"build s" is the time to build the tiled op, mostly compiling its pipeline (0 when an earlier shape
already compiled the same one): the kernel's K loop is written out, which costs compile time.
The smollm2 rows also give the matmul-only prefill bound: tokens/s if a layer's four matmuls
(qkv, o, gate_up, down) x 30 layers were all a prefill did.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from webgpu_engine.gpu import request_device_sync  # noqa: E402
from webgpu_engine.kernels.matmul import tiled as mt  # noqa: E402
from webgpu_engine.kernels import quant_ref as qr  # noqa: E402
from webgpu_engine.kernels.common import Op, Tensor, new_tensor  # noqa: E402
from webgpu_engine.kernels.matmul import MatmulConfig, matmul, upload_weight  # noqa: E402
from kernels import run_n  # noqa: E402  (bench/kernels.py, beside this script)

OWNER = "bench:prefill"
# (model, name, n, k, qtype, bias, T values): SmolLM2-135M Q4_1 per layer (30 layers) and
# all-MiniLM-L6-v2 f32 per layer (6 layers); MiniLM batches 32 sentences of ~40 tokens
SHAPES = [
    ("smollm2", "qkv", 960, 576, "q4_1", False, None),
    ("smollm2", "o", 576, 576, "q4_1", False, None),
    ("smollm2", "gate_up", 3072, 576, "q4_1", False, None),
    ("smollm2", "down", 576, 1536, "q4_1", False, None),
    ("minilm", "qkv", 1152, 384, "f32", True, [1280]),
    ("minilm", "o", 384, 384, "f32", True, [1280]),
    ("minilm", "up", 1536, 384, "f32", True, [1280]),
    ("minilm", "down", 384, 1536, "f32", True, [1280]),
]
QUICK = {("smollm2", "gate_up"), ("smollm2", "down"), ("minilm", "up")}
SMOKE = {("smollm2", "down")}
LAYERS = {"smollm2": 30, "minilm": 6}


def time_ops(dev, ops: list[Op], sync_buf, min_s: float, runs: int) -> list[tuple[float, float]]:
    """Best (wall s, CPU s) per execution of each op; the ops alternate within each round."""
    def run(op: Op, n: int) -> tuple[float, float]:
        return run_n(dev, op, n, sync_buf)
    counts = []
    for op in ops:
        dt = run(op, 1)[0]                   # compiles and warms caches
        counts.append(max(1, min(64, int(min_s / max(dt, 1e-6)))))
    best = [(float("inf"), float("inf"))] * len(ops)
    for _ in range(runs):
        for i, (op, n) in enumerate(zip(ops, counts)):
            w, c = run(op, n)
            best[i] = (min(best[i][0], w / n), min(best[i][1], c / n))
    return best


def bench_shape(dev, model, name, n, k, qtype, has_bias, T, act, over, min_s, runs) -> dict:
    cfg = mt.default_config(dev, qtype)
    for f, v in over.items():
        setattr(cfg, f, v)
    rng = np.random.default_rng(0)
    w = upload_weight(dev, qr.random_weight(qtype, n, k, rng), qtype, n, k, owner=OWNER, label=name)
    npt = np.float32 if act == "f32" else np.float16
    x = Tensor(dev.upload(rng.standard_normal((T, k)).astype(npt), owner=OWNER), (T, k), act)
    y = new_tensor(dev, (T, n), act, owner=OWNER)
    bias = None
    if has_bias:
        bias = Tensor(dev.upload(rng.standard_normal(n).astype(np.float32), owner=OWNER), (n,))
    old = matmul(dev, x, w, y, bias=bias, config=MatmulConfig())   # a config: no delegation to ours
    t0 = time.perf_counter()
    new = mt.matmul(dev, x, w, y, bias=bias, config=cfg)   # builds (compiles) its pipeline
    build_s = time.perf_counter() - t0
    ops = [old, new]
    (old_w, old_c), (new_w, new_c) = time_ops(dev, ops, y.buf, min_s, runs)
    flop = 2 * T * n * k
    dev.release_owner(OWNER)
    return {"model": model, "shape": name, "n": n, "k": k, "qtype": qtype, "T": T, "act": act,
            "config": dict(cfg.__dict__),
            "bias": has_bias, "new_build_s": build_s, "old_ms": old_w * 1e3, "old_cpu_ms": old_c * 1e3,
            "new_ms": new_w * 1e3, "new_cpu_ms": new_c * 1e3,
            "old_GFLOPs": flop / old_w / 1e9, "new_GFLOPs": flop / new_w / 1e9,
            "old_GFLOP_per_cpu_s": flop / old_c / 1e9, "new_GFLOP_per_cpu_s": flop / new_c / 1e9,
            "speedup": old_w / new_w, "cpu_speedup": old_c / new_c}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few key shapes only")
    ap.add_argument("--act", default="f32", choices=["f32", "f16"])
    ap.add_argument("--T", default="128,512", help="SmolLM2 prefill lengths (MiniLM uses 32 x 40)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--min-s", type=float, default=0.2, help="seconds per timed run")
    for f in ("tm", "wg", "kb", "kmax"):
        ap.add_argument(f"--{f}", type=int, default=None, help=f"override the tiled config's {f}")
    ap.add_argument("--only", default="", help="substring filter on model.shape")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prefill.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="one shape, 16 rows, one short run: checks the script, measures nothing")
    a = ap.parse_args(argv)
    if a.smoke:
        a.runs, a.min_s = 1, 0.002
        if a.T == "128,512":
            a.T = "16"
    dev = request_device_sync()
    over = {f: getattr(a, f) for f in ("tm", "wg", "kb", "kmax") if getattr(a, f)}
    print(f"adapter: {dev.info.name} ({dev.info.backend}); tiled config overrides {over}; act {a.act}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'shape':16} {'n x k':>11} {'qtype':5} {'T':>5} | {'old ms':>8} {'cpu':>8} {'GF/s':>6} | "
          f"{'new ms':>8} {'cpu':>8} {'GF/s':>6} {'GF/cpu-s':>8} | {'x wall':>6} {'x cpu':>6} | {'build s':>7}")
    rows = []
    for model, name, n, k, qtype, has_bias, Ts in SHAPES:
        if a.quick and (model, name) not in QUICK or a.smoke and (model, name) not in SMOKE:
            continue
        if a.only and a.only not in f"{model}.{name}":
            continue
        for T in Ts or [int(v) for v in a.T.split(",")]:
            r = bench_shape(dev, model, name, n, k, qtype, has_bias, T, a.act, over, a.min_s, a.runs)
            rows.append(r)
            print(f"{model + '.' + name:16} {n:>5}x{k:<5} {qtype:5} {T:>5} | {r['old_ms']:8.2f} "
                  f"{r['old_cpu_ms']:8.2f} {r['old_GFLOPs']:6.2f} | {r['new_ms']:8.2f} {r['new_cpu_ms']:8.2f} "
                  f"{r['new_GFLOPs']:6.2f} {r['new_GFLOP_per_cpu_s']:8.2f} | {r['speedup']:6.1f} "
                  f"{r['cpu_speedup']:6.1f} | {r['new_build_s']:7.2f}", flush=True)
    bounds = {}
    for model in LAYERS:
        for T in sorted({r["T"] for r in rows if r["model"] == model}):
            rs = [r for r in rows if r["model"] == model and r["T"] == T]
            if model == "smollm2" and len(rs) == 4:
                for kind in ("old", "new"):
                    s = LAYERS[model] * sum(r[f"{kind}_ms"] for r in rs) / 1e3
                    c = LAYERS[model] * sum(r[f"{kind}_cpu_ms"] for r in rs) / 1e3
                    bounds[f"{model}_T{T}_{kind}"] = {"matmul_s": s, "tokens_per_s": T / s, "cpu_s": c}
                    print(f"{model} T={T} {kind}: matmuls {s * 1e3:.0f} ms wall ({c * 1e3:.0f} ms cpu) "
                          f"-> matmul-only prefill bound {T / s:.0f} tokens/s")
            if model == "minilm" and len(rs) == 4:
                for kind in ("old", "new"):
                    s = LAYERS[model] * (sum(r[f"{kind}_ms"] for r in rs)) / 1e3
                    bounds[f"{model}_T{T}_{kind}"] = {"matmul_s": s, "sentences_per_s": 32 / s}
                    print(f"{model} 32 sentences x 40 tokens {kind}: matmuls {s * 1e3:.0f} ms "
                          f"-> matmul-only bound {32 / s:.0f} sentences/s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"adapter": dev.info.__dict__, "config_overrides": over, "act": a.act,
                               "load_average": os.getloadavg()[0], "rows": rows, "bounds": bounds},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
