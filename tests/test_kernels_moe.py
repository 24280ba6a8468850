"""The mixture-of-experts kernels (kernels/moe.py: routing on the GPU, products with the selected
experts of a stacked weight, in one buffer or split into buffers of whole experts) on the real
adapter against kernels/nn_ref.py's numpy references, for float and quantised expert weights; a
row's values do not depend on the other rows."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import moe, nn_ref
from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.matmul import gpu_row_bytes

from _nn_util import empty, get, put, rounded, run

OWNER = "test:nn"


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner(OWNER)


def _ids(device, a):
    return put(device, np.asarray(a, np.uint32), "u32")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("T,E,k,norm", [(1, 8, 2, True), (5, 4, 2, False), (9, 64, 8, True), (3, 6, 1, False)])
def test_moe_route(device, dtype, T, E, k, norm):
    rng = np.random.default_rng(T * E + k)
    logits = rng.standard_normal((T, E)) * 2
    logits[0, 1] = logits[0, 3] = logits[0].max() + 1       # a tie: the lower id first
    lt, st, wt = put(device, logits, dtype, lead=4), empty(device, (T, k), "u32", fill=0), empty(device, (T, k))
    run(device, moe.moe_route(device, lt, st, wt, n_sel=k, norm=norm))
    ids, w = nn_ref.moe_route(rounded(logits, dtype), k, norm)
    np.testing.assert_array_equal(get(device, st).astype(np.int64), ids)
    np.testing.assert_allclose(get(device, wt), w, rtol=1e-5, atol=1e-6)


def _close(got, want, dtype):
    """Within 1e-4 (f32) / 1e-2 (f16) of the largest value, as tests/test_kernels_matmul.py measures."""
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < (1e-4 if dtype == "f32" else 1e-2), f"error {err:.3g}"


def _stacked(device, qtype, E, N, K, rng, per_buffer=0):
    """E experts of (N, K) in `qtype` stacked on the GPU (`per_buffer` experts in each buffer: a stack
    larger than one binding) and their values (E, N, K)."""
    if qtype in ("f32", "f16"):             # bf16 (HF checkpoints): random_weight's bits, decoded below
        w = (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype({"f32": np.float32, "f16": np.float16}[qtype])
        raw = w.tobytes()
        vals = w.astype(np.float64)
    else:
        raw = qr.random_weight(qtype, E * N, K, rng)
        vals = qr.dequantize(raw, qtype, E * N, K).reshape(E, N, K).astype(np.float64)
    size = len(raw) // E
    limit = per_buffer * gpu_row_bytes(qtype, K) * N if per_buffer else None
    return moe.upload_experts(device, [[raw[e * size:(e + 1) * size]] for e in range(E)], qtype, N, K, owner=OWNER,
                              label="experts", max_binding=limit), vals


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4"])
@pytest.mark.parametrize("T,per_buffer", [(1, 0), (6, 0), (6, 4)])
def test_moe_matmul_and_down(device, dtype, qtype, T, per_buffer):
    """gate|up of each token's experts from the shared row, then the weighted sum of the experts'
    down products into the residual (accumulate); only the selected experts' rows count; a stack in
    buffers of 4 experts (a dispatch each) gives the same values."""
    rng = np.random.default_rng(T + len(qtype))
    E, k, C, F = 6, 2, 256, 256 if qtype in ("q4_k", "q6_k") else 96
    wgu, gu_vals = _stacked(device, qtype, E, 2 * F, C, rng, per_buffer)
    wd, d_vals = _stacked(device, qtype, E, C, F, rng, per_buffer)
    assert len(wgu.parts) == (2 if per_buffer else 1)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    wts = rng.random((T, k))
    x = rng.standard_normal((T, C))
    res = rng.standard_normal((T, C))
    st, wt = _ids(device, ids), put(device, wts)
    xt, gut = put(device, x, dtype, lead=4), empty(device, (T * k, 2 * F), dtype)
    run(device, moe.moe_matmul(device, xt, wgu, st, gut, n_sel=k))
    want = nn_ref.moe_matmul(rounded(x, dtype), gu_vals, ids)
    _close(get(device, gut), want, dtype)
    h = rng.standard_normal((T * k, F))
    ht, yt = put(device, h, dtype), put(device, res, dtype, lead=8)
    run(device, moe.moe_down(device, ht, wd, st, wt, yt, n_sel=k))
    want = rounded(res, dtype) + nn_ref.moe_down(rounded(h, dtype), d_vals, ids, wts)
    _close(get(device, yt), want, dtype)


def test_moe_rows_do_not_depend_on_the_batch(device):
    """Row t's expert outputs are the same bits alone and among other rows."""
    rng = np.random.default_rng(5)
    E, k, C, F, T = 4, 2, 64, 32, 5
    w, _ = _stacked(device, "f32", E, F, C, rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    x = rng.standard_normal((T, C))
    outs = []
    for rows in (slice(0, T), slice(2, 3)):
        n = len(range(T)[rows])
        yt = empty(device, (n * k, F))
        run(device, moe.moe_matmul(device, put(device, x[rows]), w, _ids(device, ids[rows]), yt, n_sel=k))
        outs.append(get(device, yt))
    np.testing.assert_array_equal(outs[0][2 * k:3 * k], outs[1])


@pytest.mark.parametrize("qtype,per_buffer", [("f32", 0), ("q8_0", 3)])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_moe_matmul_grouped_by_expert(device, qtype, per_buffer, T):
    """The prefill form: moe_group sorts the slots by expert (start, order as numpy's stable sort gives
    them) and moe_matmul_grouped reads each weight chunk once per 4 slots of its expert: the same
    values, bit for bit, as a slot's own product (f16 activations, a stack in one or several buffers)."""
    rng = np.random.default_rng(T)
    E, k, C, F = 6, 2, 64, 48
    w, _ = _stacked(device, qtype, E, 2 * F, C, rng, per_buffer)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    ids[: T // 2, 0] = 4                                    # one expert with many slots
    ids[: T // 2, 1] = np.where(ids[: T // 2, 1] == 4, 5, ids[: T // 2, 1])
    st = _ids(device, ids)
    order, start = empty(device, (T * k,), "u32", fill=0), empty(device, (E + 1,), "u32", fill=0)
    run(device, moe.moe_group(device, st, order, start, n_experts=E, n_sel=k))
    flat = ids.reshape(-1)
    np.testing.assert_array_equal(get(device, order).astype(np.int64), np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(get(device, start).astype(np.int64), np.searchsorted(np.sort(flat), np.arange(E + 1)))
    xt = put(device, rng.standard_normal((T, C)), "f16")
    outs = []
    for groups in (None, (order, start)):
        yt = empty(device, (T * k, 2 * F), "f16")
        run(device, moe.moe_matmul(device, xt, w, st, yt, n_sel=k, groups=groups))
        outs.append(get(device, yt))
    np.testing.assert_array_equal(outs[0], outs[1])
    # down: the grouped products (f32) weighted and summed per token by moe_combine, as moe_down sums
    wd, d_vals = _stacked(device, qtype, E, C, 2 * F, rng)
    h, wts, res = rng.standard_normal((T * k, 2 * F)), rng.random((T, k)), rng.standard_normal((T, C))
    ht, wt = put(device, h, "f16"), put(device, wts)
    downs = []
    for groups in (None, (order, start)):
        yt = put(device, res, "f16")
        prods = empty(device, (T * k, C)) if groups else None
        run(device, moe.moe_down(device, ht, wd, st, wt, yt, n_sel=k, groups=groups, prods=prods))
        downs.append(get(device, yt))
    _close(downs[1], rounded(res, "f16") + nn_ref.moe_down(rounded(h, "f16"), d_vals, ids, wts), "f16")
    np.testing.assert_array_equal(downs[0], downs[1])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("T,per_buffer", [(1, 0), (7, 4)])
def test_expert_biases_and_clamped_swiglu(device, dtype, T, per_buffer):
    """gpt-oss's experts: a bias per expert row in the gate|up and down products (per slot, grouped by
    expert, and weighted in the down sums), and the clamped SwiGLU between them (silu_mul's
    swiglu_oai: gates clamped above, ups both sides, at the limit)."""
    from webgpu_engine.kernels import nn
    rng = np.random.default_rng(40 + T)
    E, k, C, F = 6, 2, 64, 48
    wgu, gu_vals = _stacked(device, "f32", E, 2 * F, C, rng, per_buffer)
    wd, d_vals = _stacked(device, "f32", E, C, F, rng, per_buffer)
    b_gu, b_d = rng.standard_normal((E, 2 * F)), rng.standard_normal((E, C))
    bgt, bdt = put(device, b_gu.reshape(-1)), put(device, b_d.reshape(-1))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    wts, x, res = rng.random((T, k)), rng.standard_normal((T, C)) * 4, rng.standard_normal((T, C))
    st, wt, xt = _ids(device, ids), put(device, wts), put(device, x, dtype)
    order, start = empty(device, (T * k,), "u32", fill=0), empty(device, (E + 1,), "u32", fill=0)
    run(device, moe.moe_group(device, st, order, start, n_experts=E, n_sel=k))
    want = nn_ref.moe_matmul(rounded(x, dtype), gu_vals, ids, b_gu)
    assert np.abs(want).max() > 7.0                     # the clamps matter
    gus = []
    for groups in (None, (order, start)):
        gut = empty(device, (T * k, 2 * F), dtype)
        run(device, moe.moe_matmul(device, xt, wgu, st, gut, n_sel=k, groups=groups, bias=bgt))
        _close(get(device, gut), want, dtype)
        gus.append(get(device, gut))
    np.testing.assert_array_equal(gus[0], gus[1])
    ht = empty(device, (T * k, F), dtype)
    run(device, nn.silu_mul(device, gut, ht, act="swiglu_oai", alpha=1.702, limit=7.0))
    h = nn_ref.swiglu_oai(gus[1], 1.702, 7.0)
    _close(get(device, ht), h, dtype)
    for groups in (None, (order, start)):
        yt = put(device, res, dtype)
        prods = empty(device, (T * k, C)) if groups else None
        run(device, moe.moe_down(device, ht, wd, st, wt, yt, n_sel=k, groups=groups, prods=prods, bias=bdt))
        _close(get(device, yt), rounded(res, dtype) + nn_ref.moe_down(rounded(get(device, ht), dtype), d_vals, ids,
                                                                      wts, b_d), dtype)
