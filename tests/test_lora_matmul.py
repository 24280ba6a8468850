"""LoRA deltas made inside the decode matmuls (kernels/lora.py Delta, shaders/lora_matmul.wgsl; issue
52), against float64 numpy: a residual matmul's (o, down: into x before the next norm's values) and a
gate/up matmul's in pairs (into the sums before act(gate) * up, x from the norm's partial sums), over
T rows of adapters in different slots and base rows. Each row comes out bit for bit as the one-row
kernel makes it alone (1..4 rows in one unrolled kernel, 5 in the wide one, K past the unroll limit
the loop kernels), and a base row as the matmul without the Delta makes it."""
from __future__ import annotations

import os

import numpy as np
import pytest

from webgpu_engine.kernels import lora as lk
from webgpu_engine.kernels import nn_ref
from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.common import new_tensor, run_ops
from webgpu_engine.kernels.matmul import NormOut, default_config, interleave_pairs, matmul, upload_weight

from _matmul_util import NP, TOL, read_tensor, rel_err, rows_equal_one_row, upload_tensor
from _nn_util import put, rounded

OWNER = "test:lora_matmul"
ROWS = (2, 3, 5)
IDX = np.array([1, lk.NONE, 0, 0, 1], np.uint32)      # row t's slot: two adapters and a base row
SLOTS = 2


@pytest.fixture(autouse=True)
def _free(device):
    if not default_config(device).unroll:
        pytest.fail("these tests need the CPU family's decode kernels (a lavapipe adapter)")
    yield
    device.release_owner(OWNER)


def _t(dev, a, dtype, pad=0):
    return upload_tensor(dev, np.asarray(a), dtype, pad, owner=OWNER)


def _pool(dev, rng, targets: int, R: int, k: int, n: int, wdtype: str, cols_full):
    """A (slots, J, k) and compact B (slots, n, R) in wdtype (numpy, as held), their tensors and the
    row pairs' first columns; B's full (slots, n, J) form for the reference."""
    J = targets * R
    a = rounded(rng.standard_normal((SLOTS, J, k)) / np.sqrt(k), wdtype)
    b = rounded(rng.standard_normal((SLOTS, n, R)) / np.sqrt(R), wdtype)
    full = np.zeros((SLOTS, n, J))
    for r in range(R):
        full[:, np.arange(n), cols_full + r] = b[:, :, r]
    tensors = (put(dev, a, wdtype, owner=OWNER), put(dev, b, wdtype, owner=OWNER),
               put(dev, cols_full[::2].astype(np.uint32), "u32", owner=OWNER))
    return a, full, tensors


def _delta_ref(x, a, full, idx):
    """Each row's B[s] · (A[s] · x[t]) in float64, zero for a base row."""
    return lk.expand_ref(lk.shrink_ref(x, a, idx), full, idx, np.zeros((len(idx), full.shape[1])))


def _rows_equal_alone(run, T: int, base_run) -> list:
    """The T-row outputs of run(rows, fused_rows), each row bit for bit as the one-row kernel makes it
    alone and a base row as base_run (the matmuls without the Delta) makes it."""
    outs = rows_equal_one_row(run, T)
    base = IDX[:T] == lk.NONE
    for a, p in zip(outs, base_run(slice(0, T))):
        np.testing.assert_array_equal(a[base], p[base], err_msg=f"the base row of {T}")
    return outs


@pytest.mark.parametrize("qtype,k,act,wdtype", [("q4_1", 256, "f16", "f16"),    # v4 decode kernel
                                                ("q6_k", 256, "f32", "f32"),    # unrolled matmul_decode
                                                ("q4_1", 1536, "f32", "bf16")])  # the loop kernels
def test_a_residual_matmul_adds_each_rows_delta_before_the_next_norm(device, qtype, k, act, wdtype):
    """x += a·Wᵀ + b, then each row's adapter's B · A · a (rounded into x as stored), then x * g and
    the partial sums of x^2 from that (norm_out) — o's and down's form."""
    n, R, eps = 64, 8, 1e-5
    rng = np.random.default_rng(k + len(wdtype))
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    w = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="o")
    T = max(ROWS)
    inp = rng.standard_normal((T, k)).astype(NP[act])
    x0 = rng.standard_normal((T, n)).astype(NP[act])
    b = rng.standard_normal(n).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    gt, bt = _t(device, g, "f32", 8), _t(device, b, "f32", 4)
    a, full, (at, btn, ct) = _pool(device, rng, 1, R, k, n, wdtype, np.zeros(n, np.int64))
    idx_t = put(device, IDX, "u32", owner=OWNER)

    def run(rows, fused_rows, lora=True):
        m = rows.stop - rows.start
        xt = _t(device, x0[rows], act, 12)
        hv, pv = new_tensor(device, (m, n), act, owner=OWNER), new_tensor(device, (m * n // 4,), "f32", owner=OWNER)
        d = lk.Delta(at, btn, ct, idx_t.view((m,), rows.start), SLOTS, n, k, res=True) if lora else None
        op = matmul(device, _t(device, inp[rows], act, 4), w, xt, bias=bt, accumulate=True,
                    norm_out=NormOut(gt, hv, pv), fused_rows=fused_rows, add=d)
        if lora:
            assert op.name == "matmul[o]+lora"
            threads = int(os.environ.get("LP_NUM_THREADS") or os.cpu_count())
            assert all(gx <= max(threads, -(-n // (4 * default_config(device).wg))) for _, _, gx, *_ in op.dispatches)
        run_ops(device, op)
        return [read_tensor(device, t) for t in (xt, hv)] + [read_tensor(device, pv).reshape(m, n // 4)]
    for T in ROWS:
        xs, hs, ps = _rows_equal_alone(run, T, lambda rows: run(rows, True, lora=False))
        xq = (x0[:T].astype(np.float64) + inp[:T].astype(np.float64) @ W.T + b).astype(NP[act]).astype(np.float64)
        want = xq + _delta_ref(inp[:T], a, full, IDX[:T])
        assert rel_err(xs, want) < TOL[act], T
        assert np.abs(xs - want)[IDX[:T] != lk.NONE].max() > 0 or act == "f32"      # (f16: rounded as stored)
        np.testing.assert_array_equal(hs, (xs * g).astype(NP[act]).astype(np.float64))
        np.testing.assert_allclose(ps, (xs ** 2).reshape(T, -1, 4).sum(2), rtol=1e-5)


@pytest.mark.parametrize("act,wdtype", [("f32", "f32"), ("f16", "f16"), ("f32", "bf16")])
def test_a_gate_up_matmul_adds_each_rows_deltas_before_the_activation(device, act, wdtype):
    """RMSNorm(x) · [Wgate | Wup]ᵀ from the last residual matmul's x * g and partial sums (rms_from),
    plus each row's gate and up deltas of the normed x (two targets: rows 4q, 4q + 1 gate's, 4q + 2,
    4q + 3 up's in the interleaved weight), then act(gate) * up (silu_out)."""
    n, f, R, eps = 64, 20, 8, 1e-5
    rng = np.random.default_rng(5 + len(wdtype) + len(act))
    rg, ru = qr.random_weight("q4_1", f, n, rng), qr.random_weight("q4_1", f, n, rng)
    G, U = qr.dequantize(rg, "q4_1", f, n), qr.dequantize(ru, "q4_1", f, n)
    w2 = upload_weight(device, interleave_pairs(rg, ru, "q4_1", n), "q4_1", 2 * f, n, owner=OWNER, label="gu")
    T = max(ROWS)
    x = rng.standard_normal((T, n)).astype(NP[act])
    g = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    xg = (x.astype(np.float32) * g).astype(NP[act])                      # x * g as ep_res_norm stores it
    part = (x.astype(np.float32) ** 2).reshape(T, n // 4, 4).sum(2).astype(np.float32)
    # the interleaved weight's row i: gate row 2(i // 4) + i % 4 where i % 4 < 2, else up's
    cols = np.where(np.arange(2 * f) % 4 < 2, 0, R)
    a, full, (at, btn, ct) = _pool(device, rng, 2, R, n, 2 * f, wdtype, cols)
    idx_t = put(device, IDX, "u32", owner=OWNER)

    def run(rows, fused_rows, lora=True):
        m = rows.stop - rows.start
        d = lk.Delta(at, btn, ct, idx_t.view((m,), rows.start), SLOTS, 2 * f, n) if lora else None
        fv = new_tensor(device, (m, f), act, owner=OWNER)
        op = matmul(device, _t(device, xg[rows], act, 8), w2, fv, rms_from=(_t(device, part[rows], "f32", 4), eps),
                    silu_out=True, fused_rows=fused_rows, add=d)
        run_ops(device, op)
        return [read_tensor(device, fv)]
    for T in ROWS:
        (fs,) = _rows_equal_alone(run, T, lambda rows: run(rows, True, lora=False))
        xd = x[:T].astype(np.float64)
        normed = xg[:T].astype(np.float64) / np.sqrt((xd ** 2).mean(1, keepdims=True) + eps)
        d = _delta_ref(normed, a, full, IDX[:T])                           # (T, 2f) in the interleaved order
        i = np.arange(2 * f)
        row = 2 * (i // 4) + i % 4 % 2                                     # gate / up row of interleaved row i
        dg, du = np.zeros((T, f)), np.zeros((T, f))
        dg[:, row[i % 4 < 2]] = d[:, i % 4 < 2]
        du[:, row[i % 4 >= 2]] = d[:, i % 4 >= 2]
        want = nn_ref.silu_mul(np.concatenate([normed @ G.T + dg, normed @ U.T + du], 1))
        assert rel_err(fs, want) < TOL[act], T
        base = nn_ref.silu_mul(np.concatenate([normed @ G.T, normed @ U.T], 1))
        assert rel_err(fs[IDX[:T] != lk.NONE], base[IDX[:T] != lk.NONE]) > 10 * TOL[act]   # the deltas show


def test_a_delta_is_refused_where_the_matmul_cannot_make_it(device):
    """A Delta needs the decode kernels' epilogue: with a fused norm of x, or a residual Delta without
    norm_out, the matmul refuses it, naming why."""
    n, k, R = 16, 64, 8
    w = upload_weight(device, qr.random_weight("q4_1", n, k, np.random.default_rng(1)), "q4_1", n, k,
                      owner=OWNER, label="w")
    rng = np.random.default_rng(2)
    _, _, (at, btn, ct) = _pool(device, rng, 1, R, k, n, "f32", np.zeros(n, np.int64))
    idx_t = put(device, IDX[:1], "u32", owner=OWNER)
    x, y = new_tensor(device, (1, k), "f32", owner=OWNER), new_tensor(device, (1, n), "f32", owner=OWNER)
    g = put(device, np.ones(k, np.float32), owner=OWNER)
    h, p = new_tensor(device, (1, n), "f32", owner=OWNER), new_tensor(device, (n // 4,), "f32", owner=OWNER)
    res = lk.Delta(at, btn, ct, idx_t, SLOTS, n, k, res=True)
    with pytest.raises(ValueError, match="Delta"):
        matmul(device, x, w, y, accumulate=True, norm=(g, 1e-5), norm_out=NormOut(put(device, np.ones(n, np.float32),
                                                                                       owner=OWNER), h, p), add=res)
    with pytest.raises(ValueError, match="add needs"):
        matmul(device, x, w, y, add=res)
