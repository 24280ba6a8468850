"""WGSL for the matmul and embedding kernels: which file reads a weight type (float rows: their own
`shaders/matmul_<dtype>.wgsl`; every quantised type: `shaders/matmul_words.wgsl` plus its decode in
`shaders/dequant.wgsl`, written once for every kernel), and the host-unrolled T = 1 decode kernels'
generated entry points (`shaders/matmul_decode.wgsl`, `matmul_decode_v4.wgsl`) with their fused
inputs (RMSNorm, SiLU·up, a norm's partial sums) and epilogue calls. Page code: standard library
only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...gpu import Device
from ...gpu.shaders import load_shader_source
from ..common import XREAD, act_header, wmap_header
from ..qtypes import QTYPE

if TYPE_CHECKING:
    from .layout import QWeight


# types decoded by shaders/dequant.wgsl (one decode for every kernel): every quantised type
DEQUANT_WGSL = tuple(t.name for t in QTYPE.values() if t.quantized)

# the nibble readers dequant.wgsl's Q4_0 / Q4_1 call (`wnib4`): plain, or masked in place (component j
# scaled by 256^j) for the vec4 decode kernel, whose dot product undoes the scaling
WNIB4 = {False: "dq_nib4", True: "dq_nib4_inplace"}


def dequant_source(qtype: str, inplace: bool = False) -> str:
    """dequant.wgsl, the kernel's nibble reader and `wchunk` for one quantised type (the including
    kernel provides WChunk and the word readers wword / wquad / woct)."""
    return (f"{load_shader_source('dequant.wgsl')}\n"
            f"fn wnib4(q: u32, sh: u32) -> vec4<f32> {{ return {WNIB4[inplace]}(q, sh); }}\n"
            f"fn wchunk(base: u32, c: u32) -> WChunk {{ return dq_{qtype}(base, c); }}\n")


def weight_source(qtype: str, inplace: bool = False) -> tuple[str, str]:
    """(the file that declares the weight binding and reads it, the text that follows it in the
    header) for the row kernels: float rows' own file, or matmul_words.wgsl with dequant.wgsl."""
    if QTYPE[qtype].quantized:
        return "matmul_words.wgsl", dequant_source(qtype, inplace)
    return f"matmul_{qtype}.wgsl", ""


def row_source() -> str:
    """matmul.wgsl and the activations' part it shares with matmul_tiled.wgsl (matmul_io.wgsl)."""
    return load_shader_source("matmul.wgsl") + load_shader_source("matmul_io.wgsl")


def weight_pipeline(dev: Device, entry: str, w: QWeight, dtype: str, wg: int, rr: int = 1, extra: str = "",
                    inplace: bool = False, y_dtype: str = ""):
    """`dtype`: the activations' (x and y), or x's where `y_dtype` gives y's (kernels/moe.py's f32 sums)."""
    generic = load_shader_source("embedding.wgsl") if entry == "embedding" else row_source()
    xread = XREAD[dtype] if entry != "embedding" else ""
    file, decode = weight_source(w.qtype, inplace)
    header = (f"{act_header(y_dtype or dtype)}const WG: u32 = {wg}u;\nconst RR: u32 = {rr}u;\n{wmap_header(w)}"
              f"{xread}{generic}{extra}{decode}")
    return dev.pipeline(file, entry, header=header)


# qtype -> how the vec4 decode kernel passes a block's words to dequant.wgsl's dq_<qtype>_w (qtypes.py)
V4_ARGS = {t.name: t.v4_args for t in QTYPE.values() if t.v4_args}


V4_XS = ("q4_1", "q4_0", "q4_0f32")      # their quants come scaled by 256^j (in place): x is scaled by v4_xs


def _v4_args(qtype: str, words: list) -> str:
    """dq_<qtype>_w's arguments from a block's words (WGSL expressions), grouped as V4_ARGS says."""
    out, i = [], 0
    for n in V4_ARGS[qtype]:
        out.append(words[i] if n == 1 else f"vec4<u32>({', '.join(words[i:i + n])})")
        i += n
    return ", ".join(out)


@dataclass(frozen=True)
class DecRows:
    """The activation rows of a decode kernel: `n` rows (continuous batching: one per sequence), row
    t's x at XOFF + t * x4 (xword units) and, in pnorm mode, its partial sums at GOFF + t * g4 (vec4
    units); `t_stored` rows are stored (the rest pad a row-count bucket: computed, never stored)."""

    n: int = 1
    x4: int = 0
    g4: int = 0

    def x(self, t: int) -> str:
        return f"XOFF + {t * self.x4}u"

    def g(self, t: int) -> str:
        return f"GOFF + {t * self.g4}u"


ONE_ROW = DecRows()


def _row_ends(mode: str, k: int, rows: DecRows, acc: str, ep: str, i4: str) -> list:
    """After the K loop, per row t: the pnorm sums, the 1/rms scale and the store or epilogue of
    r = {acc}.a (acc has `t` in place of the row) times the scale."""
    out = []
    for t in range(rows.n):
        a = acc.format(t=t)
        if mode == "pnorm":
            out += [f"    {a}.ss += dec_pss({rows.g(t)}, {i}u);" for i in range(k // 16)]
        scale = f"inverseSqrt({a}.ss / {float(k)!r} + EPS)" if mode in ("norm", "pnorm") else "1.0"
        out += [f"    let r{t} = {a}.a * {scale};", EPILOGUE_CALL[ep].format(i4=i4, t=t, r=f"r{t}")]
    return out


def pro_call(ep: str, rows: DecRows) -> list[str]:
    """The entry point's first call where it has an epilogue: ep_pro (matmul_epilogue.wgsl; a row's
    LoRA shrinks where the matmul makes its deltas) of the rows 0 .. rows.n - 1."""
    return [] if ep == "store" else [f"    ep_pro(lid, 0u, {rows.n}u);"]


def store_ends(mode: str, k: int, rows: DecRows) -> list[str]:
    """WGSL lines ending the "store" epilogue of the scalar decode kernels: dec_end stores each row's
    sums (acc0..), scaled by its RMS norm in the norm / pnorm modes."""
    out = []
    for t in range(rows.n):
        a = f"acc{t}"
        if mode == "pnorm":
            out += [f"    {a}.ss += dec_pss({rows.g(t)}, {i}u);" for i in range(k // 16)]
        scale = f"inverseSqrt({a}.ss / {float(k)!r} + EPS)" if mode in ("norm", "pnorm") else "1.0"
        out.append(f"    dec_end({t}u, rows, {a}, {scale});")
    return out


def span_base(rw: int, inter_full: int) -> list[str]:
    """WGSL lines giving the v4 kernels' invocation i4 its span's first vec4 `wb` (rows 4 * i4 ..
    4 * i4 + 3, rw vec4 a span) and, for interleaved spans (copy.wgsl span_map: vec4 v of span i4 at
    wb + 8 v in whole groups), `inter` and the stride `ws`."""
    if inter_full:
        return [f"    let inter = i4 < {inter_full // rw}u;",
                f"    let wb = select(i4 * {rw}u, (i4 / 8u) * {8 * rw}u + i4 % 8u, inter);",
                "    let ws = select(1u, 8u, inter);"]
    return [f"    let wb = i4 * {rw}u;         // their first vec4 (4 rows = {rw} vec4)"]


def decode_v4_source(qtype: str, nchunks: int, k: int, x_off4: int, mode: str, nf4: int, g_off4: int,
                      eps: float, ep: str = "store", inter_full: int = 0, xs_fold: bool = True,
                      rows: DecRows = ONE_ROW) -> str:
    """matmul_decode.wgsl + matmul_decode_v4.wgsl plus the generated entry point: 4 weight rows per
    invocation read as one span of vec4<u32> (every index a constant offset from the invocation's
    base), each vec4 loaded once, at its first use, each block decoded once for every activation
    row; x chunk c of each row is loaded once for the 4 weight rows."""
    bw = QTYPE[qtype].block_words
    rw = nchunks * bw                  # row_words
    xfn = X_FN[mode]
    lines = [load_shader_source("matmul_decode.wgsl"), load_shader_source("matmul_decode_v4.wgsl"),
             f"const XOFF: u32 = {x_off4}u;\nconst NF: u32 = {nf4}u;\nconst GOFF: u32 = {g_off4}u;",
             f"const EPS: f32 = {float(eps)!r};",
             "@compute @workgroup_size(WG)",
             "fn matmul_decode(@builtin(workgroup_id) wid: vec3<u32>, "
             "@builtin(local_invocation_index) lid: u32) {",
             "    let i4 = wid.x * WG + lid;   // rows 4 * i4 .. 4 * i4 + 3"]
    lines += pro_call(ep, rows)
    lines += span_base(rw, inter_full)
    lines += [f"    var acc{t} = DecAcc(vec4<f32>(0.0), 0.0);" for t in range(rows.n)]
    loaded = set()
    comp = "xyzw"
    fold = qtype in V4_XS and xs_fold
    for c in range(nchunks):
        for t in range(rows.n):
            xc = f"{xfn}({rows.x(t)}, {c}u)"
            lines.append(f"    let x{t}_{c} = {'v4_xs(' + xc + ')' if qtype in V4_XS and not fold else xc};")
            if mode == "norm":
                lines.append(f"    acc{t}.ss += dec_sq({rows.x(t)}, {c}u);")
        for j in range(4):
            words = []
            for i in range(j * rw + c * bw, j * rw + (c + 1) * bw):
                v, e = divmod(i, 4)
                if v not in loaded:
                    lines.append(f"    let v{v} = W4[wb + {v}u * ws];" if inter_full else
                                 f"    let v{v} = W4[wb + {v}u];")
                    loaded.add(v)
                words.append(f"v{v}.{comp[e]}")
            lines.append(f"    let d{c}_{j} = dq_{qtype}_w({_v4_args(qtype, words)});")
            lines += [f"    acc{t}.a.{comp[j]} += {'cdot_xs' if fold else 'cdot'}(d{c}_{j}, x{t}_{c});"
                      for t in range(rows.n)]
    lines += _row_ends(mode, k, rows, "acc{t}", ep, "i4") + ["}", ""]
    return "\n".join(lines)


GATE_ACTS = ("silu", "gelu_tanh")   # the gate activations of the fused paths (shaders/gate_act.wgsl)


def gate_act_source(act: str) -> str:
    """shaders/gate_act.wgsl with `gate2` / `gate4` naming `act`'s pair: matmul_decode.wgsl's
    act(gate)·up input and matmul_epilogue.wgsl's ep_silu call them."""
    if act not in GATE_ACTS:
        raise ValueError(f"gate activation must be one of {', '.join(GATE_ACTS)}, got {act!r}")
    return (load_shader_source("gate_act.wgsl") +
            f"fn gate2(g: vec2<f32>) -> vec2<f32> {{ return {act}_v2(g); }}\n"
            f"fn gate4(g: vec4<f32>) -> vec4<f32> {{ return {act}_v4(g); }}\n")


# mode -> the x chunk reader of matmul_decode.wgsl (pnorm reads x as is: it is x0 * g already)
X_FN = {"plain": "dec_x", "norm": "dec_xn", "silu": "dec_xs", "pnorm": "dec_x"}


# how the generated entry points end: store the 4 sums, or hand them to an epilogue
EPILOGUE_CALL = {
    "store": "    store({t}u, 4u * {i4}, {r}.x);\n    store({t}u, 4u * {i4} + 1u, {r}.y);\n"
             "    store({t}u, 4u * {i4} + 2u, {r}.z);\n    store({t}u, 4u * {i4} + 3u, {r}.w);",
    "silu": "    ep_silu({t}u, {i4}, {r});",
    "rope_kv": "    ep_rope_kv({t}u, {i4}, {r});",
    "res_norm": "    ep_res_norm({t}u, {i4}, {r});",
}


def decode_source(nchunks: int, k: int, x_off4: int, mode: str, nf4: int, g_off4: int, eps: float,
                   ep: str = "store", rows: DecRows = ONE_ROW) -> str:
    """matmul_decode.wgsl plus its generated entry point: the K loop (and the activation rows)
    unrolled (see that file)."""
    xfn = X_FN[mode]
    lines = [load_shader_source("matmul_decode.wgsl"),
             f"const XOFF: u32 = {x_off4}u;\nconst NF: u32 = {nf4}u;\nconst GOFF: u32 = {g_off4}u;",
             f"const EPS: f32 = {float(eps)!r};",
             "@compute @workgroup_size(WG)",
             "fn matmul_decode(@builtin(workgroup_id) wid: vec3<u32>, "
             "@builtin(local_invocation_index) lid: u32) {",
             "    let rows = row_group(wid, lid);"]
    lines += pro_call(ep, rows)
    lines += [f"    var acc{t} = DecAcc(vec4<f32>(0.0), 0.0);" for t in range(rows.n)]
    for c in range(nchunks):
        lines.append(f"    let d{c} = wchunks(rows.b, {c}u);")
        for t in range(rows.n):
            lines.append(f"    acc{t} = dec_step(acc{t}, d{c}, {xfn}({rows.x(t)}, {c}u));")
            if mode == "norm":
                lines.append(f"    acc{t}.ss += dec_sq({rows.x(t)}, {c}u);")
    if ep == "store":                       # any RR: dec_end stores the invocation's rows
        lines += store_ends(mode, k, rows)
    else:                                   # RR = 4: rows.r0 = 4 * i4
        lines += _row_ends(mode, k, rows, "acc{t}", ep, "(rows.r0 / 4u)")
    lines += ["}", ""]
    return "\n".join(lines)
