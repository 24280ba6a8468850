"""Qwen3.5's recurrent states as sequences share and step them back: the kernels' state snapshots
(a row's state saved into another slot, a slot copied back: kernels/deltanet.py) against their numpy
references, and the paged batch (models/recurrent_snapshots.py): prefix reuse from a snapshot and
speculation whose rejected guesses roll the states back, each answer equal to the request alone and
to transformers' greedy tokens (tests/fixtures/qwen35_transformers.json)."""
from __future__ import annotations

import numpy as np
import pytest

from test_qwen35 import _delta_inputs, _delta_ref, _rows
from webgpu_engine.kernels import deltanet, deltanet_ref
from _nn_util import TOL, empty, get, put, rounded, run


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_causal_conv1d_saves_the_state_after_chosen_rows(device, dtype):
    """Two sequences' rows in one call (slot 0 from position 5, slot 1 from 0), rows 2 and 6 saving
    their states into slots 3 and 2: each saved slot holds the state after its row, the outputs and
    the sequences' own states are those without saves."""
    rng = np.random.default_rng(11)
    C, K = 20, 4
    w, s0 = rng.standard_normal((C, K)), rng.standard_normal((4, C, K - 1))
    x = rng.standard_normal((8, C))
    state, wt = put(device, s0), put(device, w)
    xt, yt = put(device, x, dtype), empty(device, (8, C), dtype)
    slots = [deltanet.row_slot(0)] * 2 + [deltanet.row_slot(0, save=3)] + [deltanet.row_slot(0)] * 2 + \
        [deltanet.row_slot(1)] + [deltanet.row_slot(1, save=2), deltanet.row_slot(1)]
    run(device, deltanet.causal_conv1d(device, xt, wt, state, yt, channels=C,
                                       rows=_rows(device, [5, 6, 7, 8, 9, 0, 1, 2], slots)))
    got, st = get(device, yt), get(device, state)
    xr = rounded(x, dtype)
    want_a, sa = deltanet_ref.causal_conv1d(xr[:5], w, s0[0])
    want_b, sb = deltanet_ref.causal_conv1d(xr[5:], w, None)
    np.testing.assert_allclose(got, np.concatenate([want_a, want_b]), **TOL[dtype])
    np.testing.assert_allclose(st[0], sa, **TOL[dtype])
    np.testing.assert_allclose(st[1], sb, **TOL[dtype])
    np.testing.assert_allclose(st[3], deltanet_ref.causal_conv1d(xr[:3], w, s0[0])[1], **TOL[dtype])
    np.testing.assert_allclose(st[2], deltanet_ref.causal_conv1d(xr[5:7], w, None)[1], **TOL[dtype])


def test_gated_delta_rule_saves_the_state_after_chosen_rows(device):
    """A verify step's rows (slot 1: a decode row and three guesses at positions 9..12, the first
    three saving into slots 2..4) beside another sequence's row: each saved slot is the state after
    its row, bit for bit the state a call stopping there leaves; outputs and last states unchanged."""
    rng = np.random.default_rng(12)
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    qkv, proj, hw = _delta_inputs(rng, 5, Hk, Hv, Dk, Dv)
    s0 = rng.standard_normal((5, Hv, Dk, Dv)) * 0.3
    hwt = put(device, hw)

    def call(T, positions, slots):
        state = put(device, s0)
        yt = empty(device, (T, Hv * Dv))
        run(device, deltanet.gated_delta_rule(device, put(device, qkv[:T]), put(device, proj[:T]), hwt, state, yt,
                                              n_k_heads=Hk, n_v_heads=Hv, k_dim=Dk, v_dim=Dv, z_col=3, eps=1e-6,
                                              rows=_rows(device, positions, slots)))
        return get(device, yt), get(device, state)

    saves = [deltanet.row_slot(1, save=s) for s in (2, 3, 4)] + [deltanet.row_slot(1), deltanet.row_slot(0)]
    got, st = call(5, [9, 10, 11, 12, 3], saves)
    want, ws = _delta_ref(qkv[:4], proj[:4], hw, s0[1], Hk, Hv, Dk, Dv)
    np.testing.assert_allclose(got[:4], want, **TOL["f32"])
    np.testing.assert_allclose(st[1], ws, **TOL["f32"])
    np.testing.assert_allclose(st[0], _delta_ref(qkv[4:5], proj[4:5], hw, s0[0], Hk, Hv, Dk, Dv)[1], **TOL["f32"])
    for n, slot in ((1, 2), (2, 3), (3, 4)):
        np.testing.assert_allclose(st[slot], _delta_ref(qkv[:n], proj[:n], hw, s0[1], Hk, Hv, Dk, Dv)[1],
                                   **TOL["f32"])
        alone = call(n, [9, 10, 11][:n], [deltanet.row_slot(1)] * n)[1]
        np.testing.assert_array_equal(st[slot], alone[1])          # the state a shorter step leaves


def test_state_copy_copies_whole_slots(device):
    """Two pairs of a table of three (the third past the count): the destinations equal their
    sources exactly, every other slot is untouched (an odd slot size: a last partial group)."""
    rng = np.random.default_rng(13)
    s = rng.standard_normal((6, 3, 7, 5)).astype(np.float32)
    state = put(device, s)
    pairs = put(device, np.array([2, 4, 0, 5, 2, 1, 3]), "u32")
    run(device, deltanet.state_copy(device, state, pairs, max_pairs=3))
    np.testing.assert_array_equal(get(device, state), deltanet_ref.state_copy(s, [(4, 0), (5, 2)]))
