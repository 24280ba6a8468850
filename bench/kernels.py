"""Kernel benchmark: effective GB/s and GFLOP/s of each matmul variant at the default models' shapes
(T = 1 decode, T = 128 prefill) on the current adapter, against a plain copy kernel's GB/s.

    python bench/kernels.py [--quick] [--act f32] [--runs 5] [--tm 8] [--wg 64] [--set v4=0]
    python bench/kernels.py --batch [--T 1,2,4,8,16] [--variants] [--tune] [--only q4_k]
    python bench/kernels.py --ceilings [--runs 5] [--chat-model PATH] [--embed-model DIR]
    python bench/kernels.py --smoke [--batch | --family | --ceilings] [--out PATH]

Prints a table and writes bench/results/kernels.json. Timing: many dispatches recorded into one
submit, then a blocking readback; best of --runs (the machine may be shared, so take the best).
GB/s counts the bytes a kernel must move at least once: weight (GPU layout) + x + y for matmul,
read + write for the copy; %copy compares it with the faster of the two copies, %cpu makes the same
comparison per second of this process's CPU time (a CPU adapter's threads are ours, so this column
does not depend on what else the machine runs).
--batch: the decode matmul for T = 1..16 activation rows (several sequences in one step) at
SmolLM2-135M's shapes, as the engine selects it (default config): before (batch_max_t=0: the row and
tiled kernels) and after (kernels/matmul/batch.py), with --variants every batched variant too;
--tune stores the fastest variant per shape and T in matmul.batch.PROFILES and prints them.
Writes bench/results/kernels_batch.json.
--family: the GPU kernel family (kernels/matmul/gpu.py) against the CPU family's kernels ("base")
at the same shapes: GB/s per decode variant (T = --T, default 1,4,8) and GFLOP/s per GEMM variant
(prefill, --prefill-t rows), the built-in default for this adapter and what the stored tuner
profile picked (kernels/profiles.py; "-" when the tuner has not measured that shape); the subgroup
decode variants ("-sg") where the device has subgroups (matmul.gpu.decode_variants).
Writes bench/results/kernels_family.json.
--ceilings: the adapter's ceilings (copy and read probes' GB/s, FMA GFLOP/s in f32 and f16), then every
hot kernel of the default models' decode step, prefills (128, 512 tokens) and embedding batch as the
engine builds them, as a fraction of the ceiling that bounds it (bench/ceilings.py says how). Also
the end of the default run (its JSON's "ceilings"). Writes bench/results/kernels_ceilings.json.
--smoke: two shapes (smollm2.down q4_1, minilm.ffn_up f32; --batch, --family: smollm2.down q4_1
unless --only), few rows (T 1,32;
--batch T 1,2; --family T 1,4 and 8 prefill rows; ceilings: small probes, a 16-token prefill, 4
sentences), small copies and one short run each: checks that the script runs to the end; its
figures mean nothing.
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
from webgpu_engine.kernels import quant_ref as qr  # noqa: E402
from webgpu_engine.kernels.common import DTYPE_SIZE, Op, Tensor, new_tensor, params  # noqa: E402
from webgpu_engine.kernels import matmul as mm, profiles  # noqa: E402
from webgpu_engine.kernels.matmul import batch as mb, gpu as mg  # noqa: E402
from webgpu_engine.kernels.tune import _base_op  # noqa: E402
from webgpu_engine.kernels.matmul import MatmulConfig, matmul, upload_weight  # noqa: E402
from webgpu_engine.kernels.matmul.layout import grid as _grid  # noqa: E402

OWNER = "bench"
# (name, n, k, weight types): SmolLM2 (GGUF) and MiniLM (safetensors) shapes
SHAPES = [
    ("smollm2.gate_up", 1536, 576, ["q4_1", "q4_0", "q8_0", "f16"]),
    ("smollm2.down", 576, 1536, ["q4_1", "q4_0", "q8_0", "f16"]),
    ("kquant.up", 1536, 768, ["q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs"]),   # K % 256 == 0
    ("kquant.down", 768, 1536, ["q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs"]),
    ("quant32.up", 1536, 576, ["q5_0", "q5_1", "iq4_nl"]),
    ("smollm2.k", 192, 576, ["q4_1"]),
    ("smollm2.qkv", 960, 576, ["q4_1"]),
    ("smollm2.lm_head", 49152, 576, ["q8_0"]),
    ("minilm.ffn_up", 1536, 384, ["f32", "f16", "bf16"]),
    ("minilm.ffn_down", 384, 1536, ["f32", "f16", "bf16"]),
    ("minilm.qkv", 1152, 384, ["f32", "f16"]),
]
QUICK = {("smollm2.down", "q4_1"), ("smollm2.gate_up", "q4_1"), ("smollm2.lm_head", "q8_0"),
         ("minilm.ffn_up", "f32")}
SMOKE = {("smollm2.down", "q4_1"), ("minilm.ffn_up", "f32")}


def run_n(dev, op: Op, n: int, sync_buf) -> tuple[float, float]:
    """(wall s, process CPU s) for `n` executions of `op` in one submit, waited for by a readback."""
    b = dev.batch()
    for _ in range(n):
        op.record(b)
    t0, c0 = time.perf_counter(), time.process_time()
    dev.submit(b)
    dev.read_sync(sync_buf, 0, 4)
    return time.perf_counter() - t0, time.process_time() - c0


def time_op(dev, op: Op, sync_buf, min_s: float, runs: int) -> tuple[float, float]:
    """Best (wall seconds, process CPU seconds) per execution of `op`. On a CPU adapter (lavapipe)
    the driver's threads belong to this process, so CPU time is a load-independent second measure."""
    def run(n: int) -> tuple[float, float]:
        return run_n(dev, op, n, sync_buf)
    run(1)                                   # compile / warm caches
    n = 1
    while True:
        dt = run(n)[0]
        if dt >= min_s or n >= 4096:
            break
        n = min(4096, max(n * 2, int(n * min_s / max(dt, 1e-6))))
    rs = [run(n) for _ in range(runs)]
    return min(r[0] for r in rs) / n, min(r[1] for r in rs) / n


def bench_copy(dev, nbytes: int, min_s: float, runs: int) -> dict:
    src = dev.upload(np.random.default_rng(0).integers(0, 2 ** 31, nbytes // 4, dtype=np.uint32), owner=OWNER)
    dst = dev.buffer(nbytes, owner=OWNER)
    n4 = nbytes // 16
    p = params(dev, [n4, 0, 0, 0], owner=OWNER)
    pipe = dev.pipeline("copy.wgsl", "copy_vec4")
    gx, gy = _grid(-(-n4 // 64))
    op = Op().add(pipe, dev.bind(pipe, [p, src, dst]), gx, gy)
    t, cpu = time_op(dev, op, dst, min_s, runs)
    src.release()
    dst.release()
    return {"kernel": "copy_vec4", "bytes": nbytes, "ms": t * 1e3, "cpu_ms": cpu * 1e3,
            "GB/s": 2 * nbytes / t / 1e9}


def bench_matmul(dev, name, n, k, qtype, T, act, cfg, min_s, runs) -> dict:
    rng = np.random.default_rng(0)
    w = upload_weight(dev, qr.random_weight(qtype, n, k, rng), qtype, n, k, owner=OWNER, label=name)
    x = Tensor(dev.upload(rng.standard_normal((T, k)).astype(np.float32 if act == "f32" else np.float16),
                          owner=OWNER), (T, k), act)
    y = new_tensor(dev, (T, n), act, owner=OWNER)
    op = matmul(dev, x, w, y, config=cfg)
    t, cpu = time_op(dev, op, y.buf, min_s, runs)
    moved = w.nbytes + (T * k + T * n) * DTYPE_SIZE[act]
    w.release()
    return {"shape": name, "n": n, "k": k, "qtype": qtype, "T": T, "act": act, "ms": t * 1e3,
            "cpu_ms": cpu * 1e3, "bytes": moved,
            "GB/s": moved / t / 1e9, "GFLOP/s": 2 * T * n * k / t / 1e9}


# --------------------------------------------------------------------------- --batch
# SmolLM2-135M: hidden 576, FFN 1536, vocab 49152 (K-quants need K % 256 == 0: only the down projection)
BATCH_SHAPES = [
    ("smollm2.gate_up", 1536, 576, ["q4_0", "q4_1", "q8_0", "f16"]),
    ("smollm2.down", 576, 1536, ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "f16"]),
    ("smollm2.lm_head", 49152, 576, ["q8_0"]),
]


def _time_engine(dev, x, w, y, a, overrides: dict, variant=None) -> tuple[float, float]:
    """(ms, cpu ms) of matmul as the engine selects it under `overrides` (or one batched variant)."""
    saved = dict(mm.CONFIG_OVERRIDES)
    mm.CONFIG_OVERRIDES.clear()
    mm.CONFIG_OVERRIDES.update(overrides)
    try:
        op = mb.matmul(dev, x, w, y, variant=variant) if variant else matmul(dev, x, w, y)
        t, cpu = time_op(dev, op, y.buf, a.min_s, a.runs)
    finally:
        mm.CONFIG_OVERRIDES.clear()
        mm.CONFIG_OVERRIDES.update(saved)
    op.release()
    return t * 1e3, cpu * 1e3


def bench_batch(dev, a) -> int:
    Ts = [int(v) for v in a.T.split(",")]
    rng = np.random.default_rng(0)
    rows, tuned = [], {}
    print(f"adapter: {dev.info.name} ({dev.info.backend}); act {a.act}; ms = wall, cpu = process CPU ms")
    print(f"{'shape':16} {'n x k':>11} {'qtype':6} {'T':>3} {'before':>8} {'cpu':>8} {'after':>8} {'cpu':>8} "
          f"{'x':>5} {'after/T1':>8}  variant")
    for name, n, k, qtypes in BATCH_SHAPES:
        for q in qtypes:
            if a.only and a.only not in f"{name}:{q}":
                continue
            w = upload_weight(dev, qr.random_weight(q, n, k, rng), q, n, k, owner=OWNER, label=name)
            t1 = None
            for T in Ts:
                x = Tensor(dev.upload(rng.standard_normal((T, k)).astype(np.float32 if a.act == "f32"
                                                                           else np.float16), owner=OWNER),
                           (T, k), a.act)
                y = new_tensor(dev, (T, n), a.act, owner=OWNER)
                before = _time_engine(dev, x, w, y, a, {"batch_max_t": 0})
                after = _time_engine(dev, x, w, y, a, {})
                t1 = t1 or after
                chosen = mb.choose(dev, w, T).key if 2 <= T <= mb.MAX_T else "-"
                r = {"shape": name, "n": n, "k": k, "qtype": q, "T": T, "act": a.act,
                     "before_ms": before[0], "before_cpu_ms": before[1], "after_ms": after[0],
                     "after_cpu_ms": after[1], "variant": chosen, "weight_bytes": w.nbytes}
                if (a.variants or a.tune) and 2 <= T <= mb.MAX_T:
                    r["variants"] = {v.key: _time_engine(dev, x, w, y, a, {}, variant=v) for v in mb.VARIANTS}
                    if a.tune:      # by CPU time on a CPU adapter (load-independent), else wall time
                        col = 1 if "llvmpipe" in dev.info.name.lower() else 0
                        best = min(mb.VARIANTS, key=lambda v: r["variants"][v.key][col])
                        tuned[(q, n, k, mb.bucket(T))] = best
                rows.append(r)
                print(f"{name:16} {n:>5}x{k:<5} {q:6} {T:>3} {before[0]:8.3f} {before[1]:8.3f} "
                      f"{after[0]:8.3f} {after[1]:8.3f} {before[1] / after[1]:5.2f} {after[1] / t1[1]:8.2f}  "
                      f"{chosen}", flush=True)
                for key, (ms, cpu) in r.get("variants", {}).items():
                    print(f"{'':46} {key:>18} {ms:8.3f} {cpu:8.3f}")
                x.buf.release()
                y.buf.release()
            w.release()
    if tuned:
        mb.PROFILES[mb.adapter_key(dev)] = tuned
        print("tuned (qtype, n, k, T bucket) -> variant:")
        for key, v in tuned.items():
            print(f"  {key}: {v.key}")
    out = Path(a.out).with_name("kernels_batch.json") if a.out == DEFAULT_OUT else Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"adapter": dev.info.__dict__, "act": a.act, "rows": rows,
                               "tuned": {str(k): v.key for k, v in tuned.items()}}, indent=1))
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------- --family
FAMILY_SHAPES = [
    ("smollm2.qkv", 960, 576, ["q4_1"]),
    ("smollm2.gate_up", 3072, 576, ["q4_1"]),
    ("smollm2.down", 576, 1536, ["q4_1"]),
    ("smollm2.lm_head", 49152, 576, ["q8_0"]),
    ("kquant.down", 768, 1536, ["q4_k"]),
    ("minilm.ffn_up", 1536, 384, ["f32"]),
]


def bench_family(dev, a) -> int:
    Ts = [int(v) for v in (a.T if a.T != "1,128" else "1,4,8").split(",")]
    rng = np.random.default_rng(0)
    dtype = np.float32 if a.act == "f32" else np.float16
    rows = []
    col = 1 if mm.is_cpu_adapter(dev) else 0      # CPU time on a CPU adapter (see time_op)
    out = Path(a.out).with_name("kernels_family.json") if a.out == DEFAULT_OUT else Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"adapter: {dev.info.name} ({dev.info.backend}); act {a.act}; "
          f"{'CPU' if col else 'wall'} ms; * = built-in default, T = tuner's pick (profile)")
    print(f"{'shape':16} {'qtype':6} {'rows':>8} {'variant':20} {'ms':>9} {'GB/s':>8} {'GFLOP/s':>8}")
    for name, n, k, qtypes in FAMILY_SHAPES:
        for q in qtypes:
            if a.only and a.only not in f"{name}:{q}":
                continue
            w = upload_weight(dev, qr.random_weight(q, n, k, rng), q, n, k, owner=OWNER, label=name,
                              interleave=False)
            for T, ri in [(T, False) for T in Ts] + [(a.prefill_t, True)]:
                x = Tensor(dev.upload(rng.standard_normal((T, k)).astype(dtype), owner=OWNER), (T, k), a.act)
                y = new_tensor(dev, (T, n), a.act, owner=OWNER)
                default = mg.default_variant(w, T, ri).key
                picked = profiles.choice(dev, q, n, k, T, ri) or "-"
                moved = w.nbytes + (T * k + T * n) * DTYPE_SIZE[a.act]
                cands = [("base", _base_op(dev, x, w, y, ri))]
                cands += [(v.key, mg.matmul(dev, x, w, y, variant=v, row_invariant=ri))
                          for v in (mg.GEMM_VARIANTS if ri or T > mg.MAX_DECODE_T else mg.decode_variants(dev))]
                for key, op in cands:
                    ms = time_op(dev, op, y.buf, a.min_s, a.runs)[col] * 1e3
                    op.release()
                    mark = ("*" if key == default else " ") + ("T" if key == picked else " ")
                    r = {"shape": name, "n": n, "k": k, "qtype": q, "T": T, "row_invariant": ri, "variant": key,
                         "ms": ms, "GB/s": moved / ms / 1e6, "GFLOP/s": 2 * T * n * k / ms / 1e6,
                         "default": key == default, "tuned": key == picked}
                    rows.append(r)
                    label = f"prefill{T}" if ri else f"t{T}"
                    print(f"{name:16} {q:6} {label:>8} {key:18}{mark} {ms:9.3f} {r['GB/s']:8.2f} "
                          f"{r['GFLOP/s']:8.2f}", flush=True)
                x.buf.release()
                y.buf.release()
            w.release()
            # written after every weight: a run stopped by a time limit keeps what it measured
            out.write_text(json.dumps({"adapter": dev.info.__dict__, "act": a.act, "clock": "cpu" if col else "wall",
                                       "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "kernels.json")


def main(argv=None) -> int:
    import ceilings       # bench/ceilings.py, beside this script (it imports this module's timing)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few key variants only")
    ap.add_argument("--act", default="f32", choices=["f32", "f16"])
    ap.add_argument("--T", default="1,128", help="comma-separated activation row counts")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.25, help="seconds per timed run")
    ap.add_argument("--tm", type=int, default=None)
    ap.add_argument("--wg", type=int, default=None)
    ap.add_argument("--rr", type=int, default=None)
    ap.add_argument("--prr", type=int, default=None)
    ap.add_argument("--no-unroll", action="store_true", help="T = 1: the loop kernel, not matmul_decode")
    ap.add_argument("--set", default="", help="MatmulConfig fields, e.g. v4=0,v4_max_k=2048")
    ap.add_argument("--only", default="", help="substring filter on shape name / qtype")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--batch", action="store_true", help="T = 1..16 decode batches: before / after")
    ap.add_argument("--variants", action="store_true", help="--batch: time every batched variant too")
    ap.add_argument("--tune", action="store_true", help="--batch: store the fastest variant per shape")
    ap.add_argument("--family", action="store_true", help="GPU kernel family vs base: GB/s, GFLOP/s, picks")
    ap.add_argument("--prefill-t", type=int, default=128, help="--family: rows of the prefill matmul")
    ceilings.add_arguments(ap)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny run of the chosen mode (see above): checks the script, measures nothing")
    a = ap.parse_args(argv)
    a.copy_sizes = (64 << 20, 1 << 20)
    if a.smoke:
        a.runs, a.min_s, a.copy_sizes = 1, 0.002, (4 << 20, 1 << 20)
        if a.T == "1,128":
            a.T = "1,2" if a.batch else "1,4" if a.family else "1,32"
        if a.prefill_t == 128:
            a.prefill_t = 8
        if (a.batch or a.family) and not a.only:
            a.only = "smollm2.down:q4_1"
    ceilings.configure(a)
    dev = request_device_sync()
    if a.ceilings:
        out = Path(a.out).with_name("kernels_ceilings.json") if a.out == DEFAULT_OUT else Path(a.out)
        return write(out, ceilings.run(dev, a))
    if a.family:
        return bench_family(dev, a)
    if a.batch:
        if a.T == "1,128":
            a.T = "1,2,4,8,16"
        return bench_batch(dev, a)
    cfg = MatmulConfig()
    if a.tm:
        cfg.tm = a.tm
    for f in ("wg", "rr", "prr"):
        if getattr(a, f):
            setattr(cfg, f, getattr(a, f))
    if a.no_unroll:
        cfg.unroll = False
    for item in filter(None, a.set.split(",")):
        f, v = item.split("=")
        setattr(cfg, f, type(getattr(cfg, f))(int(v)))
    # two copies: one far larger than caches (DRAM), one the size of a decode weight (cache)
    copies = [bench_copy(dev, nb, a.min_s, a.runs) for nb in a.copy_sizes]
    copy = max(copies, key=lambda c: c["GB/s"])
    print(f"adapter: {dev.info.name} ({dev.info.backend}); config {cfg}")
    for c in copies:
        print(f"copy_vec4 {c['bytes'] >> 20:>3} MiB: {c['GB/s']:.2f} GB/s (read + write), "
              f"{c['ms']:.3f} ms wall, {c['cpu_ms']:.3f} ms cpu")
    rows = []
    print(f"{'shape':18} {'n x k':>11} {'qtype':6} {'T':>4} {'ms':>9} {'cpu ms':>9} {'GB/s':>7} "
          f"{'GFLOP/s':>8} {'%copy':>6} {'%cpu':>5}")
    for name, n, k, qtypes in SHAPES:
        for q in qtypes:
            if a.quick and (name, q) not in QUICK or a.smoke and (name, q) not in SMOKE:
                continue
            if a.only and a.only not in f"{name}:{q}":
                continue
            for T in (int(v) for v in a.T.split(",")):
                r = bench_matmul(dev, name, n, k, q, T, a.act, cfg, a.min_s, a.runs)
                r["pct_copy"] = 100 * r["GB/s"] / copy["GB/s"]
                # the same ratio from CPU time (load-independent on a CPU adapter)
                cpu_rate = r["bytes"] / r["cpu_ms"]
                r["pct_copy_cpu"] = 100 * cpu_rate / max(2 * c["bytes"] / c["cpu_ms"] for c in copies)
                rows.append(r)
                print(f"{name:18} {n:>5}x{k:<5} {q:6} {T:>4} {r['ms']:9.3f} {r['cpu_ms']:9.3f} {r['GB/s']:7.2f} "
                      f"{r['GFLOP/s']:8.2f} {r['pct_copy']:5.0f}% {r['pct_copy_cpu']:4.0f}%", flush=True)
    print()
    return write(Path(a.out), {"adapter": dev.info.__dict__, "config": cfg.__dict__, "act": a.act, "copy": copy,
                               "copies": copies, "matmul": rows, "ceilings": ceilings.run(dev, a, copies)})


def write(out: Path, data: dict) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
