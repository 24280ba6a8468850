"""The prefill path's CPU-adapter kernels (issue 48) on the real adapter: paged_prefill's windowed
attention (shaders/attention_paged_windows.wgsl, kernels/attention_paged.py paged_causal_window)
against numpy and bit for bit against the loop kernel it replaces (paged_causal, the op's first
dispatch, which also runs while the window kernel compiles): chunks at pos0 0 and past it, rows
that are not whole query blocks, fewer live rows than the op's, windows, soft-caps, sinks, several
heads a lane, and recording with and without the chunk's key count."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import attention_paged as ap
from webgpu_engine.kernels import nn_ref
from webgpu_engine.kernels.common import Op

from _nn_util import TOL, empty, get, put, rounded, set_step, step_buf

BS = 16


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


def _case(device, rng, dtype, hq, hkv, d, t_max, max_blocks):
    """Shuffled pools of max_blocks blocks, one table over them, qkv rows (t_max, Hq + 2 Hkv, D)."""
    n_blocks = max_blocks + 3
    kp, vp = rng.standard_normal((n_blocks, BS, hkv, d)) * 1.5, rng.standard_normal((n_blocks, BS, hkv, d))
    table = rng.permutation(n_blocks)[:max_blocks].astype(np.uint32)
    qkv = rng.standard_normal((t_max, hq + 2 * hkv, d))
    return ((rounded(kp, dtype), rounded(vp, dtype), rounded(qkv, dtype), table),
            (put(device, kp, dtype), put(device, vp, dtype, lead=8), put(device, qkv, dtype, lead=4),
             put(device, table, "u32")))


def _keys(pool, table, n):
    """(Hkv, n, D): keys 0..n-1 through the table."""
    return np.stack([pool[table[j // BS], j % BS] for j in range(n)], 1)


def _record(device, op: Op, n_keys=None) -> None:
    b = device.batch()
    op.record(b, n_keys=n_keys)
    device.submit(b)


def _loop(op: Op) -> Op:
    """The op's loop kernel alone (paged_causal: the reference the windows must equal)."""
    return Op([op.dispatches[0]], [], "paged_causal")


@pytest.mark.parametrize("dtype,hq,hkv,d,window,softcap,g", [
    ("f16", 9, 3, 64, 0, 0.0, None),     # SmolLM2-135M's heads, one head a lane
    ("f32", 8, 2, 32, 0, 0.0, 2),        # two heads a lane
    ("f32", 8, 2, 32, 40, 1.5, None),    # a sliding window and a soft-cap
])
def test_windows_equal_the_loop_kernel(device, dtype, hq, hkv, d, window, softcap, g):
    """Chunks of 100 rows (not whole 64-row query blocks) at pos0 0, 37 and 150, and a chunk of 30
    live rows of the 100 at pos0 200: every window's output equals numpy's causal attention and,
    bit for bit, paged_causal's, recorded with the chunk's key count and without it (windows for
    the whole table)."""
    rng = np.random.default_rng(48 + d + window)
    t_max, max_blocks = 100, 16
    (kp, vp, qkv, table), (kt, vt, qt, tt) = _case(device, rng, dtype, hq, hkv, d, t_max, max_blocks)
    out = empty(device, (t_max, hq * d), dtype)
    step = step_buf(device, 0, t_max)
    op = ap.paged_prefill(device, qt, kt, vt, out, step, tt, n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                          max_blocks=max_blocks, scale=d ** -0.5, window=window, softcap=softcap, heads_per_lane=g)
    assert [d_[0].key.entry for d_ in op.dispatches] == ["paged_causal"]    # the windows: made at the first record
    for pos0, rows in ((0, 100), (37, 100), (150, 100), (200, 30)):
        set_step(device, step, pos0, rows)
        n = pos0 + rows
        _record(device, _loop(op))
        loop = get(device, out)[:rows]
        ref = nn_ref.causal_attention(qkv[:rows, :hq], _keys(kp, table, n), _keys(vp, table, n), pos0, d ** -0.5,
                                      window=window, softcap=softcap)
        np.testing.assert_allclose(loop, ref, **TOL[dtype])
        for n_keys in (n, None):
            device.write(out.buf, np.full(out.nbytes // 4, 0x7FC00000, np.uint32), out.offset)   # NaNs
            _record(device, op, n_keys)
            assert [d_[0].key.entry for d_ in op.dispatches] == ["paged_causal"] + ["paged_causal_window"] * 3
            win = get(device, out)[:rows]
            assert np.array_equal(win, loop), f"pos0={pos0} rows={rows} n_keys={n_keys}: " \
                                              f"max |diff| {np.nanmax(np.abs(win - loop))}"


def test_windows_with_sinks(device):
    """gpt-oss's per-head sinks through the windowed kernel: numpy's output, and paged_causal's bits."""
    rng = np.random.default_rng(480)
    hq, hkv, d, t_max, max_blocks, pos0 = 8, 2, 32, 70, 12, 90
    (kp, vp, qkv, table), (kt, vt, qt, tt) = _case(device, rng, "f32", hq, hkv, d, t_max, max_blocks)
    sinks = rng.uniform(-1.0, 3.0, hq).astype(np.float32)
    out = empty(device, (t_max, hq * d))
    op = ap.paged_prefill(device, qt, kt, vt, out, step_buf(device, pos0, t_max), tt, n_q_heads=hq, n_kv_heads=hkv,
                          head_dim=d, max_blocks=max_blocks, scale=0.125, sinks=put(device, sinks, "f32"))
    n = pos0 + t_max
    _record(device, op, n)
    win = get(device, out)
    np.testing.assert_allclose(win, nn_ref.causal_attention(qkv[:, :hq], _keys(kp, table, n), _keys(vp, table, n),
                                                            pos0, 0.125, sinks=sinks), **TOL["f32"])
    _record(device, _loop(op))
    assert np.array_equal(get(device, out), win)


@pytest.mark.parametrize("dtype,rot,mscale", [("f16", 64, 1.0), ("f32", 48, 1.25)])
def test_rope_rows_equal_rope_kv_paged(device, monkeypatch, dtype, rot, mscale):
    """paged_rope_kv on CPU adapters (rope_kv_rows: a lane per row and pair) rotates the q and k
    heads and writes the pool rows as rope_kv_paged does, bit for bit (partial rotary, an attention
    factor, skipped slots, fewer live rows than dispatched), and as numpy's rope within tolerance."""
    rng = np.random.default_rng(rot)
    hq, hkv, d, t, n_blocks = 9, 3, 64, 40, 6
    qkv = rng.standard_normal((t, hq + 2 * hkv, d))
    pos = (np.arange(t) + 300).astype(np.uint32)
    slots = rng.permutation(n_blocks * BS)[:t].astype(np.uint32)
    slots[[3, 17]] = ap.SKIP_SLOT
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, rot_dim=rot, base=10000.0, mscale=mscale)
    results = []
    for cpu in (True, False):
        monkeypatch.setattr(ap, "_cpu_family", lambda dev, cpu=cpu: cpu)
        qt = put(device, qkv, dtype, lead=2)
        kp, vp = (put(device, np.full((n_blocks, BS, hkv, d), 9.0), dtype, lead=6) for _ in range(2))
        op = ap.paged_rope_kv(device, qt, kp, vp, put(device, pos, "u32"), put(device, slots, "u32"),
                              step_buf(device, 0, t - 5), **kw)
        assert op.dispatches[0][0].key.entry == ("rope_kv_rows" if cpu else "rope_kv_paged")
        _record(device, op)
        results.append([get(device, x) for x in (qt, kp, vp)])
    for new, old in zip(*results):
        assert np.array_equal(new, old)
    live = t - 5
    want = nn_ref.rope(rounded(qkv, dtype)[:live], pos[:live], n_heads=hq + hkv, rot_dim=rot, base=10000.0,
                       neox=False)
    want[:, :hq + hkv, :rot] *= mscale
    np.testing.assert_allclose(results[0][0][:live], want, **TOL[dtype])
    assert np.array_equal(results[0][0][live:], rounded(qkv, dtype)[live:])
    k_all = results[0][1].reshape(-1, hkv, d)
    written = slots[:live] != ap.SKIP_SLOT
    np.testing.assert_allclose(k_all[slots[:live][written]], want[written, hq:hq + hkv], **TOL[dtype])
