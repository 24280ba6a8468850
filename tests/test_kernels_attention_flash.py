"""Flash-style prefill attention (shaders/attention_flash.wgsl: key / value tiles in workgroup memory),
which nn.attention runs where the matmuls run the GPU kernel family: against nn_ref's causal
attention (grouped heads, pos0 > 0, sliding windows, soft-capping, f32 and f16 caches), against the
CPU-shaped attn_causal, and row invariance (a query's result whatever the rows run with it)."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import matmul as mm
from webgpu_engine.kernels import nn, nn_ref

from _nn_util import TOL, empty, get, put, rounded, run, step_buf


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


def _case(device, rng, dtype, t, pos0, hq, hkv, d):
    ctx = pos0 + t + 5
    qkv = rng.standard_normal((t, hq + 2 * hkv, d))
    kc = np.zeros((hkv, ctx, d))
    vc = np.zeros((hkv, ctx, d))
    kc[:, :pos0 + t] = rng.standard_normal((hkv, pos0 + t, d)) * 1.5
    vc[:, :pos0 + t] = rng.standard_normal((hkv, pos0 + t, d))
    return ctx, (qkv, kc, vc), (put(device, qkv, dtype, lead=4), put(device, kc, dtype), put(device, vc, dtype, lead=8))


def _attn(device, tensors, out, pos0, t, hq, hkv, d, ctx, **kw):
    qt, kt, vt = tensors
    op = nn.attention(device, qt, kt, vt, out, step_buf(device, pos0, t), n_q_heads=hq, n_kv_heads=hkv,
                      head_dim=d, ctx=ctx, scale=d ** -0.5, **kw)
    run(device, op)
    return op


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("t,pos0,hq,hkv,d,kw", [
    (37, 0, 9, 3, 64, {}),                          # SmolLM2's heads, a partial block of 64 queries
    (70, 20, 4, 2, 32, {}),                         # two query blocks, pos0 > 0
    (5, 3, 6, 1, 16, {"heads_per_lane": 3}),
    (40, 9, 4, 4, 32, {"window": 7}),               # sliding window: blocks before it skipped
    (20, 0, 2, 1, 8, {"softcap": 5.0}),
])
def test_flash_matches_numpy_and_attn_causal(device, monkeypatch, dtype, t, pos0, hq, hkv, d, kw):
    rng = np.random.default_rng(t + pos0 + d)
    ctx, (qkv, kc, vc), tensors = _case(device, rng, dtype, t, pos0, hq, hkv, d)
    monkeypatch.setenv(mm.FAMILY_ENV, "gpu")
    assert nn.flash_attention(device)
    out = empty(device, (t, hq * d), dtype, lead=12)
    op = _attn(device, tensors, out, pos0, t, hq, hkv, d, ctx, **kw)
    assert op.dispatches[0][0].key.entry == "attn_flash"
    got = get(device, out)
    ref = nn_ref.causal_attention(rounded(qkv, dtype)[:, :hq], rounded(kc, dtype), rounded(vc, dtype), pos0,
                                  d ** -0.5, window=kw.get("window", 0), softcap=kw.get("softcap", 0.0))
    np.testing.assert_allclose(got, ref, **TOL[dtype])
    monkeypatch.setenv(mm.FAMILY_ENV, "cpu")
    assert not nn.flash_attention(device)
    cpu = empty(device, (t, hq * d), dtype)
    op = _attn(device, tensors, cpu, pos0, t, hq, hkv, d, ctx, **kw)
    assert op.dispatches[0][0].key.entry == "attn_causal"
    np.testing.assert_allclose(got, get(device, cpu), rtol=1e-6, atol=1e-6)


def test_flash_rows_do_not_depend_on_the_rows_beside(device, monkeypatch):
    """70 queries at once, then the same positions in chunks of 1, 3 and 64 rows (prefill
    chunking, causal single rows): every row bit for bit the same."""
    monkeypatch.setenv(mm.FAMILY_ENV, "gpu")
    rng = np.random.default_rng(3)
    hq, hkv, d, t = 9, 3, 64, 70
    ctx, (qkv, kc, vc), tensors = _case(device, rng, "f32", t, 0, hq, hkv, d)
    full = empty(device, (t, hq * d))
    _attn(device, tensors, full, 0, t, hq, hkv, d, ctx)
    want = get(device, full)
    for n in (1, 3, 64):
        for t0 in (0, 5, 66):
            if t0 + n > t:
                continue
            q = put(device, qkv[t0:t0 + n], "f32")
            out = empty(device, (n, hq * d))
            _attn(device, (q, tensors[1], tensors[2]), out, t0, n, hq, hkv, d, ctx, causal=True)
            np.testing.assert_array_equal(get(device, out), want[t0:t0 + n], err_msg=f"{n} rows at {t0}")
