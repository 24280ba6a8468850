"""The fused decode matmul for 5..16 activation rows (`shaders/matmul_wide.wgsl`): what select.py's
`fused_rows` runs past MAX_DECODE_ROWS rows where the device allows (`ok`), instead of one unrolled
kernel per group of 4 rows. Each weight chunk is read and decoded once for all rows; each row's sums
are made with the one-row decode kernel's calls in its order (matmul_decode.wgsl / matmul_decode_v4.wgsl
for K up to the unroll limit, matmul.wgsl's loop kernels beyond), with the same fused inputs
(RMSNorm, act(gate)·up, a norm's partial sums) and epilogues (codegen.EPILOGUE_CALL), so a row's
bits do not depend on how many rows run. The K loop stays a loop (a few seconds to compile where
the unrolled 8-row kernel took minutes); x reaches the lanes by subgroup broadcasts. Page code:
standard library only.
"""
from __future__ import annotations

import os
import re
from math import gcd

from ...gpu import Device
from ...gpu.shaders import load_shader_source
from ..qtypes import QTYPE
from .codegen import V4_XS, X_FN, DecRows, _row_ends, _v4_args, pro_call, span_base, store_ends

MAX_ROWS = 16            # the most rows one wide kernel takes
# weight types whose rows the wide kernel sums as the one-row kernel does, bit for bit, on lavapipe
# (LLVM 15; tests/test_kernels_matmul_batch.py): Q8_0, IQ4_NL, IQ4_XS and MXFP4 (a scale, no offset:
# the decode's zero terms fold differently inside a loop than in straight-line code) differed in the
# last bit of some sums, so they keep the unrolled kernel in groups of 4 rows
EXACT = frozenset({"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"})
LANES = 8                # lanes that load a row's 32-activation chunk (a vec4 each)


def bucket(T: int) -> int:
    """The rows of the wide kernel that runs T rows: 8 or 16 (rows past T computed, not stored)."""
    return 8 if T <= 8 else 16


def subgroup_floor(dev: Device) -> int:
    """The fewest lanes a subgroup of `dev` has: the adapter's subgroup_min_size, or for lavapipe
    (whose adapter reports wgpu's generic 4) its SIMD width, the "N bits" of its name over 32."""
    m = re.search(r"llvmpipe \(.*?(\d+) bits\)", dev.info.device)
    return max(dev.subgroup_min_size, int(m.group(1)) // 32 if m else 0)


# "0": no wide kernel (fused rows past 4 in groups of 4, batch widths past 4 the tiled kernels); any
# other value or unset: the wide kernel serves fused rows past 4, a verify step's rows and batch widths
# 5..16 (models/paged.py, through select.fused_rows_max)
ENV = "WEBGPU_ENGINE_WIDE_ROWS"


def ok(dev: Device) -> bool:
    """Whether the wide kernel runs here: subgroups of at least LANES lanes, and $WEBGPU_ENGINE_WIDE_ROWS
    is not 0."""
    return os.environ.get(ENV, "") != "0" and lanes_ok(dev)


def lanes_ok(dev: Device) -> bool:
    """Subgroups of at least LANES lanes (subgroup_lanes.wgsl's lanes8: this kernel's, LoRA's)."""
    return dev.has_subgroups and subgroup_floor(dev) >= LANES


def _lane_x(mode: str, xo: str, c: str) -> tuple[str, str]:
    """(the XChunk, this lane's raw x for dec_sq or '') for the row at xword
    offset `xo`, chunk `c` (WGSL expressions): the one-row kernel's dec_x / dec_xn / dec_xs per
    vec4 (matmul_decode.wgsl), lane ln taking vec4 ln of the 8."""
    o = f"{xo} + ({c}) * 8u + ln"
    if mode == "norm":
        return f"wide_chunk_n(xget({o}), g[GOFF + ({c}) * 8u + ln])", f"xget({o})"
    if mode == "silu":
        return f"wide_chunk_s(xget({o}), xget({o} + NF))", ""
    return f"wide_chunk(xget({o}))", ""


def source(qtype: str, nchunks: int, k: int, x_off4: int, mode: str, nf4: int, g_off4: int, eps: float,
           ep: str, rows: DecRows, *, v4: bool, inter_full: int = 0, xs_fold: bool = True) -> str:
    """matmul_decode.wgsl (+ matmul_decode_v4.wgsl where `v4`) + matmul_wide.wgsl and the generated
    entry point `matmul_decode` for `rows.n` rows: the chunk loop in steps of U chunks (U * block
    words a whole number of vec4s for v4 weights, so every word's place is a constant offset from
    the step's base), the remainder after it."""
    assert X_FN[mode]                                  # a known mode
    bw = QTYPE[qtype].block_words if v4 else 0
    rw = nchunks * bw
    U = 4 // gcd(bw, 4) if v4 else 1
    fold = v4 and qtype in V4_XS and xs_fold
    comp = "xyzw"
    files = ["matmul_decode.wgsl"] + (["matmul_decode_v4.wgsl"] if v4 else []) + ["matmul_wide.wgsl",
                                                                                  "subgroup_lanes.wgsl"]
    lines = [load_shader_source(f) for f in files]
    lines += [f"const XOFF: u32 = {x_off4}u;\nconst NF: u32 = {nf4}u;\nconst GOFF: u32 = {g_off4}u;",
              f"const EPS: f32 = {float(eps)!r};",
              "@compute @workgroup_size(WG)",
              "fn matmul_decode(@builtin(workgroup_id) wid: vec3<u32>, "
              "@builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) sid: u32) {",
              f"    let ln = sid % {LANES}u;"] + pro_call(ep, rows)
    if v4:
        lines.append("    let i4 = wid.x * WG + lid;   // rows 4 * i4 .. 4 * i4 + 3")
        lines += span_base(rw, inter_full)
    else:
        lines.append("    let rows = row_group(wid, lid);")
    lines += [f"    var acc{t} = DecAcc(vec4<f32>(0.0), 0.0);" for t in range(rows.n)]

    def step(m: str, count: int, ind: str) -> list:
        """chunks m * U + u for u < count: x of every row, then each weight chunk once for the rows."""
        out, loaded = [], set()
        for u in range(count):
            c = f"{m} * {U}u + {u}u"
            for t in range(rows.n):
                xv, raw = _lane_x(mode, rows.x(t), c)
                out.append(f"let xc{t}_{u} = {xv};")
                if raw:
                    out.append(f"acc{t}.ss += wide_sq({raw});")
            if not v4:
                out.append(f"let d{u} = wchunks(rows.b, {c});")
                out += [f"acc{t} = dec_step(acc{t}, d{u}, xc{t}_{u});" for t in range(rows.n)]
                continue
            for j in range(4):
                words = []
                for i in range(j * rw + u * bw, j * rw + (u + 1) * bw):
                    v, e = divmod(i, 4)
                    if v not in loaded:
                        idx = f"{v}u + {m} * {U * bw // 4}u"
                        out.append(f"let q{v} = W4[wb + ({idx}) * ws];" if inter_full else
                                   f"let q{v} = W4[wb + {idx}];")
                        loaded.add(v)
                    words.append(f"q{v}.{comp[e]}")
                out.append(f"let d{u}_{j} = dq_{qtype}_w({_v4_args(qtype, words)});")
                for t in range(rows.n):
                    xc = f"xc{t}_{u}" if fold or qtype not in V4_XS else f"v4_xs(xc{t}_{u})"
                    out.append(f"acc{t}.a.{comp[j]} += {'cdot_xs' if fold else 'cdot'}(d{u}_{j}, {xc});")
        return [ind + s for s in out]

    loops, rem = divmod(nchunks, U)
    if loops:
        lines.append(f"    for (var m = 0u; m < {loops}u; m++) {{")
        lines += step("m", U, "        ")
        lines.append("    }")
    if rem:
        lines.append(f"    {{\n        let m = {loops}u;")
        lines += step("m", rem, "        ")
        lines.append("    }")
    if not v4 and ep == "store":             # any RR: dec_end stores the invocation's rows
        lines += store_ends(mode, k, rows)
    else:
        lines += _row_ends(mode, k, rows, "acc{t}", ep, "i4" if v4 else "(rows.r0 / 4u)")
    lines += ["}", ""]
    return "\n".join(lines)


__all__ = ["MAX_ROWS", "EXACT", "LANES", "ENV", "bucket", "subgroup_floor", "ok", "lanes_ok", "source"]
