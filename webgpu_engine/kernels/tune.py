"""Matmul tuner: time the candidate kernels on a model's weights and store the winners per adapter.

For every distinct weight (type, rows, columns) of a loaded model and every row class the model
runs (decode "t1".."t8", prefill, or "tn" for embedders' batches; see profiles.shape_key), the
tuner times "base" — the kernels the adapter's built-in strategy runs there (the matmul package with the
"cpu" family's selection) — against kernels/matmul/gpu.py's variants that serve the class, and
stores the fastest in the adapter's profile (kernels/profiles.py). A variant replaces base only
when it is faster by more than MARGIN, twice (a second timing of the two side by side), so that
noise does not trade today's kernels for a tie.

Timing: `reps` executions recorded into one submit and waited for by a 4-byte readback, best of
`runs`; on a CPU adapter the process's CPU time (the driver's threads are ours: a measure that does
not depend on what else the machine runs), elsewhere wall time. A time budget stops the tuner
between measurements; what was measured is stored, the rest keeps the built-in default.

Tuning at load (`tune_at_load`): a model loading on an adapter whose profile lacks some of its
shapes has those timed first, within a time budget, so that its kernels are built from the stored
choices; the next load finds them and times nothing (see `tunes_at_load` for when it runs).
"""
from __future__ import annotations

import logging
import os
import struct
import sys
import time
from dataclasses import dataclass, field

from ..gpu import Device
from . import matmul as mm
from .matmul import gpu as mg
from . import profiles
from .common import DTYPE_SIZE, Op, Tensor, new_tensor

log = logging.getLogger("webgpu_engine.tune")

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
    prefill), an embedder ("embedding": batches of many rows) or a decoder run as an embedder
    ("prefill": its row-invariant prefill only) runs on each weight."""
    out = []
    for w in weights:
        if kind == "llm":
            out += [Case(w, f"t{T}", T) for T in DECODE_ROWS]
            out.append(Case(w, "prefill", prefill_t))
        elif kind == "prefill":
            out.append(Case(w, "prefill", prefill_t))
        else:
            out.append(Case(w, "tn", batch_t))
    return out


async def _time(dev: Device, op: Op, wait, cpu_clock: bool, min_s: float, runs: int) -> float:
    """Best seconds per execution of `op` (see the module docstring); `wait()` returns when the
    GPU has run everything submitted."""
    async def once(n: int) -> float:
        b = dev.batch()
        for _ in range(n):
            op.record(b)
        t0, c0 = time.perf_counter(), time.process_time()
        dev.submit(b)
        await wait()
        return (time.process_time() - c0 if cpu_clock else time.perf_counter() - t0) / n
    await once(1)                              # compile, warm caches
    n, dt = 1, await once(1)
    while dt * n < min_s and n < 256:
        n = min(256, max(2 * n, int(min_s / max(dt, 1e-6))))
        dt = await once(n)
    return min([dt] + [await once(n) for _ in range(runs - 1)])


def _blocking(coro):
    """Run a coroutine that never suspends (its waits are blocking readbacks) without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a blocking tuner run awaited")


def _base_op(dev: Device, x: Tensor, w: mm.QWeight, y: Tensor, row_invariant: bool) -> Op:
    """The matmul as the adapter's built-in strategy runs it (the matmul package's own kernels)."""
    cpu = mm.is_cpu_adapter(dev)
    saved = dict(mm.CONFIG_OVERRIDES)
    mm.CONFIG_OVERRIDES.update({"family": "cpu", "unroll": cpu, "tiled": cpu})
    try:
        return mm.matmul(dev, x, w, y, row_invariant=row_invariant)
    finally:
        mm.CONFIG_OVERRIDES.clear()
        mm.CONFIG_OVERRIDES.update(saved)


def candidates(case: Case, dev: Device | None = None) -> list:
    """The variants timed for `case` on `dev` (default: the device holding the case's weight):
    the subgroup decode variants only where the device runs them (matmul/gpu.py decode_variants)."""
    if case.rows.startswith("t") and case.rows != "tn":
        return list(mg.decode_variants(dev or case.weight.bufs[0].device))
    return list(mg.GEMM_VARIANTS)


def measure(dev: Device, case: Case, dtype: str, *, min_s: float = 0.05, runs: int = 3, owner: str = "tune") -> Result:
    """Time base and every candidate on one case; the choice per MARGIN (blocking readbacks)."""
    return _blocking(measure_async(dev, case, dtype, min_s=min_s, runs=runs, owner=owner, blocking=True))


async def measure_async(dev: Device, case: Case, dtype: str, *, min_s: float = 0.05, runs: int = 3,
                        owner: str = "tune", blocking: bool = False) -> Result:
    """`measure` whose waits for the GPU are awaited readbacks (the event loop keeps running; the
    browser has no blocking readback)."""
    w, T = case.weight, case.T
    cpu_clock = mm.is_cpu_adapter(dev)
    esz = DTYPE_SIZE[dtype]
    # activations: small values of either sign (timings do not depend on them)
    vals = [((i * 7919) % 13 - 6) / 16.0 for i in range(T * w.k)]
    raw = struct.pack(f"<{len(vals)}{'f' if dtype == 'f32' else 'e'}", *vals)
    x = Tensor(dev.upload(raw, owner=owner, label="tune:x"), (T, w.k), dtype)
    y = new_tensor(dev, (T, w.n), dtype, owner=owner, label="tune:y")

    async def wait():
        if blocking:
            dev.read_sync(y.buf, 0, 4)
        else:
            await dev.read(y.buf, 0, 4)

    async def timed(op):
        return 1e3 * await _time(dev, op, wait, cpu_clock, min_s, runs)
    res = Result(case.key, bytes=w.nbytes + (T * w.k + T * w.n) * esz, flops=2 * T * w.n * w.k)
    ops = {profiles.BASE: _base_op(dev, x, w, y, case.row_invariant)}
    try:
        ops.update((v.key, mg.matmul(dev, x, w, y, variant=v, row_invariant=case.row_invariant))
                   for v in candidates(case))
        for key, op in ops.items():
            res.times[key] = await timed(op)
        best = min((k for k in res.times if k != profiles.BASE), key=res.times.get, default=None)
        if best is not None and res.times[best] < MARGIN * res.times[profiles.BASE]:
            # a win is timed again, base and the winner side by side: a shared machine's noise
            # must not trade today's kernels for a tie
            again = {k: await timed(ops[k]) for k in (profiles.BASE, best)}
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


# --------------------------------------------------------------------------- tuning at load
TUNE_ENV = "WEBGPU_ENGINE_TUNE"             # auto | on | off (ChatConfig.tune_kernels wins)
BUDGET_ENV = "WEBGPU_ENGINE_TUNE_BUDGET"    # seconds (ChatConfig.tune_budget_s wins)
MODES = ("auto", "on", "off")
LOAD_BUDGET_S = 20.0
LOAD_MIN_S, LOAD_RUNS = 0.02, 2             # shorter timings than the command's: the user waits
# a partial run covers first what runs most: one sequence's decode, then prefill / batches
_ROW_ORDER = {"t1": 0, "prefill": 1, "tn": 1, "t2": 2, "t4": 3, "t8": 4}


def load_settings(mode: str | None = None, budget_s: float | None = None) -> tuple[str, float]:
    """(mode, budget in seconds) of tuning at load: the chat config's values, else $WEBGPU_ENGINE_TUNE
    / $WEBGPU_ENGINE_TUNE_BUDGET, else "auto" and LOAD_BUDGET_S. InvalidRequestError for a value
    that is neither."""
    from ..errors import InvalidRequestError
    mode = (mode or os.environ.get(TUNE_ENV, "") or "auto").strip().lower()
    if mode not in MODES:
        raise InvalidRequestError(f"kernel tuning {mode!r} (tune_kernels or ${TUNE_ENV}): expected one of "
                                  f"{', '.join(MODES)}.", param="tune_kernels")
    if budget_s is None:
        text = os.environ.get(BUDGET_ENV, "").strip()
        try:
            budget_s = float(text) if text else LOAD_BUDGET_S
        except ValueError:
            budget_s = -1.0
    if not budget_s >= 0:                   # also NaN
        raise InvalidRequestError(f"kernel tuning budget {budget_s!r} (tune_budget_s or ${BUDGET_ENV}): "
                                  f"expected seconds >= 0.", param="tune_budget_s")
    return mode, float(budget_s)


def tunes_at_load(dev: Device, mode: str) -> bool:
    """Whether a load on `dev` times its missing shapes. "auto": on GPU adapters, whose built-in
    choice is a guess, and not on software ones (lavapipe, SwiftShader), where the CPU family is the
    measured default and tuning would only lengthen the load; "on": everywhere; "off": never. A
    family forced by $WEBGPU_ENGINE_KERNELS=cpu|gpu never reads a profile: no tuning then."""
    forced = os.environ.get(mm.FAMILY_ENV, "").strip().lower()
    if mode == "off" or forced in ("cpu", "gpu"):
        return False
    return mode == "on" or not mm.is_software_adapter(dev)


def row_kind(model, kind: str) -> str:
    """cases_for's kind for a loaded model of pipeline kind "llm" or "embedding": a decoder run as
    an embedder (an LLM inside: `model.llm`) runs its prefill only."""
    if kind == "llm":
        return "llm"
    return "prefill" if getattr(model, "llm", None) is not None else "embedding"


def model_cases(model, kind: str) -> list[Case]:
    """The cases a loaded model runs (see row_kind), prefill at the model's chunk, what runs most
    first."""
    llm = model if kind == "llm" else getattr(model, "llm", None)
    chunk = getattr(llm, "chunk", 128) or 128
    cases = cases_for(model_weights(model), row_kind(model, kind), prefill_t=min(128, chunk))
    return sorted(cases, key=lambda c: _ROW_ORDER.get(c.rows, 5))      # stable: weights in order


def missing_cases(dev: Device, cases: list[Case]) -> list[Case]:
    """The cases this adapter's profile has no choice for (each key once)."""
    stored, seen, out = profiles.load(dev), set(), []
    for c in cases:
        if c.key not in stored and c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


class _Bar:
    """A tqdm bar on a terminal's stderr (as the artifact fetch draws one); nothing elsewhere."""

    def __init__(self, total: int, desc: str):
        self.bar = None
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="shape", leave=False, disable=None, file=sys.stderr)
        except ImportError:                 # tqdm is optional (not in Pyodide)
            pass

    def update(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text[:40], refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def tune_at_load(dev: Device, model, kind: str, dtype: str, *, mode: str | None = None,
                       budget_s: float | None = None, progress=None, name: str = "") -> int:
    """Time the shapes of a just-uploaded `model` (kind "llm" or "embedding") that this adapter's
    profile lacks, within `budget_s` seconds (stops between shapes), and store the choices: the
    untimed shapes keep the built-in default and a later load continues with them. Runs only where
    `tunes_at_load` says so. `progress(fraction, text)` gets "Tuning kernels [i/n]" reports. Returns
    how many choices were stored. A failing tuner never fails the load: it logs a warning and
    stores what it measured before; a lost device and an error raised by `progress` (the engine
    aborting this load) do propagate."""
    mode, budget_s = load_settings(mode, budget_s)
    if not tunes_at_load(dev, mode) or budget_s <= 0:
        return 0
    try:
        todo = missing_cases(dev, model_cases(model, kind))
    except Exception as e:  # noqa: BLE001 - the load goes on with the default kernels
        _failed(dev, e)
        return 0
    if not todo:
        return 0
    what = f" for {name}" if name else ""
    log.info("tuning %d matmul shapes%s on %s (budget %g s)", len(todo), what, dev.info.name, budget_s)
    results: list[Result] = []
    bar, t0 = _Bar(len(todo), "tuning kernels"), time.perf_counter()
    try:
        for i, case in enumerate(todo):
            if time.perf_counter() - t0 > budget_s:
                break
            if progress:
                progress(i / len(todo), f"Tuning kernels [{i + 1}/{len(todo)}]")
            try:
                results.append(await measure_async(dev, case, dtype, min_s=LOAD_MIN_S, runs=LOAD_RUNS))
            except Exception as e:  # noqa: BLE001
                _failed(dev, e)
                break
            bar.update(case.key)
    finally:
        bar.close()
        stored = _store(dev, results)
    if progress:
        progress(1.0, f"Tuning kernels [{len(results)}/{len(todo)}] done")
    if len(results) < len(todo):
        log.info("tuning%s: %d of %d shapes timed within %g s; the others keep the default kernels "
                 "until a later load times them", what, len(results), len(todo), budget_s)
    return stored


def _failed(dev: Device, e: Exception) -> None:
    """A tuner error: a warning, and the load goes on with the default kernels; a lost device
    fails the load as it would have anyway."""
    from ..errors import DeviceLostError
    if isinstance(e, DeviceLostError) or dev.lost:
        raise e
    log.warning("kernel tuning failed (%s: %s); loading with the default kernels", type(e).__name__, e)


def _store(dev: Device, results: list) -> int:
    if not results:
        return 0
    try:
        profiles.save(dev, {r.key: r.choice for r in results},
                      {r.key: {k: round(v, 4) for k, v in r.times.items()} for r in results})
    except OSError as e:                    # a read-only cache: this load still runs the default
        log.warning("could not store the kernel profile (%s); loading with the default kernels", e)
        return 0
    return len(results)


__all__ = ["MARGIN", "Case", "Result", "model_weights", "cases_for", "candidates", "measure", "measure_async",
           "tune", "TUNE_ENV", "BUDGET_ENV", "MODES", "LOAD_BUDGET_S", "load_settings", "tunes_at_load",
           "row_kind", "model_cases", "missing_cases", "tune_at_load"]
