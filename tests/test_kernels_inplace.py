"""In-place norm and elementwise ops (y is the same tensor as an input) on the real adapter: the
results equal numpy's, and no dispatch binds one buffer range twice — the browser's WebGPU (Dawn)
rejects a range bound writable twice in one dispatch, which native wgpu lets pass, so this is
checked here on the bind groups themselves."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import nn, nn_ref
from webgpu_engine.kernels.common import Tensor

from _nn_util import TOL, get, put, rounded, run

DTYPES = ["f32", "f16"]


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


def no_range_bound_twice(op) -> None:
    for _, bg, *_ in op.dispatches:
        wins = [b for b in bg.buffers if isinstance(b, tuple)]
        for i, (b1, o1, s1) in enumerate(wins):
            for b2, o2, s2 in wins[i + 1:]:
                assert b1 is not b2 or o1 + s1 <= o2 or o2 + s2 <= o1, (op.name, o1, s1, o2, s2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_ops_match_numpy_and_bind_each_range_once(device, dtype):
    rng = np.random.default_rng(3)
    rows, cols = 5, 64
    x = rng.standard_normal((rows, cols)) * 2
    h = rng.standard_normal((rows, cols))
    w, b = rng.standard_normal(cols), rng.standard_normal(cols)
    xr, hr = rounded(x, dtype), rounded(h, dtype)

    def case(build, want):
        xt, ht = put(device, x, dtype, lead=4), put(device, h, dtype, lead=8)
        wt, bt = put(device, w), put(device, b)
        op, out = build(xt, ht, wt, bt)
        no_range_bound_twice(op)
        run(device, op)
        np.testing.assert_allclose(get(device, out), want, **TOL[dtype])

    case(lambda x_, h_, w_, b_: (nn.add(device, x_, h_, x_), x_), xr + hr)            # y = a
    case(lambda x_, h_, w_, b_: (nn.add(device, x_, h_, h_), h_), xr + hr)            # y = b
    case(lambda x_, h_, w_, b_: (nn.scale(device, x_, x_, 0.5), x_), xr * 0.5)
    case(lambda x_, h_, w_, b_: (nn.softcap(device, x_, x_, 1.5), x_), 1.5 * np.tanh(xr / 1.5))
    case(lambda x_, h_, w_, b_: (nn.tanh(device, x_, x_), x_), nn_ref.tanh(xr))
    case(lambda x_, h_, w_, b_: (nn.gelu(device, x_, x_), x_), nn_ref.gelu(xr))
    case(lambda x_, h_, w_, b_: (nn.rms_norm(device, h_, w_, h_, eps=1e-5), h_), nn_ref.rms_norm(hr, w, 1e-5))
    case(lambda x_, h_, w_, b_: (nn.layer_norm(device, x_, w_, b_, x_, eps=1e-5, residual=h_), x_),
         nn_ref.layer_norm(xr, w, b, 1e-5, residual=hr))
    case(lambda x_, h_, w_, b_: (nn.layer_norm(device, x_, w_, b_, h_, eps=1e-5, residual=h_), h_),
         nn_ref.layer_norm(xr, w, b, 1e-5, residual=hr))


def test_an_output_overlapping_an_input_elsewhere_is_refused(device):
    x = put(device, np.arange(16, dtype=np.float32))
    shifted = Tensor(x.buf, (15,), "f32", x.offset + 4)
    head = Tensor(x.buf, (15,), "f32", x.offset)
    with pytest.raises(ValueError, match="overlaps an input"):
        nn.scale(device, head, shifted, 2.0)
