"""Browser gpu backend: the gpu layer's interface on `navigator.gpu` through Pyodide's FFI.

Differences from the native backend that callers may notice:
- WebGPU in the browser reports validation / out-of-memory errors asynchronously. Every create,
  write and submit runs inside error scopes; their results are collected at the next `await
  dev.read(...)` or `await dev.sync()` and raised there as the same typed errors (naming the kernel,
  or the WGSL file and line for compile errors). Errors nobody captured (`uncapturederror`) are raised
  by the next call into the device.
- `device.lost` is a real promise here: when it settles the device is marked lost and every later
  call raises DeviceLostError.
- Weights can be written straight from JS memory (`JsBytes`: a window of a fetched ArrayBuffer)
  without passing through the wasm heap; Python bytes are written from a zero-copy view of the heap.
- There is no blocking readback (`read_sync`): the browser's main thread cannot wait for the GPU.
"""
from __future__ import annotations

from js import GPUBufferUsage, GPUMapMode, Object, Promise, Uint8Array, navigator
from pyodide.ffi import JsException, JsProxy, create_proxy, jsnull, to_js

from ..errors import GPUOutOfMemoryError, GPUValidationError, WebGPUNotAvailableError
from .base import (STORAGE, AdapterInfo, Batch, Buffer, Device, _batch_names, device_features, round_up4,
                   staging_class)
from .encoding import PassApi, encode_ops

_OPTIONAL_FEATURES = ("shader-f16", "subgroups", "timestamp-query")
# JS limit names -> the kebab-case names the gpu layer uses (as wgpu-py reports them).
_LIMITS = {
    "maxStorageBufferBindingSize": "max-storage-buffer-binding-size",
    "maxBufferSize": "max-buffer-size",
    "maxComputeWorkgroupStorageSize": "max-compute-workgroup-storage-size",
    "maxComputeInvocationsPerWorkgroup": "max-compute-invocations-per-workgroup",
    "maxComputeWorkgroupSizeX": "max-compute-workgroup-size-x",
    "maxStorageBuffersPerShaderStage": "max-storage-buffers-per-shader-stage",
    "maxComputeWorkgroupsPerDimension": "max-compute-workgroups-per-dimension",
    "maxUniformBufferBindingSize": "max-uniform-buffer-binding-size",
}
_USAGE = {
    "storage": GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
    "uniform": GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
}
# Python-heap writes go in chunks; the heap view is re-taken per chunk because it is invalidated
# whenever the wasm heap grows.
_WRITE_CHUNK = 16 << 20

_PASS_API = PassApi("beginComputePass", "setPipeline", "setBindGroup", "dispatchWorkgroups", "end",
                    "copyBufferToBuffer")


def _js(d):
    """A Python dict/list as plain JS objects/arrays (a bare to_js(dict) gives a Map, which WebGPU rejects)."""
    return to_js(d, dict_converter=Object.fromEntries)


class JsBytes:
    """A window of JS memory (ArrayBuffer or typed array, e.g. fetched weights) that `write` and
    `upload` send to the GPU directly. Slicing gives another window without copying; `tobytes()` copies
    into Python (only for what Python must parse, like a file header)."""

    __slots__ = ("array", "offset", "nbytes")

    def __init__(self, array, offset: int = 0, nbytes: int | None = None):
        if not isinstance(array, JsProxy):
            raise TypeError("JsBytes wraps a JS ArrayBuffer or typed array")
        if getattr(array, "BYTES_PER_ELEMENT", 1) != 1 or not hasattr(array, "subarray"):
            # An ArrayBuffer, or a wider typed array: view its bytes.
            buf = array if not hasattr(array, "buffer") else array.buffer
            base = 0 if not hasattr(array, "byteOffset") else int(array.byteOffset)
            length = int(array.byteLength)
            array = Uint8Array.new(buf, base, length)
        self.array = array
        self.offset = int(offset)
        self.nbytes = int(array.length) - self.offset if nbytes is None else int(nbytes)

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, s):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("JsBytes supports contiguous slices only")
        start, stop, _ = s.indices(self.nbytes)
        return JsBytes(self.array, self.offset + start, max(0, stop - start))

    def tobytes(self) -> bytes:
        return self.array.subarray(self.offset, self.offset + self.nbytes).to_bytes()

    def __repr__(self) -> str:
        return f"JsBytes({self.nbytes} B at {self.offset})"


class BrowserDevice(Device):
    backend_name = "browser-webgpu"

    def __init__(self, adapter, raw_device, info: AdapterInfo):
        limits = {}
        for camel, kebab in _LIMITS.items():
            v = getattr(raw_device.limits, camel, None)
            if v is not None:
                limits[kebab] = int(v)
        super().__init__(info, frozenset(str(f) for f in raw_device.features), limits)
        self.adapter, self.raw, self.queue = adapter, raw_device, raw_device.queue
        self._scopes: list = []        # (popErrorScope promise, what, context) not yet examined
        self._errors: list = []        # typed errors waiting to be raised
        self._on_uncaptured = create_proxy(self._uncaptured)
        raw_device.addEventListener("uncapturederror", self._on_uncaptured)
        raw_device.lost.then(self._on_lost)

    # ------------------------------------------------------------------ async error plumbing
    def _uncaptured(self, event) -> None:
        err = event.error
        self._errors.append(self._typed_error(str(err.constructor.name), str(err.message), "WebGPU call"))

    def _on_lost(self, info) -> None:
        self.mark_lost(f"{info.reason}: {info.message}" if str(info.message) else str(info.reason))

    def _scoped(self, fn, what, ctx=None, oom: bool = False):
        """Run `fn` inside error scopes; their outcome is examined later by `_flush`. `what` is a
        string or a zero-argument callable (so hot paths build no names unless an error occurs)."""
        raw = self.raw
        if oom:
            raw.pushErrorScope("out-of-memory")
        raw.pushErrorScope("validation")
        try:
            return fn()
        finally:
            self._scopes.append((raw.popErrorScope(), what, ctx))
            if oom:
                self._scopes.append((raw.popErrorScope(), what, None))

    def check_alive(self) -> None:
        super().check_alive()
        if self._errors:
            err = self._errors.pop(0)
            raise err

    async def _flush(self) -> None:
        """Examine every pending error scope (one await for all of them) and raise the first error."""
        if self._scopes:
            scopes, self._scopes = self._scopes, []
            results = await Promise.all(_js([s[0] for s in scopes]))
            for err, (_, what, ctx) in zip(results, scopes):
                if err is None or err is jsnull:
                    continue
                name = what() if callable(what) else what
                if ctx is not None:
                    self._errors.append(await self._shader_error(err, name, ctx))
                else:
                    self._errors.append(self._typed_error(str(err.constructor.name), str(err.message), name))
        self.check_alive()

    def _typed_error(self, kind: str, msg: str, what: str) -> Exception:
        if "OutOfMemory" in kind:
            return GPUOutOfMemoryError(f"{what}: out of GPU memory ({msg})")
        return self._translate(Exception(msg), what)

    async def _shader_error(self, err, what: str, ctx) -> Exception:
        raw_pipeline, module = ctx
        file = what.split(":")[0]
        hl = 0
        for key, p in list(self._pipelines.items()):
            if p.raw is raw_pipeline:
                hl = p.header_lines
                del self._pipelines[key]   # never hand out a broken pipeline again
                break
        lines = []
        info = await module.getCompilationInfo()
        for m in info.messages:
            if str(m.type) == "error":
                lines.append(f"wgsl:{int(m.lineNum)}:{int(m.linePos)}: {m.message}")
        if not lines:   # compiled, but the pipeline itself is invalid (bad entry point, constants, ...)
            return GPUValidationError(f"{what}: pipeline creation failed: {err.message}")
        return self._translate(Exception("\n".join(lines)), what, shader=(file, hl))

    async def sync(self) -> None:
        """Wait until the GPU has finished all submitted work, then raise any error it reported."""
        self.check_alive()
        try:
            await self.queue.onSubmittedWorkDone()
        except JsException as e:
            raise self._translate(e, "sync") from None
        await self._flush()

    # ------------------------------------------------------------------ hooks
    def _raw_create_buffer(self, size: int, usage: str, label: str):
        # WebGPU zero-fills new buffers, as the interface promises.
        return self._scoped(lambda: self.raw.createBuffer(_js({"size": size, "usage": _USAGE[usage],
                                                                "label": label})),
                            f"buffer {label!r}", oom=True)

    def _raw_destroy_buffer(self, raw) -> None:
        raw.destroy()

    def _raw_write(self, raw, offset: int, mv: memoryview) -> None:
        def run():
            n, pos = mv.nbytes, 0
            while pos < n:
                m = min(_WRITE_CHUNK, n - pos)
                proxy = create_proxy(mv[pos:pos + m])
                try:
                    view = proxy.getBuffer("u8")
                    try:
                        self.queue.writeBuffer(raw, offset + pos, view.data)
                    finally:
                        view.release()
                finally:
                    proxy.destroy()
                pos += m
        self._scoped(run, lambda: f"write to {raw.label!r}")

    def _raw_create_pipeline(self, code: str, entry: str, constants: dict, label: str):
        module = pipeline = None
        # The scope's context lets _flush turn a failure into ShaderCompileError with file:line.
        self.raw.pushErrorScope("validation")
        try:
            module = self.raw.createShaderModule(_js({"code": code, "label": label}))
            stage = {"module": module, "entryPoint": entry}
            if constants:
                stage["constants"] = constants
            pipeline = self.raw.createComputePipeline(_js({"layout": "auto", "compute": stage, "label": label}))
        finally:
            self._scopes.append((self.raw.popErrorScope(), label, (pipeline, module)))
        return pipeline

    def _raw_bind(self, raw_pipeline, entries, label: str):
        desc = {"layout": raw_pipeline.getBindGroupLayout(0), "label": label,
                "entries": [{"binding": i, "resource": {"buffer": raw, "offset": off, "size": size}}
                            for i, raw, off, size in entries]}
        return self._scoped(lambda: self.raw.createBindGroup(_js(desc)), f"bind group of {label}")

    def _raw_submit(self, ops: list) -> None:
        def run():
            enc = self.raw.createCommandEncoder()
            encode_ops(ops, enc, _PASS_API)
            self.queue.submit(_js([enc.finish()]))
        self._scoped(run, lambda: _batch_names(Batch(ops)))

    def _raw_destroy_device(self) -> None:
        self.raw.destroy()

    # ------------------------------------------------------------------ writes from JS memory
    def write(self, buf: Buffer, data, offset: int = 0) -> None:
        if isinstance(data, JsProxy):
            data = JsBytes(data)
        if not isinstance(data, JsBytes):
            return super().write(buf, data, offset)
        self.check_alive()
        n = data.nbytes
        head = n & ~3
        if head:
            # writeBuffer(buffer, bufferOffset, Uint8Array, dataOffset, size): element units = bytes.
            self._guard(lambda: self._scoped(
                lambda: self.queue.writeBuffer(buf.raw, offset, data.array, data.offset, head),
                f"write to {buf.label!r}"), f"write to {buf.label!r}")
        if n % 4:
            super().write(buf, data[head:].tobytes(), offset + head)

    def upload(self, data, *, usage: str = STORAGE, owner: str = "misc", label: str = "") -> Buffer:
        if isinstance(data, JsProxy):
            data = JsBytes(data)
        if not isinstance(data, JsBytes):
            return super().upload(data, usage=usage, owner=owner, label=label)
        return self._written(data, data.nbytes, usage=usage, owner=owner, label=label)

    # ------------------------------------------------------------------ readback
    async def read(self, buf: Buffer, offset: int = 0, size: int | None = None) -> bytes:
        """Copy `size` bytes at `offset` of `buf` to the host; raises any GPU error reported so far."""
        self.check_alive()
        n = buf.size - offset if size is None else int(size)
        n4 = round_up4(n)
        what = f"readback of {buf.label!r}"
        staging = self._take_staging(n4)
        ok = False
        try:
            def copy():
                enc = self.raw.createCommandEncoder()
                enc.copyBufferToBuffer(buf.raw, offset, staging, 0, n4)
                self.queue.submit(_js([enc.finish()]))
            self._guard(lambda: self._scoped(copy, what), what)
            try:
                await staging.mapAsync(GPUMapMode.READ, 0, n4)
            except JsException as e:
                await self._flush()    # a validation error explains a failed map better
                raise self._translate(e, what) from None
            try:
                # getMappedRange may be called once per mapping; copy out only the n wanted bytes.
                data = Uint8Array.new(staging.getMappedRange(0, n4), 0, n).to_bytes()
            finally:
                staging.unmap()
            ok = True
        finally:
            self._give_staging(staging, n4, reuse=ok)
        await self._flush()
        return data

    async def collect(self, rb) -> bytes:
        n4, ok = round_up4(rb.n), False
        what = f"readback of {rb.src.label!r}"
        try:
            try:
                await rb.staging.mapAsync(GPUMapMode.READ, 0, n4)
            except JsException as e:
                await self._flush()    # a validation error explains a failed map better
                raise self._translate(e, what) from None
            try:
                data = Uint8Array.new(rb.staging.getMappedRange(0, n4), 0, rb.n).to_bytes()
            finally:
                rb.staging.unmap()
            ok = True
        finally:
            self._give_staging(rb.staging, n4, reuse=ok)
            rb.staging = None
        return data

    def read_sync(self, buf: Buffer, offset: int = 0, size: int | None = None) -> bytes:
        raise NotImplementedError("The browser cannot block on the GPU: use `await dev.read(...)`.")

    def _take_staging(self, n: int):
        # One pool per power-of-two size class; a staging buffer still being mapped by an overlapping
        # read is not in the pool, so concurrent reads (of any owners) each get their own.
        cls = staging_class(n)
        pool = self._staging.setdefault(cls, [])
        if pool:
            return pool.pop()
        usage = GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST
        return self._guard(lambda: self._scoped(
            lambda: self.raw.createBuffer(_js({"size": cls, "usage": usage, "label": f"staging{cls}"})),
            f"staging buffer of {cls} bytes", oom=True), "readback")


def _adapter_info(adapter) -> AdapterInfo:
    info = getattr(adapter, "info", None)
    get = (lambda k: str(getattr(info, k, "") or "")) if info is not None else (lambda k: "")
    fallback = bool(getattr(info, "isFallbackAdapter", False)) if info is not None else False
    return AdapterInfo(vendor=get("vendor"), architecture=get("architecture"), description=get("description"),
                       backend="browser", adapter_type="fallback" if fallback else "", device=get("device"),
                       subgroup_min_size=int(getattr(info, "subgroupMinSize", 0) or 0) if info is not None else 0,
                       subgroup_max_size=int(getattr(info, "subgroupMaxSize", 0) or 0) if info is not None else 0)


async def request_device(adapter_name: str | None = None, power_preference: str = "high-performance",
                         required_features: tuple[str, ...] = ()) -> BrowserDevice:
    """A device on the browser's adapter with every optional feature it has and its maximum buffer
    limits. `adapter_name`, if given, must occur in the adapter's vendor/architecture/description."""
    gpu = getattr(navigator, "gpu", None)
    if gpu is None:
        raise WebGPUNotAvailableError("navigator.gpu is missing: this browser has no WebGPU here "
                                      "(Chromium on Linux needs --enable-unsafe-webgpu; pages need a "
                                      "secure origin such as http://127.0.0.1)")
    try:
        adapter = await gpu.requestAdapter(_js({"powerPreference": power_preference}))
    except JsException as e:
        raise WebGPUNotAvailableError(str(e)) from None
    if adapter is None:
        raise WebGPUNotAvailableError("navigator.gpu.requestAdapter() returned null (Chromium on Linux "
                                      "needs --enable-unsafe-webgpu)")
    info = _adapter_info(adapter)
    if adapter_name:
        text = " ".join((info.vendor, info.architecture, info.description, info.device)).lower()
        if adapter_name.lower() not in text:
            raise WebGPUNotAvailableError(f"The browser's adapter ({info.vendor} {info.architecture}) does "
                                          f"not match {adapter_name!r}")
    wanted = device_features({str(f) for f in adapter.features}, _OPTIONAL_FEATURES, required_features)
    limits = {}
    for camel in ("maxStorageBufferBindingSize", "maxBufferSize", "maxComputeWorkgroupStorageSize",
                  "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX",
                  "maxStorageBuffersPerShaderStage"):
        v = getattr(adapter.limits, camel, None)
        if v is not None:
            limits[camel] = int(v)
    try:
        raw = await adapter.requestDevice(_js({"requiredFeatures": wanted, "requiredLimits": limits,
                                               "label": "webgpu_engine"}))
    except JsException as e:
        raise WebGPUNotAvailableError(f"requestDevice failed: {e}") from None
    return BrowserDevice(adapter, raw, info)


__all__ = ["BrowserDevice", "JsBytes", "request_device"]
