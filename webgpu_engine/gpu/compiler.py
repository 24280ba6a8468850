"""Pipelines that compile in the background.

A model's kernels take most of its load time on some drivers (lavapipe: 1-2 s of LLVM per tiled
prefill pipeline, ~20 s for the default chat model), while its first request needs only a few of
them. Inside `Device.compiling_in_background()` a new pipeline is not compiled where it is asked
for: it is queued on the device's `BackgroundCompiler`, whose worker threads compile the queue in
order (the driver's compile releases the GIL and runs beside the event loop). Whoever needs a
pipeline first compiles it: a submit whose batch dispatches one that no worker has started yet
compiles it in place, one a worker is compiling waits for that worker. So a request never waits
behind kernels it does not use, and once the queue is done no request compiles at all.

Some drivers finish a pipeline only at its first dispatch (lavapipe: creating one runs its NIR
passes, and LLVM compiles it when a command buffer first dispatches it, on the queue's one thread;
that is most of the time). A request compiling its own pipelines (`ready`) therefore dispatches
each of them with no workgroups as soon as it is created (`warms_on_dispatch`): the queue's thread
compiles one while the other cores still create the rest, instead of compiling them all in turn
when the request's batch runs; where Mesa's on-disk shader cache is on, part of them compiles on
a second device's queue thread instead (twin.py), its code reaching this device through the cache,
so two queue threads compile side by side. The workers, once nothing is left to create, dispatch each pipeline
they created empty (with the bind group it was first bound with) when the device has had no
read awaited and no submit for IDLE_S, or has waited WARM_WAIT_S for such a pause: the rest compiles in the background
after the first request instead of inside a later request's step. A pipeline's stand-in (same
results and bindings: the tiled matmul's 8-row tile, cheaper to compile than the full one, several
of its workgroups per workgroup of a taller tile) runs until the pipeline itself has been
dispatched once, so its compile never stalls a step either, and a cold first request compiles
the cheaper kernel.

Standard library only; the browser backend compiles in place (no threads in the page).
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable

from .twin import Split


_log = logging.getLogger("webgpu_engine.gpu")
GRACE_S = 0.5        # after a load, before the workers start (compiling_in_background)
IDLE_S = 0.3         # no submit for this long: the workers may compile by an empty dispatch
WARM_WAIT_S = 30.0   # ... or once they have waited this long for such a pause (a busy server)
TWIN_CREATE_S = 0.4  # CPU s: a pipeline created faster may compile on the twin device (twin.py)


class LazyRaw:
    """The driver object of a pipeline or bind group, made on first need by `make` (once, from any
    thread); a failure is kept and raised to everyone who needs it."""

    __slots__ = ("_raw", "_make", "_error", "_lock")

    def __init__(self, raw: Any = None, make: Callable[[], Any] | None = None):
        self._raw, self._make, self._error = raw, make, None
        self._lock = threading.Lock() if make is not None else None

    @property
    def ready(self) -> bool:
        return self._make is None

    def resolve(self) -> Any:
        if self._make is not None:
            with self._lock:
                make = self._make
                if make is not None:
                    try:
                        self._raw = make()
                    except BaseException as e:  # noqa: BLE001 - kept for whoever needs it
                        self._error = e
                    self._make = None
        if self._error is not None:
            raise self._error
        return self._raw

    def try_resolve(self) -> None:
        """resolve(), a failure left for whoever needs the object to raise."""
        try:
            self.resolve()
        except BaseException:  # noqa: BLE001 - kept in self._error
            pass

    def started(self) -> bool:
        """Whether someone is making it now (its lock is held) or has made it."""
        return self._make is None or (self._lock is not None and self._lock.locked())


class BackgroundCompiler:
    """Worker threads that resolve queued pipelines in order (see the module docstring)."""

    def __init__(self, workers: int = 1):
        self.workers = max(1, int(workers))
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._busy = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._held = 0                # requests compiling what they need: workers start nothing new
        self.done = 0                 # pipelines the workers compiled
        # created pipelines to compile by an empty dispatch when the device pauses (warms_on_dispatch):
        # `idle()` -> seconds since the device's last submit, `warm(p)` dispatches p empty
        self._to_warm: deque = deque()
        self.idle: Callable[[], float] | None = None
        self.warm: Callable[[Any], None] | None = None
        _compilers.add(self)

    def submit(self, p) -> None:
        with self._cv:
            if self._closed:
                return
            self._queue.append(p)
            if len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name="webgpu-engine-compile", daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()

    def pending(self) -> int:
        """Pipelines queued or compiling (or waiting for their empty dispatch)."""
        with self._cv:
            return len(self._queue) + self._warm_left() + self._busy

    def _warm_left(self) -> int:
        """Pipelines left to dispatch empty (under the lock): those dispatched meanwhile dropped."""
        if any(p.hot for p in self._to_warm):
            self._to_warm = deque(p for p in self._to_warm if not p.hot)
        return len(self._to_warm)

    def cancel(self) -> int:
        """Drop what no worker has started (the pipelines compile in place if ever needed)."""
        with self._cv:
            n = len(self._queue)
            self._queue.clear()
            self._to_warm.clear()
            self._cv.notify_all()
            return n

    def hold(self, on: bool) -> None:
        """While held (counted), workers finish what they compile but start nothing new: a
        request compiling its own pipelines has the cores."""
        with self._cv:
            self._held += 1 if on else -1
            self._cv.notify_all()

    def release_later(self, seconds: float) -> None:
        """hold(False) after `seconds` (a daemon timer)."""
        t = threading.Timer(seconds, self.hold, (False,))
        t.daemon = True
        t.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the queue is done (True) or `timeout` seconds pass (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._warm_left() and not self._busy,
                                     timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the queue and wait up to `timeout` s for the compiles under way (before the device
        is destroyed: the driver must not compile on a destroyed device)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._to_warm.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _next(self):
        """The next job (under the lock): ("make", p), or ("warm", p) once nothing is left to make
        and the device has paused (or waited WARM_WAIT_S for a pause); None: closed."""
        waited = 0.0
        while True:
            if self._closed:
                return None
            if self._queue and not self._held:
                return "make", self._queue.popleft()
            if self._warm_left() and not self._held and not self._queue:
                idle = self.idle() if self.idle is not None else IDLE_S
                if idle >= IDLE_S or waited >= WARM_WAIT_S:
                    return "warm", self._to_warm.popleft()
                pause = IDLE_S - idle + 0.01
                self._cv.wait(pause)
                waited += pause
                continue
            if not self._queue and not self._to_warm:
                self._cv.wait()
            else:
                self._cv.wait(IDLE_S)

    def _work(self) -> None:
        while True:
            with self._cv:
                job = self._next()
                if job is None:
                    return
                self._busy += 1
            kind, p = job
            try:
                if kind == "make" and not p.lazy.started():
                    p.lazy.try_resolve()
                    self.done += 1
                if kind == "warm":
                    self.warm(p)
                elif self.warm is not None and p.warm_group is not None and not p.hot:
                    with self._cv:
                        self._to_warm.append(p)
            finally:
                with self._cv:
                    self._busy -= 1
                    drained = not self._queue and not self._warm_left() and not self._busy
                    self._cv.notify_all()
                if drained:
                    _log.info("background compiler: queue done (%d kernels compiled by its workers so far)",
                              self.done)


class CompilingDevice:
    """Device's side of background compiling (gpu/base.py: Device.pipeline queues a new pipeline
    while `_defer` is set, Pipeline and BindGroup hold LazyRaw objects; submits call _prepare)."""

    background: "BackgroundCompiler | None"
    _defer: bool
    _queued: list
    _pipelines: dict
    compile_waits: int
    stand_ins: int
    warmed: int                   # pipelines dispatched empty (warms_on_dispatch), here or on the twin
    twin_compiled: int            # of those, the ones compiled on the twin device (twin.py)
    last_submit: float            # time.monotonic() of the last submit with dispatches
    lost: bool                    # Device's: the device was lost (nothing compiles any more)
    _guard: Callable[..., Any]    # Device's: a call that turns backend errors into the engine's
    _raw_bind: Callable[..., Any]  # the backend's bind group maker

    # whether the driver compiles a pipeline at its first dispatch, so that an empty dispatch
    # compiles it (backends that can make one say so: NativeDevice on lavapipe)
    warms_on_dispatch = False

    def _raw_warm(self, raw_pipeline, raw_bind_group, label: str, buffers: tuple = ()) -> None:
        """Dispatch a pipeline with no workgroups (backends with warms_on_dispatch); `buffers`: the
        bind group's, checked alive where the submit is made."""
        raise NotImplementedError

    @contextmanager
    def compiling_in_background(self):
        """Pipelines first asked for inside this block compile on the background compiler, where
        the backend has one. Yields the list of the pipelines it queues (filled as the block runs;
        `ready` takes it), or None where the backend compiles in place. The workers start nothing
        inside the block and for GRACE_S after it: a request sent as soon as a load returns then
        compiles what it needs on every core (a worker already compiling another kernel would
        hold a core for seconds on lavapipe)."""
        prev, queued, bg = self._defer, [], self.background
        self._defer = bg is not None
        self._queued.append(queued)
        if bg is not None:
            bg.hold(True)
            self._twin_soon()       # the twin device made during the load, ready for the first request
        try:
            yield queued if self._defer else None
        finally:
            self._defer = prev
            # by identity: list.remove compares by value, and a nested block's list may equal this one
            self._queued[:] = [q for q in self._queued if q is not queued]
            if bg is not None:
                bg.release_later(GRACE_S)

    deferring = property(lambda self: self._defer, doc="inside compiling_in_background (with a compiler)")

    def compiles_pending(self) -> int:
        """Pipelines queued on the background compiler or compiling there."""
        return self.background.pending() if self.background is not None else 0

    def uncompiled(self) -> int:
        """Pipelines of the cache not compiled yet (queued, compiling, or dropped from the queue)."""
        return sum(not p.ready for p in list(self._pipelines.values()))

    async def compiled(self) -> None:
        """Wait (without blocking the event loop) until the background compiler's queue is done."""
        if self.background is not None and self.background.pending():
            await asyncio.to_thread(self.background.wait)

    def usable(self, p) -> bool:
        """Whether pipeline p runs as itself now: created, and where the driver compiles at the first
        dispatch, dispatched once (else its stand-in, where it has one, runs in its place)."""
        return p.lazy.ready and (p.hot or not self.warms_on_dispatch)

    async def ready(self, work) -> None:
        """Compile, off the event loop and side by side, the pipelines that `work` (a Batch, or
        pipelines) dispatches and the background compiler has not made yet (its workers start
        nothing new meanwhile); a submit would compile them one by one on the submitting thread.
        A pipeline with a stand-in that is not usable yet has its stand-in compiled instead, and
        the batch runs the stand-in. Where the driver compiles on first dispatch, each is
        dispatched empty once created (with a bind group of the batch's, or the one it was first
        bound with), so that its compile overlaps the others' creation."""
        bg = self.background
        if bg is None or not bg.pending():
            return
        todo: dict = {}
        if hasattr(work, "ops"):
            for op in work.ops:
                if op[0] != "d":
                    continue
                p, group = op[1], op[2]
                if p.stand_in is not None and not self.usable(p):
                    p, group = p.stand_in, self._alt_group(group, p.stand_in)
                if not p.ready and id(p) not in todo:
                    todo[id(p)] = (p, group)
        else:                               # pipelines: each with the bind group it was first bound with
            todo = {id(p): (p, p.warm_group) for p in work if not p.ready}
        if todo:
            self.compile_waits += len(todo)
            bg.hold(True)
            split = Split()
            try:
                await asyncio.gather(*(asyncio.to_thread(self._make_and_warm, p, group, split)
                                       for p, group in todo.values()))
            finally:
                bg.hold(False)
        if hasattr(work, "ops"):
            self._stand_in(work.ops)

    def _make_and_warm(self, p, group, split: Split | None = None) -> None:
        """Create pipeline `p` (a failure is left for the submit to raise) and, given one of its
        bind groups, dispatch it with no workgroups: a driver that compiles on first dispatch
        compiles it now, on its queue's thread, while this thread goes on to the next. Where the
        backend has a twin device (twin.py), a pipeline quick to create (its create is not worth
        doing twice) may compile there instead, on the twin's queue thread, when less is queued
        there (`split`); the batch's own dispatch then finds it in the shader cache."""
        t = time.thread_time()
        p.lazy.try_resolve()
        if group is None or not self.warms_on_dispatch:
            return
        cost = len(p.source[0]) if p.source is not None else 0
        if split is not None and cost and p.lazy._error is None and not p.hot:
            quick = time.thread_time() - t < TWIN_CREATE_S
            if split.to_twin(cost, quick):
                twin = self._twin()
                if twin is not None and twin.compile(*p.source, group.entries):
                    # hot: its code is in the cache, so its first dispatch here costs a lookup
                    p.dispatched()
                    self.twin_compiled += 1
                    self.warmed += 1
                    return
        self._warm(p, group)

    def _twin(self):
        """The backend's twin device (twin.py), or None."""
        return None

    def _twin_soon(self) -> None:
        """Start making the backend's twin device, if it has one, in the background."""

    def _warm(self, p, group) -> None:
        """Dispatch created pipeline p empty with `group` (one of its bind groups), unless it is
        hot already or a buffer of the group was released; p is hot after it."""
        if p.hot or p.lazy._error is not None:
            return
        if any(not (b[0] if isinstance(b, tuple) else b).alive for b in group.buffers):
            if p.warm_group is group:       # its model was unloaded: a later bind may offer another
                p.warm_group = None
            return
        try:
            group.lazy.resolve()
            self._raw_warm(p.raw, group.raw, p.name, group.buffers)
            p.dispatched()
            self.warmed += 1
        except Exception as e:  # noqa: BLE001 - only a head start: a batch's submit reports errors
            _log.debug("warm-up dispatch of %s failed: %s", p.name, e)

    def _warm_later(self, p) -> None:
        """The background compiler's warm(p): with the bind group p was first bound with."""
        group = p.warm_group
        if group is not None and not self.lost:
            self._warm(p, group)

    def _alt_group(self, group, alt):
        """The bind group of stand-in `alt` with `group`'s entries (kept with `group`)."""
        if group.alt is None or group.alt.pipeline is not alt:
            group.alt = type(group)(None, alt, group.buffers, entries=group.entries, make=lambda: self._guard(
                lambda: self._raw_bind(alt.raw, group.entries, alt.name), alt.name))
        return group.alt

    def _stand_in(self, ops: list) -> None:
        """Dispatches of a pipeline not usable yet whose stand-in is compiled run the stand-in
        (same results and bindings; stand_in_y times the workgroups along y) with a bind group of
        its own (kept with the op's)."""
        for i, op in enumerate(ops):
            if op[0] != "d" or op[1].stand_in is None or not op[1].stand_in.ready or self.usable(op[1]):
                continue
            alt = op[1].stand_in
            x, y, z = op[3:]
            ops[i] = ("d", alt, self._alt_group(op[2], alt), x, y * op[1].stand_in_y, z)
            self.stand_ins += 1

    def _prepare(self, ops: list) -> None:
        """Make the pipelines and bind groups a batch dispatches where they are not made yet (a
        pipeline still queued compiles here; one a worker is compiling is waited for)."""
        self.last_submit = time.monotonic()
        for op in ops:
            if op[0] == "d":
                p, bg = op[1], op[2]
                if not p.lazy.ready:
                    self.compile_waits += 1
                    p.lazy.resolve()
                if not bg.lazy.ready:
                    bg.lazy.resolve()
                if not p.hot:
                    p.dispatched()


_compilers: "weakref.WeakSet[BackgroundCompiler]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit the queue is dropped and the compile under way is not waited for (a one-shot
    command exits as soon as it has answered; seen to exit cleanly on lavapipe)."""
    for c in list(_compilers):
        c.close(timeout=0.0)
