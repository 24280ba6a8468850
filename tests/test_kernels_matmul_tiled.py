"""matmul_tiled (the T > 1 prefill matmul) on the real adapter against float64 numpy x·dequant(W)ᵀ.

Error measure: max |y - ref| / max |ref|, ref computed in float64 from x as the kernel sees it
(f16-rounded for f16 activations). f32 activations: 1e-4; f16: 1e-2. K stays small where the test
is about something else: the kernel's K loop is written out per K, so each K compiles a pipeline.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from webgpu_engine.kernels.matmul import tiled as mt
from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.common import Tensor, new_tensor, run_ops

from _matmul_util import TOL, matmul_case, read_tensor, rel_err, upload_tensor
from webgpu_engine.kernels.matmul import gpu_row_bytes, upload_weight

OWNER = "test:matmul_tiled"


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner(OWNER)


def _tensor(dev, a: np.ndarray, dtype: str, pad_elems: int = 0) -> Tensor:
    return upload_tensor(dev, a, dtype, pad_elems, owner=OWNER)


def _read(dev, t: Tensor) -> np.ndarray:
    return read_tensor(dev, t)


def check(dev, qtype, n, k, T, act, *, parts=1, bias=False, accumulate=False, max_binding=None,
          pad=0, raw=None, config=None, seed=None):
    """Run matmul_tiled on a random (or given) weight and compare with numpy; returns the QWeight."""
    rng = np.random.default_rng(seed if seed is not None else n * 7 + k + T)
    w, xt, yt, bt, ref = matmul_case(dev, qtype, n, k, T, act, rng, owner=OWNER, parts=parts, bias=bias,
                                     accumulate=accumulate, max_binding=max_binding, pad=pad, raw=raw)
    if config is None:   # the device's tile, also below its min_t (where the model would fall back)
        config = mt.default_config(dev, qtype)
        config.min_t = 2
    op = mt.matmul(dev, xt, w, yt, bias=bt, accumulate=accumulate, config=config)
    assert op is not None, f"{qtype} T={T} ({n}x{k}) should be supported"
    run_ops(dev, op)
    y = _read(dev, yt)
    e = rel_err(y, ref)
    assert e < TOL[act], f"{qtype} {act} T={T} ({n}x{k}): error {e:.3g}"
    return w


# --------------------------------------------------------------------------- every type
@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype", mt.QTYPES)
def test_types_odd_shapes(device, qtype, act):
    """N = 100 (not a multiple of the workgroup), T = 7 and 37 (partial tiles of activation rows)."""
    check(device, qtype, 100, 256, 7, act)
    check(device, qtype, 100, 256, 37, act)


@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16"])
def test_float_k_not_multiple_of_32(device, qtype):
    """Float weights with K % 32 != 0: the last chunk is zero-padded in x."""
    check(device, qtype, 34, 36, 5, "f32")
    check(device, qtype, 34, 100, 19, "f16")


def test_not_applicable_returns_none(device):
    """T == 1 is the decode kernel's job, and short T below the config's min_t runs faster in the
    row kernels: None tells the caller to fall back."""
    rng = np.random.default_rng(0)
    w = upload_weight(device, qr.random_weight("q4_1", 64, 64, rng), "q4_1", 64, 64, owner=OWNER)
    for T in (1, mt.default_config(device).min_t - 1):
        x = new_tensor(device, (T, 64), owner=OWNER)
        assert mt.matmul(device, x, w, new_tensor(device, (T, 64), owner=OWNER)) is None
    assert not mt.supports(w, 1, mt.TiledConfig(min_t=1)) and mt.supports(w, 2, mt.TiledConfig(min_t=2))
    assert mt.supports(w, mt.default_config(device).min_t)


def test_unaligned_weight_buffer_returns_none(device):
    """The kernel reads weights as vec4 words: a buffer that is not whole 16-byte words (33 rows
    of 36 f16 = 2376 B) is left to the fallback kernel."""
    rng = np.random.default_rng(0)
    w = upload_weight(device, qr.random_weight("f16", 33, 36, rng), "f16", 33, 36, owner=OWNER)
    x = new_tensor(device, (16, 36), owner=OWNER)
    assert mt.matmul(device, x, w, new_tensor(device, (16, 33), owner=OWNER)) is None


def test_bad_arguments(device):
    rng = np.random.default_rng(0)
    w = upload_weight(device, qr.random_weight("q4_1", 64, 64, rng), "q4_1", 64, 64, owner=OWNER)
    x = new_tensor(device, (16, 64), owner=OWNER)
    with pytest.raises(ValueError, match="expected"):
        mt.matmul(device, x, w, new_tensor(device, (16, 65), owner=OWNER))
    with pytest.raises(ValueError, match="f16"):
        mt.matmul(device, x, w, new_tensor(device, (16, 64), "f16", owner=OWNER))
    with pytest.raises(ValueError, match="tile"):
        mt.matmul(device, x, w, new_tensor(device, (16, 64), owner=OWNER), config=mt.TiledConfig(tm=33))
    with pytest.raises(ValueError, match="tile"):   # 2 x 32 rows x 6 chunks x 128 B > 32 KiB
        mt.matmul(device, x, w, new_tensor(device, (16, 64), owner=OWNER),
                  config=mt.TiledConfig(tm=32, kb=6))


# --------------------------------------------------------------------------- model shapes
@pytest.mark.parametrize("qtype,n,k,T,act", [
    ("q4_1", 3072, 576, 37, "f32"),   # SmolLM2 fused gate_up
    ("q4_1", 960, 576, 20, "f16"),    # fused qkv
    ("q4_1", 576, 1536, 9, "f32"),    # down
    ("q8_0", 576, 1536, 9, "f16"),
])
def test_llm_shapes(device, qtype, n, k, T, act):
    check(device, qtype, n, k, T, act)


@pytest.mark.parametrize("qtype,n,k,T,act", [
    ("f32", 1152, 384, 67, "f32"),    # MiniLM fused qkv
    ("f32", 384, 1536, 40, "f32"),    # output
    ("f16", 1536, 384, 33, "f16"),    # intermediate
])
def test_bert_shapes_with_bias(device, qtype, n, k, T, act):
    check(device, qtype, n, k, T, act, bias=True)


@pytest.mark.parametrize("act", ["f32", "f16"])
def test_fused_parts(device, act):
    """Q, K, V uploaded as three parts of one matrix."""
    check(device, "q4_1", 960, 576, 7, act, parts=3)


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0", "f32"])
def test_accumulate_and_bias(device, qtype, act):
    """y += x·Wᵀ (the fused residual add), with and without bias, at unaligned tensor offsets."""
    check(device, qtype, 70, 256, 3, act, accumulate=True, pad=4)
    check(device, qtype, 70, 256, 21, act, accumulate=True, bias=True, pad=12)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q6_k", "f16", "q5_0", "q3_k"])   # q5_0, q3_k: repacked
def test_split_weight(device, qtype):
    """A weight above the binding limit is split by rows (one dispatch per buffer); force it with a
    small limit (38 rows: whole 16-byte words per buffer). The upload's parts straddle the buffer
    boundaries."""
    k = 512
    limit = 38 * gpu_row_bytes(qtype, k)
    w = check(device, qtype, 150, k, 7, "f32", parts=2, max_binding=limit)
    assert len(w.bufs) == 4 and w.rows_per_buf == 38 and w.parts[-1] == (114, 36)
    check(device, qtype, 150, k, 18, "f16", parts=3, max_binding=limit, bias=True, accumulate=True)


@pytest.mark.parametrize("cfg", [mt.TiledConfig(tm=1, wg=8, kb=1, kmax=64),
                                 mt.TiledConfig(tm=5, wg=40, kb=3),
                                 mt.TiledConfig(tm=16, wg=256, kb=8),
                                 mt.TiledConfig(tm=3, wg=200, kb=5, kmax=5),
                                 mt.TiledConfig(tm=32, wg=64, kb=4, kmax=4)])
def test_tile_parameters(device, cfg):
    """Every tile gives the same answer, with partial row groups, partial T tiles, a last chunk
    group shorter than KB, a staging loop that wraps (TM x 8 KB vec4 vs WG invocations), and K
    split into blocks (K = 416: 13 chunks; kmax = 5 makes 3 blocks, the last one padded)."""
    check(device, "q4_1", 132, 416, 19, "f32", config=cfg)
    check(device, "f32", 131, 100, 23, "f16", config=cfg, bias=True)


@pytest.mark.parametrize("qtype", mt.QTYPES)
def test_k_blocks_accumulate(device, qtype):
    """K split into several dispatches (kmax = 5 chunks; K-quants round blocks up to whole
    super-blocks): the first applies bias and the caller's accumulate, the later ones add to y.
    Every type reads its weights from a block offset (its words per chunk or super-block); f16
    activations for one type of each kind (the activation code is the type's own in
    test_types_odd_shapes, the block offsets the same as with f32)."""
    cfg = mt.TiledConfig(tm=8, wg=64, kb=2, kmax=5)
    check(device, qtype, 72, 768, 11, "f32", config=cfg, bias=True, accumulate=True, pad=8)
    if qtype in ("f16", "q4_0", "q5_0", "q4_k", "q3_k"):     # float, 32-block, repacked, super-block
        check(device, qtype, 72, 768, 11, "f16", config=cfg)


def test_many_t_tiles(device):
    """T = 600 activation rows: 38 tiles of 16 in the second grid dimension."""
    check(device, "q4_1", 64, 128, 600, "f16")


def test_real_smollm2_weights(device, smollm2_gguf):
    """Real Q4_1 blocks straight from the GGUF file (as the model loader passes them)."""
    r = GGUFReader(str(smollm2_gguf))
    t = {t.name: t for t in r.tensors}["blk.0.ffn_down.weight"]
    k, n = int(t.shape[0]), int(t.shape[1])
    check(device, "q4_1", n, k, 13, "f32", raw=np.ascontiguousarray(t.data).tobytes())
