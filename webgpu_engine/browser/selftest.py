"""In-page self-test of the browser gpu backend: writes, kernels, readback, typed errors, device loss,
the GPU kernel family's matmuls, and a q8_0 KV cache that is a sliding window's ring.

The demo's selftest page calls `await run_selftest(saxpy_wgsl)` and shows the JSON it returns; the
browser test asserts on it. Standard library only (the page has no numpy): values travel as
`array('f')`, and the expected results are computed in plain Python.
"""
from __future__ import annotations

import math
import os
import random
import struct
import time
from array import array

from ..errors import DeviceLostError, GPUOutOfMemoryError, GPUValidationError, ShaderCompileError
from ..gpu import request_device
from ..gpu.shaders import set_shader_dir
from ..kernels.common import act_header

SHADER_DIR = "/tmp/webgpu_engine_selftest"
# A WGSL file with an error on line 3 (an unknown identifier), to check file:line reporting.
BROKEN_WGSL = "@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n" \
              "@compute @workgroup_size(1) fn broken() {\n    y[0] = not_declared;\n}\n"


def _floats(n: int, f) -> array:
    return array("f", (f(i) for i in range(n)))


async def _expect(kind: type, coro_or_fn) -> str:
    """Run and return the message of the `kind` error it raises (anything else is a failure)."""
    try:
        r = coro_or_fn()
        if hasattr(r, "__await__"):
            await r
    except kind as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        raise AssertionError(f"expected {kind.__name__}, got {type(e).__name__}: {e}") from None
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


async def run_selftest(saxpy_wgsl: str) -> dict:
    os.makedirs(SHADER_DIR, exist_ok=True)
    with open(f"{SHADER_DIR}/selftest.wgsl", "w") as f:
        f.write(saxpy_wgsl)
    with open(f"{SHADER_DIR}/broken.wgsl", "w") as f:
        f.write(BROKEN_WGSL)
    set_shader_dir(SHADER_DIR)
    out: dict = {"checks": {}, "timings_ms": {}}
    checks, times = out["checks"], out["timings_ms"]
    try:
        dev = await request_device()
        out["adapter"] = dict(dev.info.__dict__)
        out["backend"] = dev.backend_name
        out["has_f16"] = dev.has_f16
        out["features"] = sorted(dev.features)
        out["max_storage_binding"] = dev.max_storage_binding

        # 1. A kernel on 1M floats written from Python bytes (zero-copy heap view), read back.
        n = 1 << 20
        x = _floats(n, lambda i: (i % 1000) * 0.5)
        y0 = _floats(n, lambda i: 1.0 - (i % 7))
        t = time.perf_counter()
        bx = dev.upload(x, owner="selftest", label="x")
        by = dev.upload(y0, owner="selftest", label="y")
        pipe = dev.pipeline("selftest.wgsl", "saxpy", constants={"A": 3.0}, header=act_header("f32"))
        dev.run(pipe, [bx, by], math.ceil(n / 64))
        got = array("f", await dev.read(by))
        times["saxpy_1M_upload_run_read"] = (time.perf_counter() - t) * 1e3
        bad = sum(1 for i in range(0, n, 997) if abs(got[i] - (3.0 * x[i] + y0[i])) > 1e-5)
        checks["saxpy_python_bytes"] = bad == 0 and len(got) == n

        # 2. The pipeline cache: the same (file, entry, constants, header) compiles once.
        c0 = dev.compile_count
        again = dev.pipeline("selftest.wgsl", "saxpy", constants={"A": 3.0}, header=act_header("f32"))
        checks["pipeline_cached"] = again is pipe and dev.compile_count == c0

        # 3. Writes straight from JS memory (what fetched weights use), with an odd tail and a window.
        from js import Float32Array, Uint8Array  # noqa: PLC0415 - page-only module
        from pyodide.ffi import to_js  # noqa: PLC0415
        from ..gpu.browser import JsBytes  # noqa: PLC0415
        js_x = Float32Array.new(to_js(list(range(64))))
        bj = dev.upload(JsBytes(js_x), owner="selftest", label="js_x")
        got = array("f", await dev.read(bj))
        checks["write_from_js_arraybuffer"] = list(got) == [float(i) for i in range(64)]
        raw = Uint8Array.new(to_js(list(range(1, 12))))        # 11 bytes: 8 + a 3-byte tail
        bt = dev.buffer(16, owner="selftest", label="tail")
        dev.write(bt, JsBytes(raw)[1:])                          # bytes 2..11 (10 bytes)
        checks["js_window_and_tail"] = await dev.read(bt, 0, 10) == bytes(range(2, 12))

        # 4. A batch mixing a dispatch and a copy, submitted as one command buffer; partial readback.
        bz = dev.buffer(n * 4, owner="selftest", label="z")
        by2 = dev.upload(y0, owner="selftest", label="y2")
        b = dev.batch()
        b.dispatch(pipe, dev.bind(pipe, [bx, by2]), math.ceil(n / 64))
        b.copy(by2, bz, 4096 * 4, src_offset=1024 * 4)
        dev.submit(b)
        part = array("f", await dev.read(bz, 0, 4096 * 4))
        checks["batch_dispatch_copy"] = all(abs(part[j] - (3.0 * x[1024 + j] + y0[1024 + j])) < 1e-5
                                            for j in range(4096))

        # 4a. Batch.readback: bytes taken at its point in the batch, collected after a later batch
        #     overwrote the source (decode steps one ahead of the host read their tokens this way).
        dev.write(bt, bytes(range(16)))
        b1 = dev.batch()
        first = b1.readback(bt, 4, 8)
        dev.submit(b1)
        dev.write(bt, bytes(range(100, 116)))
        b2 = dev.batch()
        second = b2.readback(bt)
        await dev.submit_async(b2)
        checks["batch_readback_at_its_point"] = (await dev.collect(second) == bytes(range(100, 116))
                                                 and await dev.collect(first) == bytes(range(4, 12)))

        # 4b. Host cost of encoding a decode-step-sized batch (400 dispatches) through the FFI.
        small_x = dev.upload(x[:256], owner="selftest", label="sx")
        small_y = dev.upload(y0[:256], owner="selftest", label="sy")
        bg = dev.bind(pipe, [small_x, small_y])
        b = dev.batch()
        for _ in range(400):
            b.dispatch(pipe, bg, 4)
        t = time.perf_counter()
        dev.submit(b)
        times["encode_submit_400_dispatches"] = (time.perf_counter() - t) * 1e3
        got = array("f", await dev.read(small_y))
        checks["400_dispatches_applied"] = all(abs(got[i] - (y0[i] + 400 * 3.0 * x[i])) <= 1e-3 * abs(got[i]) + 1e-3
                                               for i in range(256))

        # 5. A 64 MiB upload from the Python heap.
        big = bytearray(64 << 20)
        t = time.perf_counter()
        bb = dev.upload(big, owner="selftest", label="big")
        await dev.sync()
        times["upload_64MiB"] = (time.perf_counter() - t) * 1e3
        bb.release()

        # 6. Typed errors, raised at the next await as the native backend raises them at once.
        msg = await _expect(ShaderCompileError, lambda: _compile_broken(dev))
        checks["shader_compile_error_names_file_line"] = "shaders/broken.wgsl:3" in msg
        out["shader_error"] = msg
        bad_bg = dev.bind(pipe, [bx, (by, 0, n * 8)])            # window past the end of y
        msg = await _expect(GPUValidationError, lambda: dev.read(by, 0, 16))
        checks["validation_error_names_kernel"] = "selftest.wgsl:saxpy" in msg
        out["validation_error"] = msg
        dev.submit(dev.batch().dispatch(pipe, dev.bind(pipe, [bx, by]), 1 << 24))   # > 65535 groups
        msg = await _expect(GPUValidationError, dev.sync)
        checks["submit_error_names_kernel"] = "submit of [selftest.wgsl:saxpy]" in msg
        msg = await _expect(GPUOutOfMemoryError, lambda: dev.buffer(dev.max_buffer_size + 4, label="huge"))
        checks["oversized_buffer_is_oom"] = "huge" in msg
        del bad_bg
        # An error outside any scope arrives as an uncapturederror event and is raised by the next call.
        from js import GPUBufferUsage, Object  # noqa: PLC0415
        dev.raw.createBuffer(to_js({"size": 16, "usage": GPUBufferUsage.MAP_READ | GPUBufferUsage.STORAGE},
                                   dict_converter=Object.fromEntries))
        await dev.raw.queue.onSubmittedWorkDone()
        await _sleep(50)
        msg = await _expect(GPUValidationError, lambda: dev.buffer(16, label="after"))
        checks["uncaptured_error_raised"] = bool(msg)
        checks["device_usable_after_errors"] = array("f", await dev.read(bx, 4, 8)) == array("f", x[1:3])

        # 6b. The GPU kernel family's matmuls and flash attention (what a real GPU in the browser
        # runs) against Python.
        await _gpu_family(dev, checks, times)
        await _flash_attention(dev, checks, times)
        await _ring_q8_0(dev, checks, times)

        # 7. Memory accounting and release by owner.
        before = dev.allocated_bytes("selftest")
        dev.release_owner("selftest")
        checks["release_owner"] = before > 0 and dev.allocated_bytes("selftest") == 0

        # 8. Device loss: the browser's lost promise marks the device, later calls raise DeviceLostError.
        dev2 = await request_device()
        b2 = dev2.upload(bytes(64), label="b2")
        dev2.raw.destroy()                                       # behind the gpu layer's back
        await dev2.raw.lost
        await _sleep(0)
        checks["lost_promise_marks_device"] = dev2.lost
        msg = await _expect(DeviceLostError, lambda: dev2.read(b2))
        checks["lost_device_raises"] = "lost" in msg.lower()
        dev.close()
    except Exception as e:  # noqa: BLE001 - the page shows what broke
        import traceback  # noqa: PLC0415
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    finally:
        set_shader_dir(None)
    out["ok"] = "error" not in out and bool(checks) and all(checks.values())
    return out


async def _gpu_family(dev, checks: dict, times: dict) -> None:
    """The GPU kernel family (kernels/matmul/gpu.py) as a GPU adapter runs it, called directly
    whatever family the page's adapter gets: its decode kernel for 1 and 3 activation rows and its
    workgroup-tiled GEMM (both tile sizes), for f32 and Q8_0 weights, against plain-Python sums."""
    n, k, rows = 40, 64, 20
    rnd = random.Random(7)
    wf = [[rnd.uniform(-1.0, 1.0) for _ in range(k)] for _ in range(n)]
    xs = [[rnd.uniform(-1.0, 1.0) for _ in range(k)] for _ in range(rows)]
    # Q8_0 as GGUF stores it: per 32 weights an f16 scale d = max |w| / 127 and int8 quants w / d
    raw, wq = bytearray(), []
    for row in wf:
        deq = []
        for b in range(0, k, 32):
            blk = row[b:b + 32]
            d = struct.unpack("<e", struct.pack("<e", max(abs(v) for v in blk) / 127.0))[0]
            q = [max(-127, min(127, round(v / d))) for v in blk]
            raw += struct.pack("<e", d) + struct.pack("<32b", *q)
            deq += [d * v for v in q]
        wq.append(deq)
    t0 = time.perf_counter()
    set_shader_dir(None)                      # the package's WGSL (the page test's own dir lacks it)
    try:
        await _gpu_family_runs(dev, checks, n, k, rows, xs, wf, raw, wq)
    finally:
        set_shader_dir(SHADER_DIR)
    times["gpu_family_matmuls"] = (time.perf_counter() - t0) * 1e3


async def _gpu_family_runs(dev, checks: dict, n: int, k: int, rows: int, xs, wf, raw, wq) -> None:
    from ..kernels import matmul as mm  # noqa: PLC0415
    from ..kernels.matmul import gpu as mg  # noqa: PLC0415
    from ..kernels.common import Tensor  # noqa: PLC0415
    f32 = array("f", [v for r in wf for v in r]).tobytes()
    for qtype, data, w_ref in (("f32", f32, wf), ("q8_0", bytes(raw), wq)):
        w = mm.upload_weight(dev, data, qtype, n, k, owner="selftest", label=f"gpu_family_{qtype}")
        for v, t, row_inv in ((mg.Decode(), 1, False), (mg.Decode(), 3, False), (mg.Gemm(64), rows, True),
                              (mg.Gemm(32), rows, True)):
            x = dev.upload(array("f", [val for r in xs[:t] for val in r]), owner="selftest", label="gf_x")
            y = dev.buffer(t * n * 4, owner="selftest", label="gf_y")
            op = mg.matmul(dev, Tensor(x, (t, k), "f32"), w, Tensor(y, (t, n), "f32"), variant=v,
                           row_invariant=row_inv)
            dev.submit(op.record(dev.batch()))
            got = array("f", await dev.read(y))
            ref = [sum(xs[i][j] * w_ref[r][j] for j in range(k)) for i in range(t) for r in range(n)]
            err = max(abs(a - b) for a, b in zip(got, ref)) / max(abs(r) for r in ref)
            checks[f"gpu_family_{qtype}_{v.key}_T{t}"] = len(got) == len(ref) and err < 1e-4


async def _flash_attention(dev, checks: dict, times: dict) -> None:
    """The GPU family's prefill attention (shaders/attention_flash.wgsl: key / value tiles in
    workgroup memory), forced for this call: grouped heads, pos0 > 0, causal, against Python."""
    from ..kernels import matmul as mm, nn  # noqa: PLC0415
    from ..kernels.common import Tensor  # noqa: PLC0415
    t_new, pos0, hq, hkv, d = 10, 3, 4, 2, 16
    ctx, scale = pos0 + t_new + 2, d ** -0.5
    rnd = random.Random(11)
    qkv = [[[rnd.uniform(-1.0, 1.0) for _ in range(d)] for _ in range(hq + 2 * hkv)] for _ in range(t_new)]
    kc = [[[rnd.uniform(-1.5, 1.5) if j < pos0 + t_new else 0.0 for _ in range(d)] for j in range(ctx)]
          for _ in range(hkv)]
    vc = [[[rnd.uniform(-1.0, 1.0) if j < pos0 + t_new else 0.0 for _ in range(d)] for j in range(ctx)]
          for _ in range(hkv)]

    def flat(a):
        return array("f", [v for b in a for c in b for v in c])
    t0 = time.perf_counter()
    saved = os.environ.get(mm.FAMILY_ENV)
    os.environ[mm.FAMILY_ENV] = "gpu"
    set_shader_dir(None)
    try:
        flash = nn.flash_attention(dev)
        up = [dev.upload(flat(a), owner="selftest", label=f"fa_{i}") for i, a in enumerate((qkv, kc, vc))]
        out = dev.buffer(t_new * hq * d * 4, owner="selftest", label="fa_out")
        step = dev.upload(struct.pack("<4I", pos0, t_new, pos0 + t_new, 0), owner="selftest", label="fa_step")
        op = nn.attention(dev, Tensor(up[0], (t_new, hq + 2 * hkv, d)), Tensor(up[1], (hkv, ctx, d)),
                          Tensor(up[2], (hkv, ctx, d)), Tensor(out, (t_new, hq * d)), step, n_q_heads=hq,
                          n_kv_heads=hkv, head_dim=d, ctx=ctx, scale=scale)
        dev.submit(op.record(dev.batch()))
        got = array("f", await dev.read(out))
    finally:
        set_shader_dir(SHADER_DIR)
        if saved is None:
            os.environ.pop(mm.FAMILY_ENV, None)
        else:
            os.environ[mm.FAMILY_ENV] = saved
    ref = []
    for t in range(t_new):
        for h in range(hq):
            q, g = qkv[t][h], h // (hq // hkv)
            s = [scale * sum(a * b for a, b in zip(q, kc[g][j])) for j in range(pos0 + t + 1)]
            m = max(s)
            e = [math.exp(v - m) for v in s]
            z = sum(e)
            ref += [sum(e[j] * vc[g][j][i] for j in range(len(e))) / z for i in range(d)]
    err = max(abs(a - b) for a, b in zip(got, ref))
    checks["gpu_family_flash_attention"] = flash and op.dispatches[0][0].key.entry == "attn_flash" and err < 1e-4
    times["gpu_family_flash_attention"] = (time.perf_counter() - t0) * 1e3


async def _ring_q8_0(dev, checks: dict, times: dict) -> None:
    """A q8_0 KV cache that is a sliding window's ring (kernels/common.py Ring: 2 sinks, a window of 6,
    4 rows of room): rope_kv_quant writes 12 positions in forwards of 4 rows (prefill attention) and 2
    more by decode steps, through the ring's end twice; each row's attention against plain Python over
    the unquantised keys (the sinks scored with the query rotated at min(pos, 6))."""
    from ..kernels import nn  # noqa: PLC0415
    from ..kernels.common import Ring, Tensor  # noqa: PLC0415
    from ..kernels.kv_quant import KV_QUANTS, rope_kv_quant  # noqa: PLC0415
    hq, hkv, d, rows, ring = 4, 2, 32, 4, Ring(2, 6)
    ctx, n_h, scale = ring.window + rows, hq + 2 * hkv, d ** -0.5
    rnd = random.Random(5)
    xs = [[[rnd.uniform(-1.0, 1.0) for _ in range(d)] for _ in range(n_h)] for _ in range(14)]
    t0 = time.perf_counter()
    set_shader_dir(None)
    try:
        words = KV_QUANTS["q8_0"].cache_words(hkv, ctx, d)
        qkv = Tensor(dev.buffer(rows * n_h * d * 4, owner="selftest", label="ring_qkv"), (rows, n_h, d))
        sink = Tensor(dev.buffer(rows * hq * d * 4, owner="selftest", label="ring_sink"), (rows, hq, d))
        kc, vc = (Tensor(dev.upload(bytes(4 * words), owner="selftest", label=f"ring_{c}"), (words,), "u32")
                  for c in "kv")
        out = Tensor(dev.buffer(rows * hq * d * 4, owner="selftest", label="ring_out"), (rows, hq * d))
        step = dev.upload(bytes(16), owner="selftest", label="ring_step")
        heads = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx, ring=ring, q_sink=sink)
        write = rope_kv_quant(dev, qkv, kc, vc, step, **heads)
        ops = {n: nn.attention(dev, qkv, kc, vc, out, step, scale=scale, max_t=n, **heads) for n in (rows, 1)}
        got, pos = [], 0
        for n in (4, 4, 4, 1, 1):
            dev.write(qkv.buf, array("f", [v for t in xs[pos:pos + n] for h in t for v in h]))
            dev.write(step, struct.pack("<4I", pos, n, pos + n, 0))
            b = dev.batch()
            write.record(b)
            ops[1 if n == 1 else rows].record(b)
            dev.submit(b)
            res = array("f", await dev.read(out.buf))
            got += [res[i * hq * d:(i + 1) * hq * d] for i in range(n)]
            pos += n
    finally:
        set_shader_dir(SHADER_DIR)
    inv = [10000.0 ** (-2.0 * i / d) for i in range(d // 2)]

    def rope(v, p):
        r = list(v)
        for i, f in enumerate(inv):
            c, s_ = math.cos(p * f), math.sin(p * f)
            r[2 * i], r[2 * i + 1] = v[2 * i] * c - v[2 * i + 1] * s_, v[2 * i] * s_ + v[2 * i + 1] * c
        return r
    keys = [[rope(xs[p][hq + g], p) for g in range(hkv)] for p in range(14)]
    err = 0.0
    for p in range(14):
        seen = [j for j in range(p + 1) if j < ring.sinks or j >= p - (ring.window - ring.sinks)]
        for h in range(hq):
            g = h // (hq // hkv)
            q, qs = rope(xs[p][h], p), rope(xs[p][h], min(p, ring.window))
            sc = [scale * sum(a * b for a, b in zip(qs if j < ring.sinks else q, keys[j][g])) for j in seen]
            e = [math.exp(v - max(sc)) for v in sc]
            ref = [sum(e[i] * xs[j][hq + hkv + g][c] for i, j in enumerate(seen)) / sum(e) for c in range(d)]
            err = max(err, max(abs(a - b) for a, b in zip(got[p][h * d:(h + 1) * d], ref)))
    checks["kv_q8_0_ring_attention"] = err < 3e-2
    times["kv_q8_0_ring_attention"] = (time.perf_counter() - t0) * 1e3


async def _compile_broken(dev) -> None:
    dev.pipeline("broken.wgsl", "broken")
    await dev.sync()


async def _sleep(ms: int) -> None:
    import asyncio  # noqa: PLC0415
    await asyncio.sleep(ms / 1000)
