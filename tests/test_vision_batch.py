"""Gemma 3's images under continuous batching: the paged prefill kernel's image spans (an image's rows
attend each other both ways, inside the sliding window) against numpy, and the batch's answers with
images against the same requests alone and transformers' (tests/fixtures/make_gemma3_vision.py)."""
from __future__ import annotations

import numpy as np
import pytest

import ref_vision
from _nn_util import TOL, empty, get, put, rounded, run, step_buf
from webgpu_engine.kernels import attention_paged as ap
from webgpu_engine.kernels import nn_ref


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


# ----------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("window", [0, 12])
def test_paged_prefill_image_spans(device, dtype, window):
    """A chunk of 80 rows at positions 30.. through a shuffled block table: rows 50..69 form one image
    (across the kernel's 64-row workgroups), rows 5..8 another; their rows see their image's later
    keys too (from the window's start), as the one-request path's attn_image_rows computes them; every
    other row equals the kernel without spans bit for bit."""
    rng = np.random.default_rng(5 + window)
    hq, hkv, d, bs, max_blocks, T, pos0 = 4, 2, 16, 16, 8, 80, 30
    n = pos0 + T
    kp, vp = (rng.standard_normal((12, bs, hkv, d)) for _ in range(2))
    table = np.zeros(max_blocks, np.uint32)
    table[:-(-n // bs)] = rng.permutation(12)[:-(-n // bs)]
    qkv = rng.standard_normal((T, hq + 2 * hkv, d))
    spans = np.zeros((T, 2), np.uint32)
    spans[50:70, 1], spans[5:9, 1] = pos0 + 70, pos0 + 9
    kt, vt = put(device, kp, dtype), put(device, vp, dtype, lead=8)
    qt, tt, step = put(device, qkv, dtype, lead=4), put(device, table, "u32"), step_buf(device, pos0, T)
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, max_blocks=max_blocks, scale=d ** -0.5, window=window)
    plain, imaged = empty(device, (T, hq * d), dtype), empty(device, (T, hq * d), dtype, lead=4)
    run(device, ap.paged_prefill(device, qt, kt, vt, plain, step, tt, **kw),
        ap.paged_prefill(device, qt, kt, vt, imaged, step, tt, **kw, spans=put(device, spans, "u32", lead=6)))
    kr, vr, q = rounded(kp, dtype), rounded(vp, dtype), rounded(qkv, dtype)
    keys = [np.stack([x[table[j // bs], j % bs] for j in range(n)], 1) for x in (kr, vr)]   # (Hkv, n, D)
    causal = nn_ref.causal_attention(q[:, :hq], *keys, pos0, d ** -0.5, window=window)
    want = ref_vision.attn_image_rows(causal, q, *keys, spans, pos0, hq, hkv, d ** -0.5, window)
    got, text = get(device, imaged), spans[:, 1] == 0
    assert np.abs(want[50:70] - causal[50:70]).max() > 0.05
    np.testing.assert_allclose(got, want, **TOL[dtype])
    assert np.array_equal(got[text], get(device, plain)[text])
