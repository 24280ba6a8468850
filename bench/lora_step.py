"""What an adapter row adds to a decode step (issue 52), in one process: SmolLM2-135M Q4_1 loaded as
`serve` loads it with a random rank-16 adapter of all seven targets (bench/serve.py's; its tensors
in --lora-dtype, f16 by default, and the pool holds them in the narrowest dtype that holds them), one row
at position 40, each step recorded, submitted and waited for. Per step, CPU ms (the process's, a CPU
adapter's threads included) and wall ms (a step's time, as a stream's inter-token latency sees it) in
interleaved rounds (A B C D, D C B A, ...):

    base        the base's op list (183 dispatches)
    adapter     the op list with the deltas, the row with the adapter (on a CPU adapter the same
                183: the matmuls make the deltas, kernels/lora.py Delta)
    adapter, base  that list with a base row (the deltas' work skipped: what their kernels' form
                costs the step by itself)
    lora only   the list's LoRA dispatches alone (none on a CPU adapter with a decode row)
    lora, base  the same with a base row (each returns at once)

    python bench/lora_step.py [--rounds 8] [--steps 20] [--only NAME] [--prefill T] [--model REF]
                              [--lora-dtype f32|f16|bf16] [--smoke]

--prefill T: the same four lists for a prefill chunk of T rows of one sequence (positions 40 ..;
a CPU adapter's LoRA ops there: lora_rows, 4 rows a workgroup) instead of a decode step. --model:
another model reference (SmolLM2-135M's Q4_1 by default). --smoke: one round of one step (checks
that the script runs to the end; its figures mean nothing).

Prints a table; writes bench/results/lora_step.json. For where a step's CPU goes, run one list
(`--only "lora only" --steps 400`) under `perf record -e cpu-clock -p PID` once its rounds have
begun: lavapipe's compiled kernels show as [JIT], the rest per library (`perf report --sort dso`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
MODEL = "SmolLM2-135M-Instruct-Q4_1"
POS = 40


async def main() -> None:
    from serve import random_adapter

    from webgpu_engine.engine.engine import AsyncMLCEngine
    from webgpu_engine.kernels.lora import NONE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default=None, help="time this list alone (base, adapter, 'adapter, base', 'lora only', "
                                                  "'lora, base')")
    ap.add_argument("--prefill", type=int, default=0, metavar="T", help="time a prefill chunk of T rows instead")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--lora-dtype", default="f16", choices=("f32", "f16", "bf16"), help="the adapter's tensors")
    ap.add_argument("--smoke", action="store_true", help="one round of one step")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_step.json"))
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 1
    with tempfile.TemporaryDirectory() as tmp:
        eng = AsyncMLCEngine()
        await eng.reload(args.model, {"context_window_size": 1024, "max_num_sequences": 4},
                         lora_adapters={"bench": random_adapter(args.model, Path(tmp) / "lora", dtype=args.lora_dtype)})
    pipe = next(iter(eng.held.models.values())).pipeline      # the one model loaded
    fwd, dev = pipe.scheduler.fwd, pipe.scheduler.dev
    slot = pipe.lora.acquire("bench")
    T, kind = (args.prefill, "prefill") if args.prefill else (1, "decode")
    rows = list(range(POS, POS + T))
    inputs = [(fwd.ids.buf, [1] * T), (fwd.positions.buf, rows), (fwd.slots.buf, rows),
              (fwd.tables.buf, list(range(fwd.max_blocks)))]
    inputs += [(fwd.step, (POS, T, POS + T, 0))] if args.prefill else [(fwd.lens.buf, [POS + 1])]
    lists = {"base": (fwd.ops(kind, T, False), None), "adapter": (fwd.ops(kind, T, True), slot)}
    lists["adapter, base"] = (lists["adapter"][0], NONE)
    lora_ops = [op for op in lists["adapter"][0] if op.name.startswith("lora")]
    lists["lora only"], lists["lora, base"] = (lora_ops, slot), (lora_ops, NONE)
    if args.only:
        lists = {args.only: lists[args.only]}

    def step(name: str) -> None:
        ops, s = lists[name]
        batch = dev.batch()
        fwd._put(batch, inputs + ([(fwd.lora_idx.buf, [s] * T)] if s is not None else []))
        for op in ops:
            op.record(batch, n_keys=POS + T)
        dev.submit(batch)
        dev.read_sync(fwd.logits.buf, 0, 4)

    for name in lists:                       # compiled and warm
        step(name)
    await dev.compiled()
    for name in lists:
        step(name)
    cpu, wall = {name: [] for name in lists}, {name: [] for name in lists}
    for r in range(args.rounds):
        for name in (list(lists) if r % 2 == 0 else list(lists)[::-1]):
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                step(name)
            cpu[name].append((time.process_time() - c0) / args.steps * 1e3)
            wall[name].append((time.perf_counter() - w0) / args.steps * 1e3)
    load = os.getloadavg()
    what = f"a prefill chunk of {T} rows" if args.prefill else "one decode row"
    print(f"{args.model}, a rank-16 {args.lora_dtype} adapter of 7 targets (held in {pipe.lora.wdtype}), {what}; "
          f"CPU ms a step, {args.rounds} rounds of "
          f"{args.steps}, load {load[0]:.1f} / {load[1]:.1f}")
    base = statistics.median(cpu.get("base", cpu[next(iter(cpu))]))
    wbase = statistics.median(wall.get("base", wall[next(iter(wall))]))
    for name, xs in cpu.items():
        d = sum(len(op.dispatches) for op in lists[name][0])
        ws = statistics.median(wall[name])
        print(f"  {name:14s} {d:4d} dispatches  median {statistics.median(xs):6.2f}  min {min(xs):6.2f}  "
              f"({statistics.median(xs) / base:.3f}x the base); wall median {ws:6.2f} ({ws / wbase:.3f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "lora_dtype": args.lora_dtype, "held": pipe.lora.wdtype,
                                          "kind": kind, "rows": T, "load": load, "rounds": args.rounds, "steps": args.steps,
                                         "cpu_ms": cpu, "wall_ms": wall, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    await eng.unload()


if __name__ == "__main__":
    asyncio.run(main())
