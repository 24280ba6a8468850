"""The batched decode matmul (kernels/matmul/batch.py) on the real adapter against float64 numpy,
and batch invariance: a row computed inside a batch against the same row computed alone.

Error measure as in test_kernels_matmul.py: max |y - ref| / max |ref|; f32 1e-4, f16 1e-2.
"""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import matmul as mm
from webgpu_engine.kernels.matmul import batch as mb
from webgpu_engine.kernels.common import new_tensor, run_ops
from webgpu_engine.kernels.matmul import QTYPES, gpu_row_bytes, matmul

from _matmul_util import TOL, matmul_case, read_tensor, rel_err, upload_tensor

OWNER = "test:matmul_batch"
ROWS = mb.BatchVariant("rows", rr=4, wg=32)


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner(OWNER)


def _check(dev, qtype, n, k, T, act, variant=None, **kw):
    rng = np.random.default_rng(n + k + T)
    w, xt, yt, bt, ref = matmul_case(dev, qtype, n, k, T, act, rng, owner=OWNER, **kw)
    accumulate = kw.get("accumulate", False)
    if variant is None:       # as the engine selects it
        op = matmul(dev, xt, w, yt, bias=bt, accumulate=accumulate)
    else:
        op = mb.matmul(dev, xt, w, yt, bias=bt, accumulate=accumulate, variant=variant)
    run_ops(dev, op)
    e = rel_err(read_tensor(dev, yt), ref)
    assert e < TOL[act], f"{qtype} {act} T={T} ({n}x{k}) {variant}: error {e:.3g}"
    return op


# --------------------------------------------------------------------------- against numpy
@pytest.mark.parametrize("qtype", QTYPES)
def test_every_type(device, qtype):
    """The "rows" kernel with each type's decode: N = 100 (partial workgroups and row groups), T = 3."""
    _check(device, qtype, 100, 256, 3, "f16" if qtype in ("q4_0", "q6_k", "bf16") else "f32", ROWS)


@pytest.mark.parametrize("qtype,act", [("q4_1", "f32"), ("q4_k", "f16"), ("bf16", "f32")])
def test_selected(device, qtype, act):
    """As matmul selects it (the device's default variant), T = 3 (a padded tile) and T = 16."""
    for T in (3, 16):
        op = _check(device, qtype, 100, 256, T, act)
        assert op.name.startswith(("matmul_tiled", "matmul_batch")), op.name


@pytest.mark.parametrize("variant", [mb.TILED, ROWS])
def test_options(device, variant):
    """bias, accumulate into y, tensors at unaligned offsets, a weight split over buffers, float
    weights whose K is not a multiple of 32."""
    _check(device, "q4_1", 70, 256, 5, "f32", variant, bias=True, accumulate=True, pad=12)
    op = _check(device, "q8_0", 150, 256, 7, "f16", variant, parts=2,
                max_binding=37 * gpu_row_bytes("q8_0", 256))
    assert len(op.dispatches) == 5          # one per weight buffer
    _check(device, "f16", 34, 100, 6, "f32", variant, bias=True)


def test_selection_and_errors(device, monkeypatch):
    """2 ≤ T ≤ batch_max_t goes through matmul_batch; batch_max_t = 0 restores the old kernels;
    matmul_batch refuses T outside 1..16 and bad variants with a clear error."""
    rng = np.random.default_rng(2)
    w, xt, yt, _, _ = matmul_case(device, "q4_0", 64, 256, 17, "f32", rng, owner=OWNER)
    with pytest.raises(ValueError, match="1..16 rows"):
        mb.matmul(device, xt, w, yt)
    x4, y4 = xt.view((4, 256)), yt.view((4, 64))
    with pytest.raises(ValueError, match="variant"):
        mb.matmul(device, x4, w, y4, variant=mb.BatchVariant("rows", rr=3))
    on = {d[0].key for d in matmul(device, x4, w, y4).dispatches}
    assert on == {d[0].key for d in mb.matmul(device, x4, w, y4).dispatches}
    monkeypatch.setitem(mm.CONFIG_OVERRIDES, "batch_max_t", 0)
    off = {d[0].key for d in matmul(device, x4, w, y4).dispatches}
    assert off and not off & on


def test_tiles(device):
    """Tiles of 2, 4 and 8 rows for T ≤ 8; from 9 rows the default tile (so a 16-row embedder
    bucket shares its pipelines with larger batches)."""
    from webgpu_engine.kernels.matmul import tiled as mt
    assert [mb.tiled_config(device, "q4_1", T).tm for T in (1, 2, 3, 5, 8)] == [2, 2, 4, 8, 8]
    for qtype in ("q4_1", "f32"):
        assert mb.tiled_config(device, qtype, 9) == mb.tiled_config(device, qtype, 16) == \
            mt.default_config(device, qtype)


def test_tiled_falls_back(device):
    """A weight the tiled kernel cannot read (a buffer that is not whole 16-byte words): the
    "tiled" variant gives None and matmul falls back to the row kernels, with the right answer."""
    rng = np.random.default_rng(5)
    w, xt, yt, _, ref = matmul_case(device, "q4_1", 3, 288, 4, "f32", rng, owner=OWNER)
    assert w.bufs[0].size % 16
    assert mb.matmul(device, xt, w, yt, variant=mb.TILED) is None
    run_ops(device, matmul(device, xt, w, yt))
    assert rel_err(read_tensor(device, yt), ref) < TOL["f32"]


def test_profile_overrides_default(device, monkeypatch):
    """A measured winner stored for this adapter and shape is what `choose` returns."""
    rng = np.random.default_rng(3)
    w, *_ = matmul_case(device, "q4_1", 64, 256, 1, "f32", rng, owner=OWNER)
    v = mb.BatchVariant("rows", rr=1, wg=16)
    monkeypatch.setitem(mb.PROFILES, mb.adapter_key(device), {("q4_1", 64, 256, 8): v})
    assert mb.choose(device, w, 5) == v and mb.choose(device, w, 9) != v


# --------------------------------------------------------------------------- batch invariance
def _rows_alone(dev, w, xs, act, **kw):
    out = []
    for t in range(xs.shape[0]):
        x1 = upload_tensor(dev, xs[t:t + 1], act, owner=OWNER)
        y1 = new_tensor(dev, (1, w.n), act, owner=OWNER)
        run_ops(dev, matmul(dev, x1, w, y1, **kw))
        out.append(read_tensor(dev, y1)[0])
    return np.array(out)


@pytest.mark.parametrize("qtype,k", [("q4_1", 288), ("q4_k", 256), ("f16", 100)])
def test_batch_invariance(device, qtype, k):
    """"rows": each row of a batch of 8 is bit for bit the T = 1 decode kernel's result for it alone
    (Q4_1 K = 288, rows of 45 words: the vec4 decode kernel; Q4_K: the unrolled one; f16 K = 100:
    the loop kernel).
    "tiled": each row is the same bits in batches of 2 and 8 and in the row-invariant T = 1 kernel
    (prefill), and within 2e-6 (relative) of the T = 1 decode kernel's."""
    n = 64
    rng = np.random.default_rng(4)
    w, xt, _, _, ref = matmul_case(device, qtype, n, k, 8, "f32", rng, owner=OWNER)
    xs = read_tensor(device, xt).astype(np.float32)
    alone = _rows_alone(device, w, xs, "f32")
    alone_ri = _rows_alone(device, w, xs[:1], "f32", row_invariant=True)
    got = {}
    for v, T in ((ROWS, 8), (mb.TILED, 8), (mb.TILED, 2)):
        y = new_tensor(device, (T, n), "f32", owner=OWNER)
        run_ops(device, mb.matmul(device, xt.view((T, k)), w, y, variant=v))
        got[v.key, T] = read_tensor(device, y)
    np.testing.assert_array_equal(got[ROWS.key, 8], alone)
    tiled = got["tiled", 8]
    np.testing.assert_array_equal(got["tiled", 2], tiled[:2])
    np.testing.assert_array_equal(alone_ri, tiled[:1])
    assert np.abs(tiled - alone).max() / np.abs(ref).max() < 2e-6


# --------------------------------------------------------------------------- wide fused rows
@pytest.mark.parametrize("qtype,k,act,modes", [("q4_1", 256, "f32", ("plain", "norm", "silu")),  # vec4 spans
                                               ("q6_k", 256, "f16", ("plain",)),   # matmul_decode's sums
                                               ("q8_0", 288, "f32", ("plain",))])  # not EXACT: groups of 4
def test_wide_rows_equal_one_row(device, qtype, k, act, modes):
    """fused_rows past 4 rows on this adapter: one wide kernel (matmul/wide.py) of 16 rows for 11
    (rows past 11 not stored), each row bit for bit the fused one-row kernel's for it alone, plain
    (bias, accumulate), RMSNorm in and act(gate)·up in, and against float64 numpy (5 rows and the
    other fused inputs and epilogues: tests/test_kernels_matmul_rows.py); a type outside wide.EXACT
    (Q8_0, whose wide sums differed in the last bit) in groups of 4 rows, as before."""
    from webgpu_engine.kernels import nn_ref
    from webgpu_engine.kernels import quant_ref as qr
    from webgpu_engine.kernels.matmul import upload_weight, wide
    assert wide.ok(device) and wide.subgroup_floor(device) >= 8        # lavapipe: 256-bit lanes
    n, T, eps = 40, 11, 1e-5
    rng = np.random.default_rng(k)
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    w = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="w")
    np_act = np.float16 if act == "f16" else np.float32
    x = rng.standard_normal((T, k)).astype(np_act)
    gu = (rng.standard_normal((T, 2 * k)) * 3).astype(np_act)
    y0 = rng.standard_normal((T, n)).astype(np_act)
    g = rng.standard_normal(k).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    gt, bt = upload_tensor(device, g, "f32", 4, owner=OWNER), upload_tensor(device, b, "f32", 1, owner=OWNER)
    xd = x.astype(np.float64)
    cases = {"plain": (dict(bias=bt, accumulate=True), x, xd @ W.T + b + y0),
             "norm": (dict(norm=(gt, eps)), x, (xd / np.sqrt((xd ** 2).mean(1, keepdims=True) + eps) * g) @ W.T),
             "silu": (dict(silu=True), gu, nn_ref.silu_mul(gu.astype(np.float64)) @ W.T)}
    for name in modes:
        kw, xin, ref = cases[name]

        def run(rows, kw=kw, xin=xin):
            y = upload_tensor(device, y0[rows], act, 3, owner=OWNER)
            op = matmul(device, upload_tensor(device, xin[rows], act, 8, owner=OWNER), w, y,
                        fused_rows=rows.stop - rows.start > 1, **kw)
            run_ops(device, op)
            return op, read_tensor(device, y)
        op, ys = run(slice(0, T))
        heads = [d[0].key.header for d in op.dispatches]
        if qtype in wide.EXACT:
            assert len(heads) == 1 and "subgroupBroadcast" in heads[0] and "acc15 " in heads[0], name
        else:
            assert len(heads) == 3 and not any("subgroupBroadcast" in h for h in heads), name
        for t in (0, 4, 10):
            np.testing.assert_array_equal(ys[t:t + 1], run(slice(t, t + 1))[1], err_msg=f"{name}: row {t}")
        assert rel_err(ys, ref) < TOL[act], name
