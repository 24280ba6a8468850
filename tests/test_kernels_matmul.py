"""matmul / embedding / upload_weight / upload_vector on the real adapter against float64 numpy.

Error measure: max |y - ref| / max |ref| (per test), ref = x · dequant(W)ᵀ in float64 with x as
the kernel sees it (f16-rounded for f16 activations). f32 activations: 1e-4; f16: 1e-2.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.common import Tensor, new_tensor, run_ops
from webgpu_engine.kernels import nn, nn_ref
from webgpu_engine.kernels.matmul import (MIXED, QTYPES, MatmulConfig, NormOut, RopeKV, embedding, epilogue_ok,
                                          gpu_row_bytes, interleave_pairs, matmul, upload_vector, upload_weight)
from webgpu_engine.kernels.matmul.layout import grid
from webgpu_engine.kernels.qtypes import QTYPE

from _matmul_util import NP, TOL, matmul_case, read_tensor, rel_err, upload_tensor

OWNER = "test:matmul"


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner(OWNER)


def _tensor(dev, a: np.ndarray, dtype: str, pad_elems: int = 0) -> Tensor:
    return upload_tensor(dev, a, dtype, pad_elems, owner=OWNER)


def _read(dev, t: Tensor) -> np.ndarray:
    return read_tensor(dev, t)


def check_matmul(dev, qtype, n, k, T, act, *, parts=1, bias=False, accumulate=False, rng=None,
                 max_binding=None, pad=0, raw=None, config=None):
    rng = rng or np.random.default_rng(n * 7 + k + T)
    w, xt, yt, bt, ref = matmul_case(dev, qtype, n, k, T, act, rng, owner=OWNER, parts=parts, bias=bias,
                                     accumulate=accumulate, max_binding=max_binding, pad=pad, raw=raw)
    run_ops(dev, matmul(dev, xt, w, yt, bias=bt, accumulate=accumulate, config=config))
    y = _read(dev, yt)
    e = rel_err(y, ref)
    assert e < TOL[act], f"{qtype} {act} T={T} ({n}x{k}): error {e:.3g}"
    return w


# --------------------------------------------------------------------------- every type, small odd shapes
@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("qtype", QTYPES)
def test_types_odd_rows(device, qtype, act, T):
    """N = 100 rows: not a multiple of the workgroup size. T = 1: the decode kernels; T = 7: the
    batch kernel's 8-row tile (the 16-row prefill tile of every type and activation:
    test_kernels_matmul_tiled.py's test_types_odd_shapes)."""
    check_matmul(device, qtype, 100, 256, T, act)


@pytest.mark.parametrize("qtype,act", [("f32", "f32"), ("bf16", "f16"), ("q4_1", "f16"), ("q6_k", "f32")])
def test_prefill_rows_take_the_tiled_kernel(device, qtype, act):
    """T = 67 (past the batch kernel's 16 rows, not a multiple of the tile) goes to the prefill
    tile: the pipeline test_kernels_matmul_tiled.py runs for every type and activation at N = 100,
    K = 256 (the same WGSL), here reached through the selector."""
    check_matmul(device, qtype, 100, 256, 67, act)
    rng = np.random.default_rng(67)
    w = upload_weight(device, qr.random_weight(qtype, 100, 256, rng), qtype, 100, 256, owner=OWNER)
    op = matmul(device, new_tensor(device, (67, 256), act, owner=OWNER), w,
                new_tensor(device, (67, 100), act, owner=OWNER))
    assert op.name.startswith("matmul_tiled"), op.name


@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("k", [36, 100])
def test_float_k_not_multiple_of_32(device, qtype, k):
    check_matmul(device, qtype, 33, k, 5, "f32")
    check_matmul(device, qtype, 33, k, 1, "f16")


# --------------------------------------------------------------------------- model shapes
@pytest.mark.parametrize("qtype,n,k,T,act", [
    ("q4_1", 1536, 576, 1, "f32"),    # SmolLM2 gate / up
    ("q4_1", 1536, 576, 67, "f16"),
    ("q4_1", 576, 1536, 7, "f32"),    # down
    ("q4_1", 576, 1536, 1, "f16"),
    ("q4_1", 192, 576, 7, "f32"),     # k / v
    ("q4_0", 576, 1536, 1, "f32"),
    ("q8_0", 576, 1536, 7, "f16"),
    ("q4_k", 1536, 768, 7, "f32"),    # K-quants need K % 256 == 0
    ("q6_k", 576, 1536, 7, "f32"),
    ("q5_k", 1536, 768, 1, "f32"),    # decode, unrolled K
    ("q3_k", 576, 1536, 1, "f16"),    # decode, K past the unrolled limit: the loop kernel
    ("iq4_xs", 576, 1536, 1, "f32"),
    ("q2_k", 1536, 768, 7, "f32"),    # the 4-row tile
    ("q5_0", 576, 1536, 1, "f32"),
    ("iq4_nl", 1536, 576, 7, "f16"),
    ("mxfp4", 576, 1536, 7, "f32"),   # gpt-oss's experts
    ("mxfp4", 1536, 576, 1, "f16"),
])
def test_llm_shapes(device, qtype, n, k, T, act):
    check_matmul(device, qtype, n, k, T, act)


@pytest.mark.parametrize("act", ["f32", "f16"])
def test_fused_qkv_parts(device, act):
    """Q (576), K (192), V (192) rows uploaded as three parts: one 960-row matrix."""
    check_matmul(device, "q4_1", 960, 576, 7, act, parts=3)
    check_matmul(device, "q4_0", 960, 576, 1, act, parts=3)


@pytest.mark.parametrize("qtype,n,k,T,act", [
    ("f32", 1536, 384, 67, "f32"),    # MiniLM intermediate
    ("f32", 384, 1536, 7, "f32"),     # MiniLM output
    ("f16", 1152, 384, 67, "f16"),    # fused QKV
    ("f16", 384, 1536, 1, "f32"),
])
def test_bert_shapes_with_bias(device, qtype, n, k, T, act):
    check_matmul(device, qtype, n, k, T, act, bias=True)


def test_lm_head_q8_0(device):
    """Tied embeddings: 49152 x 576 Q8_0, decode and a short prefill, over one upload. The reference
    dequantises 4096 rows at a time: the whole float64 matrix (226 MB) cost ~5 CPU s a case on this
    host, most of it in page faults, against ~0.5 s for both cases in pieces."""
    n, k, rows = 49152, 576, 4096
    rng = np.random.default_rng(3)
    raw = qr.random_weight("q8_0", n, k, rng)
    w = upload_weight(device, raw, "q8_0", n, k, owner=OWNER, label="lm_head")
    cases = [(rng.standard_normal((T, k)).astype(NP[act]), act) for T, act in ((1, "f32"), (7, "f16"))]
    refs = [np.empty((len(x), n)) for x, _ in cases]
    rb = qr.row_bytes("q8_0", k)
    for r0 in range(0, n, rows):
        W = qr.dequantize(memoryview(raw)[r0 * rb:(r0 + rows) * rb], "q8_0", rows, k)
        for (x, _), ref in zip(cases, refs):
            ref[:, r0:r0 + rows] = x.astype(np.float64) @ W.T
    for (x, act), ref in zip(cases, refs):
        yt = new_tensor(device, (len(x), n), act, owner=OWNER)
        run_ops(device, matmul(device, _tensor(device, x, act), w, yt))
        assert rel_err(_read(device, yt), ref) < TOL[act], (len(x), act)


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0", "f32"])
def test_accumulate_and_bias(device, qtype, act):
    """y += x·Wᵀ (the fused residual add), with and without bias, at unaligned tensor offsets."""
    check_matmul(device, qtype, 70, 256, 1, act, accumulate=True, pad=1 * 4)
    check_matmul(device, qtype, 70, 256, 9, act, accumulate=True, bias=True, pad=12)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q6_k", "f16", "q5_0", "q3_k"])   # q5_0, q3_k: repacked
def test_split_weight(device, qtype):
    """A weight above the binding limit is split by rows; force it with a small limit. Parts of the
    upload straddle the buffer boundaries."""
    k = 512
    limit = 37 * gpu_row_bytes(qtype, k)
    w = check_matmul(device, qtype, 150, k, 7, "f32", parts=2, max_binding=limit)
    assert len(w.bufs) == 5 and w.rows_per_buf == 37 and w.parts[-1] == (148, 2)
    check_matmul(device, qtype, 150, k, 1, "f16", parts=3, max_binding=limit, bias=True)


@pytest.mark.parametrize("cfg", [MatmulConfig(wg=32, rr=1, tm=1), MatmulConfig(wg=64, rr=2, tm=4, prr=1),
                                 MatmulConfig(wg=128, rr=4, tm=4, prr=2),
                                 MatmulConfig(wg=16, rr=2, tm=4, prr=4)])
def test_strategy_parameters(device, cfg):
    """Every strategy gives the same answer, with row counts that leave partial row groups."""
    for T in (1, 19):
        check_matmul(device, "q4_1", 130, 256, T, "f32", config=cfg)
        check_matmul(device, "f32", 131, 100, T, "f16", config=cfg)
    with pytest.raises(ValueError, match="strategy"):
        check_matmul(device, "q4_1", 130, 256, 2, "f32", config=MatmulConfig(tm=3))


def test_real_smollm2_weights(device, smollm2_gguf):
    """Real Q4_1 and Q8_0 blocks straight from the GGUF file (as the model loader passes them)."""
    r = GGUFReader(str(smollm2_gguf))
    ts = {t.name: t for t in r.tensors}
    for name, qtype in [("blk.0.ffn_down.weight", "q4_1"), ("blk.0.attn_k.weight", "q4_1")]:
        t = ts[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        check_matmul(device, qtype, n, k, 7, "f32", raw=np.ascontiguousarray(t.data).tobytes())
    emb = ts["token_embd.weight"]
    raw = np.ascontiguousarray(emb.data[:4096]).tobytes()
    check_matmul(device, "q8_0", 4096, 576, 1, "f32", raw=raw)


# --------------------------------------------------------------------------- embedding
@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_embedding(device, qtype, act):
    rng = np.random.default_rng(4)
    V, C = 300, 256 if qtype not in ("f32", "f16", "bf16") else 100
    raw = qr.random_weight(qtype, V, C, rng)
    ref = qr.dequantize(raw, qtype, V, C)
    table = upload_weight(device, raw, qtype, V, C, owner=OWNER, label="emb")
    ids = np.array([0, 299, 5, 5, 123, 77, 1], np.uint32)
    it = Tensor(device.upload(np.concatenate([[9, 9, 9], ids]).astype(np.uint32), owner=OWNER),
                (len(ids),), "u32", 12)
    out = new_tensor(device, (len(ids), C), act, owner=OWNER)
    run_ops(device, embedding(device, it, table, out))
    e = rel_err(_read(device, out), ref[ids])
    assert e < (1e-7 if act == "f32" else 1e-3)


def test_embedding_split_table(device):
    rng = np.random.default_rng(5)
    V, C = 1000, 576
    raw = qr.random_weight("q8_0", V, C, rng)
    table = upload_weight(device, [raw[:400 * 612], raw[400 * 612:]], "q8_0", V, C, owner=OWNER,
                          label="emb", max_binding=300 * 648)
    assert len(table.bufs) == 4
    ids = rng.integers(0, V, 40).astype(np.uint32)
    it = Tensor(device.upload(ids, owner=OWNER), (40,), "u32")
    out = new_tensor(device, (40, C), "f32", owner=OWNER)
    run_ops(device, embedding(device, it, table, out))
    np.testing.assert_allclose(_read(device, out), qr.dequantize(raw, "q8_0", V, C)[ids], rtol=1e-6)


# --------------------------------------------------------------------------- vectors, errors, limits
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_upload_vector(device, dtype):
    v = np.random.default_rng(6).standard_normal(37).astype(np.float32)
    raw = qr.random_weight(dtype, 1, 36, np.random.default_rng(6)) if dtype != "f32" else v.tobytes()
    want = qr.dequantize(raw, dtype, 1, len(raw) // (4 if dtype == "f32" else 2))[0]
    t = upload_vector(device, raw, dtype=dtype, owner=OWNER, label="v")
    assert t.dtype == "f32" and t.shape == (len(want),)
    np.testing.assert_array_equal(_read(device, t), want)


def test_shape_errors(device):
    raw = qr.random_weight("q4_1", 64, 256, np.random.default_rng(7))
    with pytest.raises(ValueError, match="bytes given"):
        upload_weight(device, raw[:-20], "q4_1", 64, 256, owner=OWNER)
    with pytest.raises(ValueError, match="k % 32"):
        upload_weight(device, raw, "q4_1", 64 * 256 // 100, 100, owner=OWNER)
    with pytest.raises(ValueError, match="unsupported weight type"):
        upload_weight(device, raw, "q8_1", 64, 256, owner=OWNER)
    w = upload_weight(device, raw, "q4_1", 64, 256, owner=OWNER)
    x = new_tensor(device, (2, 128), "f32", owner=OWNER)
    y = new_tensor(device, (2, 64), "f32", owner=OWNER)
    with pytest.raises(ValueError, match="columns"):
        matmul(device, x, w, y)
    x = new_tensor(device, (2, 256), "f32", owner=OWNER)
    with pytest.raises(ValueError, match="expected"):
        matmul(device, x, w, new_tensor(device, (3, 64), "f32", owner=OWNER))
    with pytest.raises(ValueError, match="f16"):
        matmul(device, x, w, new_tensor(device, (2, 64), "f16", owner=OWNER))


def test_grid_respects_dispatch_limit():
    for g in (1, 65535, 65536, 10 ** 6):
        x, y = grid(g)
        assert x <= 65535 and y <= 65535 and x * y >= g


def test_embedding_many_ids_folds_grid(device):
    """T * C / 32 / 64 > 65535 workgroups: the dispatch is folded into two dimensions."""
    V, C, T = 64, 32 * 64, 2100    # 2100 * 64 chunks / 64 per workgroup... x 64 = 134400 groups
    raw = qr.random_weight("q4_1", V, C, np.random.default_rng(8))
    table = upload_weight(device, raw, "q4_1", V, C, owner=OWNER, label="emb")
    ids = (np.arange(T) * 7 % V).astype(np.uint32)
    it = Tensor(device.upload(ids, owner=OWNER), (T,), "u32")
    out = new_tensor(device, (T, C), "f16", owner=OWNER)
    run_ops(device, embedding(device, it, table, out, wg=1))
    assert rel_err(_read(device, out), qr.dequantize(raw, "q4_1", V, C)[ids]) < 1e-3


# --------------------------------------------------------------------------- decode path, fused inputs
@pytest.mark.parametrize("qtype,n,k,act", [("q4_1", 130, 576, "f32"), ("q4_1", 130, 576, "f16"),
                                           ("q8_0", 70, 256, "f32"), ("q8_0", 70, 256, "f16"),
                                           ("f16", 33, 64, "f16"), ("q6_k", 20, 512, "f32"),
                                           ("q3_k", 20, 512, "f16"), ("iq4_nl", 36, 96, "f32")])
def test_decode_fused_norm_and_silu(device, qtype, n, k, act):
    """T = 1 with RMSNorm fused in (norm=(g, eps)) and with SiLU·up fused in (silu=True), against
    numpy; bias and accumulate on top, x at an unaligned offset. The fused input's code depends on
    the activation type and the kernel (v4 for Q4_1 / Q8_0: both activations), not on how a weight
    decodes: the other types each take one activation."""
    rng = np.random.default_rng(n + k)
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    w = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="w")
    x = rng.standard_normal((1, k)).astype(NP[act])
    g = rng.standard_normal(k).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    y0 = rng.standard_normal((1, n)).astype(NP[act])
    xd = x.astype(np.float64)
    h = xd / np.sqrt((xd ** 2).mean() + 1e-5) * g
    yt = _tensor(device, y0, act, 3)
    run_ops(device, matmul(device, _tensor(device, x, act, 8), w, yt, norm=(_tensor(device, g, "f32", 4), 1e-5),
                           bias=_tensor(device, b, "f32", 1), accumulate=True))
    assert rel_err(_read(device, yt), h @ W.T + b + y0) < TOL[act]
    gu = rng.standard_normal((1, 2 * k)).astype(NP[act]) * 3
    for gate, ref in (("silu", nn_ref.silu_mul), ("gelu_tanh", nn_ref.gelu_tanh_mul)):   # act(gate) * up
        yt = new_tensor(device, (1, n), act, owner=OWNER)
        run_ops(device, matmul(device, _tensor(device, gu, act, 4), w, yt, silu=True, gate_act=gate))
        assert rel_err(_read(device, yt), ref(gu.astype(np.float64)) @ W.T) < TOL[act], gate
    with pytest.raises(ValueError, match="gate_act must be one of"):
        matmul(device, _tensor(device, gu, act, 4), w, yt, silu=True, gate_act="relu")
    with pytest.raises(ValueError, match="T = 1"):
        matmul(device, new_tensor(device, (2, k), act, owner=OWNER), w,
               new_tensor(device, (2, n), act, owner=OWNER), silu=False, norm=(_tensor(device, g, "f32"), 1e-5))


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0", "q4_k"])
def test_decode_loop_and_unrolled_agree(device, qtype):
    """T = 1 through the loop kernel (unroll off, or K / N above the unroll limits) and the unrolled
    kernel (matmul_decode.wgsl): both match the reference."""
    for cfg in (MatmulConfig(unroll=False), MatmulConfig(), MatmulConfig(unroll_max_k=128),
                MatmulConfig(unroll_max_n=64)):
        check_matmul(device, qtype, 100, 512, 1, "f16", config=cfg, bias=True)


@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype", ["q4_1", "q4_0", "q8_0", "q5_0", "q5_1", "iq4_nl", "mxfp4"])
def test_decode_vec4_weights(device, qtype, act):
    """T = 1 through matmul_decode_v4.wgsl (weights read as vec4<u32> spans of 4 rows): rows not a
    multiple of 4 (the last span runs past the weight), rows 4 bytes (K = 544: 85 words for the
    4-bit types) and 8 bytes (K = 576) off 16-byte alignment, a weight split over buffers at a row
    count not a multiple of 4, x at an offset that is not 256-byte aligned, bias + accumulate: all
    match the reference."""
    cfg = MatmulConfig(v4=True)
    for n, k, rows_per_buf, pad in ((101, 544, None, 4), (50, 576, 13, 0)):
        mb = rows_per_buf and rows_per_buf * k // 32 * QTYPE[qtype].gpu_bytes
        w = check_matmul(device, qtype, n, k, 1, act, config=cfg, bias=True, accumulate=True, pad=pad,
                         max_binding=mb)
        assert len(w.bufs) == (1 if mb is None else 4)
    # the v4 kernel is the one that ran: its source declares W4
    x = new_tensor(device, (1, 576), act, owner=OWNER)
    w = upload_weight(device, qr.random_weight(qtype, 8, 576, np.random.default_rng(0)), qtype, 8, 576,
                      owner=OWNER, label="w")
    for on in (True, False):
        op = matmul(device, x, w, new_tensor(device, (1, 8), act, owner=OWNER),
                    config=MatmulConfig(v4=on))
        assert ("W4" in op.dispatches[0][0].key.header) == on


# --------------------------------------------------------------------------- decode path, fused epilogues
_PAIRS = [("q4_1", 66, 576, MatmulConfig()),           # v4 kernel
          ("q8_0", 34, 256, MatmulConfig(v4=False)),    # unrolled
          ("f16", 18, 64, MatmulConfig()),
          ("q4_k", 10, 256, MatmulConfig()),
          ("q5_k", 10, 256, MatmulConfig()),
          ("q5_1", 18, 64, MatmulConfig())]


@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype,f,k,cfg,gate", [(*p, "silu") for p in _PAIRS] +
                         [(*p, "gelu_tanh") for p in _PAIRS[:2]])
def test_silu_epilogue_and_pairs(device, qtype, f, k, cfg, act, gate):
    """A gate + up weight uploaded with interleave_pairs: T = 1 with silu_out stores
    act(x·Gᵀ) * (x·Uᵀ) (F outputs, F not a multiple of 4 rows per invocation x 2; act SiLU or
    GELU-tanh); T = 5 through the prefill path + silu_mul(pairs=True) gives the same; both against
    numpy. GELU-tanh's code (gate_act_source) is the same text whatever the weight: with the v4 and
    the unrolled kernel."""
    rng = np.random.default_rng(f + k)
    rg, ru = qr.random_weight(qtype, f, k, rng), qr.random_weight(qtype, f, k, rng)
    G, U = qr.dequantize(rg, qtype, f, k), qr.dequantize(ru, qtype, f, k)
    w = upload_weight(device, interleave_pairs(rg, ru, qtype, k), qtype, 2 * f, k, owner=OWNER, label="gu")
    assert epilogue_ok(device, qtype, 2 * f, k, cfg, force=True)
    for T in (1, 5):
        x = rng.standard_normal((T, k)).astype(NP[act])
        xd = x.astype(np.float64)
        ref = (nn_ref.silu_mul if gate == "silu" else nn_ref.gelu_tanh_mul)(
            np.concatenate([xd @ G.T, xd @ U.T], axis=1))
        y = new_tensor(device, (T, f), act, owner=OWNER)
        xt = _tensor(device, x, act, 4)
        if T == 1:
            op = matmul(device, xt, w, y, silu_out=True, config=cfg, gate_act=gate)
            assert len(op.dispatches) == 1 and "ep_silu(" in op.dispatches[0][0].key.header
            run_ops(device, op)
        else:
            gu = new_tensor(device, (T, 2 * f), act, owner=OWNER)
            run_ops(device, matmul(device, xt, w, gu), nn.silu_mul(device, gu, y, pairs=True, act=gate))
        assert rel_err(_read(device, y), ref) < TOL[act], f"T={T}"
    with pytest.raises(ValueError, match="T = 1"):
        matmul(device, new_tensor(device, (2, k), act, owner=OWNER), w,
               new_tensor(device, (2, f), act, owner=OWNER), silu_out=True)
    with pytest.raises(ValueError, match="accumulate"):
        matmul(device, new_tensor(device, (1, k), act, owner=OWNER), w,
               new_tensor(device, (1, f), act, owner=OWNER), silu_out=True, accumulate=True)


@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype,rot_dim,bias", [("q4_1", 32, False), ("q8_0", 16, True), ("f16", 32, True)])
def test_rope_kv_epilogue(device, qtype, rot_dim, bias, act):
    """The qkv projection with rope_kv at T = 1 equals matmul + nn.rope_kv (the unfused decode
    path) and numpy: q and k rows rotated at position pos (partial rotary dims too), k and v
    written to cache row pos and nothing else in the caches changed; bias added before rotating."""
    Hq, Hkv, D, K, ctx, pos = 4, 2, 32, 128, 12, 9
    n = (Hq + 2 * Hkv) * D
    rng = np.random.default_rng(rot_dim + K)
    raw = qr.random_weight(qtype, n, K, rng)
    W = qr.dequantize(raw, qtype, n, K)
    w = upload_weight(device, raw, qtype, n, K, owner=OWNER, label="qkv")
    x = rng.standard_normal((1, K)).astype(NP[act])
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    bt = _tensor(device, b, "f32", 2) if bias else None
    step = device.upload(np.array([pos, 1, pos + 1, 0], np.uint32), owner=OWNER)
    freq = nn.rope_frequencies(device, rot_dim, 10000.0, owner=OWNER)
    c0 = rng.standard_normal((Hkv, ctx, D)).astype(NP[act])
    outs = []
    for fused in (True, False):
        kc, vc = _tensor(device, c0, act, 8), _tensor(device, c0, act, 0)
        qkv = new_tensor(device, (1, n), act, owner=OWNER)
        xt = _tensor(device, x, act, 4)
        if fused:
            rope = RopeKV(step, freq, kc, vc, Hq, Hkv, D, rot_dim, ctx)
            run_ops(device, matmul(device, xt, w, qkv, bias=bt, rope_kv=rope))
        else:
            run_ops(device, matmul(device, xt, w, qkv, bias=bt),
                    nn.rope_kv(device, qkv.view((1, Hq + 2 * Hkv, D)), kc, vc, step, n_q_heads=Hq,
                               n_kv_heads=Hkv, head_dim=D, ctx=ctx, rot_dim=rot_dim))
        outs.append([_read(device, t) for t in (qkv, kc, vc)])
    # numpy: projection (+ bias), rotation of q and k heads, cache rows
    yref = x.astype(np.float64) @ W.T + (b if bias else 0.0)
    heads = yref.reshape(Hq + 2 * Hkv, D)
    rot = nn_ref.rope(heads[None], np.array([pos]), n_heads=Hq + Hkv, rot_dim=rot_dim, base=10000.0,
                      neox=False)[0, :Hq + Hkv].astype(np.float64)
    qkv_ref = np.concatenate([rot, heads[Hq + Hkv:]]).reshape(1, n)
    kc_ref, vc_ref = c0.astype(np.float64).copy(), c0.astype(np.float64).copy()
    kc_ref[:, pos] = rot[Hq:]
    vc_ref[:, pos] = heads[Hq + Hkv:]
    for got, name in zip(outs, ("fused", "unfused")):
        assert rel_err(got[0], qkv_ref) < TOL[act], name
        assert np.abs(got[1] - kc_ref).max() < TOL[act] * np.abs(kc_ref).max(), name
        assert np.abs(got[2] - vc_ref).max() < TOL[act] * np.abs(vc_ref).max(), name
    for a, b_ in zip(*outs):
        assert np.abs(a - b_).max() <= (1e-6 if act == "f32" else 2e-3) * max(1.0, np.abs(b_).max())


@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype,k,cfg,entry", [
    ("q4_1", 576, MatmulConfig(), "matmul_decode"),                    # v4 kernel
    ("q8_0", 256, MatmulConfig(v4=False), "matmul_decode"),            # unrolled
    ("q4_1", 1536, MatmulConfig(), "matmul_res_norm"),                 # K too long: loop kernel
    ("f16", 64, MatmulConfig(unroll_max_k=32), "matmul_res_norm")])
def test_res_norm_epilogue_and_rms_from(device, qtype, k, cfg, entry, act):
    """x += a·Wᵀ + b with norm_out stores x, x * g and the sums of x^2 per 4 rows; the next matmul
    with rms_from on x * g gives RMSNorm(x) · W2ᵀ — both against numpy, run twice (the partials
    are overwritten, not accumulated)."""
    n, n2, eps = 96, 40, 1e-5
    rng = np.random.default_rng(k + n)
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    w = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="o")
    raw2 = qr.random_weight("q4_1", n2, n, rng)
    W2 = qr.dequantize(raw2, "q4_1", n2, n)
    w2 = upload_weight(device, raw2, "q4_1", n2, n, owner=OWNER, label="qkv")
    a = rng.standard_normal((1, k)).astype(NP[act])
    x0 = rng.standard_normal((1, n)).astype(NP[act])
    b = rng.standard_normal(n).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    at, gt, bt = _tensor(device, a, act, 4), _tensor(device, g, "f32", 8), _tensor(device, b, "f32", 4)
    xt = _tensor(device, x0, act, 12)
    h = new_tensor(device, (1, n), act, owner=OWNER)
    part = _tensor(device, np.full(n // 4, 7.0, np.float32), "f32", 16)
    y2 = new_tensor(device, (1, n2), act, owner=OWNER)
    op = matmul(device, at, w, xt, bias=bt, accumulate=True, config=cfg, norm_out=NormOut(gt, h, part))
    assert len(op.dispatches) == 1 and op.dispatches[0][0].key.entry == entry
    op2 = matmul(device, h, w2, y2, rms_from=(part, eps), config=cfg)
    assert len(op2.dispatches) == 1 and "dec_pss(" in op2.dispatches[0][0].key.header
    run_ops(device, op, op2)
    xr = x0.astype(np.float64) + a.astype(np.float64) @ W.T + b                     # (1, n)
    xs = xr.astype(NP[act]).astype(np.float64)                                      # as stored
    normed = xs / np.sqrt((xs ** 2).mean() + eps) * g
    assert rel_err(_read(device, xt), xr) < TOL[act]
    assert rel_err(_read(device, h), xs * g) < TOL[act]
    assert rel_err(_read(device, part), (xs ** 2).reshape(-1, 4).sum(1)) < TOL[act]
    assert rel_err(_read(device, y2), normed @ W2.T) < TOL[act]
    run_ops(device, op)                       # x grows again; the partials follow it
    xs2 = (xs + a.astype(np.float64) @ W.T + b).astype(NP[act]).astype(np.float64)
    assert rel_err(_read(device, part), (xs2 ** 2).reshape(-1, 4).sum(1)) < TOL[act]
    with pytest.raises(ValueError, match="only one"):
        matmul(device, at, w, xt, silu_out=True, norm_out=NormOut(gt, h, part))
    with pytest.raises(ValueError, match="partial sums"):
        matmul(device, h, w2, y2, rms_from=(gt, eps))


@pytest.mark.parametrize("qtype", ["q4_1", "q4_0", "q8_0"])
def test_interleaved_spans_every_reader(device, qtype):
    """A weight stored in interleaved 4-row spans (n = 75: two whole 32-row groups and an 11-row
    tail; the default on CPU adapters) gives what the row layout gives through every kernel that
    reads it: the T = 1 vec4 and unrolled decode kernels, the loop kernel, the tiled and the 4-row
    tile prefill kernels, and the embedding gather."""
    n, k = 75, 256
    rng = np.random.default_rng(21)
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    wi = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="wi", interleave=True)
    wr = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="wr", interleave=False)
    assert wi.inter_full == 2 * 8 * wi.row_words and wr.inter_full == 0
    assert device.read_sync(wi.bufs[0]) != device.read_sync(wr.bufs[0])     # the layouts differ
    for cfg, T in ((MatmulConfig(), 1), (MatmulConfig(v4=False), 1), (MatmulConfig(unroll=False), 1),
                   (None, 40), (MatmulConfig(), 5)):
        x = rng.standard_normal((T, k)).astype(np.float32)
        ref = x.astype(np.float64) @ W.T
        for w in (wi, wr):
            y = new_tensor(device, (T, n), "f32", owner=OWNER)
            run_ops(device, matmul(device, _tensor(device, x, "f32"), w, y, config=cfg))
            assert rel_err(_read(device, y), ref) < TOL["f32"], (cfg, T, w.label)
    ids = np.array([0, 31, 32, 74, 64, 5], np.uint32)
    it = Tensor(device.upload(ids, owner=OWNER), (len(ids),), "u32")
    out = new_tensor(device, (len(ids), k), "f32", owner=OWNER)
    run_ops(device, embedding(device, it, wi, out))
    assert rel_err(_read(device, out), W[ids]) < 1e-7


def test_epilogue_ok_needs_one_buffer(device):
    """A weight that upload_weight would split across buffers cannot take a fused epilogue (the
    model then keeps its separate rope / silu ops), one that fits can."""
    limit = min(device.max_storage_binding, device.max_buffer_size)
    k = 512
    n_fit = limit // (k * 4) // 4 * 4
    assert epilogue_ok(device, "f32", n_fit, k, force=True)
    assert not epilogue_ok(device, "f32", n_fit + 4, k, force=True)


# --------------------------------------------------------------------------- parts of different types
@pytest.mark.parametrize("act", ["f32", "f16"])
def test_mixed_type_parts(device, act):
    """A fused projection whose parts differ in type (Q4_K_M files store attn_v in Q6_K beside
    Q4_K attn_q / attn_k): one MIXED weight whose rows keep their places. Against numpy at T = 1
    (decode; also with the RMSNorm fused in), 7, 37 and row-invariant, with bias and accumulate;
    fused epilogues are refused."""
    rng = np.random.default_rng(11)
    k = 256      # one super-block: the kernels' K loops are tested elsewhere, this is about the parts
    spec = [("q4_k", 64), ("q4_k", 32), ("q6_k", 32), ("q5_0", 8)]
    raws = [qr.random_weight(qt, rows, k, rng) for qt, rows in spec]
    W = np.concatenate([qr.dequantize(r, qt, rows, k) for r, (qt, rows) in zip(raws, spec)])
    n = W.shape[0]
    w = upload_weight(device, raws, [qt for qt, _ in spec], n, k, owner=OWNER, label="qkv")
    assert w.qtype == MIXED and [s.qtype for s in w.subs] == ["q4_k", "q6_k", "q5_0"]
    assert not epilogue_ok(device, w.qtype, n, k, force=True)
    b = rng.standard_normal(n).astype(np.float32)
    for T, kw in [(1, {}), (7, {}), (37, {}), (5, {"row_invariant": True})]:
        x = rng.standard_normal((T, k)).astype(NP[act])
        y0 = rng.standard_normal((T, n)).astype(NP[act])
        yt = _tensor(device, y0, act, 3)
        run_ops(device, matmul(device, _tensor(device, x, act, 8), w, yt, bias=_tensor(device, b, "f32", 1),
                               accumulate=True, **kw))
        ref = x.astype(np.float64) @ W.T + b + y0.astype(np.float64)
        assert rel_err(_read(device, yt), ref) < TOL[act], f"T={T} {kw}"
    x = rng.standard_normal((1, k)).astype(NP[act])
    g = rng.standard_normal(k).astype(np.float32)
    xd = x.astype(np.float64)
    yt = new_tensor(device, (1, n), act, owner=OWNER)
    run_ops(device, matmul(device, _tensor(device, x, act), w, yt, norm=(_tensor(device, g, "f32"), 1e-5)))
    assert rel_err(_read(device, yt), (xd / np.sqrt((xd ** 2).mean() + 1e-5) * g) @ W.T) < TOL[act]
    with pytest.raises(ValueError, match="fused epilogue"):
        matmul(device, _tensor(device, x, act), w, new_tensor(device, (1, n // 2), act, owner=OWNER),
               silu_out=True)
    with pytest.raises(ValueError, match="rows"):
        upload_weight(device, raws, [qt for qt, _ in spec], n + 4, k, owner=OWNER)


# --------------------------------------------------------------------------- row-invariant (prefill)
@pytest.mark.parametrize("qtype,act", [("q4_1", "f32"), ("q8_0", "f16"), ("q4_k", "f32"), ("f16", "f32"),
                                       ("q6_k", "f16"), ("q5_k", "f32"), ("iq4_xs", "f16"), ("q5_0", "f32")])
def test_row_invariant_rows_do_not_depend_on_T(device, qtype, act):
    """matmul(..., row_invariant=True): each row against numpy, and bit for bit the same whether it
    runs alone (T = 1), in a short batch (below the tiled kernel's min_t) or in a long one."""
    n, k, T = 96, 256, 21
    rng = np.random.default_rng(5)
    raw = qr.random_weight(qtype, n, k, rng)
    W = qr.dequantize(raw, qtype, n, k)
    w = upload_weight(device, raw, qtype, n, k, owner=OWNER, label="ri")
    x = rng.standard_normal((T, k)).astype(NP[act])
    rows = {}
    for t0, t1 in [(0, T), (0, 1), (5, 6), (3, 7), (8, 21), (20, 21)]:
        xt = _tensor(device, x[t0:t1], act)
        yt = new_tensor(device, (t1 - t0, n), act, owner=OWNER)
        run_ops(device, matmul(device, xt, w, yt, row_invariant=True))
        y = _read(device, yt)
        assert rel_err(y, x[t0:t1].astype(np.float64) @ W.T) < TOL[act]
        for i, t in enumerate(range(t0, t1)):
            if t in rows:
                assert np.array_equal(rows[t], y[i]), f"row {t} differs between batches"
            rows[t] = y[i]
    g = _tensor(device, np.ones(k, np.float32), "f32")
    with pytest.raises(Exception, match="row_invariant"):
        matmul(device, _tensor(device, x[:1], act), w, new_tensor(device, (1, n), act, owner=OWNER),
               row_invariant=True, norm=(g, 1e-5))
