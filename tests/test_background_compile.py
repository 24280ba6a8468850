"""Kernels compiled in the background (gpu/compiler.py): inside Device.compiling_in_background a new
pipeline is queued, not compiled; worker threads compile the queue; a submit (or Device.ready)
compiles what it needs that no worker has reached; errors stay typed; a model's load returns once
its weights are up, its answers do not change, and once the queue is done no request compiles."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.engine import EngineConfig
from webgpu_engine.engine.engine import AsyncMLCEngine
from webgpu_engine.errors import ShaderCompileError
from webgpu_engine.gpu import request_device, twin
from webgpu_engine.gpu import shaders as shader_lookup
from webgpu_engine.kernels.common import params
from webgpu_engine.kernels.matmul import tiled

from _matmul_util import matmul_case

SCALE_WGSL = """
struct P { k: f32, n: u32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(64) fn scale(@builtin(global_invocation_id) g: vec3<u32>) {
    if (g.x < p.n) { y[g.x] = x[g.x] * p.k * VARIANT; }
}
"""
BROKEN_WGSL = """
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64) fn broken(@builtin(global_invocation_id) g: vec3<u32>) {
    y[g.x] = undefined_symbol * 2.0;
}
"""
N = 100


@pytest.fixture
def shader_dir(tmp_path):
    (tmp_path / "scale.wgsl").write_text(SCALE_WGSL)
    (tmp_path / "broken.wgsl").write_text(BROKEN_WGSL)
    shader_lookup.set_shader_dir(tmp_path)
    yield tmp_path
    shader_lookup.set_shader_dir(None)


def _variant(dev, v: int):
    return dev.pipeline("scale.wgsl", "scale", header=f"const VARIANT: f32 = {v}.0;\n")


def _scale_batch(dev, pipes):
    """A batch that runs each pipeline on x = 0..N-1 into a buffer of its own (k = 2)."""
    x = dev.upload(np.arange(N, dtype=np.float32), owner="t:bg")
    u = params(dev, [2.0, N], owner="t:bg")
    outs = [dev.buffer(4 * N, owner="t:bg") for _ in pipes]
    batch = dev.batch()
    for p, y in zip(pipes, outs):
        batch.dispatch(p, dev.bind(p, [x, y, u]), -(-N // 64))
    return batch, outs


def _check(dev, outs, variants):
    for y, v in zip(outs, variants):
        got = np.frombuffer(dev.read_sync(y), np.float32)
        assert np.array_equal(got, np.arange(N, dtype=np.float32) * 2 * v)


def test_a_queued_pipeline_compiles_at_its_first_submit(fresh_device, shader_dir):
    dev, bg = fresh_device, fresh_device.background
    assert bg is not None                      # the native backend has a compiler
    bg.hold(True)                              # the workers start nothing
    try:
        count, waits = dev.compile_count, dev.compile_waits
        with dev.compiling_in_background() as queued:
            p = _variant(dev, 3)
            assert _variant(dev, 3) is p       # cached while queued
        assert queued == [p] and not p.ready and dev.uncompiled() == 1
        assert dev.compile_count == count + 1
        batch, outs = _scale_batch(dev, [p])   # bound before it is compiled
        dev.submit(batch)
        assert p.ready and dev.compile_waits == waits + 1
        _check(dev, outs, [3])
    finally:
        bg.hold(False)
        dev.release_owner("t:bg")


def test_nested_blocks_each_collect_their_own_pipelines(fresh_device, shader_dir):
    """A block inside another (a draft model loaded inside its target's load): the inner list holds
    what was asked for inside it, the outer one everything; lists equal in value at the inner end
    are told apart (the inner's exit once removed the outer's list, and the outer's exit failed)."""
    dev, bg = fresh_device, fresh_device.background
    bg.hold(True)
    try:
        with dev.compiling_in_background() as outer:
            with dev.compiling_in_background() as inner:
                a = _variant(dev, 7)
            assert inner == outer == [a]
            b = _variant(dev, 8)
        assert inner == [a] and outer == [a, b] and dev._queued == []
    finally:
        bg.hold(False)


async def test_the_workers_compile_the_queue(fresh_device, shader_dir):
    dev, bg = fresh_device, fresh_device.background
    done = bg.done
    with dev.compiling_in_background():
        pipes = [_variant(dev, v) for v in (4, 5, 6)]
    await dev.compiled()
    assert dev.compiles_pending() == 0 and all(p.ready for p in pipes) and bg.done == done + 3
    waits = dev.compile_waits
    batch, outs = _scale_batch(dev, pipes)
    await dev.ready(batch)
    dev.submit(batch)
    assert dev.compile_waits == waits        # nothing left to compile on the request's path
    _check(dev, outs, [4, 5, 6])
    dev.release_owner("t:bg")


async def test_ready_compiles_what_a_batch_needs_and_nothing_else(fresh_device, shader_dir):
    dev, bg = fresh_device, fresh_device.background
    bg.hold(True)
    try:
        with dev.compiling_in_background():
            pipes = [_variant(dev, v) for v in (7, 8, 9, 10)]
        batch, outs = _scale_batch(dev, pipes[:3])
        waits = dev.compile_waits
        await dev.ready(batch)                 # side by side, off the event loop
        assert [p.ready for p in pipes] == [True, True, True, False]
        assert dev.compile_waits == waits + 3 and dev.uncompiled() == 1
        dev.submit(batch)
        assert dev.compile_waits == waits + 3
        _check(dev, outs, [7, 8, 9])
        done = bg.done
    finally:
        bg.hold(False)
    await dev.compiled()
    assert pipes[3].ready and bg.done == done + 1   # the workers skipped what ready() compiled
    dev.release_owner("t:bg")


async def test_ready_dispatches_what_it_compiles_empty_where_the_driver_compiles_then(fresh_device, shader_dir):
    """lavapipe compiles a pipeline's code at its first dispatch: ready() dispatches each pipeline it
    creates with no workgroups (the driver compiles it while the next one is created), which
    writes nothing; the batch then gives the same results."""
    dev, bg = fresh_device, fresh_device.background
    assert dev.warms_on_dispatch == dev.info.cpu
    bg.hold(True)
    try:
        with dev.compiling_in_background():
            pipes = [_variant(dev, v) for v in (11, 12)]
        batch, outs = _scale_batch(dev, pipes)
        warmed = dev.warmed                 # some may compile on the twin device instead (counted)
        await dev.ready(batch)
        assert dev.warmed == warmed + (2 if dev.warms_on_dispatch else 0)
        for y in outs:                         # zero-filled at creation, still
            assert not np.frombuffer(dev.read_sync(y), np.float32).any()
        dev.submit(batch)
        _check(dev, outs, [11, 12])
    finally:
        bg.hold(False)
        dev.release_owner("t:bg")


async def test_a_twin_device_compiles_part_of_what_ready_needs_where_mesa_caches(fresh_device, shader_dir,
                                                                                 monkeypatch):
    """lavapipe with Mesa's on-disk shader cache on (its default): `ready` compiles some of a batch's
    pipelines on a second device, whose queue thread runs beside this device's (the code comes back
    through the cache); the results do not change. With the cache off there is no twin."""
    dev, bg = fresh_device, fresh_device.background
    assert (dev._twin() is not None) == (dev.warms_on_dispatch and twin.cache_enabled())
    bg.hold(True)
    try:
        with dev.compiling_in_background():
            pipes = [_variant(dev, v) for v in (21, 22, 23, 24)]
        batch, outs = _scale_batch(dev, pipes)
        n = dev.twin_compiled
        await dev.ready(batch)
        assert dev.twin_compiled - n == (2 if dev._twin() is not None else 0)   # the lighter queue each
        dev.submit(batch)
        _check(dev, outs, [21, 22, 23, 24])
    finally:
        bg.hold(False)
        dev.release_owner("t:bg")
    monkeypatch.setenv("MESA_SHADER_CACHE_DISABLE", "true")
    off = await request_device()
    try:
        assert off._twin() is None
    finally:
        off.close()


async def test_the_workers_dispatch_what_they_created_empty_once_the_device_pauses(fresh_device, shader_dir):
    """Where the driver compiles at the first dispatch, the workers finish the job: each pipeline
    they created is dispatched empty (with the bind group it was first bound with) once the device
    has paused, so no later batch compiles it; nothing is written."""
    dev, bg = fresh_device, fresh_device.background
    bg.hold(True)
    try:
        with dev.compiling_in_background():
            pipes = [_variant(dev, v) for v in (13, 14)]
        batch, outs = _scale_batch(dev, pipes)          # bound before the workers reach them
        warmed = dev.warmed
    finally:
        bg.hold(False)
    await dev.compiled()
    assert all(p.ready for p in pipes) and dev.compiles_pending() == 0
    assert [p.hot for p in pipes] == [dev.warms_on_dispatch] * 2
    assert dev.warmed == warmed + (2 if dev.warms_on_dispatch else 0)
    for y in outs:
        assert not np.frombuffer(dev.read_sync(y), np.float32).any()
    waits = dev.compile_waits
    dev.submit(batch)
    assert dev.compile_waits == waits
    _check(dev, outs, [13, 14])
    dev.release_owner("t:bg")


def test_a_broken_shader_queued_fails_typed_where_it_is_used(fresh_device, shader_dir):
    dev = fresh_device
    dev.background.hold(True)
    try:
        with dev.compiling_in_background():
            p = dev.pipeline("broken.wgsl", "broken")     # queued: no error yet
        y = dev.buffer(4 * N, owner="t:bg")
        with pytest.raises(ShaderCompileError, match=r"broken\.wgsl:4.*undefined_symbol"):
            dev.submit(dev.batch().dispatch(p, dev.bind(p, [y]), 1))
        with pytest.raises(ShaderCompileError):           # kept: raised again, not compiled again
            dev.submit(dev.batch().dispatch(p, dev.bind(p, [y]), 1))
    finally:
        dev.background.hold(False)
    batch, outs = _scale_batch(dev, [_variant(dev, 2)])   # the device goes on
    dev.submit(batch)
    _check(dev, outs, [2])
    dev.release_owner("t:bg")


async def test_forget_pipelines_drops_the_queue(fresh_device, shader_dir):
    dev, bg = fresh_device, fresh_device.background
    bg.hold(True)
    try:
        with dev.compiling_in_background():
            pipes = [_variant(dev, v) for v in (11, 12)]
        assert dev.compiles_pending() == 2
        dev.forget_pipelines()
        assert dev.compiles_pending() == 0 and dev.uncompiled() == 0
    finally:
        bg.hold(False)
    batch, outs = _scale_batch(dev, pipes)    # ops that hold them still run: compiled in place
    dev.submit(batch)
    _check(dev, outs, [11, 12])
    dev.release_owner("t:bg")


def test_without_a_compiler_pipelines_compile_in_place(fresh_device, shader_dir):
    dev = fresh_device
    dev.background, bg = None, dev.background     # as in the page (no threads)
    try:
        with dev.compiling_in_background() as queued:
            p = _variant(dev, 13)
        assert queued is None and p.ready and dev.compiles_pending() == 0
    finally:
        dev.background = bg


# --------------------------------------------------------------------------- a model's load
OPTS = {"dtype": "f32", "context_window_size": 192, "prefill_chunk_size": 32}
LONG = ("the quick brown fox jumps over a lazy dog while seven small birds sing near the old river bank and "
        "the quick brown fox")                            # two 32-row chunks and a 9-row one
SHORT = ["the", "a lazy dog", "birds sing"]                # 1 .. 8 rows: the few-row tiles
PROMPTS = [LONG, *SHORT]


async def test_the_8_row_tile_stands_in_for_a_taller_one_with_the_same_bits(fresh_device):
    """A 16-row tile not compiled yet: `ready` compiles the cheaper 8-row tile, and the batch runs
    two of its workgroups per 16-row tile (rows past T unwritten), each row's sums those of the
    16-row tile."""
    dev = fresh_device
    dev.background.hold(True)       # deterministic: nothing compiles in the background
    try:
        w, x, y, bias, _ = matmul_case(dev, "q4_1", 200, 256, 37, "f32", np.random.default_rng(4),
                                       owner="t:bg", bias=True)
        with dev.compiling_in_background():
            op = tiled.matmul(dev, x, w, y, bias=bias)          # 3 tiles of 16 rows
        full = next(o[1] for o in _recorded(dev, op).ops if o[0] == "d")
        alt = full.stand_in
        assert tiled.default_config(dev, "q4_1").tm == 16 and full.stand_in_y == 2
        assert "const TM: u32 = 8u;" in alt.key.header and not full.ready
        outs = []
        for stand_in in (True, False):
            dev.write(y.buf, np.zeros(37 * 200, np.float32))
            batch, n = _recorded(dev, op), dev.stand_ins
            if stand_in:
                await dev.ready(batch)
                assert [o[1] for o in batch.ops if o[0] == "d"] == [alt] and not full.ready
                assert [o[4] for o in batch.ops if o[0] == "d"] == [6]
                assert dev.stand_ins == n + 1
            dev.submit(batch)             # without ready: the 16-row tile compiles here
            outs.append(np.frombuffer(dev.read_sync(y.buf), np.float32).copy())
        assert full.ready and np.array_equal(outs[0], outs[1]) and np.abs(outs[0]).max() > 0
    finally:
        dev.background.hold(False)


def _recorded(dev, op):
    batch = dev.batch()
    op.record(batch)
    return batch


async def _answer(eng, prompt: str) -> str:
    r = await eng.completions.create(prompt=prompt, max_tokens=6, ignore_eos=True, temperature=0)
    await eng.reset_chat()            # no prefix reuse: every prompt is prefilled whole
    return r.choices[0].text


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tinymodels import write_tiny_llama_gguf
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("bg") / "tinybg.gguf", qtype="q8_0", seed=5)["path"]


async def test_load_returns_before_its_kernels_and_answers_do_not_change(fresh_device, device, tiny_path):
    dev, reports = fresh_device, []
    dev.background.hold(True)     # deterministic: every kernel is still queued when the load returns
    eng = AsyncMLCEngine(EngineConfig(device=dev, init_progress_callback=reports.append))
    answers = {}
    try:
        await eng.reload(str(tiny_path), chat_opts=OPTS)
        pending = dev.compiles_pending()
        assert pending > 0 and dev.uncompiled() > 0
        assert any(f"compiling {pending} GPU kernels in the background" in r["text"] for r in reports)
        (lm,) = eng.models.values()
        kernels = lm.describe(dev)["kernels"]                # /v1/models
        assert kernels["queued_at_load"] == pending and kernels["compiling"] == dev.uncompiled()
        waits, left = dev.compile_waits, dev.uncompiled()
        stand_ins = dev.stand_ins
        answers[LONG] = await _answer(eng, LONG)         # compiles what it needs, side by side
        assert dev.compile_waits > waits and dev.stand_ins > stand_ins   # the 8-row tile for the full one
        assert 0 < dev.uncompiled() < left               # ... and not the rest
        # prompts of fewer rows: their few-row tiles are not compiled, the 8-row tile stands in
        waits, stand_ins = dev.compile_waits, dev.stand_ins
        for p in SHORT:
            answers[p] = await _answer(eng, p)
        assert dev.compile_waits == waits and dev.stand_ins > stand_ins
    finally:
        dev.background.hold(False)
    await dev.compiled()
    assert dev.compiles_pending() == 0 and dev.uncompiled() == 0
    assert lm.describe(dev)["kernels"] == {"queued_at_load": pending, "compiling": 0}
    count, waits, stand_ins = dev.compile_count, dev.compile_waits, dev.stand_ins
    again = {p: await _answer(eng, p) for p in [*SHORT, LONG]}
    r = await eng.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0.8, seed=3)
    assert r.choices[0].message.content is not None
    # no request compiled, and the few-row tiles now run as themselves
    assert (dev.compile_count, dev.compile_waits, dev.stand_ins) == (count, waits, stand_ins)
    assert again == answers
    await eng.unload()
    ref = AsyncMLCEngine(EngineConfig(device=device))
    await ref.reload(str(tiny_path), chat_opts={**OPTS, "compile_at_load": False})
    try:
        assert answers == {p: await _answer(ref, p) for p in answers}
    finally:
        await ref.unload()


async def test_compile_in_background_off_compiles_everything_before_the_load_returns(fresh_device, tiny_path):
    dev = fresh_device
    eng = AsyncMLCEngine(EngineConfig(device=dev))
    await eng.reload(str(tiny_path), chat_opts={**OPTS, "compile_in_background": False})
    try:
        assert dev.compile_count > 0 and dev.uncompiled() == 0 and dev.compiles_pending() == 0
        count, waits = dev.compile_count, dev.compile_waits
        for p in PROMPTS:
            await _answer(eng, p)
        assert (dev.compile_count, dev.compile_waits) == (count, waits)
    finally:
        await eng.unload()
