"""numpy references for the weight layouts the matmul kernels read (tests and benchmarks only).

Written from ggml's block layouts (ggml-common.h), not from the gguf package, so tests can check
one against the other. f16 is IEEE half. Every function takes the raw bytes of a weight of n rows
by k columns and returns float64 (n, k). This module imports numpy: never import it in page code.
"""
from __future__ import annotations

import numpy as np

# bytes per block and elements per block
BLOCK = {"q4_0": (18, 32), "q4_1": (20, 32), "q8_0": (34, 32), "q4_k": (144, 256), "q6_k": (210, 256),
         "q5_0": (22, 32), "q5_1": (24, 32), "iq4_nl": (18, 32), "q5_k": (176, 256), "q3_k": (110, 256),
         "q2_k": (84, 256), "iq4_xs": (136, 256), "q4_0f32": (20, 32), "mxfp4": (17, 32)}
# IQ4_NL / IQ4_XS: a 4-bit index into this non-linear table (ggml's kvalues_iq4nl)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         np.float64)
# MXFP4: a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit) and its value
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
ELEM = {"f32": 4, "f16": 2, "bf16": 2}


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k weights in the file layout."""
    if qtype in ELEM:
        return k * ELEM[qtype]
    bs, qk = BLOCK[qtype]
    if k % qk:
        raise ValueError(f"{qtype} rows need a multiple of {qk} columns, got {k}")
    return k // qk * bs


def _blocks(raw, qtype: str, n: int, k: int) -> np.ndarray:
    bs, _ = BLOCK[qtype]
    a = np.frombuffer(raw, dtype=np.uint8, count=n * row_bytes(qtype, k))
    return a.reshape(-1, bs)


def _f16(b: np.ndarray) -> np.ndarray:
    # (nb, 2) uint8 → (nb, 1) float64
    return np.ascontiguousarray(b).view(np.float16).astype(np.float64)


def dequantize(raw, qtype: str, n: int, k: int) -> np.ndarray:
    """(n, k) float64 values of a weight stored as `qtype`."""
    if qtype == "f32":
        return np.frombuffer(raw, np.float32, n * k).reshape(n, k).astype(np.float64)
    if qtype == "f16":
        return np.frombuffer(raw, np.float16, n * k).reshape(n, k).astype(np.float64)
    if qtype == "bf16":
        u = np.frombuffer(raw, np.uint16, n * k).astype(np.uint32) << 16
        return u.view(np.float32).reshape(n, k).astype(np.float64)
    b = _blocks(raw, qtype, n, k)
    out = {"q4_0": _q4_0, "q4_1": _q4_1, "q8_0": _q8_0, "q4_k": _q4_k, "q6_k": _q6_k, "q5_0": _q5_0,
           "q5_1": _q5_1, "iq4_nl": _iq4_nl, "q5_k": _q5_k, "q3_k": _q3_k, "q2_k": _q2_k,
           "iq4_xs": _iq4_xs, "q4_0f32": _q4_0f32, "mxfp4": _mxfp4}[qtype](b)
    return out.reshape(n, k)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # qs (nb, 16): low nibbles are elements 0..15, high nibbles 16..31
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)


def _q4_0(b):   # d f16, qs[16]; (q - 8) * d
    return (_nibbles(b[:, 2:18]) - 8.0) * _f16(b[:, 0:2])


def _q4_0f32(b):   # d f32, qs[16]; (q - 8) * d (MLC's q4f32_1 after loaders/mlc.py's repack)
    return (_nibbles(b[:, 4:20]) - 8.0) * np.ascontiguousarray(b[:, 0:4]).view(np.float32).astype(np.float64)


def _q4_1(b):   # d f16, m f16, qs[16]; q * d + m
    return _nibbles(b[:, 4:20]) * _f16(b[:, 0:2]) + _f16(b[:, 2:4])


def _q8_0(b):   # d f16, qs int8[32]; q * d
    return b[:, 2:34].view(np.int8).astype(np.float64) * _f16(b[:, 0:2])


def _high_bits(qh: np.ndarray) -> np.ndarray:
    # qh (nb, 4) little-endian u32 → (nb, 32): bit e is the fifth bit of element e
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return bits.astype(np.float64)


def _q5_0(b):   # d f16, qh u32, qs[16]; (q - 16) * d with q = nibble | high bit << 4
    return (_nibbles(b[:, 6:22]) + 16.0 * _high_bits(b[:, 2:6]) - 16.0) * _f16(b[:, 0:2])


def _q5_1(b):   # d f16, m f16, qh u32, qs[16]; q * d + m
    return (_nibbles(b[:, 8:24]) + 16.0 * _high_bits(b[:, 4:8])) * _f16(b[:, 0:2]) + _f16(b[:, 2:4])


def _iq4_nl(b):   # d f16, qs[16]; d * kvalues[nibble]
    return KVALUES_IQ4NL[_nibbles(b[:, 2:18]).astype(np.int64)] * _f16(b[:, 0:2])


def _mxfp4(b):   # e E8M0 (2^(e - 127)), qs[16] of E2M1 codes
    return E2M1[_nibbles(b[:, 1:17]).astype(np.int64)] * np.exp2(b[:, 0:1].astype(np.float64) - 127.0)


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all j: scales (nb, 12) → six-bit (sc, m), each (nb, 8)."""
    s = scales.astype(np.int64)
    sc = np.empty((s.shape[0], 8), np.int64)
    mn = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[:, j] = s[:, j] & 63
            mn[:, j] = s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0x0F) | ((s[:, j - 4] >> 6) << 4)
            mn[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    return sc, mn


def _q4_k(b):   # d, dmin f16, scales[12], qs[128]; d*sc*q - dmin*m per 32-element sub-block
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 32)              # 4 groups of 32 bytes = 64 elements each
    q = np.stack([qs & 0x0F, qs >> 4], axis=2)        # (nb, 4, 2, 32): low nibbles first
    q = q.reshape(-1, 8, 32).astype(np.float64)        # sub-block j = 2*group + (high nibble)
    out = d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]
    return out.reshape(-1, 256)


def _q6_k(b):   # ql[128], qh[64], scales int8[16], d f16; d*sc*(q - 32) per 16 elements
    ql, qh = b[:, 0:128].astype(np.int64), b[:, 128:192].astype(np.int64)
    sc = b[:, 192:208].view(np.int8).astype(np.float64)
    d = _f16(b[:, 208:210])
    out = np.empty((b.shape[0], 256), np.float64)
    for h in range(2):                 # two halves of 128 elements
        l_ = ql[:, 64 * h:64 * h + 64]
        hh = qh[:, 32 * h:32 * h + 32]
        for quarter in range(4):       # elements 32*quarter .. +32 of this half
            lo = l_[:, 32 * (quarter & 1):32 * (quarter & 1) + 32]
            lo = (lo >> 4) if quarter >= 2 else (lo & 0x0F)
            q = lo | (((hh >> (2 * quarter)) & 3) << 4)
            for half16 in range(2):
                s = sc[:, 8 * h + 2 * quarter + half16][:, None]
                e0 = 128 * h + 32 * quarter + 16 * half16
                out[:, e0:e0 + 16] = d * s * (q[:, 16 * half16:16 * half16 + 16] - 32.0)
    return out


def _q5_k(b):   # d, dmin f16, scales[12], qh[32], qs[128]; d*sc*q - dmin*m per 32, q 5 bits
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = scale_min_k4(b[:, 4:16])
    qs = b[:, 48:176].reshape(-1, 4, 32)
    lo = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.int64)
    qh = b[:, 16:48].astype(np.int64)                 # bit j of qh[l]: element l of sub-block j
    hi = np.stack([(qh >> j) & 1 for j in range(8)], axis=1)
    q = (lo | (hi << 4)).astype(np.float64)
    out = d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]
    return out.reshape(-1, 256)


def q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 16 six-bit scales (signed, minus 32) from scales[12] (nb, 12) → (nb, 16): low nibbles
    in bytes 0..7 (scales 0..7 low, 8..15 high nibble), the top two bits in bytes 8..11."""
    s = s.astype(np.int64)
    out = np.empty((s.shape[0], 16), np.int64)
    for i in range(16):
        low = s[:, i] & 0xF if i < 8 else s[:, i - 8] >> 4
        out[:, i] = (low | (((s[:, 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)) - 32
    return out


def _q3_k(b):   # hmask[32], qs[64], scales[12], d f16; d*sc*(q - 4) per 16, q = 2 bits | hmask bit << 2
    hm, qs = b[:, 0:32].astype(np.int64), b[:, 32:96].astype(np.int64)
    sc = q3_k_scales(b[:, 96:108]).astype(np.float64)
    d = _f16(b[:, 108:110])
    out = np.empty((b.shape[0], 256), np.float64)
    for j in range(8):              # 32 elements: half h = j // 4 of qs, bits 2 (j % 4) of its bytes
        h, jj = divmod(j, 4)
        q = ((qs[:, 32 * h:32 * h + 32] >> (2 * jj)) & 3) | (((hm >> j) & 1) << 2)
        for half16 in range(2):
            s = sc[:, 2 * j + half16][:, None]
            out[:, 32 * j + 16 * half16:32 * j + 16 * half16 + 16] = \
                d * s * (q[:, 16 * half16:16 * half16 + 16] - 4.0)
    return out


def _q2_k(b):   # scales[16] (low nibble scale, high min), qs[64], d, dmin f16; d*sc*q - dmin*m per 16
    sc, qs = b[:, 0:16].astype(np.int64), b[:, 16:80].astype(np.int64)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    out = np.empty((b.shape[0], 256), np.float64)
    for j in range(8):              # as Q3_K: 32 elements from 2 bits of half j // 4 of qs
        h, jj = divmod(j, 4)
        q = ((qs[:, 32 * h:32 * h + 32] >> (2 * jj)) & 3).astype(np.float64)
        for half16 in range(2):
            s = sc[:, 2 * j + half16][:, None]
            out[:, 32 * j + 16 * half16:32 * j + 16 * half16 + 16] = \
                d * (s & 0xF) * q[:, 16 * half16:16 * half16 + 16] - dmin * (s >> 4)
    return out


def _iq4_xs(b):   # d f16, scales_h u16, scales_l[4], qs[128]; d*(ls - 32)*kvalues[nibble] per 32
    d = _f16(b[:, 0:2])
    sh = b[:, 2].astype(np.int64) | (b[:, 3].astype(np.int64) << 8)
    sl = b[:, 4:8].astype(np.int64)
    out = np.empty((b.shape[0], 256), np.float64)
    for j in range(8):
        ls = ((sl[:, j // 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)
        q = _nibbles(b[:, 8 + 16 * j:24 + 16 * j]).astype(np.int64)
        out[:, 32 * j:32 * j + 32] = d * (ls - 32.0)[:, None] * KVALUES_IQ4NL[q]
    return out


# random_weight's f16 fields of a block, drawn in this order: (byte offset, low, high) of each scale
# (or min) it draws uniformly; the other bytes stay random
_K = (0.0005, 0.005)
_RANDOM_F16 = {
    "q4_0": ((0, 0.001, 0.05),), "q8_0": ((0, 0.001, 0.05),), "q5_0": ((0, 0.001, 0.05),),
    "q4_1": ((0, 0.001, 0.05), (2, -0.2, 0.0)), "q5_1": ((0, 0.001, 0.05), (2, -0.2, 0.0)),
    "iq4_nl": ((0, 0.0002, 0.005),), "iq4_xs": ((0, 0.00002, 0.0005),),
    "q4_k": ((0, *_K), (2, *_K)), "q5_k": ((0, *_K), (2, *_K)), "q2_k": ((80, *_K), (82, *_K)),
    "q3_k": ((108, *_K),), "q6_k": ((208, *_K),),
}


def random_weight(qtype: str, n: int, k: int, rng: np.random.Generator) -> bytes:
    """Raw bytes of a random (n, k) weight in `qtype`'s file layout: random payload bits with
    finite, moderate f16 scales (so tests cover every bit pattern of the quants)."""
    if qtype == "f32":
        return rng.standard_normal((n, k)).astype(np.float32).tobytes()
    if qtype == "f16":
        return rng.standard_normal((n, k)).astype(np.float16).tobytes()
    if qtype == "bf16":
        f = rng.standard_normal((n, k)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    bs, qk = BLOCK[qtype]
    nb = n * k // qk
    b = rng.integers(0, 256, size=(nb, bs), dtype=np.uint8)

    for col, lo, hi in _RANDOM_F16.get(qtype, ()):
        b[:, col:col + 2] = rng.uniform(lo, hi, (nb, 1)).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if qtype == "q4_0f32":                       # its scale is an f32
        b[:, 0:4] = rng.uniform(0.001, 0.05, (nb, 1)).astype(np.float32).view(np.uint8).reshape(nb, 4)
    if qtype == "mxfp4":                         # its scale a power of two, 2^-10 .. 2^-3
        b[:, 0] = rng.integers(117, 125, nb, dtype=np.uint8)
    return b.tobytes()
