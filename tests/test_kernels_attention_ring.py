"""WebLLM's sliding window with attention sinks over a ring cache (kernels/common.py Ring): rope_kv
writes keys past the cache's end into the ring and the sinks' queries beside qkv; the causal, split
and short decode forms attend the sinks and the window before each query, against nn_ref's
ring_attention by positions, for f32, f16 and the quantised caches; the result of a row does not
depend on how the sequence was cut into forwards."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import nn, nn_ref
from webgpu_engine.kernels.common import Ring
from webgpu_engine.kernels.kv_quant import KV_QUANTS, rope_kv_quant

from _nn_util import TOL, empty, get, put, set_step, step_buf

BASE = 10000.0


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


class RingRun:
    """One sequence of raw qkv rows xs (N, Hq+2Hkv, D) fed through rope_kv + attention with a ring, in
    forwards of the given sizes (1: the decode op, else the causal op of `rows` rows)."""

    def __init__(self, device, xs, hq, hkv, d, ring, ctx, rows, dtype="f32", kv=None, **attn):
        self.dev, self.xs, self.hq, self.d, self.dtype, self.ctx = device, xs, hq, d, dtype, ctx
        n_h = hq + 2 * hkv
        self.qkv = put(device, np.zeros((rows, n_h, d)), dtype)
        self.sink = empty(device, (rows, hq, d), dtype)
        if kv:
            words = KV_QUANTS[kv].cache_words(hkv, ctx, d)
            self.kc, self.vc = (put(device, np.zeros(words, np.uint32), "u32") for _ in range(2))
        else:
            self.kc, self.vc = empty(device, (hkv, ctx, d), dtype, fill=0), empty(device, (hkv, ctx, d), dtype, fill=0)
        self.out = empty(device, (rows, hq * d), dtype)
        self.step = step_buf(device, 0, rows)
        heads = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx)
        write = rope_kv_quant if kv else nn.rope_kv
        self.rope = write(device, self.qkv, self.kc, self.vc, self.step, **heads, base=BASE, ring=ring,
                          q_sink=self.sink)
        sc = dict(scale=d ** -0.5, ring=ring, q_sink=self.sink, **heads, **attn)
        self.prefill = nn.attention(device, self.qkv, self.kc, self.vc, self.out, self.step, max_t=rows, **sc)
        self.decode = nn.attention(device, self.qkv, self.kc, self.vc, self.out, self.step, max_t=1, **sc)

    def feed(self, sizes, short: bool = True) -> np.ndarray:
        """Outputs (N, Hq*D) of every position, the sequence fed in forwards of `sizes` rows; decode
        steps take the short form where the op serves their keys when `short`."""
        outs, pos = [], 0
        np_dt = np.float32 if self.dtype == "f32" else np.float16
        for n in sizes:
            self.dev.write(self.qkv.buf, self.xs[pos:pos + n].astype(np_dt), self.qkv.offset)
            set_step(self.dev, self.step, pos, n)
            b = self.dev.batch()
            self.rope.record(b)
            if n == 1:
                n_keys = min(pos + 1, self.ctx)
                self.decode.record(b, n_keys=n_keys if short and n_keys <= self.decode.max_keys else None)
            else:
                self.prefill.record(b)
            self.dev.submit(b)
            outs.append(get(self.dev, self.out)[:n])
            pos += n
        return np.concatenate(outs)


def get_words(device, t):
    return np.frombuffer(device.read_sync(t.buf, t.offset, t.nbytes), np.uint32)


def _reference(xs, hq, hkv, d, ring, dtype, softcap=0.0):
    n = len(xs)
    x = xs.astype(np.float16).astype(np.float32) if dtype == "f16" else xs
    rot = nn_ref.rope(x, np.arange(n), n_heads=hq + hkv, rot_dim=d, base=BASE, neox=False)
    sink = nn_ref.rope(x, np.minimum(np.arange(n), ring.window), n_heads=hq, rot_dim=d, base=BASE, neox=False)
    k, v = rot[:, hq:hq + hkv].transpose(1, 0, 2), x[:, hq + hkv:].transpose(1, 0, 2)
    return nn_ref.ring_attention(rot[:, :hq], sink[:, :hq], k, v, range(n), ring.sinks, ring.window, d ** -0.5,
                                 softcap)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("sinks,window", [(4, 40), (0, 33), (20, 24)])
def test_ring_prefill_and_decode_match_the_reference(device, dtype, sinks, window):
    """150 positions through a ring of 40 + 24 rows: prefill forwards (some crossing the cache's end)
    and decode steps in the short and the split form, GQA heads (3 per kv head)."""
    hq, hkv, d, rows = 6, 2, 32, 24
    ring = Ring(sinks, window)
    ctx = window + rows
    xs = np.random.default_rng(sinks + window).standard_normal((150, hq + 2 * hkv, d))
    r = RingRun(device, xs, hq, hkv, d, ring, ctx, rows, dtype, min_chunk=16)
    sizes = [24, 17, 1, 1, 24, 3, 1, 24, 24, 5, 1, 1, 23, 1]
    assert sum(sizes) == 150
    ref = _reference(xs, hq, hkv, d, ring, dtype)
    tol = TOL[dtype]
    np.testing.assert_allclose(r.feed(sizes), ref, **tol)
    np.testing.assert_allclose(r.feed(sizes, short=False), ref, **tol)
    rot = nn_ref.rope(xs, np.arange(150), n_heads=hq + hkv, rot_dim=d, base=BASE, neox=False)
    full = nn_ref.causal_attention(rot[:, :hq], rot[:, hq:hq + hkv].transpose(1, 0, 2),
                                   xs[:, hq + hkv:].transpose(1, 0, 2), 0, d ** -0.5)
    assert np.abs(full[window + 10:] - ref[window + 10:]).max() > 1e-2     # the ring changes the result


def test_ring_with_a_soft_cap(device):
    """Gemma 2's soft-capped scores over the ring, odd head width and one kv head (GQA 5)."""
    hq, hkv, d, rows, ring = 5, 1, 16, 8, Ring(3, 21)
    ctx = ring.window + rows
    xs = np.random.default_rng(5).standard_normal((70, hq + 2 * hkv, d)) * 2.0
    r = RingRun(device, xs, hq, hkv, d, ring, ctx, rows, "f32", softcap=2.0)
    ref = _reference(xs, hq, hkv, d, ring, "f32", softcap=2.0)
    np.testing.assert_allclose(r.feed([8, 7, 1, 8, 8, 1, 1, 8, 8, 1, 8, 8, 3]), ref, **TOL["f32"])
    assert np.abs(_reference(xs, hq, hkv, d, ring, "f32") - ref).max() > 1e-2


def test_a_rows_result_does_not_depend_on_the_forwards(device):
    """Rows fed in different forwards (prefill chunks of other sizes, or one at a time through the
    causal kernel) give the same bits: each row folds the same rows in the same blocks."""
    hq, hkv, d, rows, ring = 9, 3, 64, 16, Ring(4, 48)
    ctx = ring.window + rows
    xs = np.random.default_rng(3).standard_normal((120, hq + 2 * hkv, d))
    r = RingRun(device, xs, hq, hkv, d, ring, ctx, rows, "f16")
    a = r.feed([16] * 7 + [8])
    b = r.feed([5, 16, 16, 11, 16, 16, 16, 16, 8])
    c = r.feed([16, 2, 2, 14, 16, 16, 16, 16, 16, 6])
    assert (a == b).all() and (a == c).all()


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_ring_over_a_quantised_cache(device, kv):
    """rope_kv_quant writes the ring's rows and the sink queries; attention over the quantised ring
    follows the reference within the cache's rounding, and the ring's rows are the positions'."""
    hq, hkv, d, rows, ring = 6, 2, 32, 16, Ring(4, 40)
    ctx = ring.window + rows
    xs = np.random.default_rng(7).standard_normal((130, hq + 2 * hkv, d))
    r = RingRun(device, xs, hq, hkv, d, ring, ctx, rows, "f32", kv=kv)
    got = r.feed([16, 16, 1, 16, 16, 1, 1, 16, 16, 15, 1, 1, 14])
    ref = _reference(xs, hq, hkv, d, ring, "f32")
    err = np.abs(got - ref).max()
    assert err < (0.05 if kv == "q8_0" else 0.3), err
    # the cache rows hold the newest position of each ring slot: 129 is in row 4 + (129 - 4) % 52
    words = get_words(device, r.kc)
    codes, scales = nn_ref.kv_unpack(words, hkv, ctx, d, kv)
    keys = nn_ref.kv_dequantize(codes, scales)
    rot = nn_ref.rope(xs, np.arange(130), n_heads=hq + hkv, rot_dim=d, base=BASE, neox=False)[:, hq:hq + hkv]
    row = ring.sinks + (129 - ring.sinks) % (ctx - ring.sinks)
    np.testing.assert_allclose(keys[:, row], rot[129], atol=0.05 if kv == "q8_0" else 0.4)
    np.testing.assert_allclose(keys[:, 2], rot[2], atol=0.05 if kv == "q8_0" else 0.4)   # a sink stays
