"""Gated DeltaNet's recurrence (kernels/deltanet.py gated_delta_rule): the time of one layer's call
over T rows of one sequence, as a prefill chunk runs it, at Qwen3.5-0.8B's shape (16 key and 16 value
heads of 128 x 128) or the one given.

    python bench/deltanet.py [--rows 1,64,128] [--heads 16] [--dim 128] [--runs 3]

Random f32 inputs; each time is the best of --runs (one call submitted and a word read back). Prints a
table and writes bench/results/deltanet.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")


def main() -> None:
    from _nn_util import empty, put, step_buf
    from webgpu_engine.gpu import request_device_sync
    from webgpu_engine.kernels import deltanet
    from webgpu_engine.kernels.common import run_ops
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64,128")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "deltanet.json"))
    a = ap.parse_args()
    dev = request_device_sync()
    H, D = a.heads, a.dim
    rng = np.random.default_rng(0)
    out = []
    print(f"{'rows':>6} {'ms':>9} {'ms/row':>8}")
    for T in (int(x) for x in a.rows.split(",")):
        qkv = put(dev, rng.standard_normal((T, 3 * H * D)))
        proj = put(dev, rng.standard_normal((T, H * D + 2 * H)))
        hw = put(dev, np.concatenate([np.log(rng.uniform(0.5, 8, H)), rng.standard_normal(H) * 0.5, np.ones(D)]))
        state, y = put(dev, np.zeros((1, H, D, D))), empty(dev, (T, H * D))
        op = deltanet.gated_delta_rule(dev, qkv, proj, hw, state, y, step_buf(dev, 0, T), n_k_heads=H, n_v_heads=H,
                                       k_dim=D, v_dim=D, z_col=0, eps=1e-6)
        best = float("inf")
        for _ in range(a.runs + 1):                 # the first call compiles
            t0 = time.perf_counter()
            run_ops(dev, op)
            dev.read_sync(y.buf, 0, 4)
            best = min(best, time.perf_counter() - t0)
        out.append({"rows": T, "heads": H, "dim": D, "ms": round(best * 1e3, 2)})
        print(f"{T:>6} {best * 1e3:>9.1f} {best * 1e3 / T:>8.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"adapter": str(getattr(dev, "adapter_info", "")), "results": out}, indent=1))


if __name__ == "__main__":
    main()
