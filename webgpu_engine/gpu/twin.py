"""A second device on the same adapter that compiles pipelines for the first one (lavapipe).

llvmpipe compiles a pipeline's code at its first dispatch, on its queue's one thread, and keeps the
code in Mesa's on-disk shader cache (on by default). A second device compiling the same pipeline
fills that cache for the first: on lavapipe (LLVM 15) a tiled GEMM's first dispatch cost 0.06 CPU
s on one device after the other had compiled it, against 2.4 cold (2.4 both with
MESA_SHADER_CACHE_DISABLE set). So the kernels a request needs compile on two queue threads
instead of one (compiler.py `ready`). Each device runs its own driver's code for the same shader:
what a kernel computes never depends on which device compiled it first, only when it is ready.
"""
from __future__ import annotations

import logging
import os
import threading

_log = logging.getLogger("webgpu_engine.gpu")
_MAX_BIND = 1 << 16      # bytes bound per binding: an empty dispatch reads nothing


def cache_enabled() -> bool:
    """Whether Mesa's on-disk shader cache is on (its default) and the twin is not switched off
    ($WEBGPU_ENGINE_COMPILE_TWIN=0)."""
    off = ("1", "true", "yes")
    return (os.environ.get("MESA_SHADER_CACHE_DISABLE", "").lower() not in off
            and os.environ.get("WEBGPU_ENGINE_COMPILE_TWIN", "1") != "0")


class Twin:
    """The second device: `compile(code, entry, constants, entries)` creates the pipeline there
    and dispatches it with no workgroups, returning once its queue has run it (compiled)."""

    def __init__(self, raw_device, usage_flags, map_read):
        self.raw = raw_device
        self._u, self._map_read = usage_flags, map_read
        self._bufs: dict = {}
        self._lock = threading.Lock()

    def _buffer(self, usage: int, size: int, binding: int = -1):
        key = (usage, size, binding)    # a buffer per binding: one bound read-only and read-write conflicts
        with self._lock:
            b = self._bufs.get(key)
            if b is None:
                b = self._bufs[key] = self.raw.create_buffer(size=size, usage=usage, label="twin")
            return b

    def compile(self, code: str, entry: str, constants: dict, entries: tuple) -> bool:
        """False where it failed (the caller then compiles on its own device)."""
        try:
            stage = {"module": self.raw.create_shader_module(code=code), "entry_point": entry}
            if constants:
                stage["constants"] = constants
            pipe = self.raw.create_compute_pipeline(layout="auto", compute=stage)
            keep = self._u.STORAGE | self._u.UNIFORM
            binds = []
            for i, raw, _off, size in entries:
                n = max(4, min(size, _MAX_BIND) // 4 * 4)
                binds.append({"binding": i, "resource": {
                    "buffer": self._buffer((raw.usage & keep) | self._u.COPY_DST, n, i), "offset": 0, "size": n}})
            group = self.raw.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=binds)
            done = self.raw.create_buffer(size=4, usage=self._u.MAP_READ | self._u.COPY_DST)
            src = self._buffer(self._u.COPY_SRC, 4)
            enc = self.raw.create_command_encoder()
            cpass = enc.begin_compute_pass()
            cpass.set_pipeline(pipe)
            cpass.set_bind_group(0, group)
            cpass.dispatch_workgroups(0, 1, 1)
            cpass.end()
            enc.copy_buffer_to_buffer(src, 0, done, 0, 4)
            self.raw.queue.submit([enc.finish()])
            done.map_sync(self._map_read)           # its queue has compiled and run the dispatch
            done.unmap()
            done.destroy()
            return True
        except Exception as e:  # noqa: BLE001 - only a head start
            _log.debug("twin compile of %s failed: %s", entry, e)
            return False

    def destroy(self) -> None:
        with self._lock:
            for b in self._bufs.values():
                b.destroy()
            self._bufs.clear()
        self.raw.destroy()


class Split:
    """One `ready` call's share of compile work between the device's queue and the twin's, by a
    pipeline's code length (a rough measure of its LLVM time): each goes where less is queued."""

    def __init__(self):
        self.main = self.twin = 0
        self._lock = threading.Lock()

    def to_twin(self, cost: int, quick: bool) -> bool:
        """Whether a pipeline of `cost` goes to the twin; one slow to create (`quick` False) stays."""
        with self._lock:
            if quick and self.twin <= self.main:
                self.twin += cost
                return True
            self.main += cost
            return False
