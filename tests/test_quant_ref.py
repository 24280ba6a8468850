"""quant_ref (our numpy dequantization, written from ggml's layouts) against the gguf package's
`gguf.quants.dequantize`, on quantized random data and on real blocks of the SmolLM2 GGUF file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader
from gguf import quants as gq

from webgpu_engine.kernels import quant_ref as qr

GGUF_TYPE = {"f16": GT.F16, "bf16": GT.BF16, "q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q8_0": GT.Q8_0,
             "q4_k": GT.Q4_K, "q6_k": GT.Q6_K, "q5_0": GT.Q5_0, "q5_1": GT.Q5_1, "iq4_nl": GT.IQ4_NL,
             "q5_k": GT.Q5_K, "q3_k": GT.Q3_K, "q2_k": GT.Q2_K, "iq4_xs": GT.IQ4_XS, "mxfp4": GT.MXFP4}


def _theirs(raw: bytes, qtype: str, n: int) -> np.ndarray:
    return gq.dequantize(np.frombuffer(raw, np.uint8).reshape(n, -1), GGUF_TYPE[qtype]).astype(np.float64)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "mxfp4", "bf16", "f16"])
def test_quantized_random_data(qtype):
    """gguf quantizes a random matrix; both dequantizations must agree exactly."""
    rng = np.random.default_rng(1)
    n, k = 24, 512
    x = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3, (n, 1))).astype(np.float32)
    if qtype == "f16":
        raw = x.astype(np.float16).tobytes()
    else:
        raw = gq.quantize(x, GGUF_TYPE[qtype]).tobytes()
    assert len(raw) == n * qr.row_bytes(qtype, k)
    ours = qr.dequantize(raw, qtype, n, k)
    np.testing.assert_array_equal(ours, _theirs(raw, qtype, n))
    # and the quantization is a close approximation of the data (sanity of the whole chain)
    assert np.abs(ours - x).max() < 0.2 * np.abs(x).max()


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "q5_0", "q5_1", "iq4_nl",
                                   "q5_k", "q3_k", "q2_k", "iq4_xs", "mxfp4"])
def test_random_blocks(qtype):
    """gguf cannot quantize K-quants or IQ4 from Python: random block bytes (every bit pattern of
    the quants and packed scales) with finite f16 scales test the layouts instead."""
    rng = np.random.default_rng(2)
    n, k = 16, 1024
    raw = qr.random_weight(qtype, n, k, rng)
    ours = qr.dequantize(raw, qtype, n, k)
    assert ours.shape == (n, k) and np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, _theirs(raw, qtype, n))


def test_scale_min_k4_matches_ggml_rule():
    """get_scale_min_k4 by hand for one block of scale bytes."""
    s = np.arange(12, dtype=np.uint8)[None, :] * np.uint8(23)
    sc, mn = qr.scale_min_k4(s)
    q = [int(v) for v in s[0]]
    for j in range(8):
        if j < 4:
            want = (q[j] & 63, q[j + 4] & 63)
        else:
            want = ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
        assert (sc[0, j], mn[0, j]) == want


def test_q3_k_scales_by_hand():
    """Q3_K's 6-bit scales: scale i has low 4 bits from byte i % 8 (low nibble for i < 8, else
    high) and high 2 bits from byte 8 + i % 4 at bit 2 (i // 4); stored plus 32."""
    s = (np.arange(12, dtype=np.uint8)[None, :] * np.uint8(37) + np.uint8(11))
    got = qr.q3_k_scales(s)
    q = [int(v) for v in s[0]]
    for i in range(16):
        low = q[i] & 0xF if i < 8 else q[i - 8] >> 4
        assert got[0, i] == (low | (((q[8 + i % 4] >> (2 * (i // 4))) & 3) << 4)) - 32


def test_type_tables_agree():
    """Every weight type the kernels read: the loader, the kernels' table, this reference and ggml
    agree on its block (weights, file bytes); a quantized GPU block is whole u32 words."""
    from webgpu_engine.kernels.qtypes import QTYPE
    from webgpu_engine.loaders.tensor_info import QTYPE_BLOCK, SUPPORTED_QTYPES
    assert set(SUPPORTED_QTYPES) == set(QTYPE)
    for name, t in QTYPE.items():
        assert QTYPE_BLOCK[name] == (t.block, t.file_bytes), name
        assert (t.pad_at is None) == (t.gpu_bytes == t.file_bytes), name
        if t.quantized:
            assert t.gpu_bytes % 4 == 0, name
            assert qr.BLOCK[name] == (t.file_bytes, t.block), name
            if name in GGUF_TYPE:            # q4_0f32 is ours (MLC's q4f32_1 repacked), not ggml's
                assert gq.GGML_QUANT_SIZES[GGUF_TYPE[name]] == (t.block, t.file_bytes), name


def test_iq4_table_is_ggml_table():
    assert qr.KVALUES_IQ4NL.tolist() == list(gq.IQ4_NL.kvalues)


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf):
    return GGUFReader(str(smollm2_gguf))


@pytest.mark.parametrize("name,qtype", [("blk.0.ffn_down.weight", "q4_1"), ("blk.3.attn_q.weight", "q4_1"),
                                        ("token_embd.weight", "q8_0")])
def test_real_smollm2_blocks(smollm2_reader, name, qtype):
    t = next(t for t in smollm2_reader.tensors if t.name == name)
    assert t.tensor_type == GGUF_TYPE[qtype]
    k = int(t.shape[0])
    n = min(int(t.shape[1]), 512)   # the first rows are enough (token_embd has 49152)
    raw = np.ascontiguousarray(t.data[:n]).tobytes()
    ours = qr.dequantize(raw, qtype, n, k)
    np.testing.assert_array_equal(ours, _theirs(raw, qtype, n))
    assert np.abs(ours).max() > 0
