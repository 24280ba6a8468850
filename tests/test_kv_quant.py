"""The quantised KV caches, q8_0 and q4_0 (kernels/kv_quant.py, shaders/kv_quant.wgsl), on the real
adapter: the writes against nn_ref's words (codes and f16 scales, bit for bit), and every attention
kernel reading them (causal prefill, flash prefill, split-key decode and its one-dispatch form, the
paged decode and prefill) against nn_ref's attention over the dequantised cache: odd lengths,
grouped heads, a sliding window, soft-capping."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import matmul as mm
from webgpu_engine.kernels import nn, nn_ref
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.kernels.kv_quant import KV_QUANTS, kv_quant, scale_words

from _nn_util import TOL, empty, get, put, rounded, run, set_step, step_buf


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


KINDS = list(KV_QUANTS)


def _cache(device, words: np.ndarray) -> Tensor:
    buf = device.upload(np.ascontiguousarray(words, np.uint32).view(np.uint8), owner="test:nn", label="kvq")
    return Tensor(buf, (words.size,), "u32", 0)


def _zero_cache(device, kind, hkv, ctx, d) -> Tensor:
    return _cache(device, np.zeros(KV_QUANTS[kind].cache_words(hkv, ctx, d), np.uint32))


def _words(device, t: Tensor) -> np.ndarray:
    return np.frombuffer(device.read_sync(t.buf, 0, t.nbytes), np.uint32)


def _row_words(words: np.ndarray, kind, hkv, ctx, d) -> tuple[np.ndarray, np.ndarray]:
    """A cache's words per row: (values (Hkv, ctx, D*bits/32), scales (Hkv, ctx, SW))."""
    n = hkv * ctx * KV_QUANTS[kind].value_words(d)
    return words[:n].reshape(hkv, ctx, -1), words[n:].reshape(hkv, ctx, scale_words(d))


def assert_rows_written(words, kind, hkv, ctx, d, rows, x):
    """The cache words of rows[i] (its axis 1: positions, or pool rows with hkv = 1) are nn_ref's for
    x[:, i], bit for bit; every other row's words are still 0."""
    got_v, got_s = _row_words(words, kind, hkv, ctx, d)
    ref_v, ref_s = _row_words(nn_ref.kv_pack(*nn_ref.kv_quantize(x, kind), kind), kind, hkv, len(rows), d)
    np.testing.assert_array_equal(got_v[:, rows], ref_v)
    np.testing.assert_array_equal(got_s[:, rows], ref_s)
    rest = np.setdiff1d(np.arange(ctx), rows)
    assert not got_v[:, rest].any() and not got_s[:, rest].any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("t,n_new,pos0,hq,hkv,d", [(7, 0, 0, 9, 3, 64), (5, 3, 11, 4, 2, 96), (1, 0, 20, 2, 1, 128)])
def test_kv_quant_writes_llama_cpp_rows(device, kind, dtype, t, n_new, pos0, hq, hkv, d):
    """Rows t < n_new (0: all) at pos0 + t: the words nn_ref packs from its codes (from the f32 scale)
    and f16 scales, bit for bit; other rows untouched. One block of a row is all zeros (scale 0)."""
    rng = np.random.default_rng(t + d)
    ctx = pos0 + t + 4
    qkv = rng.standard_normal((t, hq + 2 * hkv, d)) * 3
    qkv[0, hq, :32] = 0.0
    qt = put(device, qkv, dtype, lead=4)
    kc, vc = _zero_cache(device, kind, hkv, ctx, d), _zero_cache(device, kind, hkv, ctx, d)
    run(device, kv_quant(device, qt, kc, vc, step_buf(device, pos0, n_new), n_q_heads=hq, n_kv_heads=hkv,
                         head_dim=d, ctx=ctx))
    live = n_new or t
    x = rounded(qkv, dtype)
    for c, heads in ((kc, x[:, hq:hq + hkv]), (vc, x[:, hq + hkv:hq + 2 * hkv])):
        assert_rows_written(_words(device, c), kind, hkv, ctx, d, np.arange(pos0, pos0 + live),
                            heads[:live].transpose(1, 0, 2))
    q, s = nn_ref.kv_unpack(_words(device, kc), hkv, ctx, d, kind)
    assert s[0, pos0, 0] == 0 and not q[0, pos0, :32].any()


def _setup(device, rng, dtype, t, ctx, hq, hkv, d, fill, kind):
    """qkv and quantised caches whose first `fill` rows are random; the dequantised caches (the reference's)."""
    qkv = rng.standard_normal((t, hq + 2 * hkv, d))
    caches, deq = [], []
    for scale in (1.5, 1.0):
        x = np.zeros((hkv, ctx, d), np.float32)
        x[:, :fill] = rng.standard_normal((hkv, fill, d)) * scale
        q, s = nn_ref.kv_quantize(x, kind)
        caches.append(_cache(device, nn_ref.kv_pack(q, s, kind)))
        deq.append(nn_ref.kv_dequantize(q, s))
    return qkv, put(device, qkv, dtype, lead=4), caches, deq


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["cpu", "gpu"])          # attn_causal; attn_flash
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("t,pos0,hq,hkv,d,kw", [
    (37, 0, 9, 3, 64, {}),                      # SmolLM2's heads, a partial block of 64 queries
    (70, 21, 4, 2, 96, {}),                     # two query blocks, pos0 > 0, an odd scale word
    (9, 40, 8, 2, 32, {"window": 13}),          # sliding window
    (5, 3, 6, 1, 64, {"softcap": 5.0, "heads_per_lane": 3}),
])
def test_prefill_attention_over_quantised_caches(device, monkeypatch, kind, family, dtype, t, pos0, hq, hkv, d, kw):
    monkeypatch.setenv(mm.FAMILY_ENV, family)
    rng = np.random.default_rng(t + pos0 + d)
    ctx = pos0 + t + 7
    qkv, qt, (kc, vc), (kr, vr) = _setup(device, rng, dtype, t, ctx, hq, hkv, d, pos0 + t, kind)
    out = empty(device, (t, hq * d), dtype, lead=12)
    op = nn.attention(device, qt, kc, vc, out, step_buf(device, pos0, t), n_q_heads=hq, n_kv_heads=hkv,
                      head_dim=d, ctx=ctx, scale=d ** -0.5, **kw)
    assert op.dispatches[0][0].key.entry == ("attn_flash" if family == "gpu" else "attn_causal")
    run(device, op)
    ref = nn_ref.causal_attention(rounded(qkv, dtype)[:, :hq], kr, vr, pos0, d ** -0.5,
                                  window=kw.get("window", 0), softcap=kw.get("softcap", 0.0))
    np.testing.assert_allclose(get(device, out), ref, **TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hq,hkv,d,kw", [("f32", 9, 3, 64, {}), ("f16", 8, 2, 128, {"window": 100}),
                                               ("f32", 4, 4, 32, {"softcap": 4.0})])
def test_decode_attention_over_quantised_caches(device, kind, dtype, hq, hkv, d, kw):
    """One decode op over a 600-row cache at kv_len 1 .. 600, split + combine and the one-dispatch form."""
    rng = np.random.default_rng(d)
    ctx = 600
    qkv, qt, (kc, vc), (kr, vr) = _setup(device, rng, dtype, 1, ctx, hq, hkv, d, ctx, kind)
    out = empty(device, (1, hq * d), dtype)
    step = step_buf(device, 0, 1)
    op = nn.attention(device, qt, kc, vc, out, step, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                      scale=d ** -0.5, **kw)
    q = rounded(qkv, dtype)[:, :hq]
    for kv_len in (1, 33, 129, 317, 600):
        set_step(device, step, kv_len - 1, 1)
        ref = nn_ref.causal_attention(q, kr, vr, kv_len - 1, d ** -0.5, window=kw.get("window", 0),
                                      softcap=kw.get("softcap", 0.0))
        for n_keys in [None] + ([kv_len] if kv_len <= op.max_keys else []):
            b = device.batch()
            op.record(b, n_keys=n_keys)
            device.submit(b)
            np.testing.assert_allclose(get(device, out), ref, **TOL[dtype], err_msg=f"kv_len={kv_len} n_keys={n_keys}")


@pytest.mark.parametrize("kind", KINDS)
def test_quantised_cache_refuses_what_it_cannot_hold(device, kind):
    qt = put(device, np.zeros((1, 4, 16)))
    kc = _cache(device, np.zeros(KV_QUANTS[kind].cache_words(1, 8, 16), np.uint32))
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_quant(device, qt, kc, kc, step_buf(device, 0, 1), n_q_heads=2, n_kv_heads=1, head_dim=16, ctx=8)
    qt = put(device, np.zeros((1, 4, 32)))
    small = _cache(device, np.zeros(KV_QUANTS[kind].cache_words(1, 8, 32) - 1, np.uint32))
    with pytest.raises(ValueError, match="u32 words"):
        nn.attention(device, qt, small, small, empty(device, (1, 64)), step_buf(device, 0, 1), n_q_heads=2,
                     n_kv_heads=1, head_dim=32, ctx=8, scale=0.2)


# ---------------------------------------------------------------------------- the paged pool
BS = 16


def _pool(device, x: np.ndarray, kind):
    """A quantised pool holding x (n_blocks, BS, Hkv, D); the dequantised values."""
    n_blocks, bs, hkv, d = x.shape
    q, s = nn_ref.kv_quantize(x.reshape(1, -1, d), kind)
    buf = device.upload(nn_ref.kv_pack(q, s, kind).view(np.uint8), owner="test:nn", label="kvq_pool")
    shape = KV_QUANTS[kind].pool_shape(n_blocks, bs, hkv, d)
    return Tensor(buf, shape, "u32", 0), nn_ref.kv_dequantize(q, s).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,neox", [("f32", False), ("f16", True)])
def test_paged_rope_kv_into_quantised_pools(device, kind, dtype, neox):
    """Rows at positions of their own: q and k rotated in place as nn_ref.rope, the rotated k and the
    v heads quantised into pool rows slots[t] (a skipped slot rotates only), the words nn_ref packs
    from what the kernel rotated, bit for bit; other rows untouched."""
    from webgpu_engine.kernels import attention_paged as ap
    rng = np.random.default_rng(4)
    hq, hkv, d, n_blocks = 4, 2, 64, 4
    qkv = rng.standard_normal((6, hq + 2 * hkv, d)) * 2
    pos = np.array([0, 5, 17, 3, 100, 40], np.uint32)
    slots = np.array([3, 20, ap.SKIP_SLOT, 63, 16, 0], np.uint32)
    qt = put(device, qkv, dtype, lead=4)
    kp, vp = ap.new_kv_pool(device, n_blocks, BS, hkv, d, kind, owner="test:nn")
    op = ap.paged_rope_kv(device, qt, kp, vp, put(device, pos, "u32"), put(device, slots, "u32", lead=64),
                          n_q_heads=hq, n_kv_heads=hkv, head_dim=d, base=500.0, neox=neox)
    assert [x[0].key.entry for x in op.dispatches] == ["rope_paged", "kv_quant_slots"]
    run(device, op)
    want = nn_ref.rope(rounded(qkv, dtype), pos, n_heads=hq + hkv, rot_dim=d, base=500.0, neox=neox)
    got = get(device, qt)
    np.testing.assert_allclose(got, want, **TOL[dtype])
    written = slots != ap.SKIP_SLOT
    for pool, heads in ((kp, got[:, hq:hq + hkv]), (vp, rounded(qkv, dtype)[:, hq + hkv:])):
        rows = (slots[written][:, None] * hkv + np.arange(hkv)).reshape(-1)       # pool rows, one per head
        assert_rows_written(_words(device, pool), kind, 1, n_blocks * BS * hkv, d, rows,
                            heads[written].reshape(1, -1, d))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,hq,hkv,d,window,softcap", [("f32", 9, 3, 64, 0, 0.0), ("f16", 6, 2, 96, 37, 2.0)])
def test_paged_decode_and_prefill_over_quantised_pools(device, kind, dtype, hq, hkv, d, window, softcap):
    """A ragged decode batch (block boundaries, an idle slot) and a chunked prefill through a block
    table, over quantised pools, against nn_ref's attention over the dequantised keys and values."""
    from webgpu_engine.kernels import attention_paged as ap
    rng = np.random.default_rng(d)
    n_blocks, max_blocks = 40, 16
    kt, kx = _pool(device, (rng.standard_normal((n_blocks, BS, hkv, d)) * 1.5).astype(np.float32), kind)
    vt, vx = _pool(device, rng.standard_normal((n_blocks, BS, hkv, d)).astype(np.float32), kind)
    lens = [1, BS, BS + 1, 150, 0]
    ids = list(rng.permutation(n_blocks))
    tables = np.zeros((len(lens), max_blocks), np.uint32)
    for q, n in enumerate(lens):
        for i in range(-(-n // BS)):
            tables[q, i] = ids.pop()

    def gather(pool, table, n):
        return np.stack([pool[table[j // BS], j % BS] for j in range(n)], 1)
    qkv = rng.standard_normal((len(lens), hq + 2 * hkv, d)) * 2
    out = empty(device, (len(lens), hq * d), dtype, fill=7.0)
    scale = d ** -0.5
    op = ap.paged_decode(device, put(device, qkv, dtype), kt, vt, out, put(device, np.array(lens, np.uint32), "u32"),
                         put(device, tables, "u32"), n_q_heads=hq, n_kv_heads=hkv, head_dim=d, max_seqs=len(lens),
                         max_blocks=max_blocks, scale=scale, window=window, softcap=softcap, min_chunk=32)
    run(device, op)
    got = get(device, out)
    for q, n in enumerate(lens):
        if n:
            ref = nn_ref.causal_attention(rounded(qkv, dtype)[q:q + 1, :hq], gather(kx, tables[q], n),
                                          gather(vx, tables[q], n), n - 1, scale, window=window, softcap=softcap)
            np.testing.assert_allclose(got[q:q + 1], ref, **TOL[dtype], err_msg=f"sequence {q}")
        else:
            assert (got[q] == 7.0).all()
    # prefill: rows 130 .. 149 of sequence 3 (its table holds keys 0 .. 149)
    t, pos0 = 20, 130
    x = rng.standard_normal((t, hq + 2 * hkv, d))
    pout = empty(device, (t, hq * d), dtype)
    run(device, ap.paged_prefill(device, put(device, x, dtype), kt, vt, pout, step_buf(device, pos0, t),
                                 put(device, tables[3], "u32"), n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                                 max_blocks=max_blocks, scale=scale, window=window, softcap=softcap))
    kc, vc = gather(kx, tables[3], 150), gather(vx, tables[3], 150)
    ref = nn_ref.causal_attention(rounded(x, dtype)[:, :hq], kc, vc, pos0, scale, window=window, softcap=softcap)
    np.testing.assert_allclose(get(device, pout), ref, **TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,neox,rot,mscale", [("f32", False, 64, 1.0), ("f32", True, 32, 1.0),
                                                   ("f16", False, 48, 1.19)])
def test_rope_kv_quant_one_dispatch(device, kind, dtype, neox, rot, mscale):
    """The q heads rotated in place as nn_ref.rope (the k and v heads left as they were); the k heads
    rotated (partial rotary: dims past rot_dim as they are, longrope's mscale on the rotated ones)
    and the v heads quantised into rows pos0 + t < n_new: the v rows' words nn_ref's bit for bit, the
    k rows' (rotated in f32 on the device, not as numpy rounds) within a code of nn_ref's."""
    from webgpu_engine.kernels.kv_quant import rope_kv_quant
    rng = np.random.default_rng(rot)
    t, n_new, pos0, hq, hkv, d = 5, 4, 9, 4, 2, 64
    ctx = pos0 + t + 3
    qkv = rng.standard_normal((t, hq + 2 * hkv, d)) * 2
    qt = put(device, qkv, dtype, lead=4)
    kc, vc = _zero_cache(device, kind, hkv, ctx, d), _zero_cache(device, kind, hkv, ctx, d)
    op = rope_kv_quant(device, qt, kc, vc, step_buf(device, pos0, n_new), n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                    ctx=ctx, rot_dim=rot, base=700.0, neox=neox, mscale=mscale)
    assert len(op.dispatches) == 1
    run(device, op)
    x = rounded(qkv, dtype)
    pos = np.arange(pos0, pos0 + t)
    roped = nn_ref.rope(x, pos, n_heads=hq + hkv, rot_dim=rot, base=700.0, neox=neox)
    roped[:, :hq + hkv, :rot] *= np.float32(mscale)                 # longrope's factor on the rotated dims
    got = get(device, qt)
    np.testing.assert_allclose(got[:n_new, :hq], roped[:n_new, :hq], **TOL[dtype])
    np.testing.assert_array_equal(got[:, hq:], x[:, hq:])                  # k and v heads untouched
    rows = np.arange(pos0, pos0 + n_new)
    assert_rows_written(_words(device, vc), kind, hkv, ctx, d, rows, x[:n_new, hq + hkv:].transpose(1, 0, 2))
    words = _words(device, kc)
    q, s = nn_ref.kv_unpack(words, hkv, ctx, d, kind)
    rq, rs = nn_ref.kv_quantize(roped[:n_new, hq:hq + hkv].transpose(1, 0, 2), kind)
    deq = nn_ref.kv_dequantize(q[:, rows], s[:, rows])
    step = np.abs(rs.astype(np.float32)).max()
    np.testing.assert_allclose(deq, nn_ref.kv_dequantize(rq, rs), rtol=0, atol=float(step) * 1.01)
    assert (np.abs(q[:, rows].astype(int) - rq) <= 1).all()
    values, scales = _row_words(words, kind, hkv, ctx, d)
    assert not values[:, pos0 + n_new:].any() and not values[:, :pos0].any() and not scales[:, :pos0].any()
