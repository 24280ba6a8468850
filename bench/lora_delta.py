"""lora_delta's cost per dispatch (kernels/lora.py) at SmolLM2-135M's shapes, rank 16, a base row and
an adapter row (T = 2, as a decode step of serve's base + adapter), f16 A / B: `--dispatches` of one
projection group in one submission, CPU and wall microseconds per dispatch, kernel variants A / B
in interleaved rounds (A B, B A, ...) in one process: kernels/lora.py's BAKE_SHAPES and NARROW_WG
(the widths compiled in, a workgroup as wide as the shrink needs) off, then on. Prints a table; writes bench/results/lora_delta.json.

    python bench/lora_delta.py --rounds 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from webgpu_engine.gpu import request_device_sync
from webgpu_engine.kernels import lora as lk
from webgpu_engine.kernels.common import Tensor, run_ops

# group -> (K, N, targets, normed input and stored deltas): SmolLM2-135M (C 576, 9 heads of 64 with 3
# KV heads, F 1536)
GROUPS = {"qkv": (576, 960, 3, True), "o": (576, 576, 1, False), "gate_up": (576, 3072, 2, True),
          "down": (1536, 576, 1, False)}
RANK, SLOTS, OWNER = 16, 4, "bench:lora"


def _put(dev, a, dtype="f32") -> Tensor:
    a = np.ascontiguousarray(a.astype({"f32": np.float32, "f16": np.float16, "u32": np.uint32}[dtype]))
    return Tensor(dev.upload(a.view(np.uint8), owner=OWNER, label="t"), a.shape, dtype, 0)


def ops_for(dev, group: str, n: int) -> list:
    K, N, targets, normed = GROUPS[group]
    rng = np.random.default_rng(0)
    J = targets * RANK
    a = _put(dev, rng.standard_normal((SLOTS, J, K)) / np.sqrt(K), "f16")
    b = _put(dev, rng.standard_normal((SLOTS, N, RANK)) / np.sqrt(RANK), "f16")
    cols = _put(dev, RANK * ((np.arange(N // 2)) % targets), "u32")     # row pairs' targets in turn
    idx = _put(dev, np.array([lk.NONE, 1]), "u32")
    x, y = _put(dev, rng.standard_normal((2, K))), _put(dev, np.zeros((2, N)))
    norm = (_put(dev, 1 + 0.1 * rng.standard_normal(K)), 1e-5) if normed else None
    return [lk.lora_delta(dev, x, a, b, cols, idx, y, slots=SLOTS, norm=norm, store=normed) for _ in range(n)], y


def timed(dev, ops_y) -> tuple[float, float]:
    ops, y = ops_y
    c0, w0 = time.process_time(), time.perf_counter()
    run_ops(dev, *ops)
    dev.read_sync(y.buf, 0, 4)                    # waits for the submission
    return time.process_time() - c0, time.perf_counter() - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dispatches", type=int, default=60)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora_delta.json"))
    args = ap.parse_args()
    dev = request_device_sync()
    variants = {}
    for bake in (False, True):
        lk.BAKE_SHAPES = lk.NARROW_WG = bake
        variants[bake] = {g: ops_for(dev, g, args.dispatches) for g in GROUPS}
        for ops in variants[bake].values():
            timed(dev, (ops[0][:1], ops[1]))      # compiled and warm
    res = {g: {False: [], True: []} for g in GROUPS}
    for r in range(args.rounds):
        for bake in ((False, True) if r % 2 == 0 else (True, False)):
            for g, ops in variants[bake].items():
                cpu, wall = timed(dev, ops)
                res[g][bake].append((cpu / args.dispatches * 1e6, wall / args.dispatches * 1e6))
    load = os.getloadavg()[0]
    print(f"lora_delta, T = 2 (base + adapter row), rank {RANK}, f16 A / B, {args.dispatches} a submission, "
          f"{args.rounds} rounds, load {load:.1f}; CPU / wall us per dispatch, median (min)")
    out = {"load": load, "rounds": args.rounds, "dispatches": args.dispatches, "groups": {}}
    for g in GROUPS:
        row = {}
        for bake, name in ((False, "64 lanes, uniforms"), (True, "narrow, compiled in")):
            cpu = [c for c, _ in res[g][bake]]
            wall = [w for _, w in res[g][bake]]
            row[name] = {"cpu_us": cpu, "wall_us": wall}
            print(f"  {g:8s} {name:20s} cpu {statistics.median(cpu):7.1f} ({min(cpu):6.1f})   "
                  f"wall {statistics.median(wall):7.1f} ({min(wall):6.1f})")
        out["groups"][g] = row
    Path(args.out).write_text(json.dumps(out, indent=1))
    dev.release_owner(OWNER)


if __name__ == "__main__":
    main()
