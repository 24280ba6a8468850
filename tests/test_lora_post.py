"""lora_post (kernels/lora.py, issue 52): a one-target group's delta added after its residual matmul
(x, the next norm's x * w and partial sums stored again), then the next group's delta, in one
dispatch, against numpy; a base row keeps the matmul's bits."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import lora as lk

from _nn_util import NP, get, put, rounded, run

OWNER = "test:nn"


@pytest.fixture
def _free(device):
    yield
    device.release_owner(OWNER)


@pytest.mark.parametrize("dtype,wdtype", [("f32", "f32"), ("f16", "f16"), ("f16", "bf16")])
@pytest.mark.parametrize("nxt", [True, False])
def test_lora_post_adds_the_delta_after_the_matmul_and_norms_again(device, _free, dtype, wdtype, nxt):
    rng = np.random.default_rng(7 + nxt)
    T, K, K1, R, N2, targets, slots, eps = 3, 64, 1152, 8, 48, 2, 2, 1e-5   # K1 > KC: staged twice
    idx = np.array([1, lk.NONE, 0], np.uint32)
    x0 = rounded(rng.standard_normal((T, K)), dtype)
    inp = rounded(rng.standard_normal((T, K1)), dtype)
    a1 = rounded(rng.standard_normal((slots, R, K1)) / np.sqrt(K1), wdtype)
    b1 = rounded(rng.standard_normal((slots, K, R)) / np.sqrt(R), wdtype)
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    h0 = rounded(x0 * w, dtype)
    part0 = (x0 * x0).reshape(T, K // 4, 4).sum(axis=2).astype(np.float32)
    J = targets * R
    a2 = rounded(rng.standard_normal((slots, J, K)) / np.sqrt(K), wdtype)
    cols = (R * ((np.arange(N2) // 2) % targets)).astype(np.uint32)
    b2 = rounded(rng.standard_normal((slots, N2, R)) / np.sqrt(R), wdtype)
    xt, ht, pt = put(device, x0, dtype, lead=4), put(device, h0, dtype, lead=4), put(device, part0, lead=2)
    yt = put(device, np.full((T, N2), 7.0), dtype)
    it = put(device, idx, "u32")
    more = (put(device, a2, wdtype), put(device, b2, wdtype), put(device, cols[::2], "u32"), yt, eps) if nxt else None
    run(device, lk.lora_post(device, xt, put(device, inp, dtype, lead=8), put(device, a1, wdtype),
                             put(device, b1, wdtype), it, put(device, w), ht, pt, slots=slots, nxt=more))
    x, h, part = get(device, xt), get(device, ht), get(device, pt)
    base = idx == lk.NONE
    for got, was in ((x, x0), (h, h0), (part, part0)):      # a base row: the matmul's bits
        np.testing.assert_array_equal(got[base], was[base])
    tol = 1e-4 if dtype == "f32" else 1e-2
    want = lk.expand_ref(lk.shrink_ref(inp, a1, idx), b1, idx, x0)
    assert np.abs(x - want)[~base].max() / np.abs(want).max() < tol
    np.testing.assert_array_equal(h[~base], rounded(x * w, dtype)[~base])
    np.testing.assert_allclose(part[~base], (x * x).reshape(T, K // 4, 4).sum(axis=2)[~base], rtol=1e-6)
    y = get(device, yt)
    if not nxt:
        assert (y == 7.0).all()
        return
    b2full = np.zeros((slots, N2, J), np.float32)
    for r in range(R):
        b2full[:, np.arange(N2), cols + r] = b2[:, :, r]
    d = lk.expand_ref(lk.shrink_ref(x, a2, idx, (w, eps)), b2full, idx, np.zeros((T, N2)))
    assert np.abs(y - d)[~base].max() / np.abs(d).max() < tol
    assert (y[base] == 0).all() and np.signbit(y[base]).all()


@pytest.mark.parametrize("dtype,wdtype", [("f32", "f32"), ("f16", "f16")])
def test_the_shrinks_x_through_the_subgroup_gives_the_same_bits(device, _free, monkeypatch, dtype, wdtype):
    """kernels/lora.py SUBGROUP_X (x handed to the shrink's lanes by subgroup broadcasts, 32 values a
    block, the rest read by each lane) against each lane reading x itself: lora_post + the next
    group's delta and lora_delta (normed, added), bit for bit; K1 = 1096 (two staged chunks, the
    last not whole blocks of 32)."""
    if not lk.rows_ok(device):
        pytest.skip("this adapter has no subgroups of 8 lanes: the per-lane form is the only one")
    rng = np.random.default_rng(11)
    T, K, K1, R, N2, slots = 2, 576, 1096, 16, 96, 2
    idx = np.array([1, 0], np.uint32)
    x0, inp = rng.standard_normal((T, K)), rng.standard_normal((T, K1))
    a1 = (rng.standard_normal((slots, R, K1)) / np.sqrt(K1)).astype(NP[wdtype])
    b1 = (rng.standard_normal((slots, K, R)) / np.sqrt(R)).astype(NP[wdtype])
    a2 = (rng.standard_normal((slots, 3 * R, K)) / np.sqrt(K)).astype(NP[wdtype])
    b2 = (rng.standard_normal((slots, N2, R)) / np.sqrt(R)).astype(NP[wdtype])
    cols = (R * ((np.arange(N2) // 2) % 3)).astype(np.uint32)[::2]
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    got = []
    for sg in (False, True):
        monkeypatch.setattr(lk, "SUBGROUP_X", sg)
        xt, ht, pt = put(device, x0, dtype), put(device, x0 * w, dtype), put(device, np.zeros((T, K // 4)))
        yt, zt = put(device, np.zeros((T, N2)), dtype), put(device, np.ones((T, N2)), dtype)
        it, wt = put(device, idx, "u32"), put(device, w)
        run(device, lk.lora_post(device, xt, put(device, inp, dtype), put(device, a1, wdtype), put(device, b1, wdtype),
                                 it, wt, ht, pt, slots=slots,
                                 nxt=(put(device, a2, wdtype), put(device, b2, wdtype), put(device, cols, "u32"), yt,
                                      1e-5)),
            lk.lora_delta(device, xt, put(device, a2, wdtype), put(device, b2, wdtype), put(device, cols, "u32"), it,
                          zt, slots=slots, norm=(wt, 1e-5)))
        got.append([get(device, t) for t in (xt, ht, pt, yt, zt)])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    assert np.abs(got[1][4] - 1).max() > 0.01          # the deltas were added
