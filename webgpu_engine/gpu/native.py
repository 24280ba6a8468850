"""Native gpu backend over wgpu-py (Vulkan, Metal, DX12); wgpu-py's private names only through
wgpu_private.py."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import wgpu

from ..errors import DeviceLostError, GPUValidationError, WebGPUNotAvailableError
from .base import STORAGE, AdapterInfo, Buffer, Device, _batch_names, device_features, round_up4, staging_class
from .compiler import BackgroundCompiler
from .twin import Twin, cache_enabled
from .encoding import encode_ops, released_buffer
from .wgpu_private import wgpu_calls

_OPTIONAL_FEATURES = ("shader-f16", "subgroups", "subgroup", "timestamp-query")
_MAX_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
               "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x",
               "max-storage-buffers-per-shader-stage")

_U = wgpu.BufferUsage
_USAGE = {
    "storage": _U.STORAGE | _U.COPY_SRC | _U.COPY_DST,
    "uniform": _U.UNIFORM | _U.COPY_DST,
}


def _info_int(info, key: str) -> int:
    """An integer field of wgpu-py's adapter info (0 when absent); wgpu-py 0.32 spells the
    subgroup sizes "stackgroup_*"."""
    v = info.get(key, info.get(key.replace("subgroup", "stackgroup"), 0))
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


class NativeDevice(Device):
    backend_name = "wgpu-native"
    # naga compiles subgroup builtins on a device with the feature but rejects `enable subgroups;`
    implicit_extensions = frozenset({"subgroups"})

    def __init__(self, adapter, raw_device):
        info = adapter.info
        super().__init__(
            AdapterInfo(vendor=str(info.get("vendor", "")), architecture=str(info.get("architecture", "")),
                        description=str(info.get("description", "")), backend=str(info.get("backend_type", "")),
                        adapter_type=str(info.get("adapter_type", "")), device=str(info.get("device", "")),
                        subgroup_min_size=_info_int(info, "subgroup_min_size"),
                        subgroup_max_size=_info_int(info, "subgroup_max_size")),
            frozenset(raw_device.features), dict(raw_device.limits))
        self.adapter, self.raw = adapter, raw_device
        self.queue = raw_device.queue
        self._sync_src = None                 # 4 bytes that sync() reads back
        # A readback's copy is submitted from a worker thread while the event loop may release the
        # buffer it reads (an unload during a request): wgpu-native aborts the process on a submit
        # that uses a destroyed buffer, so the check-and-submit and the destroy exclude each other.
        self._release_lock = threading.Lock()
        self._destroyed = False               # set under that lock: no readback submits after it
        self._loss_waiters: set = set()       # (loop, future) of maps in flight, woken by a loss
        # lavapipe: a submit while the GPU is busy blocks until it drains. wgpu-py's map_async for
        # reading submits an empty command buffer first (its sync, gfx-rs/wgpu-native#305), which
        # then held the event loop for a whole step: _mapped makes that submit from a worker thread
        self._submit_blocks = self.info.cpu
        # llvmpipe compiles a pipeline's code at its first dispatch, even one of no workgroups
        self.warms_on_dispatch = self.info.cpu
        # wgpu-py's private fast paths (per-dispatch calls, maps without its sync submit), or with
        # $WEBGPU_ENGINE_WGPU_PUBLIC=1 its public API (wgpu_private.py)
        self.wgpu_calls = wgpu_calls()
        # a worker per core (they start nothing new while a request compiles what it needs), or
        # $WEBGPU_ENGINE_COMPILE_THREADS; 2 cores, SmolLM2: the queue done at 18.2-18.6 s from process
        # start against 20.4-25.1 s with one worker, the first token no later (bench/first_request.py)
        self.background = BackgroundCompiler(int(os.environ.get("WEBGPU_ENGINE_COMPILE_THREADS", 0))
                                             or os.cpu_count() or 1)
        if self.warms_on_dispatch:      # the workers compile by empty dispatches when the device pauses
            # idle: no read awaited (a step's token, a sync) and no submit for a while; a long
            # batch's readback is in flight the whole time its batch runs
            self.background.idle = lambda: 0.0 if self.reads_in_flight else time.monotonic() - self.last_submit
            self.background.warm = self._warm_later
        # a second device that compiles half of what a request needs, for Mesa's shader cache (twin.py)
        self._twin_state: Twin | bool | None = None if self.warms_on_dispatch and cache_enabled() else False
        self._twin_lock = threading.Lock()

    # ------------------------------------------------------------------ hooks
    def _raw_create_buffer(self, size: int, usage: str, label: str):
        return self.raw.create_buffer(size=size, usage=_USAGE[usage], label=label)

    def _raw_destroy_buffer(self, raw) -> None:
        with self._release_lock:
            raw.destroy()

    def _raw_write(self, raw, offset: int, mv: memoryview) -> None:
        self.queue.write_buffer(raw, offset, mv)

    def _raw_create_pipeline(self, code: str, entry: str, constants: dict, label: str):
        module = self.raw.create_shader_module(code=code, label=label)
        stage = {"module": module, "entry_point": entry}
        if constants:
            stage["constants"] = constants
        return self.raw.create_compute_pipeline(layout="auto", compute=stage, label=label)

    def _raw_warm(self, raw_pipeline, raw_bind_group, label: str, buffers: tuple = ()) -> None:
        def record(enc):
            cpass = enc.begin_compute_pass(label=label)
            cpass.set_pipeline(raw_pipeline)
            cpass.set_bind_group(0, raw_bind_group)
            cpass.dispatch_workgroups(0, 1, 1)
            cpass.end()
        self._locked_submit(f"warm-up of {label}", record, buffers)

    def _twin_soon(self) -> None:
        if self._twin_state is None:
            threading.Thread(target=self._twin, name="webgpu-engine-twin", daemon=True).start()

    def _twin(self) -> Twin | None:
        """The twin device, made at the first need (None: none here, or it could not be made)."""
        with self._twin_lock:
            if self._twin_state is None and not self._destroyed:
                try:
                    limits = {k: self.raw.limits[k] for k in _MAX_LIMITS if k in self.raw.limits}
                    raw = self.adapter.request_device_sync(required_features=list(self.raw.features),
                                                           required_limits=limits, label="webgpu_engine twin")
                    self._twin_state = Twin(raw, _U, wgpu.MapMode.READ)
                except Exception:  # noqa: BLE001 - only a head start
                    self._twin_state = False
            return self._twin_state or None

    def _raw_bind(self, raw_pipeline, entries, label: str):
        layout = raw_pipeline.get_bind_group_layout(0)
        return self.raw.create_bind_group(layout=layout, label=label, entries=[
            {"binding": i, "resource": {"buffer": raw, "offset": off, "size": size}}
            for i, raw, off, size in entries])

    def _raw_submit(self, ops: list) -> None:
        enc = self.raw.create_command_encoder()
        encode_ops(ops, enc, self.wgpu_calls.pass_api)
        self.queue.submit([enc.finish()])

    async def submit_async(self, batch) -> None:
        """submit() from a worker thread, under the release lock: a model unloaded (its buffers
        released) or the device destroyed after the batch was recorded fails typed, never in the
        driver."""
        self.check_alive()
        if not batch.ops:
            return
        what = _batch_names(batch)
        self._stage_readbacks(batch)

        def run():
            self._prepare(batch.ops)          # pipelines still compiling: here, off the event loop
            with self._release_lock:
                if self._destroyed:
                    raise DeviceLostError(f"{what}: the device was destroyed")
                dead = released_buffer(batch.ops)
                if dead is not None:
                    raise GPUValidationError(f"{what}: buffer {dead.label!r} was released before the submit ran")
                self._raw_submit(batch.ops)
        try:
            await asyncio.to_thread(self._guard, run, what)
        except BaseException:
            self._unstage_readbacks(batch)
            raise

    def _raw_destroy_device(self) -> None:
        # under the readback lock: a worker thread's copy submitted while the device is being
        # destroyed aborts wgpu-native (seen once in a suite run: the batching device-loss test)
        with self._release_lock:
            self._destroyed = True
            self.raw.destroy()
        with self._twin_lock:
            if self._twin_state:
                self._twin_state.destroy()
            self._twin_state = False

    # ------------------------------------------------------------------ readback
    async def read(self, buf: Buffer, offset: int = 0, size: int | None = None) -> bytes:
        """Copy `size` bytes at `offset` of `buf` to the host (awaits the GPU). Each read in flight
        has a staging buffer of its own, so models reading back at the same time never share one."""
        n = buf.size - offset if size is None else size
        return await self._read_raw(buf.raw, offset, n, f"readback of {buf.label!r}", src=buf)

    async def sync(self) -> None:
        """Wait until the GPU has finished all submitted work, without blocking the event loop.

        A 4-byte readback queued after that work: its map completes only when everything before it
        has run (wgpu-py's on_submitted_work_done_async does not bind to every wgpu-native build).
        Its submit goes through a worker thread, because a submit while the GPU is busy can block
        until the queue drains (lavapipe), and the map is awaited on wgpu-native's polling thread."""
        self.check_alive()
        if self._sync_src is None:
            self._sync_src = self._guard(lambda: self.raw.create_buffer(size=4, usage=_U.COPY_SRC,
                                                                        label="sync"), "sync")
        await self._read_raw(self._sync_src, 0, 4, "sync")

    async def _read_raw(self, raw, offset: int, n: int, what: str, src: Buffer | None = None) -> bytes:
        """n bytes at `offset` of `raw` through a staging buffer. The copy's submit goes through a
        worker thread (right after a step it would wait for the step to finish there, lavapipe, and
        hold the event loop that long), with the map's sync submit after it where submits block."""
        n4 = round_up4(n)
        staging = self._guard(lambda: self._take_staging(n4), what)
        ok = False
        self._read_started()
        try:
            def copy(enc):
                if src is not None and not src.alive:
                    raise GPUValidationError(f"{what}: the buffer was released before its readback ran")
                enc.copy_buffer_to_buffer(raw, offset, staging, 0, n4)

            def submit():
                self._locked_submit(what, copy)
                if self._submit_blocks:
                    self._locked_submit(what)
            await asyncio.to_thread(self._guard, submit, what)
            data = await self._mapped(staging, n4, n, what, synced=True)
            ok = True
        finally:
            self._read_ended()
            self._give_staging(staging, n4, reuse=ok)
        return data

    def _locked_submit(self, what: str, record=None, buffers: tuple = ()) -> None:
        """A command buffer that `record(encoder)` fills (None: an empty one, what wgpu-py's map_async
        submits before mapping for reading), submitted under the release lock. From a worker thread
        it waits there for the work before where submits block (lavapipe). `buffers` (base.Buffer,
        or (Buffer, offset, size)): what the work binds, checked alive under the lock (a buffer
        destroyed meanwhile would fail the submit, which aborts wgpu-native): GPUValidationError."""
        with self._release_lock:
            if self._destroyed:
                raise DeviceLostError(f"{what}: the device was destroyed")
            dead = next((b for b in (x[0] if isinstance(x, tuple) else x for x in buffers) if not b.alive), None)
            if dead is not None:
                raise GPUValidationError(f"{what}: buffer {dead.label!r} was released before the submit ran")
            enc = self.raw.create_command_encoder()
            if record is not None:
                record(enc)
            self.queue.submit([enc.finish()])

    async def _mapped(self, staging, n4: int, n: int, what: str, synced: bool = False) -> bytes:
        """The first n bytes of a staging buffer once the work before has run, the event loop free
        meanwhile (`synced`: the caller made the map's sync submit). A loss meanwhile raises
        DeviceLostError: a map in flight when the device is destroyed never completes."""
        self.check_alive()
        if self._submit_blocks and not synced:
            await asyncio.to_thread(self._guard, lambda: self._locked_submit(what), what)
        # where submits block, wgpu-py's own sync submit (on the event loop) is the one made above
        mode = self.wgpu_calls.map_read_synced if self._submit_blocks else wgpu.MapMode.READ
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        waiter = (loop, lost)
        self._loss_waiters.add(waiter)
        mapping = asyncio.ensure_future(staging.map_async(mode, 0, n4))
        try:
            await asyncio.wait({mapping, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._loss_waiters.discard(waiter)
        if not mapping.done():
            mapping.cancel()
            raise DeviceLostError(f"{what}: {self.lost_reason}")
        try:
            mapping.result()
            data = bytes(staging.read_mapped(0, n4, copy=False))[:n]
            staging.unmap()
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, what) from None
        return data

    def mark_lost(self, reason: str) -> None:
        super().mark_lost(reason)
        for loop, fut in list(self._loss_waiters):      # maps awaited on any thread's loop
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    async def collect(self, rb) -> bytes:
        n4, ok = round_up4(rb.n), False
        what = f"readback of {rb.src.label!r}"
        self._read_started()
        try:
            data = await self._mapped(rb.staging, n4, rb.n, what)
            ok = True
        finally:
            self._read_ended()
            self._give_staging(rb.staging, n4, reuse=ok)
            rb.staging = None
        return data

    def _read_started(self) -> None:
        self.reads_in_flight += 1

    def _read_ended(self) -> None:
        """A read is done: the device counts as busy until IDLE_S after it (the background compiler)."""
        self.reads_in_flight -= 1
        self.last_submit = time.monotonic()

    def read_sync(self, buf: Buffer, offset: int = 0, size: int | None = None) -> bytes:
        """Blocking readback for scripts and tests (native backend only)."""
        n = buf.size - offset if size is None else size
        return bytes(self._guard(lambda: self.queue.read_buffer(buf.raw, offset, round_up4(n)),
                                 f"readback of {buf.label!r}"))[:n]

    def _take_staging(self, n: int):
        # A pool per power-of-two size class: per-token readbacks allocate nothing, and a buffer
        # being mapped by one read is out of the pool, so an overlapping read takes another.
        pool = self._staging.setdefault(staging_class(n), [])
        if pool:
            return pool.pop()
        cls = staging_class(n)
        return self.raw.create_buffer(size=cls, usage=_U.MAP_READ | _U.COPY_DST, label=f"staging{cls}")


    def close(self) -> None:
        super().close()
        if self._sync_src is not None:
            try:
                self._sync_src.destroy()
            except Exception:  # noqa: BLE001 - a lost device has nothing left to free
                pass
            self._sync_src = None


def list_adapters() -> list[AdapterInfo]:
    out = []
    for a in wgpu.gpu.enumerate_adapters_sync():
        i = a.info
        out.append(AdapterInfo(str(i.get("vendor", "")), str(i.get("architecture", "")),
                               str(i.get("description", "")), str(i.get("backend_type", "")),
                               str(i.get("adapter_type", "")), str(i.get("device", ""))))
    return out


def _pick_adapter(name: str | None, power_preference: str):
    if name:
        for a in wgpu.gpu.enumerate_adapters_sync():
            i = a.info
            text = " ".join(str(i.get(k, "")) for k in ("vendor", "device", "description", "backend_type"))
            if name.lower() in text.lower():
                return a
        raise WebGPUNotAvailableError(f"No adapter matches WEBGPU_ENGINE_ADAPTER={name!r}; "
                                      f"adapters: {[a.name for a in list_adapters()]}")
    a = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
    if a is None:
        raise WebGPUNotAvailableError()
    return a


async def request_device(adapter_name: str | None = None, power_preference: str = "high-performance",
                         required_features: tuple[str, ...] = ()) -> NativeDevice:
    """Create a device on the chosen adapter with every optional feature it has and its maximum
    buffer limits. `adapter_name` (or env WEBGPU_ENGINE_ADAPTER) picks an adapter by substring."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    name = adapter_name or os.environ.get("WEBGPU_ENGINE_ADAPTER")
    try:
        adapter = _pick_adapter(name, power_preference)
    except WebGPUNotAvailableError:
        raise
    except Exception as e:  # noqa: BLE001 - no driver at all
        raise WebGPUNotAvailableError(str(e)) from None
    wanted = device_features(set(adapter.features), _OPTIONAL_FEATURES, required_features)
    limits = {k: adapter.limits[k] for k in _MAX_LIMITS if k in adapter.limits}
    raw = await adapter.request_device_async(required_features=wanted, required_limits=limits,
                                             label="webgpu_engine")
    return NativeDevice(adapter, raw)


__all__ = ["NativeDevice", "request_device", "list_adapters", "STORAGE"]
