"""Norm, elementwise, RoPE, KV-write and pooling kernels on the real adapter against nn_ref (numpy)."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import nn, nn_ref

from _nn_util import TOL, empty, get, put, rounded, run, set_step, step_buf

DTYPES = ["f32", "f16"]


def _width(op) -> int:
    return 4 if "const W: u32 = 4u" in op.dispatches[0][0].key.header else 1


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


# ----------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 576), (130, 37)])
def test_rms_norm(device, dtype, rows, cols):
    rng = np.random.default_rng(rows * cols)
    x = rng.standard_normal((rows, cols)) * 3 + 0.5
    w = rng.standard_normal(cols)
    xt, wt, yt = put(device, x, dtype, lead=4), put(device, w), empty(device, (rows, cols), dtype, lead=8)
    op = nn.rms_norm(device, xt, wt, yt, eps=1e-5)
    assert _width(op) == (4 if cols % 4 == 0 else 1)
    run(device, op)
    np.testing.assert_allclose(get(device, yt), nn_ref.rms_norm(rounded(x, dtype), w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hq,hkv,d", [(1, 4, 2, 64), (5, 6, 2, 32), (3, 2, 1, 6)])
def test_head_rms_norm(device, dtype, rows, hq, hkv, d):
    """Qwen3's q/k norms in place on a fused qkv row: q heads with w[:D], k heads with w[D:], v kept."""
    rng = np.random.default_rng(rows * hq * d)
    qkv = rng.standard_normal((rows, hq + 2 * hkv, d)) * 2 + 0.3
    w = rng.standard_normal(2 * d)
    xt = put(device, qkv, dtype, lead=4)
    op = nn.head_rms_norm(device, xt, put(device, w, lead=4), n_q_heads=hq, n_k_heads=hkv, head_dim=d, eps=1e-6)
    assert _width(op) == (4 if d % 4 == 0 else 1)
    run(device, op)
    want = nn_ref.head_rms_norm(rounded(qkv, dtype), w, hq, hkv, 1e-6)
    assert np.abs(want[:, :hq] - rounded(qkv, dtype)[:, :hq]).max() > 0.1
    np.testing.assert_allclose(get(device, xt), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hq,hkv,d", [(1, 4, 2, 64), (5, 6, 2, 32), (3, 2, 1, 6)])
def test_proj_rms_norm(device, dtype, rows, hq, hkv, d):
    """OLMo-2's q/k norms in place on a fused qkv row: the whole q projection with w[:Hq D], the whole
    k projection with w[Hq D:], v kept; not the per-head norm."""
    rng = np.random.default_rng(rows * hq * d + 1)
    qkv = rng.standard_normal((rows, (hq + 2 * hkv) * d)) * 2 + 0.3
    qkv[:, :d] *= 5.0                      # heads of different scales: per-head and whole norms differ
    w = rng.standard_normal((hq + hkv) * d)
    xt = put(device, qkv, dtype, lead=4)
    op = nn.proj_rms_norm(device, xt, put(device, w, lead=4), q_dim=hq * d, k_dim=hkv * d, eps=1e-6)
    assert _width(op) == (4 if d % 4 == 0 else 1)
    run(device, op)
    want = nn_ref.proj_rms_norm(rounded(qkv, dtype), w, hq * d, hkv * d, 1e-6)
    per_head = nn_ref.head_rms_norm(rounded(qkv, dtype).reshape(rows, -1, d), np.ones(2 * d), hq, hkv, 1e-6)
    assert np.abs(want[:, :d] - per_head[:, 0] * w[:d]).max() > 0.1
    np.testing.assert_array_equal(get(device, xt)[:, (hq + hkv) * d:], rounded(qkv, dtype)[:, (hq + hkv) * d:])
    np.testing.assert_allclose(get(device, xt), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,res", [(5, 384, False), (5, 384, True), (3, 37, True)])
def test_layer_norm(device, dtype, rows, cols, res):
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((rows, cols)) + 4.0      # a large mean checks the two-pass variance
    r = rng.standard_normal((rows, cols))
    w, b = rng.standard_normal(cols), rng.standard_normal(cols)
    xt, rt = put(device, x, dtype), put(device, r, dtype, lead=4)
    yt = empty(device, (rows, cols), dtype)
    run(device, nn.layer_norm(device, xt, put(device, w), put(device, b), yt, eps=1e-12,
                              residual=rt if res else None))
    ref = nn_ref.layer_norm(rounded(x, dtype), w, b, 1e-12, rounded(r, dtype) if res else None)
    np.testing.assert_allclose(get(device, yt), ref, **TOL[dtype])


def test_layer_norm_in_place_on_residual(device):
    """BERT's h = LN(attn_out + h) writes over its own residual input."""
    rng = np.random.default_rng(1)
    x, r = rng.standard_normal((9, 384)), rng.standard_normal((9, 384))
    w, b = rng.standard_normal(384), rng.standard_normal(384)
    xt, rt = put(device, x), put(device, r)
    run(device, nn.layer_norm(device, xt, put(device, w), put(device, b), rt, eps=1e-12, residual=rt))
    np.testing.assert_allclose(get(device, rt), nn_ref.layer_norm(x, w, b, 1e-12, r), **TOL["f32"])


# ----------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,width", [(0, 4), (2, 1)])
def test_add_in_place(device, dtype, lead, width):
    """4-wide loads when sizes and offsets allow; one element per invocation otherwise."""
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((7, 576)), rng.standard_normal((7, 576))
    at, bt = put(device, a, dtype, lead=lead), put(device, b, dtype)
    op = nn.add(device, at, bt, at)
    assert _width(op) == width
    run(device, op)
    np.testing.assert_allclose(get(device, at), rounded(a, dtype) + rounded(b, dtype), **TOL[dtype])


def test_add_beyond_one_dispatch_dimension(device):
    """More than 65535 workgroups of 64: the grid folds into y (an odd n: one element per invocation)."""
    n = 65535 * 64 + 1001
    a = np.arange(n, dtype=np.float32) % 1000
    at, bt, yt = put(device, a), put(device, -2 * a), empty(device, (n,))
    op = nn.add(device, at, bt, yt)
    assert op.dispatches[0][3] == 2
    run(device, op)
    np.testing.assert_array_equal(get(device, yt), -a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_add(device, dtype):
    rng = np.random.default_rng(3)
    x, b = rng.standard_normal((5, 1152)), rng.standard_normal(1152)
    xt, yt = put(device, x, dtype), empty(device, (5, 1152), dtype)
    run(device, nn.bias_add(device, xt, put(device, b), yt))
    np.testing.assert_allclose(get(device, yt), rounded(x, dtype) + b.astype(np.float32), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,f", [(1, 64), (5, 37)])
def test_gelu_tanh_mul(device, dtype, rows, f):
    """GeGLU (Gemma): GELU's tanh form of the gate times up, finite far out in both tails."""
    rng = np.random.default_rng(f + rows)
    gu = rng.standard_normal((rows, 2 * f)) * 4
    gu[0, :4] = [-100.0, 100.0, 0.0, -30.0]
    gt, yt = put(device, gu, dtype, lead=8), empty(device, (rows, f), dtype)
    run(device, nn.silu_mul(device, gt, yt, act="gelu_tanh"))
    out = get(device, yt)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, nn_ref.gelu_tanh_mul(rounded(gu, dtype)), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_and_softcap_in_place(device, dtype):
    rng = np.random.default_rng(9)
    x = rng.standard_normal(1001) * 40
    xt = put(device, x, dtype, lead=4)
    run(device, nn.scale(device, xt, xt, 8.0), nn.softcap(device, xt, xt, 30.0))
    want = 30.0 * np.tanh(rounded(x, dtype).astype(np.float64) * 8.0 / 30.0)
    np.testing.assert_allclose(get(device, xt), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,f", [(1, 1536), (3, 1536), (5, 37)])
def test_silu_mul(device, dtype, rows, f):
    rng = np.random.default_rng(f + rows)
    gu = rng.standard_normal((rows, 2 * f)) * 4
    gu[0, :4] = [-100.0, 100.0, 0.0, -30.0]          # saturation of exp
    gt, yt = put(device, gu, dtype, lead=8), empty(device, (rows, f), dtype)
    run(device, nn.silu_mul(device, gt, yt))
    out = get(device, yt)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, nn_ref.silu_mul(rounded(gu, dtype)), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_in_place(device, dtype):
    """Phi's dense FFN activation (gelu_new), in place, finite far out in both tails."""
    rng = np.random.default_rng(8)
    x = np.concatenate([rng.standard_normal(3000) * 4, [-100.0, 100.0, 0.0, -30.0]])
    xt = put(device, x, dtype, lead=4)
    run(device, nn.gelu_tanh(device, xt, xt))
    out = get(device, xt)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, nn_ref.gelu_tanh(rounded(x, dtype)), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul(device, dtype):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 2 * 48)) * 3
    xt, yt = put(device, x, dtype), empty(device, (5, 48), dtype)
    run(device, nn.gelu_mul(device, xt, yt))
    np.testing.assert_allclose(get(device, yt), nn_ref.gelu_mul(rounded(x, dtype)), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh(device, dtype):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(3000) * 2, np.linspace(-100, 100, 2001), [0.0, 1e-8, -1e-8]])
    xt, yt = put(device, x, dtype), empty(device, x.shape, dtype)
    run(device, nn.tanh(device, xt, yt))
    out = get(device, yt)
    assert np.isfinite(out).all() and out.max() <= 1.0 and out.min() >= -1.0
    np.testing.assert_allclose(out, nn_ref.tanh(rounded(x, dtype)), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_erf_form(device, dtype):
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(3000) * 3, np.linspace(-12, 12, 2001),
                        np.geomspace(1e-6, 1e-2, 50), -np.geomspace(1e-6, 1e-2, 50)])
    xt, yt = put(device, x, dtype), empty(device, x.shape, dtype)
    run(device, nn.gelu(device, xt, yt))
    out, ref = get(device, yt), nn_ref.gelu(rounded(x, dtype))
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    if dtype == "f32":
        # relative accuracy near zero and in the negative tail, where erf approximations fail
        sel = (np.abs(ref) > 1e-30)
        assert np.max(np.abs(out[sel] - ref[sel]) / np.abs(ref[sel])) < 1e-4


# ----------------------------------------------------------------------------- rope and kv write
def _qkv(rng, t, hq, hkv, d):
    return rng.standard_normal((t, hq + 2 * hkv, d))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox,rot_dim,pos0,t", [(False, 64, 0, 5), (True, 64, 7, 5),
                                                 (False, 32, 3000, 3), (True, 48, 4090, 6),
                                                 (False, 64, 32760, 2)])
def test_rope(device, dtype, neox, rot_dim, pos0, t):
    rng = np.random.default_rng(pos0 + rot_dim)
    hq, hkv, d, base = 9, 3, 64, 100000.0
    x = _qkv(rng, t, hq, hkv, d)
    xt = put(device, x, dtype, lead=4)
    run(device, nn.rope(device, xt, step_buf(device, pos0, t), n_heads=hq + hkv, head_dim=d,
                        rot_dim=rot_dim, base=base, neox=neox))
    ref = nn_ref.rope(rounded(x, dtype), pos0 + np.arange(t), n_heads=hq + hkv, rot_dim=rot_dim,
                      base=base, neox=neox)
    out = get(device, xt)
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    np.testing.assert_array_equal(out[:, hq + hkv:], rounded(x, dtype)[:, hq + hkv:])  # v untouched


@pytest.mark.parametrize("neox,rot_dim", [(True, 64), (True, 32), (False, 64)])
def test_rope_positions_restart_every_sequence(device, neox, rot_dim):
    """step[3] = S: B padded sequences of S rows rotated in one op, row t at position t % S."""
    rng = np.random.default_rng(11)
    b, s, h, d = 3, 20, 4, 64
    x = _qkv(rng, b * s, h, h, d)
    xt = put(device, x, "f32", lead=4)
    step = device.upload(np.array([0, 0, 0, s], np.uint32), owner="test:nn", label="step")
    run(device, nn.rope(device, xt, step, n_heads=2 * h, head_dim=d, rot_dim=rot_dim, base=1000.0, neox=neox))
    ref = nn_ref.rope(x, np.arange(b * s) % s, n_heads=2 * h, rot_dim=rot_dim, base=1000.0, neox=neox)
    np.testing.assert_allclose(get(device, xt), ref, **TOL["f32"])


def test_rope_skips_rows_past_n_new(device):
    """An op built for T rows processes only step.n_new of them (a short final prefill chunk)."""
    rng = np.random.default_rng(5)
    x = _qkv(rng, 8, 2, 1, 32)
    xt = put(device, x)
    run(device, nn.rope(device, xt, step_buf(device, 10, 3), n_heads=3, head_dim=32, base=10000.0))
    out = get(device, xt)
    ref = nn_ref.rope(x, 10 + np.arange(8), n_heads=3, rot_dim=32, base=10000.0, neox=False)
    np.testing.assert_allclose(out[:3], ref[:3], **TOL["f32"])
    np.testing.assert_array_equal(out[3:], x[3:].astype(np.float32))


@pytest.mark.parametrize("dtype,neox,rot_dim", [("f32", False, 64), ("f16", False, 64), ("f32", True, 32),
                                                ("f16", True, 64)])
def test_kv_write_and_fused_rope_kv(device, dtype, neox, rot_dim):
    rng = np.random.default_rng(6)
    hq, hkv, d, ctx, t, pos0 = 9, 3, 64, 40, 6, 30
    x = _qkv(rng, t, hq, hkv, d)
    kc0 = rng.standard_normal((hkv, ctx, d))
    step = step_buf(device, pos0, t)
    # kv_write alone: a plain copy of the k and v heads into rows pos0..pos0+T-1
    xt, kc, vc = put(device, x, dtype), put(device, kc0, dtype), empty(device, (hkv, ctx, d), dtype, fill=0)
    run(device, nn.kv_write(device, xt, kc, vc, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx))
    xr = rounded(x, dtype)
    k_ref, v_ref = rounded(kc0, dtype), np.zeros((hkv, ctx, d), np.float32)
    k_ref[:, pos0:pos0 + t] = xr[:, hq:hq + hkv].transpose(1, 0, 2)
    v_ref[:, pos0:pos0 + t] = xr[:, hq + hkv:].transpose(1, 0, 2)
    np.testing.assert_array_equal(get(device, kc), k_ref)
    np.testing.assert_array_equal(get(device, vc), v_ref)
    # rope_kv: rotated q and k in qkv, rotated k and raw v in the caches, one dispatch
    xt2, kc2, vc2 = put(device, x, dtype), empty(device, (hkv, ctx, d), dtype, fill=0), \
        empty(device, (hkv, ctx, d), dtype, fill=0)
    op = nn.rope_kv(device, xt2, kc2, vc2, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                    base=100000.0, rot_dim=rot_dim, neox=neox)
    assert len(op.dispatches) == 1
    run(device, op)
    rot = nn_ref.rope(xr, pos0 + np.arange(t), n_heads=hq + hkv, rot_dim=rot_dim, base=100000.0, neox=neox)
    np.testing.assert_allclose(get(device, xt2), rot, **TOL[dtype])
    np.testing.assert_allclose(get(device, kc2)[:, pos0:pos0 + t], rot[:, hq:hq + hkv].transpose(1, 0, 2),
                               **TOL[dtype])
    np.testing.assert_array_equal(get(device, vc2)[:, pos0:pos0 + t], v_ref[:, pos0:pos0 + t])
    assert not get(device, kc2)[:, :pos0].any()


def test_rope_kv_reused_across_decode_steps(device):
    """Built once, recorded each step while the step buffer moves pos0 along."""
    rng = np.random.default_rng(7)
    hq, hkv, d, ctx = 9, 3, 64, 64
    xs = [_qkv(rng, 1, hq, hkv, d) for _ in range(4)]
    xt = put(device, xs[0])
    kc, vc = empty(device, (hkv, ctx, d), fill=0), empty(device, (hkv, ctx, d), fill=0)
    step = step_buf(device, 0, 1)
    op = nn.rope_kv(device, xt, kc, vc, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                    base=100000.0)
    for i, pos in enumerate([0, 1, 17, 63]):
        device.write(xt.buf, xs[i].astype(np.float32), xt.offset)
        set_step(device, step, pos, 1)
        run(device, op)
        rot = nn_ref.rope(xs[i], np.array([pos]), n_heads=hq + hkv, rot_dim=d, base=100000.0, neox=False)
        np.testing.assert_allclose(get(device, xt), rot, **TOL["f32"])
        np.testing.assert_allclose(get(device, kc)[:, pos], rot[0, hq:hq + hkv], **TOL["f32"])
        np.testing.assert_array_equal(get(device, vc)[:, pos], xs[i][0, hq + hkv:].astype(np.float32))


# ----------------------------------------------------------------------------- pooling
@pytest.mark.parametrize("xdt,ydt", [("f32", "f32"), ("f16", "f32"), ("f16", "f16")])
def test_pooling(device, xdt, ydt):
    rng = np.random.default_rng(8)
    b, s, c = 3, 7, 384
    lengths = np.array([7, 3, 1], np.uint32)
    x = rng.standard_normal((b * s, c))
    xt, lt = put(device, x, xdt), put(device, lengths, "u32")
    xr = rounded(x, xdt)
    tol = TOL["f16" if "f16" in (xdt, ydt) else "f32"]
    for fn, ref in [(nn.mean_pool, nn_ref.mean_pool), (nn.max_pool, nn_ref.max_pool),
                    (nn.cls_pool, nn_ref.cls_pool), (nn.last_pool, nn_ref.last_pool),
                    (nn.weighted_mean_pool, nn_ref.weighted_mean_pool)]:
        yt = empty(device, (b, c), ydt)
        run(device, fn(device, xt, lt, yt))
        np.testing.assert_allclose(get(device, yt), ref(xr, lengths, b), **tol)


@pytest.mark.parametrize("xdt,ydt", [("f32", "f32"), ("f16", "f32")])
def test_l2_normalize(device, xdt, ydt):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 384)) * 5
    x[3] = 0.0                                     # a zero row stays zero (no 0/0)
    xt, yt = put(device, x, xdt), empty(device, (4, 384), ydt)
    run(device, nn.l2_normalize(device, xt, yt))
    out = get(device, yt)
    np.testing.assert_allclose(out, nn_ref.l2_normalize(rounded(x, xdt)), **TOL[xdt])
    np.testing.assert_allclose(np.linalg.norm(out[:3], axis=1), 1.0, rtol=1e-3)
