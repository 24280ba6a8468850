"""fused_rows in the CPU family: the fused one-row decode kernels over T activation rows (continuous
batching with up to 4 sequences). Each row of a T-row matmul must come out bit for bit as the
one-row (T = 1) decode kernel makes it from that row alone — with the same fused input (RMSNorm,
act(gate)·up, the norm's partial sums) and epilogue (act(gate)·up of paired rows, the residual's
norm, the RoPE + KV write of a qkv projection at each row's position, into one sequence's cache or
a paged pool) — for every T (1..4 in one kernel of 1, 2 or 4 rows, 5..16 in one wide kernel of 8
or 16 rows: matmul/wide.py, more in groups), and match
float64 numpy.
"""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import nn, nn_ref
from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.common import Tensor, new_tensor, run_ops
from webgpu_engine.kernels.matmul import NormOut, RopeKV, default_config, interleave_pairs, matmul, upload_weight

from _matmul_util import NP, TOL, read_tensor, rel_err, rows_equal_one_row, upload_tensor

OWNER = "test:matmul_rows"
ROWS = (2, 3, 5)      # the 2- and 4-row kernels (row 4 unused at T = 3), a group of 4 + 1


@pytest.fixture(autouse=True)
def _free(device):
    if not default_config(device).unroll:
        pytest.fail("these tests need the CPU family's unrolled decode kernels (a lavapipe adapter)")
    yield
    device.release_owner(OWNER)


def _t(dev, a, dtype, pad=0):
    return upload_tensor(dev, np.asarray(a), dtype, pad, owner=OWNER)


@pytest.mark.parametrize("qtype,n,k,act", [("q4_1", 36, 256, "f16"),    # v4 kernel (vec4 weight spans)
                                           ("q6_k", 12, 256, "f32"),    # unrolled matmul_decode
                                           ("f16", 8, 64, "f16"),
                                           ("q4_1", 12, 1536, "f16")])  # K past the unroll limit: the loop
def test_plain_and_fused_inputs(device, qtype, n, k, act):
    """Plain (bias + accumulate), RMSNorm in, act(gate)·up in: every row as the one-row kernel."""
    rng = np.random.default_rng(n + k)
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    w = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="w")
    T = max(ROWS)
    x = rng.standard_normal((T, k)).astype(NP[act])
    gu = (rng.standard_normal((T, 2 * k)) * 3).astype(NP[act])
    y0 = rng.standard_normal((T, n)).astype(NP[act])
    g = rng.standard_normal(k).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    gt, bt = _t(device, g, "f32", 4), _t(device, b, "f32", 1)
    xd, gud = x.astype(np.float64), gu.astype(np.float64)
    cases = {"plain": (dict(bias=bt, accumulate=True), x, xd @ W.T + b + y0)}
    if k <= 1024:       # fused inputs unroll (the loop kernel takes none)
        cases["norm"] = (dict(norm=(gt, 1e-5)), x, (xd / np.sqrt((xd ** 2).mean(1, keepdims=True) + 1e-5) * g) @ W.T)
        cases["silu"] = (dict(silu=True), gu, nn_ref.silu_mul(gud) @ W.T)
    for name, (kw, xin, ref) in cases.items():
        for T in ROWS:
            def run(rows, fused_rows, kw=kw, xin=xin):
                y = _t(device, y0[rows], act, 3)
                op = matmul(device, _t(device, xin[rows], act, 8), w, y, fused_rows=fused_rows, **kw)
                run_ops(device, op)
                return [read_tensor(device, y)]
            (y,) = rows_equal_one_row(run, T)
            assert rel_err(y, ref[:T]) < TOL[act], (name, T)


@pytest.mark.parametrize("qtype,k,act", [("q4_1", 256, "f16"), ("q6_k", 256, "f32"), ("q4_1", 1536, "f32")])
def test_res_norm_then_rms_from(device, qtype, k, act):
    """x += a·Wᵀ + b with norm_out (x, x * g and per-row partial sums stored by the epilogue), then
    rms_from on x * g into a gate/up weight in pairs with silu_out: every row of every output as the
    one-row kernels make it, and RMSNorm(x)·W2 through act(gate)·up against numpy."""
    n, f, eps = 64, 20, 1e-5
    rng = np.random.default_rng(k)
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    w = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="o")
    rg, ru = qr.random_weight("q4_1", f, n, rng), qr.random_weight("q4_1", f, n, rng)
    G, U = qr.dequantize(rg, "q4_1", f, n), qr.dequantize(ru, "q4_1", f, n)
    w2 = upload_weight(device, interleave_pairs(rg, ru, "q4_1", n), "q4_1", 2 * f, n, owner=OWNER, label="gu")
    T = max(ROWS)
    a = rng.standard_normal((T, k)).astype(NP[act])
    x0 = rng.standard_normal((T, n)).astype(NP[act])
    b = rng.standard_normal(n).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    gt, bt = _t(device, g, "f32", 8), _t(device, b, "f32", 4)
    for T in ROWS:
        def run(rows, fused_rows):
            m = rows.stop - rows.start
            xt = _t(device, x0[rows], act, 12)
            hv, pv = new_tensor(device, (m, n), act, owner=OWNER), new_tensor(device, (m * n // 4,), "f32", owner=OWNER)
            fv = new_tensor(device, (m, f), act, owner=OWNER)
            op = matmul(device, _t(device, a[rows], act, 4), w, xt, bias=bt, accumulate=True,
                        norm_out=NormOut(gt, hv, pv), fused_rows=fused_rows)
            op2 = matmul(device, hv, w2, fv, rms_from=(pv, eps), silu_out=True, fused_rows=fused_rows)
            # a dispatch per 4 rows; K past the unroll limit: the loop kernel, 4 rows a tile; past
            # 4 rows one wide kernel (matmul/wide.py)
            entries = [p.key.entry for p, *_ in op.dispatches]
            assert len(entries) == (1 if m > 4 else -(-m // 4))
            assert entries[0] == ("matmul_decode" if k <= 1024 or m > 4 else "matmul_res_norm" if m == 1
                                  else "matmul_tile_res_norm"), entries
            run_ops(device, op, op2)
            return [read_tensor(device, t) for t in (xt, hv, fv)] + [read_tensor(device, pv).reshape(m, n // 4)]
        xs, hs, fs, ps = rows_equal_one_row(run, T)
        xr = x0[:T].astype(np.float64) + a[:T].astype(np.float64) @ W.T + b
        xq = xr.astype(NP[act]).astype(np.float64)                                   # as stored
        normed = xq / np.sqrt((xq ** 2).mean(1, keepdims=True) + eps) * g
        assert rel_err(xs, xr) < TOL[act] and rel_err(hs, xq * g) < TOL[act]
        assert rel_err(ps, (xq ** 2).reshape(T, -1, 4).sum(2)) < TOL[act]
        assert rel_err(fs, nn_ref.silu_mul(np.concatenate([normed @ G.T, normed @ U.T], 1))) < TOL[act], T


def test_kernels_and_errors(device):
    """T rows take the unrolled kernel of the row bucket (1, 2, 4: rows past T not stored), in one
    dispatch; more than 4 rows go in groups; the fused paths refuse T > 1 without fused_rows, and
    fused_rows refuses the other row modes."""
    k, n = 64, 16
    w = upload_weight(device, qr.random_weight("q8_0", n, k, np.random.default_rng(1)), "q8_0", n, k,
                      owner=OWNER, label="w")
    g = _t(device, np.ones(k, np.float32), "f32")

    def mm(T, **kw):
        return matmul(device, new_tensor(device, (T, k), "f32", owner=OWNER), w,
                      new_tensor(device, (T, n), "f32", owner=OWNER), **kw)
    for T, want in ((1, 1), (2, 2), (3, 4), (4, 4)):
        (pipe, *_), = mm(T, norm=(g, 1e-5), fused_rows=True).dispatches
        assert f"acc{want - 1} " in pipe.key.header and f"acc{want} " not in pipe.key.header, T
    assert len(mm(6, norm=(g, 1e-5), fused_rows=True).dispatches) == 2   # Q8_0 (not wide.EXACT): groups of 4
    w = upload_weight(device, qr.random_weight("q4_1", n, k, np.random.default_rng(1)), "q4_1", n, k,
                      owner=OWNER, label="w4")
    (pipe, *_), = mm(6, norm=(g, 1e-5), fused_rows=True).dispatches     # 5..16 rows: one wide kernel
    assert "subgroupBroadcast" in pipe.key.header and "acc7 " in pipe.key.header and "acc8 " not in pipe.key.header
    assert len(mm(17, norm=(g, 1e-5), fused_rows=True).dispatches) == 5   # more: groups of 4
    with pytest.raises(ValueError, match="T = 1"):
        mm(2, norm=(g, 1e-5))
    with pytest.raises(ValueError, match="fused_rows takes no"):
        mm(2, fused_rows=True, row_invariant=True)
    with pytest.raises(ValueError, match="fused_rows takes no"):
        mm(2, fused_rows=True, decode_rows=True)


@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("paged", [False, True])
def test_rope_kv_rows(device, paged, act):
    """The qkv projection with rope_kv over T rows: row t rotated at its own position (one
    sequence's pos0 + t, or a paged row's positions[t]) and its k, v written to its cache row (pos0
    + t, or pool row slots[t]; 0xffffffff: none), bit for bit as the one-row kernel writes each row
    alone (rows in order, on the same caches), and as numpy rotates and places them."""
    Hq, Hkv, D, K, rot, pos0, ctx, bs = 4, 2, 32, 128, 16, 6, 16, 4
    n = (Hq + 2 * Hkv) * D
    rng = np.random.default_rng(7 + paged)
    raw = qr.random_weight("q4_1", n, K, rng)
    W = qr.dequantize(raw, "q4_1", n, K)
    w = upload_weight(device, raw, "q4_1", n, K, owner=OWNER, label="qkv")
    b = rng.standard_normal(n).astype(np.float32)
    bt = _t(device, b, "f32", 2)
    freq = nn.rope_frequencies(device, rot, 10000.0, owner=OWNER)
    T = max(ROWS)
    x = rng.standard_normal((T, K)).astype(NP[act])
    positions = np.array([9, 0, 13, 3, 7], np.uint32) if paged else pos0 + np.arange(T, dtype=np.uint32)
    slots = np.array([6, 1, 0xffffffff, 13, 2], np.uint32)
    shape = (4, bs, Hkv, D) if paged else (Hkv, ctx, D)        # a pool of 4 blocks, or ctx rows
    c0 = rng.standard_normal(shape).astype(NP[act])

    def u32(a, pad):                   # at an offset that is not binding-aligned, as model code's views
        return Tensor(device.upload(np.concatenate([np.zeros(pad, np.uint32), a]), owner=OWNER), a.shape, "u32",
                      4 * pad)

    def rope_for(rows, kc, vc):
        if paged:
            return RopeKV(None, freq, kc, vc, Hq, Hkv, D, rot, 0, positions=u32(positions[rows], 3),
                          slots=u32(slots[rows], 5))
        step = device.upload(np.array([positions[rows][0], 1, 0, 0], np.uint32), owner=OWNER)
        return RopeKV(step, freq, kc, vc, Hq, Hkv, D, rot, ctx)

    for m in ROWS:
        kc, vc = _t(device, c0, act, 8), _t(device, c0, act, 0)
        y = new_tensor(device, (m, n), act, owner=OWNER)
        run_ops(device, matmul(device, _t(device, x[:m], act, 4), w, y, bias=bt, rope_kv=rope_for(slice(0, m), kc, vc),
                               fused_rows=True))
        rows = [read_tensor(device, t) for t in (y, kc, vc)]
        ka, va = _t(device, c0, act, 8), _t(device, c0, act, 0)           # each row alone, in order
        for t in range(m):
            ya = new_tensor(device, (1, n), act, owner=OWNER)
            run_ops(device, matmul(device, _t(device, x[t:t + 1], act, 4), w, ya, bias=bt,
                                   rope_kv=rope_for(slice(t, t + 1), ka, va)))
            np.testing.assert_array_equal(rows[0][t:t + 1], read_tensor(device, ya), err_msg=f"row {t} of {m}")
        np.testing.assert_array_equal(rows[1], read_tensor(device, ka))
        np.testing.assert_array_equal(rows[2], read_tensor(device, va))
        # numpy: projection + bias, q and k heads rotated at each row's position, cache rows placed
        heads = (x[:m].astype(np.float64) @ W.T + b).reshape(m, Hq + 2 * Hkv, D)
        rotd = nn_ref.rope(heads, positions[:m], n_heads=Hq + Hkv, rot_dim=rot, base=10000.0, neox=False)
        ref = np.concatenate([rotd[:, :Hq + Hkv], heads[:, Hq + Hkv:]], 1)
        assert rel_err(rows[0], ref.reshape(m, n)) < TOL[act], m
        kref, vref = c0.astype(np.float64).copy(), c0.astype(np.float64).copy()
        for t in range(m):
            if paged and slots[t] == 0xffffffff:
                continue
            at = (slots[t] // bs, slots[t] % bs) if paged else (slice(None), positions[t])
            kref[at], vref[at] = ref[t, Hq:Hq + Hkv], ref[t, Hq + Hkv:]
        assert np.abs(rows[1] - kref).max() < TOL[act] * np.abs(kref).max(), m
        assert np.abs(rows[2] - vref).max() < TOL[act] * np.abs(vref).max(), m
