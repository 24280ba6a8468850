"""The gpu layer's backend-neutral interface: device, buffers, pipelines, batches, readback.

Two backends implement it: `native` (wgpu-py: Vulkan, Metal, DX12) and `browser` (Pyodide's FFI on
navigator.gpu). Nothing above `gpu/` imports wgpu or js. Only device creation and readback are async.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import (DeviceLostError, FeatureSupportError, GPUOutOfMemoryError, GPUValidationError,
                      ShaderCompileError, ShaderF16SupportError, WebGPUEngineError)
from .compiler import CompilingDevice, LazyRaw
from .shaders import load_shader_source

STORAGE = "storage"
UNIFORM = "uniform"


def device_features(available, optional, required) -> list:
    """The features to request of an adapter offering `available`: the `optional` ones it has, then
    each `required` one, which it must have (ShaderF16SupportError / FeatureSupportError)."""
    wanted = [f for f in optional if f in available]
    for f in required:
        if f not in available:
            raise ShaderF16SupportError() if f == "shader-f16" else FeatureSupportError(f)
        if f not in wanted:
            wanted.append(f)
    return wanted


def round_up4(n: int) -> int:
    return max(4, (int(n) + 3) & ~3)


_DIRECTIVE = re.compile(r"\s*enable\s+([\w\s,]+?)\s*;\s*$")


def directives_first(header: str, implicit: frozenset = frozenset()) -> str:
    """`header` with its `enable` directives merged into its first line (WGSL wants them before
    any declaration, and a header is assembled from pieces, each enabling what it uses); an
    extension in `implicit` (one the backend's WGSL compiler rejects as a directive but allows with
    the device feature) is left out. The line count stays (error line numbers)."""
    if "enable" not in header:
        return header
    found, rest = [], []
    for line in header.split("\n"):
        m = _DIRECTIVE.fullmatch(line)
        if m is None:
            rest.append(line)
            continue
        found += [e.strip() for e in m.group(1).split(",") if e.strip() and e.strip() not in found]
        rest.append("")
    if not found:
        return header
    rest.remove("")                     # a directive's line becomes the merged one
    kept = [e for e in found if e not in implicit]
    head = (f"enable {', '.join(kept)};" if kept else "") + "".join(
        f" // {e}: implicit" for e in found if e in implicit)
    return "\n".join([head.strip()] + rest)


def staging_class(n: int) -> int:
    """The size class (a power of two, at least 256 bytes) of the staging buffer a readback of n uses."""
    return 1 << max(8, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class AdapterInfo:
    vendor: str
    architecture: str
    description: str
    backend: str
    adapter_type: str = ""
    device: str = ""
    subgroup_min_size: int = 0       # 0: the adapter does not say
    subgroup_max_size: int = 0

    @property
    def name(self) -> str:
        return self.device or self.description or self.vendor

    @property
    def cpu(self) -> bool:
        """lavapipe (adapter type CPU, name llvmpipe): a rasteriser on the host's cores."""
        return "cpu" in self.adapter_type.lower() or "llvmpipe" in self.name.lower()


@dataclass(frozen=True)
class PipelineKey:
    file: str
    entry: str
    constants: tuple = ()
    header: str = ""


class Buffer:
    """A GPU buffer (storage or uniform) of `size` bytes (a multiple of 4), counted against `owner`."""

    __slots__ = ("raw", "size", "nbytes", "usage", "owner", "label", "device", "alive")

    def __init__(self, device: "Device", raw: Any, size: int, nbytes: int, usage: str, owner: str,
                 label: str):
        self.device, self.raw, self.size, self.nbytes = device, raw, size, nbytes
        self.usage, self.owner, self.label, self.alive = usage, owner, label, True

    def release(self) -> None:
        """Free the GPU memory now (idempotent)."""
        if self.alive:
            self.alive = False
            self.device._forget(self)

    def __repr__(self) -> str:
        return f"Buffer({self.label!r}, {self.size} B, {self.usage}, owner={self.owner!r})"


class Pipeline:
    """A compute pipeline; `raw` is the driver's object. One queued on the device's background
    compiler (gpu/compiler.py) is made on first need: `raw` compiles it, or waits for the worker
    compiling it."""

    __slots__ = ("key", "header_lines", "lazy", "stand_in", "stand_in_y", "hot", "warm_group", "source")

    def __init__(self, key: PipelineKey, raw: Any = None, header_lines: int = 0, make=None):
        self.key, self.header_lines, self.lazy = key, header_lines, LazyRaw(raw, make)
        # same results and bindings (another height of the tiled matmul's tile): runs while this
        # compiles, with stand_in_y times this one's workgroups along y
        self.stand_in: Pipeline | None = None
        self.stand_in_y = 1
        # dispatched at least once (drivers that compile at the first dispatch have compiled it),
        # and, until then, a bind group of its to dispatch it empty with (gpu/compiler.py)
        self.hot = False
        self.warm_group: BindGroup | None = None
        self.source: tuple | None = None    # queued, until dispatched: (code, entry, constants) for a twin (twin.py)

    raw = property(lambda self: self.lazy.resolve())
    ready = property(lambda self: self.lazy.ready)

    def dispatched(self) -> None:
        """It has been dispatched (here, or compiled on a twin device whose code the cache gives
        this one): no warm-up bind group or source is needed for it any more."""
        self.hot, self.warm_group, self.source = True, None, None

    @property
    def name(self) -> str:
        return f"{self.key.file}:{self.key.entry}"


class BindGroup:
    """A bind group; one of a pipeline still compiling is made (`raw`) when first submitted."""

    __slots__ = ("lazy", "pipeline", "buffers", "entries", "alt")

    def __init__(self, raw: Any, pipeline: Pipeline, buffers: tuple = (), make=None, entries: tuple = ()):
        self.lazy, self.pipeline, self.buffers = LazyRaw(raw, make), pipeline, buffers
        self.entries = entries          # (binding, raw buffer, offset, size): to bind a stand-in
        self.alt: BindGroup | None = None

    raw = property(lambda self: self.lazy.resolve())


@dataclass
class Batch:
    """Dispatches and copies recorded in order, submitted together as one command buffer."""

    ops: list = field(default_factory=list)

    def dispatch(self, pipeline: Pipeline, bind_group: BindGroup, x: int, y: int = 1, z: int = 1):
        self.ops.append(("d", pipeline, bind_group, int(x), int(y), int(z)))
        return self

    def copy(self, src: Buffer, dst: Buffer, size: int | None = None, src_offset: int = 0,
             dst_offset: int = 0):
        n = src.size - src_offset if size is None else size
        self.ops.append(("c", src, src_offset, dst, dst_offset, round_up4(n)))
        return self

    def readback(self, src: Buffer, offset: int = 0, size: int | None = None) -> "Readback":
        """Copy `size` bytes at `offset` of `src` to a staging buffer at this point of the batch:
        after the submit, `await dev.collect(rb)` gives the bytes as soon as this batch has run
        (later submissions need not finish first: host and GPU overlap)."""
        n = src.size - offset if size is None else size
        rb = Readback(src, offset, n)
        self.ops.append(("r", rb))
        return rb

    def __len__(self) -> int:
        return len(self.ops)


@dataclass(eq=False)
class Readback:
    """A copy to the host recorded in a batch (Batch.readback); the device gives it a staging
    buffer when the batch is submitted and maps it in `collect`."""

    src: Buffer
    offset: int
    n: int
    staging: Any = None


class Device(CompilingDevice):
    """One logical GPU device. Subclasses implement the `_raw_*` hooks and `read`.

    Errors: validation → GPUValidationError naming the kernel; allocation beyond limits or memory →
    GPUOutOfMemoryError; a lost/destroyed device → DeviceLostError, and every later call fails fast
    with it (wgpu-py never delivers `device.lost`, so loss is detected from failing calls).
    """

    backend_name = "abstract"
    # WGSL extensions the backend's compiler allows with the device feature but rejects as an
    # `enable` directive (see directives_first)
    implicit_extensions: frozenset = frozenset()

    def __init__(self, info: AdapterInfo, features: frozenset[str], limits: Mapping[str, int]):
        self.info, self.features, self.limits = info, frozenset(features), dict(limits)
        self.lost_reason: str | None = None
        self._allocated: dict[str, int] = {}
        self._buffers: set = set()
        self._pipelines: dict[PipelineKey, Pipeline] = {}
        self.compile_count = 0
        # the background compiler (gpu/compiler.py; None: the backend compiles in place) and whether
        # new pipelines go to it now (compiling_in_background); compile_waits counts the pipelines
        # a submit found not compiled yet (it compiled them or waited for a worker)
        self.background = None
        self._defer = False
        self._queued: list[list] = []     # the lists compiling_in_background blocks collect into
        self.stand_ins = 0                # dispatches that ran a pipeline's stand-in (see ready)
        self.compile_waits = 0
        self.warmed = 0
        self.twin_compiled = 0            # of the warmed, those compiled on the twin device (twin.py)
        self.last_submit = 0.0            # time.monotonic() of the last submit or read (compiler.py)
        self.reads_in_flight = 0
        # pipelines that models have run once on this device at load (drivers such as lavapipe
        # compile on first dispatch): a later load that uses only these records no warm-up run
        self.warmed_pipelines: set[PipelineKey] = set()
        self._staging: dict[int, list] = {}   # readback staging buffers: size class -> idle ones

    # ------------------------------------------------------------------ facts
    @property
    def has_f16(self) -> bool:
        return "shader-f16" in self.features

    @property
    def has_subgroups(self) -> bool:
        """WebGPU's subgroups feature (wgpu-native names it "subgroup")."""
        return bool({"subgroups", "subgroup"} & self.features)

    @property
    def subgroup_min_size(self) -> int:
        """The smallest subgroup the adapter may run (4, WebGPU's lower bound, when it does not say)."""
        return self.info.subgroup_min_size or 4

    @property
    def max_storage_binding(self) -> int:
        return int(self.limits.get("max-storage-buffer-binding-size", 128 << 20))

    @property
    def max_buffer_size(self) -> int:
        return int(self.limits.get("max-buffer-size", 256 << 20))

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def describe(self) -> dict:
        return {"backend": self.backend_name, "adapter": self.info.__dict__,
                "features": sorted(self.features), "limits": dict(sorted(self.limits.items()))}

    # ------------------------------------------------------------------ memory accounting
    def allocated_bytes(self, owner: str | None = None) -> int:
        if owner is None:
            return sum(self._allocated.values())
        return self._allocated.get(owner, 0)

    def allocations(self) -> dict[str, int]:
        return {k: v for k, v in self._allocated.items() if v}

    def release_owner(self, owner: str) -> None:
        """Free every buffer of `owner` (e.g. one model) at once."""
        for b in [b for b in self._buffers if b.owner == owner]:
            b.release()

    def _forget(self, buf: Buffer) -> None:
        self._buffers.discard(buf)
        self._allocated[buf.owner] = self._allocated.get(buf.owner, 0) - buf.size
        try:
            self._raw_destroy_buffer(buf.raw)
        except Exception:  # a lost device has nothing left to free
            pass
        buf.raw = None

    # ------------------------------------------------------------------ buffers
    def buffer(self, nbytes: int, *, usage: str = STORAGE, owner: str = "misc", label: str = "") -> Buffer:
        """A zero-filled buffer of at least `nbytes` (rounded up to 4)."""
        self.check_alive()
        size = round_up4(nbytes)
        if size > self.max_buffer_size:
            raise GPUOutOfMemoryError(
                f"Buffer {label or owner!r} needs {size} bytes, more than this device's max buffer size "
                f"({self.max_buffer_size} bytes).")
        raw = self._guard(lambda: self._raw_create_buffer(size, usage, label), f"buffer {label!r}")
        buf = Buffer(self, raw, size, int(nbytes), usage, owner, label)
        self._buffers.add(buf)
        self._allocated[owner] = self._allocated.get(owner, 0) + size
        return buf

    def upload(self, data, *, usage: str = STORAGE, owner: str = "misc", label: str = "") -> Buffer:
        """A new buffer holding `data` (bytes, memoryview or numpy array), written without host copies."""
        mv = _as_bytes_view(data)
        return self._written(mv, mv.nbytes, usage=usage, owner=owner, label=label)

    def _written(self, data, nbytes: int, *, usage: str, owner: str, label: str) -> Buffer:
        """A new buffer of `nbytes` holding `data` (released again if the write fails)."""
        buf = self.buffer(nbytes, usage=usage, owner=owner, label=label)
        try:
            self.write(buf, data)
        except BaseException:
            buf.release()
            raise
        return buf

    def write(self, buf: Buffer, data, offset: int = 0) -> None:
        """Write `data` at `offset` (a multiple of 4). A length that is not a multiple of 4 is
        zero-filled up to the next 4-byte boundary, as WebGPU writes whole words."""
        self.check_alive()
        mv = _as_bytes_view(data)
        n = mv.nbytes
        if n % 4:
            # WebGPU writes must be 4-byte multiples: copy only the short tail.
            head = n & ~3
            if head:
                self._guard(lambda: self._raw_write(buf.raw, offset, mv[:head]), f"write {buf.label!r}")
            tail = bytes(mv[head:]) + b"\0" * (4 - n % 4)
            self._guard(lambda: self._raw_write(buf.raw, offset + head, memoryview(tail)),
                        f"write {buf.label!r}")
            return
        self._guard(lambda: self._raw_write(buf.raw, offset, mv), f"write {buf.label!r}")

    async def read(self, buf: Buffer, offset: int = 0, size: int | None = None) -> bytes:
        raise NotImplementedError

    def _take_staging(self, n: int):
        """A mappable staging buffer of at least n bytes from the backend's pool (see _staging)."""
        raise NotImplementedError

    async def sync(self) -> None:
        """Wait (without blocking the event loop) until the GPU has finished all submitted work."""
        raise NotImplementedError

    # ------------------------------------------------------------------ pipelines
    def pipeline(self, file: str, entry: str, constants: Mapping[str, float] | None = None,
                 header: str = "") -> Pipeline:
        """The compute pipeline for `entry` in `shaders/<file>`, compiled once per
        (file, entry, constants, header). `header` is WGSL prepended to the file (e.g. `enable f16;`
        and type aliases for a variant); `constants` set pipeline-overridable constants."""
        self.check_alive()
        key = PipelineKey(file, entry, tuple(sorted((constants or {}).items())), header)
        p = self._pipelines.get(key)
        if p is None:
            src = load_shader_source(file)
            header = directives_first(header, self.implicit_extensions)
            code = header + ("\n" if header and not header.endswith("\n") else "") + src
            hl = code.count("\n") - src.count("\n")
            name = f"{file}:{entry}"

            def make():
                try:
                    return self._raw_create_pipeline(code, entry, dict(key.constants), name)
                except Exception as e:  # noqa: BLE001 - translated right here
                    raise self._translate(e, name, shader=(file, hl)) from None
            if self._defer:
                p = Pipeline(key, header_lines=hl, make=make)
                if self.warms_on_dispatch:      # a twin may compile it (twin.py) until it is dispatched
                    p.source = (code, entry, dict(key.constants))
                self.background.submit(p)
                for queued in self._queued:
                    queued.append(p)
            else:
                p = Pipeline(key, make(), hl)
            self._pipelines[key] = p
            self.compile_count += 1
        return p

    def bind(self, pipeline: Pipeline, buffers: Sequence | Mapping) -> BindGroup:
        """A bind group for group 0: `buffers[i]` goes to binding i (or, given a mapping,
        `buffers[b]` to binding b); an item may be a Buffer or (Buffer, offset, size) for a window."""
        self.check_alive()
        entries = []
        items = sorted(buffers.items()) if isinstance(buffers, Mapping) else enumerate(buffers)
        for i, b in items:
            if isinstance(b, tuple):
                buf, off, sz = b
            else:
                buf, off, sz = b, 0, b.size
            if not buf.alive:
                raise GPUValidationError(f"{pipeline.name}: binding {i} uses a released buffer {buf.label!r}")
            entries.append((i, buf.raw, off, sz))
        held = tuple(b for _, b in sorted(buffers.items())) if isinstance(buffers, Mapping) else tuple(buffers)
        entries = tuple(entries)
        if not pipeline.ready:        # compiling in the background: bound at the first submit
            group = BindGroup(None, pipeline, held, make=lambda: self._guard(
                lambda: self._raw_bind(pipeline.raw, entries, pipeline.name), pipeline.name), entries=entries)
        else:
            raw = self._guard(lambda: self._raw_bind(pipeline.raw, entries, pipeline.name), pipeline.name)
            group = BindGroup(raw, pipeline, held, entries=entries)
        if self.warms_on_dispatch and not pipeline.hot and pipeline.warm_group is None:
            pipeline.warm_group = group
        return group

    # ------------------------------------------------------------------ submission
    def batch(self) -> Batch:
        return Batch()

    def submit(self, batch: Batch) -> None:
        self.check_alive()
        if batch.ops:
            self._stage_readbacks(batch)
            self._guard(lambda: (self._prepare(batch.ops), self._raw_submit(batch.ops)), _batch_names(batch))

    async def submit_async(self, batch: Batch) -> None:
        """submit() off the event loop where the backend can (native: a worker thread; a submit while
        the GPU is busy may block until it drains, lavapipe). Here: in place (the page)."""
        self.submit(batch)

    def _stage_readbacks(self, batch: Batch) -> None:
        for op in batch.ops:
            if op[0] == "r":
                rb = op[1]
                rb.staging = self._guard(lambda: self._take_staging(round_up4(rb.n)), "readback")

    def _unstage_readbacks(self, batch: Batch) -> None:
        """A batch that was never submitted: its readbacks' staging buffers are not handed out again."""
        for op in batch.ops:
            if op[0] == "r" and op[1].staging is not None:
                self._give_staging(op[1].staging, round_up4(op[1].n), reuse=False)
                op[1].staging = None

    async def collect(self, rb: Readback) -> bytes:
        """The bytes of a submitted Batch.readback, once its batch has run (maps its staging buffer;
        the staging buffer goes back to the pool)."""
        raise NotImplementedError

    def run(self, pipeline: Pipeline, buffers: Sequence, x: int, y: int = 1, z: int = 1) -> None:
        """Bind, dispatch and submit one kernel (convenient for tests and one-off work)."""
        self.submit(self.batch().dispatch(pipeline, self.bind(pipeline, buffers), x, y, z))

    # ------------------------------------------------------------------ life and errors
    def check_alive(self) -> None:
        if self.lost_reason is not None:
            raise DeviceLostError(self.lost_reason)

    def mark_lost(self, reason: str) -> None:
        if self.lost_reason is None:
            self.lost_reason = reason

    def destroy(self) -> None:
        """Destroy the device (what a driver reset does). Later calls raise DeviceLostError."""
        if self.background is not None:
            self.background.close()   # the compiles under way finish first
        try:
            self._raw_destroy_device()
        finally:
            self.mark_lost("the device was destroyed")

    def forget_pipelines(self) -> int:
        """Drop the pipeline cache (and what was warmed): pipelines no live op holds are freed by the
        driver (on lavapipe each holds its JIT-compiled code, ~10 MB); later requests for them compile
        again. Returns how many were cached. For long-lived processes that cycle through many models
        (the test suite); a loaded model keeps working, its ops hold their own pipelines."""
        n = len(self._pipelines)
        if self.background is not None:
            self.background.cancel()
        self._pipelines.clear()
        self.warmed_pipelines.clear()
        return n

    def close(self) -> None:
        """Intentional shutdown: release every buffer; not reported as a loss."""
        if self.background is not None:
            self.background.close()
        for b in list(self._buffers):
            b.release()
        self._pipelines.clear()
        for pool in self._staging.values():
            for s in pool:
                try:
                    s.destroy()
                except Exception:  # noqa: BLE001 - a lost device has nothing left to free
                    pass
        self._staging.clear()

    # ------------------------------------------------------------------ readback staging buffers
    # A pool per power-of-two size class (backends' _take_staging): per-token readbacks allocate
    # nothing, and a buffer being mapped by one read is out of the pool, so an overlapping read
    # takes another.
    def _give_staging(self, staging, n: int, *, reuse: bool = True) -> None:
        if reuse and not self.lost:
            self._staging.setdefault(staging_class(n), []).append(staging)
            return
        try:             # a failed read may leave it mapped or pending: never hand it out again
            staging.destroy()
        except Exception:  # noqa: BLE001 - a lost device has nothing left to free
            pass

    def _guard(self, fn, what: str):
        self.check_alive()
        try:
            return fn()
        except WebGPUEngineError:
            raise                      # translated already (a pipeline made on first need)
        except Exception as e:  # noqa: BLE001 - translated right here
            raise self._translate(e, what) from None

    def _translate(self, e: Exception, what: str, shader: tuple[str, int] | None = None) -> Exception:
        msg = str(e)
        low = msg.lower()
        if "lost" in low or ("destroyed" in low and "device" in low):
            self.mark_lost(f"{what}: device lost")
            return DeviceLostError(f"while running {what}")
        if "out of memory" in low or "outofmemory" in low or "greater than the maximum" in low \
                or ("exceeds" in low and "limit" in low):
            return GPUOutOfMemoryError(f"{what}: {_first_cause(msg)}")
        if shader is not None:
            file, hl = shader
            m = re.search(r"wgsl:(\d+):(\d+)", msg)
            where = f"shaders/{file}"
            if m:
                where += f":{int(m.group(1)) - hl}:{m.group(2)}"
            return ShaderCompileError(f"{where}: failed to compile entry point "
                                      f"{what.split(':')[-1]!r}: {_first_cause(msg)}")
        return GPUValidationError(f"WebGPU validation error in {what} (a bug in this kernel's host code "
                                  f"or shader): {_first_cause(msg)}")

    # ------------------------------------------------------------------ backend hooks
    def _raw_create_buffer(self, size: int, usage: str, label: str):
        raise NotImplementedError

    def _raw_destroy_buffer(self, raw) -> None:
        raise NotImplementedError

    def _raw_write(self, raw, offset: int, mv: memoryview) -> None:
        raise NotImplementedError

    def _raw_create_pipeline(self, code: str, entry: str, constants: dict, label: str):
        raise NotImplementedError

    def _raw_bind(self, raw_pipeline, entries, label: str):
        raise NotImplementedError

    def _raw_submit(self, ops: list) -> None:
        raise NotImplementedError

    def _raw_destroy_device(self) -> None:
        raise NotImplementedError


def _batch_names(batch: Batch) -> str:
    names = sorted({op[1].name for op in batch.ops if op[0] == "d"})
    return "submit of [" + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") + "]"


def _first_cause(msg: str) -> str:
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln not in ("Validation Error", "Caused by:") and not ln.startswith("In wgpu")]
    return " | ".join(lines[:6]) or msg


def _as_bytes_view(data) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("GPU uploads need C-contiguous data")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv
