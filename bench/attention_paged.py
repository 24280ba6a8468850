"""Paged decode attention benchmark: one ragged-batch paged_decode op for S sequences against S
contiguous nn.attention decode ops (today's one-sequence-at-a-time path), at SmolLM2-135M's heads.

    python bench/attention_paged.py [--S 1,4,8] [--L 256,1024] [--act f32,f16] [--block 16] [--runs 3]
                                    [--smoke] [--out PATH]

Prints a table and writes bench/results/attention_paged.json. Each measurement records the op(s) many
times into one submit and waits on a readback; the best of --runs rounds is kept, paged and
contiguous back to back in each round, in wall time and in this process's CPU time (on a CPU
adapter the driver's threads belong to the process, so CPU time depends less on the machine's other
load). Both record as a decode step does (n_keys = the longest sequence), so each takes its
one-dispatch form while the keys are few and split + combine beyond; "form" names which.
Every sequence has L keys, its blocks shuffled over the pool.
--smoke: S 1,2, one round of a few executions per measurement (both forms, both activations): checks
that the script runs to the end; its figures mean nothing.
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
from webgpu_engine.kernels import attention_paged as ap  # noqa: E402
from webgpu_engine.kernels import nn  # noqa: E402
from webgpu_engine.kernels.common import Tensor  # noqa: E402

OWNER = "bench:attention_paged"
HQ, HKV, D = 9, 3, 64            # SmolLM2-135M
NP = {"f32": np.float32, "f16": np.float16, "u32": np.uint32}


def put(dev, arr, dtype):
    a = np.ascontiguousarray(np.asarray(arr).astype(NP[dtype]))
    return Tensor(dev.upload(a.view(np.uint8).ravel(), owner=OWNER, label="t"), a.shape, dtype)


def time_ops(dev, ops, n_keys, sync, min_s=0.25) -> tuple[int, callable]:
    """(n, run): run() times n executions of `ops` (recorded in order) in one submit and returns
    (wall s, process CPU s) per execution; n is chosen so that a run lasts about min_s."""
    def go(n):
        b = dev.batch()
        for _ in range(n):
            for op in ops:
                op.record(b, n_keys=n_keys)
        t0, c0 = time.perf_counter(), time.process_time()
        dev.submit(b)
        dev.read_sync(sync, 0, 4)
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    go(1)                                    # compile / warm
    n = 1
    while (dt := go(n)[0] * n) < min_s and n < 1024:
        n = min(1024, max(2 * n, int(n * min_s / max(dt, 1e-6))))
    return n, lambda: go(n)


def bench_one(dev, rng, act: str, s: int, length: int, bs: int, runs: int, min_s: float = 0.25) -> dict:
    max_blocks = -(-length // bs)
    n_blocks = s * max_blocks
    kp = put(dev, rng.standard_normal((n_blocks, bs, HKV, D)), act)
    vp = put(dev, rng.standard_normal((n_blocks, bs, HKV, D)), act)
    tables = rng.permutation(n_blocks).astype(np.uint32).reshape(s, max_blocks)
    qkv = put(dev, rng.standard_normal((s, HQ + 2 * HKV, D)), act)
    out = put(dev, np.zeros((s, HQ * D)), act)
    paged = ap.paged_decode(dev, qkv, kp, vp, out, put(dev, np.full(s, length, np.uint32), "u32"),
                            put(dev, tables, "u32"), n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, max_seqs=s,
                            max_blocks=max_blocks, scale=D ** -0.5)
    cont = []
    for i in range(s):
        q = put(dev, rng.standard_normal((1, HQ + 2 * HKV, D)), act)
        kc, vc = (put(dev, rng.standard_normal((HKV, length, D)), act) for _ in range(2))
        step = put(dev, np.array([length - 1, 1, length, 0], np.uint32), "u32")
        cont.append(nn.attention(dev, q, kc, vc, put(dev, np.zeros((1, HQ * D)), act), step, n_q_heads=HQ,
                                 n_kv_heads=HKV, head_dim=D, ctx=length, scale=D ** -0.5))
    _, run_p = time_ops(dev, [paged], length, out.buf, min_s)
    _, run_c = time_ops(dev, cont, length, out.buf, min_s)
    rounds = [(run_p(), run_c()) for _ in range(runs)]          # A/B back to back: the same load
    (t_p, c_p), (t_c, c_c) = ((min(r[i][0] for r in rounds), min(r[i][1] for r in rounds)) for i in (0, 1))
    form = "1-dispatch" if length <= paged.max_keys else "split+combine"
    cform = "1-dispatch" if length <= cont[0].max_keys else "split+combine"
    dev.release_owner(OWNER)
    return {"act": act, "S": s, "L": length, "block": bs, "paged_ms": t_p * 1e3, "contiguous_ms": t_c * 1e3,
            "paged_over_contiguous": t_p / t_c, "paged_cpu_ms": c_p * 1e3, "contiguous_cpu_ms": c_c * 1e3,
            "cpu_ratio": c_p / c_c, "paged_form": form, "contiguous_form": cform}


def main() -> None:
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap_.add_argument("--S", default="1,4,8")
    ap_.add_argument("--L", default="256,1024")
    ap_.add_argument("--act", default="f32,f16")
    ap_.add_argument("--block", type=int, default=16)
    ap_.add_argument("--runs", type=int, default=3)
    ap_.add_argument("--smoke", action="store_true",
                     help="tiny run (S 1,2, one short round): checks the script, measures nothing")
    ap_.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "attention_paged.json"))
    args = ap_.parse_args()
    min_s = 0.25
    if args.smoke:
        args.S, args.runs, min_s = "1,2", 1, 0.005
    dev = request_device_sync()
    acts = [a for a in args.act.split(",") if a == "f32" or "shader-f16" in dev.features]
    rng = np.random.default_rng(0)
    rows = []
    print(f"{dev.info.name}  heads {HQ}/{HKV} x {D}, block {args.block}")
    print(f"{'act':>4} {'S':>3} {'L':>5} {'paged ms':>9} {'S x contig ms':>14} {'ratio':>6} "
          f"{'paged cpu-ms':>13} {'contig cpu-ms':>14} {'ratio':>6}  form (paged / contig)")
    for act in acts:
        for length in (int(x) for x in args.L.split(",")):
            for s in (int(x) for x in args.S.split(",")):
                r = bench_one(dev, rng, act, s, length, args.block, args.runs, min_s)
                rows.append(r)
                print(f"{act:>4} {s:>3} {length:>5} {r['paged_ms']:>9.3f} {r['contiguous_ms']:>14.3f} "
                      f"{r['paged_over_contiguous']:>6.2f} {r['paged_cpu_ms']:>13.3f} {r['contiguous_cpu_ms']:>14.3f} "
                      f"{r['cpu_ratio']:>6.2f}  {r['paged_form']} / {r['contiguous_form']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": dev.info.name, "heads": [HQ, HKV, D], "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
