"""Test helpers for the nn kernels: place numpy arrays in GPU tensors (at awkward offsets) and read back."""
from __future__ import annotations

import numpy as np

from webgpu_engine.kernels.common import Tensor, run_ops
from webgpu_engine.models.lora import HALVES

NP = {"f32": np.float32, "f16": np.float16, "u32": np.uint32}
# f32 within 1e-4 relative (1e-5 absolute); f16 within 1e-2
TOL = {"f32": dict(rtol=1e-4, atol=1e-5), "f16": dict(rtol=1e-2, atol=1e-2)}


def put(dev, arr, dtype="f32", lead=0, owner="test:nn"):
    """A Tensor holding arr as dtype, `lead` elements into its buffer (tests offset handling); bf16:
    arr's values rounded to bf16 (see rounded)."""
    if dtype == "bf16":
        a = HALVES["bf16"][0](arr)
    else:
        a = np.ascontiguousarray(np.asarray(arr).astype(NP[dtype]))
    pad = np.zeros(lead, a.dtype)
    tail = np.zeros(4, a.dtype)     # keeps the buffer larger than the tensor's window
    buf = dev.upload(np.concatenate([pad, a.ravel(), tail]).view(np.uint8), owner=owner, label="t")
    return Tensor(buf, a.shape, dtype, lead * a.itemsize)


def empty(dev, shape, dtype="f32", lead=0, fill=np.nan):
    return put(dev, np.full(shape, fill), dtype, lead)


def get(dev, t: Tensor) -> np.ndarray:
    lo = t.offset & ~3                      # reads start at 4-byte multiples
    raw = dev.read_sync(t.buf, lo, t.offset - lo + t.nbytes)[t.offset - lo:]
    return np.frombuffer(raw, NP[t.dtype]).reshape(t.shape).astype(np.float32)


def rounded(a, dtype):
    """What the GPU sees after upload as dtype (the reference input); bf16: rounded to nearest even,
    as the LoRA pool rounds."""
    if dtype == "bf16":
        to, back = HALVES["bf16"]
        return back(to(a))
    return np.asarray(a).astype(NP[dtype]).astype(np.float32)


def run(dev, *ops):
    run_ops(dev, *ops)


def step_buf(dev, pos0, n_new, kv_len=None):
    return dev.upload(np.array([pos0, n_new, pos0 + n_new if kv_len is None else kv_len, 0], np.uint32),
                      owner="test:nn", label="step")


def set_step(dev, buf, pos0, n_new, kv_len=None):
    dev.write(buf, np.array([pos0, n_new, pos0 + n_new if kv_len is None else kv_len, 0], np.uint32))
