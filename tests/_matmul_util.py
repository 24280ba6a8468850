"""Shared set-up of matmul tests: random weight in its file layout, activations, numpy reference."""
from __future__ import annotations

import numpy as np

from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.common import Tensor, new_tensor
from webgpu_engine.kernels.matmul import file_row_bytes, upload_weight

TOL = {"f32": 1e-4, "f16": 1e-2}
NP = {"f32": np.float32, "f16": np.float16}


def rel_err(y, ref) -> float:
    """max |y - ref| / max |ref|: the error measure of the matmul tests."""
    return np.abs(y - ref).max() / np.abs(ref).max()


def upload_tensor(dev, a: np.ndarray, dtype: str, pad_elems: int = 0, *, owner: str) -> Tensor:
    """Upload `a` as `dtype` after `pad_elems` leading elements (a view at an offset that is not
    256-byte aligned, as model code makes of shared buffers)."""
    flat = np.concatenate([np.full(pad_elems, 7, NP[dtype]), a.astype(NP[dtype]).ravel()])
    return Tensor(dev.upload(flat, owner=owner), a.shape, dtype, pad_elems * flat.itemsize)


def read_tensor(dev, t: Tensor) -> np.ndarray:
    start = t.offset & ~3    # readbacks start at a multiple of 4 bytes
    raw = dev.read_sync(t.buf, start, t.offset - start + t.nbytes)[t.offset - start:]
    return np.frombuffer(raw, NP[t.dtype]).reshape(t.shape).astype(np.float64)


def matmul_case(dev, qtype, n, k, T, act, rng, *, owner, parts=1, bias=False, accumulate=False,
                max_binding=None, pad=0, raw=None):
    """(w, x, y, bias, ref): a weight uploaded in `parts` row pieces, x (T, k), y (T, n) (holding
    random values when `accumulate`), an optional f32 bias, and ref = x·dequant(W)ᵀ (+ y0 + bias)
    in float64 from x as the kernel sees it."""
    raw = raw if raw is not None else qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    rb = file_row_bytes(qtype, k)
    cuts = np.linspace(0, n, parts + 1).astype(int)
    pieces = [memoryview(raw)[a * rb:b * rb] for a, b in zip(cuts[:-1], cuts[1:])]
    w = upload_weight(dev, pieces, qtype, n, k, owner=owner, label=f"{qtype}{n}x{k}",
                      max_binding=max_binding)
    x = rng.standard_normal((T, k)).astype(NP[act])
    xt = upload_tensor(dev, x, act, pad, owner=owner)
    ref = x.astype(np.float64) @ W.T
    if accumulate:
        y0 = rng.standard_normal((T, n)).astype(NP[act])
        yt = upload_tensor(dev, y0, act, pad + 3, owner=owner)
        ref = ref + y0.astype(np.float64)
    else:
        yt = new_tensor(dev, (T, n), act, owner=owner)
    bt = None
    if bias:
        b = rng.standard_normal(n).astype(np.float32)
        bt = upload_tensor(dev, b, "f32", 5, owner=owner)
        ref = ref + b
    return w, xt, yt, bt, ref


def rows_equal_one_row(run, T: int) -> list:
    """run(rows, fused_rows) -> the output arrays of a matmul over `rows` (a slice of the T input
    rows, uploaded afresh at the same offsets, so that a row alone runs the one-row path's very
    pipeline); asserts that the T-row fused_rows outputs equal, row by row and bit for bit, those of
    the one-row decode kernel on each row alone. Returns the T-row outputs."""
    outs = run(slice(0, T), True)
    for t in range(T):
        alone = run(slice(t, t + 1), False)
        for a, b in zip(outs, alone):
            np.testing.assert_array_equal(a[t:t + 1], b, err_msg=f"row {t} of {T}")
    return outs
