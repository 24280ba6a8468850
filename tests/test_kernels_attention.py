"""Attention kernels on the real adapter against nn_ref: causal prefill (also chunked, pos0 > 0),
split-key decode reused across steps, grouped-query heads, BERT's bidirectional masked attention."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import nn, nn_ref

from _nn_util import TOL, empty, get, put, rounded, run, set_step, step_buf

SMOL = dict(hq=9, hkv=3, d=64)          # SmolLM2-135M


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


def _setup(device, rng, dtype, t, ctx, hq, hkv, d, fill_keys):
    """qkv (T, Hq+2Hkv, D) and caches (Hkv, ctx, D) whose first fill_keys rows are random."""
    qkv = rng.standard_normal((t, hq + 2 * hkv, d))
    kc = np.zeros((hkv, ctx, d))
    vc = np.zeros((hkv, ctx, d))
    kc[:, :fill_keys] = rng.standard_normal((hkv, fill_keys, d)) * 1.5
    vc[:, :fill_keys] = rng.standard_normal((hkv, fill_keys, d))
    return (qkv, kc, vc), (put(device, qkv, dtype, lead=4), put(device, kc, dtype), put(device, vc, dtype, lead=8))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("t,pos0,shape", [(37, 0, SMOL), (20, 50, SMOL), (5, 3, dict(hq=4, hkv=4, d=32)),
                                          (3, 200, dict(hq=6, hkv=1, d=16)), (70, 1, dict(hq=8, hkv=1, d=8)),
                                          (9, 4, dict(hq=9, hkv=3, d=64, g=1))])
def test_causal_prefill(device, dtype, t, pos0, shape):
    """Grouped query heads (1, 2, 3 or 4 per lane), partial blocks of 64 queries, pos0 > 0."""
    rng = np.random.default_rng(t + pos0)
    hq, hkv, d = shape["hq"], shape["hkv"], shape["d"]
    ctx = pos0 + t + 9
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, dtype, t, ctx, hq, hkv, d, pos0 + t)
    out = empty(device, (t, hq * d), dtype, lead=12)
    scale = d ** -0.5
    run(device, nn.attention(device, qt, kt, vt, out, step_buf(device, pos0, t), n_q_heads=hq,
                             n_kv_heads=hkv, head_dim=d, ctx=ctx, scale=scale,
                             heads_per_lane=shape.get("g")))
    ref = nn_ref.causal_attention(rounded(qkv, dtype)[:, :hq], rounded(kc, dtype), rounded(vc, dtype),
                                  pos0, scale)
    np.testing.assert_allclose(get(device, out), ref, **TOL[dtype])


def test_causal_prefill_256_rows_and_short_final_chunk(device):
    """T = 256 dispatched; then the same op with n_new = 100 leaves rows >= 100 alone."""
    rng = np.random.default_rng(11)
    t, ctx = 256, 512
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, "f32", t, ctx, 9, 3, 64, 300)
    out = empty(device, (t, 9 * 64))
    step = step_buf(device, 0, t)
    op = nn.attention(device, qt, kt, vt, out, step, n_q_heads=9, n_kv_heads=3, head_dim=64, ctx=ctx,
                      scale=0.125)
    run(device, op)
    ref = nn_ref.causal_attention(qkv[:, :9], kc, vc, 0, 0.125)
    np.testing.assert_allclose(get(device, out), ref, **TOL["f32"])
    set_step(device, step, 44, 100)
    device.write(out.buf, np.full((t, 9 * 64), 7.0, np.float32))
    run(device, op)
    got = get(device, out)
    ref = nn_ref.causal_attention(qkv[:100, :9], kc, vc, 44, 0.125)
    np.testing.assert_allclose(got[:100], ref, **TOL["f32"])
    assert (got[100:] == 7.0).all()


@pytest.mark.parametrize("dtype,heads_per_lane,chunk,split_wg", [("f32", 1, 32, 64), ("f32", 3, 128, 8),
                                                                 ("f16", None, None, None)])
def test_split_decode_reused_across_steps(device, dtype, heads_per_lane, chunk, split_wg):
    """One decode op built for a 4096-row cache, recorded at kv_len 1 .. 3000 (split boundaries
    included), with a lane per (split, head) or per (split, the 3 heads sharing a kv head)."""
    rng = np.random.default_rng(12)
    hq, hkv, d, ctx = 9, 3, 64, 4096
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, dtype, 1, ctx, hq, hkv, d, 3000)
    out = empty(device, (1, hq * d), dtype)
    step = step_buf(device, 0, 1)
    op = nn.attention(device, qt, kt, vt, out, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                      scale=0.125, heads_per_lane=heads_per_lane,
                      min_chunk=chunk, split_wg=split_wg)
    assert len(op.dispatches) == 2
    q, k, v = rounded(qkv, dtype)[:, :hq], rounded(kc, dtype), rounded(vc, dtype)
    assert len(op.short) == 1
    for kv_len in (1, 31, 33, 127, 129, 3000):
        set_step(device, step, kv_len - 1, 1)
        ref = nn_ref.causal_attention(q, k, v, kv_len - 1, 0.125)
        # the split + combine form always; the one-dispatch form (attn_decode1) where the op says
        # it serves this many keys, recorded as a decode step does (n_keys)
        forms = [None] + ([kv_len] if kv_len <= op.max_keys else [])
        for n_keys in forms:
            device.write(out.buf, np.full(hq * d, 7.0, np.float32 if dtype == "f32" else np.float16),
                         out.offset)
            b = device.batch()
            op.record(b, n_keys=n_keys)
            assert len(b) == (1 if n_keys else 2)
            device.submit(b)
            np.testing.assert_allclose(get(device, out), ref, **TOL[dtype],
                                       err_msg=f"kv_len={kv_len} n_keys={n_keys}")
    assert op.max_keys >= 128       # 1, 31, 33 and 127 took the short form above


def test_decode_end_to_end_with_rope_kv(device):
    """rope_kv + attention per step, as the model records them: keys written by earlier steps are
    the ones attended; the result matches full-sequence reference attention over rotated q/k."""
    rng = np.random.default_rng(13)
    hq, hkv, d, ctx, n = 9, 3, 64, 256, 6
    xs = rng.standard_normal((n, hq + 2 * hkv, d))
    qt = put(device, xs[:1])
    kt, vt = empty(device, (hkv, ctx, d), fill=0), empty(device, (hkv, ctx, d), fill=0)
    out, step = empty(device, (1, hq * d)), step_buf(device, 0, 1)
    ops = [nn.rope_kv(device, qt, kt, vt, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                      base=100000.0),
           nn.attention(device, qt, kt, vt, out, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                        ctx=ctx, scale=0.125)]
    rot = nn_ref.rope(xs, np.arange(n), n_heads=hq + hkv, rot_dim=d, base=100000.0, neox=False)
    k_all, v_all = rot[:, hq:hq + hkv].transpose(1, 0, 2), xs[:, hq + hkv:].transpose(1, 0, 2)
    full = nn_ref.causal_attention(rot[:, :hq], k_all, v_all, 0, 0.125)
    for i in range(n):
        device.write(qt.buf, xs[i].astype(np.float32), qt.offset)
        set_step(device, step, i, 1)
        run(device, *ops)
        np.testing.assert_allclose(get(device, out)[0], full[i], **TOL["f32"], err_msg=f"step {i}")


def test_decode_split_count_is_bounded():
    assert nn.decode_splits(4096) == (32, 128)
    chunk, splits = nn.decode_splits(32768)
    assert chunk * splits >= 32768 and splits <= 128
    assert nn.decode_splits(5) == (32, 1)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("b,s,h,d,lengths,qpl", [(3, 17, 12, 32, [17, 5, 1], 2),   # MiniLM heads
                                                 (2, 9, 3, 4, [0, 9], 4), (2, 1, 2, 8, [1, 1], 2),
                                                 (2, 150, 2, 32, [150, 77], 3), (1, 70, 1, 16, [66], 1)])
@pytest.mark.parametrize("lanes", [8, 64])
def test_attention_bidir(device, dtype, b, s, h, d, lengths, qpl, lanes):
    """Several queries per lane (with a clamped last lane), blocks of queries, empty sequences;
    workgroups of 64 lanes (GPUs) and 8 (CPU adapters) give the same rows bit for bit."""
    rng = np.random.default_rng(b * s)
    qkv = rng.standard_normal((b * s, 3 * h * d))
    lens = np.array(lengths, np.uint32)
    qt, lt = put(device, qkv, dtype, lead=4), put(device, lens, "u32")
    out = empty(device, (b * s, h * d), dtype)
    scale = d ** -0.5
    run(device, nn.attention_bidir(device, qt, lt, out, batch=b, seq=s, n_heads=h, head_dim=d, scale=scale,
                                   queries_per_lane=qpl, lanes=lanes))
    got = get(device, out)
    assert np.isfinite(got).all()
    run(device, nn.attention_bidir(device, qt, lt, out, batch=b, seq=s, n_heads=h, head_dim=d, scale=scale,
                                   queries_per_lane=2, lanes=64))
    valid = np.concatenate([np.arange(s) < n for n in lens])
    np.testing.assert_array_equal(got[valid], get(device, out)[valid])
    ref = nn_ref.bidir_attention(rounded(qkv, dtype), lens, b, s, h, d, scale)
    np.testing.assert_allclose(got[valid], ref[valid], **TOL[dtype])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("window", [1, 4, 40])
def test_attention_bidir_local_window(device, dtype, window):
    """ModernBERT's local layers: query i sees keys |j - i| <= window of its sequence."""
    b, s, h, d = 2, 70, 2, 16
    rng = np.random.default_rng(window)
    qkv = rng.standard_normal((b * s, 3 * h * d))
    lens = np.array([70, 23], np.uint32)
    qt, lt = put(device, qkv, dtype, lead=4), put(device, lens, "u32")
    out = empty(device, (b * s, h * d), dtype)
    run(device, nn.attention_bidir(device, qt, lt, out, batch=b, seq=s, n_heads=h, head_dim=d, scale=d ** -0.5,
                                   window=window))
    got = get(device, out)
    ref = nn_ref.bidir_attention(rounded(qkv, dtype), lens, b, s, h, d, d ** -0.5, window=window)
    valid = np.concatenate([np.arange(s) < n for n in lens])
    np.testing.assert_allclose(got[valid], ref[valid], **TOL[dtype])
    full = nn_ref.bidir_attention(rounded(qkv, dtype), lens, b, s, h, d, d ** -0.5)
    assert np.abs(full[valid] - ref[valid]).max() > 1e-2          # the window changes the result


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_causal_kernel_rows_do_not_depend_on_T(device, dtype):
    """attention(..., causal=True) keeps the prefill kernel for one row: a query gives bit for bit the
    same output alone (T = 1, pos0 = its position) as inside a longer prefill (what a warm KV prefix
    and any prefill chunking need), and matches numpy."""
    rng = np.random.default_rng(3)
    hq, hkv, d, t, ctx = 9, 3, 64, 40, 64
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, dtype, t, ctx, hq, hkv, d, t)
    out = empty(device, (t, hq * d), dtype)
    run(device, nn.attention(device, qt, kt, vt, out, step_buf(device, 0, t), n_q_heads=hq, n_kv_heads=hkv,
                             head_dim=d, ctx=ctx, scale=d ** -0.5, causal=True))
    full = get(device, out)
    for row in (0, 17, 39):
        one = put(device, qkv[row:row + 1], dtype, lead=4)
        o1 = empty(device, (1, hq * d), dtype)
        run(device, nn.attention(device, one, kt, vt, o1, step_buf(device, row, 1), n_q_heads=hq,
                                 n_kv_heads=hkv, head_dim=d, ctx=ctx, scale=d ** -0.5, causal=True))
        got = get(device, o1)
        assert np.array_equal(got[0], full[row])
        ref = nn_ref.causal_attention(rounded(qkv[row:row + 1], dtype)[:, :hq], rounded(kc, dtype),
                                      rounded(vc, dtype), row, d ** -0.5)
        np.testing.assert_allclose(got, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("t,pos0,window,softcap", [(70, 0, 16, 0.0), (40, 100, 37, 0.0), (5, 300, 64, 0.0),
                                                    (20, 50, 0, 2.0), (33, 90, 20, 1.5)])
def test_causal_prefill_sliding_window_and_softcap(device, dtype, t, pos0, window, softcap):
    """Keys at or below p - window masked (whole 16-key blocks before the first query's window
    skipped); soft-capped scores (Gemma 2)."""
    rng = np.random.default_rng(t + window)
    hq, hkv, d, ctx = 4, 2, 32, pos0 + t + 5
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, dtype, t, ctx, hq, hkv, d, pos0 + t)
    qkv[:, :hq] *= 3.0                   # scores well past the cap
    qt = put(device, qkv, dtype, lead=4)
    out = empty(device, (t, hq * d), dtype, lead=12)
    run(device, nn.attention(device, qt, kt, vt, out, step_buf(device, pos0, t), n_q_heads=hq, n_kv_heads=hkv,
                             head_dim=d, ctx=ctx, scale=d ** -0.5, window=window, softcap=softcap))
    args = (rounded(qkv, dtype)[:, :hq], rounded(kc, dtype), rounded(vc, dtype), pos0, d ** -0.5)
    ref = nn_ref.causal_attention(*args, window=window, softcap=softcap)
    assert np.abs(ref - nn_ref.causal_attention(*args)).max() > 0.05     # the window / cap matter
    np.testing.assert_allclose(get(device, out), ref, **TOL[dtype])


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_split_decode_sliding_window(device, softcap):
    """Decode with a 100-key window over a 1024-row cache: splits wholly before the window are
    skipped by both the split and the combine kernels; the one-dispatch form agrees."""
    rng = np.random.default_rng(21)
    hq, hkv, d, ctx, window = 6, 2, 32, 1024, 100
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, "f32", 1, ctx, hq, hkv, d, 700)
    out, step = empty(device, (1, hq * d)), step_buf(device, 0, 1)
    op = nn.attention(device, qt, kt, vt, out, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                      scale=d ** -0.5, min_chunk=32, window=window, softcap=softcap)
    q, k, v = qkv[:, :hq], kc, vc
    for kv_len in (1, 99, 100, 101, 130, 333, 700):
        set_step(device, step, kv_len - 1, 1)
        ref = nn_ref.causal_attention(q, k, v, kv_len - 1, d ** -0.5, window=window, softcap=softcap)
        for n_keys in [None] + ([kv_len] if kv_len <= op.max_keys else []):
            b = device.batch()
            op.record(b, n_keys=n_keys)
            device.submit(b)
            np.testing.assert_allclose(get(device, out), ref, **TOL["f32"], err_msg=f"kv_len={kv_len} {n_keys}")


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 128), (4, 2, 256), (16, 4, 128)])
def test_wide_heads_prefill_and_decode(device, hq, hkv, d):
    """Llama-3 / Qwen3 heads (128 wide, 4 query heads per kv head) and Gemma's (256): the default
    heads per lane keep G * D within what a lane holds correctly; prefill and split decode."""
    rng = np.random.default_rng(d + hq)
    t, pos0, ctx = 20, 30, 64
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, "f32", t, ctx, hq, hkv, d, pos0 + t)
    out = empty(device, (t, hq * d))
    op = nn.attention(device, qt, kt, vt, out, step_buf(device, pos0, t), n_q_heads=hq, n_kv_heads=hkv,
                      head_dim=d, ctx=ctx, scale=d ** -0.5)
    g = int(op.dispatches[0][0].key.header.split("const G: u32 = ")[1].split("u")[0])
    assert g * d <= 256
    run(device, op)
    np.testing.assert_allclose(get(device, out), nn_ref.causal_attention(qkv[:, :hq], kc, vc, pos0, d ** -0.5),
                               **TOL["f32"])
    q1, out1, step = put(device, qkv[:1]), empty(device, (1, hq * d)), step_buf(device, 40, 1)
    run(device, nn.attention(device, q1, kt, vt, out1, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                             scale=d ** -0.5, min_chunk=16))
    np.testing.assert_allclose(get(device, out1), nn_ref.causal_attention(qkv[:1, :hq], kc, vc, 40, d ** -0.5),
                               **TOL["f32"])


@pytest.mark.parametrize("dtype,window,softcap", [("f32", 0, 0.0), ("f16", 0, 0.0), ("f32", 40, 1.5)])
def test_decode_rows_equal_decode_steps(device, dtype, window, softcap):
    """decode_rows (speculative decoding's verify): row t of T rows at pos0 + t gives, bit for bit,
    what the one-row decode op gives at that position with the live-key form the decode path picks
    (record(n_keys=position + 1): short up to op.max_keys, split-key beyond), rows of both forms
    in one op; with every row short, the split dispatch alone gives the same."""
    rng = np.random.default_rng(33 + window)
    hq, hkv, d, ctx, T = 9, 3, 64, 512, 6
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx, scale=d ** -0.5, window=window, softcap=softcap)
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, dtype, T, ctx, hq, hkv, d, ctx)
    out, step = empty(device, (T, hq * d), dtype), step_buf(device, 0, T)
    rows = nn.attention(device, qt, kt, vt, out, step, max_t=T, decode_rows=True, **kw)
    one_q, one_out, one_step = empty(device, (1, hq + 2 * hkv, d), dtype), empty(device, (1, hq * d), dtype), \
        step_buf(device, 0, 1)
    one = nn.attention(device, one_q, kt, vt, one_out, one_step, **kw)
    assert rows.max_keys == one.max_keys and len(rows.short) == 1
    q_rows = rounded(qkv, dtype).astype({"f32": np.float32, "f16": np.float16}[dtype])
    for pos0 in (0, rows.max_keys - T + 1, rows.max_keys - 2, 300):
        set_step(device, step, pos0, T)
        forms = [None] + ([pos0 + T] if pos0 + T <= rows.max_keys else [])
        for n_keys in forms:
            b = device.batch()
            rows.record(b, n_keys=n_keys)
            device.submit(b)
            got = get(device, out)
            for t in range(T):
                device.write(one_q.buf, np.ascontiguousarray(q_rows[t:t + 1]), one_q.offset)
                set_step(device, one_step, pos0 + t, 1)
                b = device.batch()
                one.record(b, n_keys=pos0 + t + 1)
                device.submit(b)
                assert np.array_equal(get(device, one_out)[0], got[t]), f"pos0={pos0} row {t} {n_keys=}"
        ref = nn_ref.causal_attention(rounded(qkv, dtype)[:, :hq], rounded(kc, dtype), rounded(vc, dtype), pos0,
                                      d ** -0.5, window=window, softcap=softcap)
        np.testing.assert_allclose(got, ref, **TOL[dtype], err_msg=f"pos0={pos0}")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_attention_sinks(device, dtype):
    """gpt-oss's sinks, a logit per q head in the softmax's denominator: causal prefill (with a
    window), the split decode and its one-dispatch form over many keys and few."""
    rng = np.random.default_rng(31)
    hq, hkv, d, t, pos0, ctx = 8, 2, 32, 20, 40, 1024
    (qkv, kc, vc), (qt, kt, vt) = _setup(device, rng, dtype, t, ctx, hq, hkv, d, 700)
    sinks = rng.uniform(-1.0, 3.0, hq).astype(np.float32)
    st = put(device, sinks, "f32")
    q, k, v = rounded(qkv, dtype)[:, :hq], rounded(kc, dtype), rounded(vc, dtype)
    for window in (0, 24):
        out = empty(device, (t, hq * d), dtype, lead=12)
        run(device, nn.attention(device, qt, kt, vt, out, step_buf(device, pos0, t), n_q_heads=hq, n_kv_heads=hkv,
                                 head_dim=d, ctx=ctx, scale=d ** -0.5, window=window, sinks=st))
        ref = nn_ref.causal_attention(q, k, v, pos0, d ** -0.5, window=window, sinks=sinks)
        assert np.abs(ref - nn_ref.causal_attention(q, k, v, pos0, d ** -0.5, window=window)).max() > 0.05
        np.testing.assert_allclose(get(device, out), ref, **TOL[dtype])
    out, step = empty(device, (1, hq * d), dtype), step_buf(device, 0, 1)
    op = nn.attention(device, qt, kt, vt, out, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                      scale=d ** -0.5, max_t=1, min_chunk=32, sinks=st)
    for kv_len in (1, 30, 700):
        set_step(device, step, kv_len - 1, 1)
        ref = nn_ref.causal_attention(q[:1], k, v, kv_len - 1, d ** -0.5, sinks=sinks)
        for n_keys in [None] + ([kv_len] if kv_len <= op.max_keys else []):
            b = device.batch()
            op.record(b, n_keys=n_keys)
            device.submit(b)
            np.testing.assert_allclose(get(device, out), ref, **TOL[dtype], err_msg=f"kv_len={kv_len} {n_keys}")
