"""wgpu-py's private fast paths (gpu/wgpu_private.py) and their public fallback, on the real adapter:
the pinned wgpu-py has every private name, a wgpu-py without them or $WEBGPU_ENGINE_WGPU_PUBLIC=1
gets the public API, and either way a kernel's dispatches, every readback and a tiny model's decode
through the engine give the same numbers."""
from __future__ import annotations

import numpy as np
import pytest
import wgpu
from wgpu.backends import wgpu_native

from webgpu_engine.gpu import request_device_sync
from webgpu_engine.gpu import wgpu_private
from webgpu_engine.gpu.wgpu_private import PUBLIC_ENV, PUBLIC_PASS, wgpu_calls
from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.common import Tensor, new_tensor
from webgpu_engine.kernels.matmul import matmul, upload_weight

from tinymodels import write_tiny_llama_gguf

OWNER = "test:wgpu_private"


@pytest.fixture(scope="module")
def public_device():
    """A device of its own made with $WEBGPU_ENGINE_WGPU_PUBLIC=1 (the session device: as the
    environment says, the private fast paths by default)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PUBLIC_ENV, "1")
        dev = request_device_sync()
    assert not dev.wgpu_calls.direct_dispatch and not dev.wgpu_calls.nosync_map
    yield dev
    dev.close()


def test_the_pinned_wgpu_has_both_fast_paths_and_the_switch_or_a_missing_name_turns_them_off(monkeypatch):
    fast = wgpu_calls(public=False)
    assert fast.direct_dispatch and fast.nosync_map             # wgpu-py <0.33, as pyproject pins it
    public = wgpu_calls(public=True)
    assert public.pass_api is PUBLIC_PASS and public.map_read_synced == wgpu.MapMode.READ
    for value, forced in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(PUBLIC_ENV, value)
        assert wgpu_calls().direct_dispatch is not forced
    monkeypatch.delenv(PUBLIC_ENV)
    # another wgpu-py: no cffi module, a map_async that knows no READ_NOSYNC
    monkeypatch.setattr(wgpu_native, "_ffi", None)
    monkeypatch.setattr(wgpu_native.GPUBuffer, "map_async", lambda self, mode, offset=0, size=None: None)
    try:
        wgpu_private._direct_pass.cache_clear()
        wgpu_private._read_synced_mode.cache_clear()
        assert wgpu_calls() == public
    finally:
        monkeypatch.undo()
        wgpu_private._direct_pass.cache_clear()
        wgpu_private._read_synced_mode.cache_clear()
    assert wgpu_calls(public=False) == fast


async def test_kernels_and_every_readback_give_the_same_bytes_either_way(device, public_device):
    """The decode kernel (T = 1; Q4_0: the vec4 kernel over interleaved spans on a CPU adapter) and
    the batch kernel (T = 3), read back by collect, read, read_sync and after sync."""
    rng = np.random.default_rng(0)
    n, k = 96, 256
    raw = qr.random_weight("q4_0", n, k, rng)
    xs = [rng.standard_normal((t, k)).astype(np.float32) for t in (1, 3)]
    got = []
    for dev in (device, public_device):
        try:
            w = upload_weight(dev, raw, "q4_0", n, k, owner=OWNER, label="w")
            batch, ys = dev.batch(), []
            for x in xs:
                y = new_tensor(dev, (len(x), n), owner=OWNER)
                matmul(dev, Tensor(dev.upload(x, owner=OWNER), x.shape), w, y).record(batch)
                ys.append(y)
            readbacks = [batch.readback(y.buf) for y in ys]
            dev.submit(batch)
            reads = [await dev.collect(rb) for rb in readbacks]
            reads += [await dev.read(y.buf) for y in ys] + [dev.read_sync(y.buf) for y in ys]
            await dev.sync()
            reads += [await dev.read(y.buf, 4, 8) for y in ys]
            got.append(reads)
        finally:
            dev.release_owner(OWNER)
    assert got[0] == got[1]
    assert got[0][:2] == got[0][2:4] == got[0][4:6] and got[0][6:] == [r[4:12] for r in got[0][:2]]
    W = qr.dequantize(raw, "q4_0", n, k)
    for x, y in zip(xs, got[0]):
        ref = x.astype(np.float64) @ W.T
        assert np.abs(np.frombuffer(y, np.float32).reshape(ref.shape) - ref).max() < 1e-4 * np.abs(ref).max()


async def test_a_tiny_models_decode_gives_the_same_tokens_either_way(device, public_device, tmp_path):
    from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", "llama", "q4_0", context_length=256)["path"]
    app = default_app_config().with_records(ModelRecord("tiny", str(path), "llm"))
    msgs = [{"role": "user", "content": "Name three colours and a number."}]
    answers = []
    for dev in (device, public_device):
        eng = AsyncMLCEngine(EngineConfig(device=dev, app_config=app))
        await eng.reload("tiny", {"compile_at_load": False})
        try:
            r = await eng.chat.completions.create(messages=msgs, max_tokens=12, temperature=0,
                                                  ignore_eos=True, logprobs=True)
            s = [c async for c in await eng.chat.completions.create(
                messages=msgs, max_tokens=12, temperature=0, ignore_eos=True, stream=True)]
        finally:
            await eng.unload()
        lp = r.choices[0].logprobs.content
        answers.append(([t.token for t in lp], [t.logprob for t in lp], r.choices[0].message.content,
                        "".join(c.choices[0].delta.content or "" for c in s if c.choices)))
        assert len(lp) == 12 and answers[-1][2] == answers[-1][3]
    assert answers[0] == answers[1]
