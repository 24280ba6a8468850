"""The gpu layer on the real adapter: device facts, buffers, pipeline cache, batching, typed errors."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from webgpu_engine.errors import DeviceLostError, GPUOutOfMemoryError, ShaderCompileError
from webgpu_engine.gpu import request_device_sync
from webgpu_engine.gpu import shaders as shader_lookup

SCALE_WGSL = """
// scale: y[i] = x[i] * p.k   dispatch (ceil(n/64),1,1), workgroup 64
struct P { k: f32, n: u32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;        // (n)
@group(0) @binding(1) var<storage, read_write> y: array<f32>;  // (n)
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(64) fn scale(@builtin(global_invocation_id) g: vec3<u32>) {
    if (g.x < p.n) { y[g.x] = x[g.x] * p.k; }
}
"""

SPIN_WGSL = """
// spin: y[i] = x[i] after p.n multiply-adds per element (GPU work that takes a while)
struct P { k: f32, n: u32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(64) fn spin(@builtin(global_invocation_id) g: vec3<u32>) {
    var a = x[g.x];
    for (var i = 0u; i < p.n; i++) { a = a * p.k + (1.0 - p.k) * x[g.x]; }
    y[g.x] = a;
}
"""

BROKEN_WGSL = """
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64) fn broken(@builtin(global_invocation_id) g: vec3<u32>) {
    y[g.x] = undefined_symbol * 2.0;
}
"""


@pytest.fixture
def shader_dir(tmp_path):
    (tmp_path / "scale.wgsl").write_text(SCALE_WGSL)
    (tmp_path / "broken.wgsl").write_text(BROKEN_WGSL)
    (tmp_path / "spin.wgsl").write_text(SPIN_WGSL)
    shader_lookup.set_shader_dir(tmp_path)
    yield tmp_path
    shader_lookup.set_shader_dir(None)


def test_device_facts(device):
    assert device.info.backend
    assert device.max_storage_binding >= 128 << 20
    assert device.max_buffer_size >= device.max_storage_binding
    d = device.describe()
    assert d["features"] == sorted(device.features)
    assert "max-storage-buffer-binding-size" in d["limits"]


@pytest.mark.parametrize("nbytes", [4, 12, 1000, 4096 + 4, 1 << 20, 64 << 20])
def test_buffer_round_trip_exact(device, nbytes):
    rng = np.random.default_rng(nbytes)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    buf = device.upload(data, owner="test-roundtrip")
    try:
        back = asyncio.run(device.read(buf))
        assert back == data.tobytes()
    finally:
        buf.release()
    assert device.allocated_bytes("test-roundtrip") == 0


async def test_concurrent_reads_of_two_owners_get_their_own_data(device):
    """Two models reading back at the same time (same size class, so the same staging pool) must each
    get their own bytes: a shared staging buffer would be mapped twice or overwritten mid-read."""
    rng = np.random.default_rng(7)
    owners = ("model:a", "model:b")
    payloads = {o: [rng.integers(0, 256, 3000 + 4 * i, dtype=np.uint8).tobytes() for i in range(4)]
                for o in owners}
    bufs = {o: [device.upload(d, owner=o, label=f"{o}:{i}") for i, d in enumerate(ds)]
            for o, ds in payloads.items()}
    try:
        for _ in range(3):
            jobs = [(o, i) for i in range(4) for o in owners]
            got = await asyncio.gather(*(device.read(bufs[o][i], 4, len(payloads[o][i]) - 8)
                                         for o, i in jobs))
            for (o, i), data in zip(jobs, got):
                assert data == payloads[o][i][4:-4], (o, i)
    finally:
        for o in owners:
            device.release_owner(o)
    assert device.allocated_bytes(owners[0]) == device.allocated_bytes(owners[1]) == 0


def test_odd_sizes_round_up_and_partial_write(device):
    buf = device.buffer(7, owner="test-odd")
    assert buf.size == 8 and buf.nbytes == 7
    device.write(buf, b"abcdefg")
    assert device.read_sync(buf, size=7) == b"abcdefg"
    device.write(buf, b"WXYZ", offset=4)
    assert device.read_sync(buf) == b"abcdWXYZ"
    # A write whose length is not a multiple of 4 zero-fills up to the next 4-byte boundary.
    device.write(buf, b"XY", offset=4)
    assert device.read_sync(buf) == b"abcdXY\0\0"
    buf.release()


def test_allocation_accounting_per_owner(device):
    base = device.allocated_bytes()
    bufs = [device.buffer(1000, owner="acct-a") for _ in range(3)] + [device.buffer(64, owner="acct-b")]
    assert device.allocated_bytes("acct-a") == 3 * 1000
    assert device.allocated_bytes("acct-b") == 64
    assert device.allocated_bytes() == base + 3064
    device.release_owner("acct-a")
    assert device.allocated_bytes("acct-a") == 0 and not bufs[0].alive
    bufs[3].release()
    bufs[3].release()  # idempotent
    assert device.allocated_bytes() == base


def test_pipeline_cache_compiles_once_and_batch_runs(device, shader_dir):
    from webgpu_engine.kernels.common import params
    n = 1000
    x = np.arange(n, dtype=np.float32)
    xb = device.upload(x, owner="t")
    yb = device.buffer(4 * n, owner="t")
    before = device.compile_count
    p1 = device.pipeline("scale.wgsl", "scale")
    p2 = device.pipeline("scale.wgsl", "scale")
    assert p1 is p2 and device.compile_count == before + 1
    # A different header is a different variant.
    p3 = device.pipeline("scale.wgsl", "scale", header="// variant\n")
    assert p3 is not p1 and device.compile_count == before + 2
    # Many dispatches in one batch, one submit: y = x*2, then y2 = y*3.
    y2 = device.buffer(4 * n, owner="t")
    u2, u3 = params(device, [2.0, n], owner="t"), params(device, [3.0, n], owner="t")
    batch = device.batch()
    batch.dispatch(p1, device.bind(p1, [xb, yb, u2]), (n + 63) // 64)
    batch.dispatch(p1, device.bind(p1, [yb, y2, u3]), (n + 63) // 64)
    batch.copy(y2, xb)
    assert len(batch) == 3
    device.submit(batch)
    np.testing.assert_array_equal(np.frombuffer(device.read_sync(xb), np.float32), x * 6)
    device.release_owner("t")


async def test_a_readback_leaves_the_event_loop_free_while_the_gpu_works(device, shader_dir):
    """collect (a decode step's tokens) and read wait for the GPU without holding the event loop: on
    lavapipe a submit while the GPU is busy blocks until it drains, and wgpu-py's map for reading
    makes one (an empty one) first; it held the loop through a whole step, so a streamed token waited
    for the next step. Here the loop's longest stall is a small part of the wait."""
    from webgpu_engine.kernels.common import params
    n = 64 * 256
    x = np.linspace(-1, 1, n, dtype=np.float32)
    xb, yb = device.upload(x, owner="t"), device.buffer(4 * n, owner="t")
    spin = device.pipeline("spin.wgsl", "spin")
    group = device.bind(spin, [xb, yb, params(device, [1.0, 4000], owner="t")])
    for reps in (1, 2, 4, 8, 16, 32, 64):          # GPU work of at least 0.3 s
        batch = device.batch()
        for _ in range(reps):
            batch.dispatch(spin, group, n // 64)
        rb = batch.readback(yb)
        device.submit(batch)
        t0 = last = asyncio.get_running_loop().time()
        task = asyncio.ensure_future(device.collect(rb))
        stall = 0.0
        while not task.done():
            await asyncio.sleep(0)
            t = asyncio.get_running_loop().time()
            stall, last = max(stall, t - last), t
        wait = last - t0
        np.testing.assert_array_equal(np.frombuffer(task.result(), np.float32), x)
        if wait >= 0.3:
            break
    assert wait >= 0.3, wait
    assert stall < 0.5 * wait, (stall, wait)
    device.release_owner("t")


def test_a_bad_dispatch_is_a_typed_error_and_the_device_goes_on(device, shader_dir):
    """The per-dispatch calls go straight to wgpu-native (no error scope each): a pass's error is
    still raised, typed and naming the kernel, when the batch is submitted."""
    from webgpu_engine.errors import GPUValidationError
    from webgpu_engine.kernels.common import params
    x, y = device.upload(np.ones(64, np.float32), owner="t"), device.buffer(256, owner="t")
    p = device.pipeline("scale.wgsl", "scale")
    group = device.bind(p, [x, y, params(device, [2.0, 64], owner="t")])
    with pytest.raises(GPUValidationError, match="scale.wgsl:scale.*65535"):
        device.submit(device.batch().dispatch(p, group, 70000))
    device.submit(device.batch().dispatch(p, group, 1))
    np.testing.assert_array_equal(np.frombuffer(device.read_sync(y), np.float32), np.full(64, 2.0, np.float32))
    device.release_owner("t")


def test_a_warm_up_with_a_released_buffer_is_refused_under_the_lock(device, shader_dir):
    """An empty warm-up dispatch (the background compiler's, from a worker thread) whose bind group
    lost a buffer meanwhile is refused where the submit is made, under the release lock: a submit
    with a destroyed buffer would abort wgpu-native. The device goes on."""
    from webgpu_engine.errors import GPUValidationError
    from webgpu_engine.kernels.common import params
    x, y = device.upload(np.ones(64, np.float32), owner="t"), device.buffer(256, owner="t")
    p = device.pipeline("scale.wgsl", "scale")
    group = device.bind(p, [x, y, params(device, [2.0, 64], owner="t")])
    x.release()
    with pytest.raises(GPUValidationError, match="released before the submit"):
        device._raw_warm(p.raw, group.raw, p.name, group.buffers)
    device.release_owner("t")
    z = device.upload(np.ones(4, np.float32), owner="t")
    assert np.frombuffer(device.read_sync(z), np.float32).tolist() == [1.0] * 4
    device.release_owner("t")


def test_broken_shader_names_file_and_line(device, shader_dir):
    with pytest.raises(ShaderCompileError) as ei:
        device.pipeline("broken.wgsl", "broken")
    msg = str(ei.value)
    assert "broken.wgsl:4" in msg and "undefined_symbol" in msg


def test_broken_shader_line_accounts_for_header(device, shader_dir):
    with pytest.raises(ShaderCompileError) as ei:
        device.pipeline("broken.wgsl", "broken", header="alias act = f32;\nalias act4 = vec4<f32>;\n")
    assert "broken.wgsl:4" in str(ei.value)


def test_missing_shader_file(device, shader_dir):
    with pytest.raises(FileNotFoundError, match="nope.wgsl"):
        device.pipeline("nope.wgsl", "x")


def test_buffer_over_max_size_is_typed_error(device):
    before = device.allocated_bytes()
    with pytest.raises(GPUOutOfMemoryError, match="max buffer size"):
        device.buffer(device.max_buffer_size + 4, owner="too-big")
    assert device.allocated_bytes() == before


def test_device_lost_after_destroy(fresh_device, shader_dir):
    dev = fresh_device
    p = dev.pipeline("scale.wgsl", "scale")
    buf = dev.upload(np.ones(64, np.float32), owner="lost")
    dev.destroy()
    assert dev.lost
    with pytest.raises(DeviceLostError):
        dev.submit(dev.batch().copy(buf, buf, 16, 0, 16))
    with pytest.raises(DeviceLostError):
        asyncio.run(dev.read(buf))
    with pytest.raises(DeviceLostError):
        dev.buffer(16)
    with pytest.raises(DeviceLostError):
        dev.pipeline("scale.wgsl", "scale", header="// other\n")
    assert p is not None


def test_lost_detected_from_failing_call(fresh_device):
    """A loss the layer did not cause itself (raw destroy) is detected from the next failing call."""
    dev = fresh_device
    buf = dev.upload(np.ones(64, np.float32), owner="lost2")
    dev.raw.destroy()            # bypass Device.destroy: the layer must notice by itself
    assert not dev.lost
    with pytest.raises(DeviceLostError):
        dev.submit(dev.batch().copy(buf, buf, 16, 0, 16))
    assert dev.lost
    with pytest.raises(DeviceLostError):
        dev.buffer(16)


def test_second_device_is_independent():
    d = request_device_sync()
    b = d.upload(b"\1\2\3\4", owner="x")
    assert d.read_sync(b) == b"\1\2\3\4"
    d.close()
    assert d.allocated_bytes() == 0


@pytest.mark.parametrize("end", ["close", "destroy"])
def test_a_device_that_ends_is_freed(end):
    """A device closed or lost (destroyed) is freed once its user drops it: nothing the kernels keep
    per device (the placeholder binding of an absent bias) holds it, with its pipelines' memory
    (on lavapipe ~10 MB of JIT code each); an engine that recovers from losses makes a device each."""
    import gc
    import weakref

    from webgpu_engine.kernels import quant_ref as qr
    from webgpu_engine.kernels.common import new_tensor, run_ops
    from webgpu_engine.kernels.matmul import matmul, upload_weight
    dev = request_device_sync()
    w = upload_weight(dev, qr.random_weight("q8_0", 8, 32, np.random.default_rng(0)), "q8_0", 8, 32, owner="t")
    run_ops(dev, matmul(dev, new_tensor(dev, (1, 32), "f32", owner="t"), w, new_tensor(dev, (1, 8), "f32", owner="t")))
    ref = weakref.ref(dev)
    dev.close() if end == "close" else dev.destroy()
    del dev, w
    gc.collect()
    assert ref() is None
