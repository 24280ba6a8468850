"""Matmul tuner: time the candidate kernels on a model's weights and store the winners per adapter.

For every distinct weight (type, rows, columns) of a loaded model and every row class the model
runs (decode "t1".."t8", prefill, or "tn" for embedders' batches; see profiles.shape_key), the
tuner times "base" — the kernels the adapter's built-in strategy runs there (matmul.py with the
"cpu" family's selection) — against kernels/matmul_gpu.py's variants that serve the class, and
stores the fastest in the adapter's profile (kernels/profiles.py). A variant replaces base only
when it is faster by more than MARGIN, twice (a second timing of the two side by side), so that
noise does not trade today's kernels for a tie.

Timing: `reps` executions recorded into one submit and waited for by a 4-byte readback, best of
`runs`; on a CPU adapter the process's CPU time (the driver's threads are ours: a measure that does
not depend on what else the machine runs), elsewhere wall time. A time budget stops the tuner
between measurements; what was measured is stored, the rest keeps the built-in default.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

from ..gpu import Device
from . import matmul as mm
from . import matmul_gpu as mg
from . import profiles
from .common import DTYPE_SIZE, Op, Tensor, new_tensor

MARGIN = 0.9                     # a variant must take under 90% of base's time to replace it
DECODE_ROWS = (1, 2, 4, 8)


@dataclass
class Case:
    """One timed matmul: a weight, a row class and its T."""

    weight: mm.QWeight
    rows: str                    # "t1".."t8", "prefill" or "tn"
    T: int

    @property
    def row_invariant(self) -> bool:
        return self.rows == "prefill"

    @property
    def key(self) -> str:
        w = self.weight
        return profiles.shape_key(w.qtype, w.n, w.k, self.T, self.row_invariant)


@dataclass
class Result:
    key: str
    times: dict = field(default_factory=dict)     # candidate key -> ms
    choice: str = profiles.BASE
    bytes: int = 0                               # weight + x + y bytes one matmul moves
    flops: int = 0


def model_weights(model) -> list:
    """The distinct (type, n, k) matmul weights reachable from a model object (its attributes,
    lists and dataclasses; a MIXED weight's parts each count)."""
    found, seen, stack, visited = [], set(), [model], set()
    while stack:
        o = stack.pop()
        if id(o) in visited or o is None or isinstance(o, (str, bytes, int, float, Tensor)):
            continue
        visited.add(id(o))
        if isinstance(o, mm.QWeight):
            for w in (o.subs or [o]):
                if (w.qtype, w.n, w.k) not in seen and w.bufs:
                    seen.add((w.qtype, w.n, w.k))
                    found.append(w)
            continue
        if isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("webgpu_engine.models"):
            stack.extend(vars(o).values())
    return sorted(found, key=lambda w: (w.qtype, w.n, w.k))


def cases_for(weights: list, kind: str, prefill_t: int = 128, batch_t: int = 128) -> list[Case]:
    """The row classes a chat model (kind "llm": decode of 1..8 sequences and row-invariant
    prefill) or an embedder ("embedding": batches of many rows) runs on each weight."""
    out = []
    for w in weights:
        if kind == "llm":
            out += [Case(w, f"t{T}", T) for T in DECODE_ROWS]
            out.append(Case(w, "prefill", prefill_t))
        else:
            out.append(Case(w, "tn", batch_t))
    return out


def _time(dev: Device, op: Op, sync, cpu_clock: bool, min_s: float, runs: int) -> float:
    """Best seconds per execution of `op` (see the module docstring)."""
    def once(n: int) -> float:
        b = dev.batch()
        for _ in range(n):
            op.record(b)
        t0, c0 = time.perf_counter(), time.process_time()
        dev.submit(b)
        dev.read_sync(sync, 0, 4)
        return (time.process_time() - c0 if cpu_clock else time.perf_counter() - t0) / n
    once(1)                                    # compile, warm caches
    n, dt = 1, once(1)
    while dt * n < min_s and n < 256:
        n = min(256, max(2 * n, int(min_s / max(dt, 1e-6))))
        dt = once(n)
    return min([dt] + [once(n) for _ in range(runs - 1)])


def _base_op(dev: Device, x: Tensor, w: mm.QWeight, y: Tensor, row_invariant: bool) -> Op:
    """The matmul as the adapter's built-in strategy runs it (matmul.py's own kernels)."""
    cpu = mm.is_cpu_adapter(dev)
    saved = dict(mm.CONFIG_OVERRIDES)
    mm.CONFIG_OVERRIDES.update({"family": "cpu", "unroll": cpu, "tiled": cpu})
    try:
        return mm.matmul(dev, x, w, y, row_invariant=row_invariant)
    finally:
        mm.CONFIG_OVERRIDES.clear()
        mm.CONFIG_OVERRIDES.update(saved)


def candidates(case: Case) -> list:
    if case.rows.startswith("t") and case.rows != "tn":
        return list(mg.DECODE_VARIANTS)
    return list(mg.GEMM_VARIANTS)


def measure(dev: Device, case: Case, dtype: str, *, min_s: float = 0.05, runs: int = 3, owner: str = "tune") -> Result:
    """Time base and every candidate on one case; the choice per MARGIN."""
    w, T = case.weight, case.T
    cpu_clock = mm.is_cpu_adapter(dev)
    esz = DTYPE_SIZE[dtype]
    # activations: small values of either sign (timings do not depend on them)
    vals = [((i * 7919) % 13 - 6) / 16.0 for i in range(T * w.k)]
    raw = struct.pack(f"<{len(vals)}{'f' if dtype == 'f32' else 'e'}", *vals)
    x = Tensor(dev.upload(raw, owner=owner, label="tune:x"), (T, w.k), dtype)
    y = new_tensor(dev, (T, w.n), dtype, owner=owner, label="tune:y")
    res = Result(case.key, bytes=w.nbytes + (T * w.k + T * w.n) * esz, flops=2 * T * w.n * w.k)
    ops = {profiles.BASE: _base_op(dev, x, w, y, case.row_invariant)}
    try:
        ops.update((v.key, mg.matmul(dev, x, w, y, variant=v, row_invariant=case.row_invariant))
                   for v in candidates(case))
        for key, op in ops.items():
            res.times[key] = 1e3 * _time(dev, op, y.buf, cpu_clock, min_s, runs)
        best = min((k for k in res.times if k != profiles.BASE), key=res.times.get, default=None)
        if best is not None and res.times[best] < MARGIN * res.times[profiles.BASE]:
            # a win is timed again, base and the winner side by side: a shared machine's noise
            # must not trade today's kernels for a tie
            again = {k: 1e3 * _time(dev, ops[k], y.buf, cpu_clock, min_s, runs) for k in (profiles.BASE, best)}
            if again[best] < MARGIN * again[profiles.BASE]:
                res.choice = best
            res.times.update({k: min(res.times[k], t) for k, t in again.items()})
    finally:
        for op in ops.values():
            op.release()
        x.buf.release()
        y.buf.release()
    return res


def tune(dev: Device, cases: list[Case], dtype: str, *, budget_s: float = 120.0, progress=None,
         save: bool = True, min_s: float = 0.05, runs: int = 3) -> list[Result]:
    """Measure `cases` within about `budget_s` seconds (stops between cases), store the choices in
    this adapter's profile (`save`) and return the results. `progress(done, total, result)` is
    called after each case."""
    t0 = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        if time.perf_counter() - t0 > budget_s:
            break
        results.append(measure(dev, case, dtype, min_s=min_s, runs=runs))
        if progress:
            progress(i + 1, len(cases), results[-1])
    if save and results:
        profiles.save(dev, {r.key: r.choice for r in results},
                      {r.key: {k: round(v, 4) for k, v in r.times.items()} for r in results})
    return results


__all__ = ["MARGIN", "Case", "Result", "model_weights", "cases_for", "candidates", "measure", "tune"]
