"""The batch width of a CPU adapter by measurement: decode steps of the scheduler's paged forward for
each width (`max_num_sequences`) and row count, and the width that `max_num_sequences` 0 should mean.

    python bench/batch_width.py [--model REF] [--widths 4,8,16] [--rounds 3] [--steps 8] [--k 3]
                                [--kinds] [--store] [--smoke] [--out PATH]

One pipeline per width over the one model (a width picks the kernels every row runs, so that a row's
bits never depend on the batch: up to matmul.fused_rows_max rows (16 where the wide kernel runs, else 4;
WEBGPU_ENGINE_WIDE_ROWS=0 turns it off) the fused one-row kernels' sums, wider the row-invariant tiled ones); per
width, steps of 1, 4, 8 and 16 rows and the width's own (up to the width), each row one sequence at
position 100 (a step's cost depends on how many keys it reads, not on their values), `--steps`
steps submitted back to back and one readback, `--rounds` rounds with the widths in turn (the host is
shared: interleaved, best round); wall and process CPU ms a step (a CPU adapter's threads are ours, so
CPU time does not depend on what else the host runs). No sampling (a slot's sampler runs per row either
way). The rule (WIDTH_RULE), by CPU time: the widest width whose full step costs under `--k` (3) times
the cheapest one-row step of any width and whose own one-row step (what a lone request pays: a width
fixes the kernels every row runs) at most `--lone` (1.25) times it; --store keeps it in the adapter's profile
(kernels/profiles.py save_width), which models/plan.py auto_width reads. --kinds: CPU ms per kernel
kind of each width's full step and of its one-row step (each kind's dispatches alone, best of 3).
Prints a table and writes bench/results/batch_width.json. --smoke: widths 1,2, rounds 1, steps 2: checks
that the script runs to the end (a tiny model); its figures mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

POS = 100               # the keys each row's sequence holds before the timed steps
ROWS = (1, 4, 8, 16)    # and each width's own
WIDTH_RULE = ("widest width whose full step < k x the cheapest one-row step and whose own one-row step "
              "<= lone x it (CPU ms)")


def choose_width(steps: dict, k: float, lone: float = 1.25) -> int:
    """WIDTH_RULE over steps {(width, rows): (wall ms, cpu ms)}: the widest width w whose w-row step
    costs under k times the cheapest one-row step of any width, and whose one-row step (a lone
    request: a width fixes the kernels of every row) at most `lone` times it; the narrowest width
    when none qualifies."""
    widths = sorted({w for w, _ in steps})
    one = min(c for (w, r), (_, c) in steps.items() if r == 1)
    fit = [w for w in widths if (w, w) in steps and steps[(w, w)][1] < k * one
           and steps.get((w, 1), (0, 0.0))[1] <= lone * one]
    return max(fit) if fit else widths[0]


class Width:
    """One pipeline of `width` slots and the sequences its steps decode."""

    def __init__(self, pipe):
        self.pipe, self.fwd, self.pool = pipe, pipe.scheduler.fwd, pipe.scheduler.pool

    def steps(self, rows: int, n: int) -> tuple[float, float]:
        """(wall ms, CPU ms) per step of `rows` sequences, n steps back to back."""
        fwd, pool, dev = self.fwd, self.pool, self.pipe.dev
        sids = [f"bench.width.{i}" for i in range(rows)]
        for s in sids:
            pool.add_sequence(s, [])
            pool.reserve(s, POS)
            pool.append_tokens(s, [1] * POS, decoded=True)
        t, c = time.perf_counter(), time.process_time()
        for _ in range(n):
            for s in sids:
                pool.reserve(s, pool.num_tokens(s) + 1)
            b = dev.batch()
            fwd.record_decode(b, [1] * rows, pool.decode_inputs(sids, rows, fwd.max_blocks))
            dev.submit(b)
            for s in sids:
                pool.append_tokens(s, [1], decoded=True)
        dev.read_sync(fwd.logits.buf, 0, 4)
        out = (1e3 * (time.perf_counter() - t) / n, 1e3 * (time.process_time() - c) / n)
        for s in sids:
            pool.free(s)
        return out


async def measure(path: Path, widths: list[int], rounds: int, n_steps: int, kinds: bool) -> dict:
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.gpu import request_device
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    import llm as bench_llm

    dev = await request_device()
    runs = {}
    for w in widths:
        pipe = await LLMChatPipeline.load(dev, path, ChatConfig(context_window_size=POS + rounds * n_steps + 64,
                                                                max_num_sequences=w))
        runs[w] = Width(pipe)
    plan = [(w, r) for w in widths for r in sorted({*ROWS, w}) if r <= w]
    for w, r in plan:                                   # compile and warm every form once
        runs[w].steps(r, 1)
    best: dict = {}
    for _ in range(rounds):
        for w, r in plan:
            ms, cpu = runs[w].steps(r, n_steps)
            b = best.get((w, r), (1e9, 1e9))
            best[(w, r)] = (min(b[0], ms), min(b[1], cpu))
    out = {"adapter": dev.info.name, "dtype": runs[widths[0]].pipe.model.dtype, "model": path.name,
           "fused_rows": {w: runs[w].fwd.fused_rows for w in widths},
           "steps": [{"width": w, "rows": r, "ms": round(ms, 2), "cpu_ms": round(c, 2)}
                     for (w, r), (ms, c) in sorted(best.items())]}
    if kinds:
        out["kinds"] = {}
        for w in widths:
            fwd = runs[w].fwd
            for r in sorted({1, w}):
                cpu = bench_llm._by_kind(dev, fwd.ops("decode", r), fwd.logits.buf, POS + 1)[1]
                out["kinds"][f"{w}x{r}"] = dict(sorted(cpu.items(), key=lambda kv: -kv[1]))
    for r in runs.values():
        r.pipe.dispose()
    out["_best"] = best
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct-Q4_1", help="a model reference or .gguf path")
    ap.add_argument("--widths", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps per timed run")
    ap.add_argument("--k", type=float, default=3.0, help="WIDTH_RULE's factor for a full step")
    ap.add_argument("--lone", type=float, default=1.25, help="WIDTH_RULE's factor for a width's one-row step")
    ap.add_argument("--kinds", action="store_true", help="CPU ms per kernel kind of each width's steps")
    ap.add_argument("--store", action="store_true", help="keep the chosen width in this adapter's profile")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "batch_width.json"))
    ap.add_argument("--smoke", action="store_true", help="widths 1,2, one round of 2 steps: runs, measures nothing")
    a = ap.parse_args(argv)
    if a.smoke:
        a.widths, a.rounds, a.steps = "1,2", 1, 2
    from webgpu_engine import cache
    path = Path(a.model) if Path(a.model).exists() else Path(cache.default_model_path(a.model))
    widths = sorted({int(v) for v in a.widths.split(",")})
    res = asyncio.run(measure(path, widths, a.rounds, a.steps, a.kinds))
    best = res.pop("_best")
    width = choose_width(best, a.k, a.lone)
    one = min(c for (w, r), (_, c) in best.items() if r == 1)
    print(f"adapter {res['adapter']} ({res['dtype']}); {res['model']}; ms a decode step, best of {a.rounds} rounds "
          f"of {a.steps} steps; host load {os.getloadavg()[0]:.1f}")
    print(f"{'width':>5} {'rows':>4} {'wall ms':>8} {'CPU ms':>8} {'x one row':>9} {'CPU ms/row':>10}")
    for s in res["steps"]:
        print(f"{s['width']:>5} {s['rows']:>4} {s['ms']:8.1f} {s['cpu_ms']:8.1f} {s['cpu_ms'] / one:9.2f} "
              f"{s['cpu_ms'] / s['rows']:10.1f}")
    for key, kinds in res.get("kinds", {}).items():
        print(f"  width x rows {key}: " + ", ".join(f"{k} {v}" for k, v in kinds.items()))
    print(f"chosen width ({WIDTH_RULE}, k = {a.k:g}, lone = {a.lone:g}): {width}")
    res.update({"k": a.k, "lone": a.lone, "rule": WIDTH_RULE, "width": width, "load": os.getloadavg()[0]})
    if a.store:
        from webgpu_engine.gpu import request_device_sync
        from webgpu_engine.kernels import profiles
        print(f"stored in {profiles.save_width(request_device_sync(), width, {'steps': res['steps']})}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
