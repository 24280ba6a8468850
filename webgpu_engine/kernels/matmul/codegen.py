"""WGSL for the matmul and embedding kernels: which file reads a weight type (float rows: their own
`shaders/matmul_<dtype>.wgsl`; every quantised type: `shaders/matmul_words.wgsl` plus its decode in
`shaders/dequant.wgsl`, written once for every kernel), and the host-unrolled T = 1 decode kernels'
generated entry points (`shaders/matmul_decode.wgsl`, `matmul_decode_v4.wgsl`) with their fused
inputs (RMSNorm, SiLU·up, a norm's partial sums) and epilogue calls. Page code: standard library
only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...gpu import Device
from ...gpu.shaders import load_shader_source
from ..common import XREAD, act_header, wmap_header
from ..qtypes import QTYPE

if TYPE_CHECKING:
    from .config import MatmulConfig
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


def weight_pipeline(dev: Device, entry: str, w: QWeight, dtype: str, wg: int, rr: int = 1, extra: str = "",
                    inplace: bool = False):
    generic = load_shader_source("embedding.wgsl" if entry == "embedding" else "matmul.wgsl")
    xread = XREAD[dtype] if entry != "embedding" else ""
    file, decode = weight_source(w.qtype, inplace)
    header = (f"{act_header(dtype)}const WG: u32 = {wg}u;\nconst RR: u32 = {rr}u;\n{wmap_header(w)}"
              f"{xread}{generic}{extra}{decode}")
    return dev.pipeline(file, entry, header=header)


# qtype -> how the vec4 decode kernel passes a 32-weight block's words to dequant.wgsl's
# dq_<qtype>_w: 1 = one u32 argument, 4 = one vec4<u32> (the block's u32 words in order)
V4_ARGS = {"q4_1": (1, 4), "q4_0": (1, 4), "q8_0": (1, 4, 4), "q5_0": (1, 1, 4), "q5_1": (1, 1, 4),
           "iq4_nl": (1, 4), "q4_0f32": (1, 4)}
V4_BLOCK = {t: sum(a) for t, a in V4_ARGS.items()}     # u32 words per block


V4_XS = ("q4_1", "q4_0", "q4_0f32")      # their quants come scaled by 256^j (in place): x is scaled by v4_xs


def _v4_args(qtype: str, words: list) -> str:
    """dq_<qtype>_w's arguments from a block's words (WGSL expressions), grouped as V4_ARGS says."""
    out, i = [], 0
    for n in V4_ARGS[qtype]:
        out.append(words[i] if n == 1 else f"vec4<u32>({', '.join(words[i:i + n])})")
        i += n
    return ", ".join(out)


def use_v4(cfg: MatmulConfig, w: "QWeight") -> bool:
    return (cfg.unroll and cfg.v4 and cfg.rr == 4 and w.qtype in V4_BLOCK and w.k % 32 == 0
            and w.k <= cfg.v4_max_k and w.n <= cfg.v4_max_n)


def decode_v4_source(qtype: str, nchunks: int, k: int, x_off4: int, mode: str, nf4: int, g_off4: int,
                      eps: float, ep: str = "store", inter_full: int = 0, xs_fold: bool = True) -> str:
    """matmul_decode.wgsl + matmul_decode_v4.wgsl plus the generated entry point: 4 rows per
    invocation read as one span of vec4<u32> (every index a constant offset from the invocation's
    base), each vec4 loaded once, at its first use; x chunk c is loaded once for the 4 rows."""
    bw = V4_BLOCK[qtype]
    rw = nchunks * bw                  # row_words
    xfn = X_FN[mode]
    lines = [load_shader_source("matmul_decode.wgsl"), load_shader_source("matmul_decode_v4.wgsl"),
             f"const XOFF: u32 = {x_off4}u;\nconst NF: u32 = {nf4}u;\nconst GOFF: u32 = {g_off4}u;",
             f"const EPS: f32 = {float(eps)!r};",
             "@compute @workgroup_size(WG)",
             "fn matmul_decode(@builtin(workgroup_id) wid: vec3<u32>, "
             "@builtin(local_invocation_index) lid: u32) {",
             "    let i4 = wid.x * WG + lid;   // rows 4 * i4 .. 4 * i4 + 3"]
    if inter_full:
        # interleaved spans (copy.wgsl span_map): vec4 v of span i4 is at wb + 8 v in whole groups
        lines += [f"    let inter = i4 < {inter_full // rw}u;",
                  f"    let wb = select(i4 * {rw}u, (i4 / 8u) * {8 * rw}u + i4 % 8u, inter);",
                  "    let ws = select(1u, 8u, inter);"]
    else:
        lines.append(f"    let wb = i4 * {rw}u;         // their first vec4 (4 rows = {rw} vec4)")
    lines += [
             "    var a = vec4<f32>(0.0);",
             "    var ss = 0.0;"]
    loaded = set()
    comp = "xyzw"
    for c in range(nchunks):
        xs = f"v4_xs({xfn}({c}u))" if qtype in V4_XS and not xs_fold else f"{xfn}({c}u)"
        cd = "cdot_xs" if qtype in V4_XS and xs_fold else "cdot"
        lines.append(f"    let x{c} = {xs};")
        if mode == "norm":
            lines.append(f"    ss += dec_sq({c}u);")
        for j in range(4):
            words = []
            for t in range(bw):
                i = j * rw + c * bw + t
                v, e = divmod(i, 4)
                if v not in loaded:
                    lines.append(f"    let v{v} = W4[wb + {v}u * ws];" if inter_full else
                                 f"    let v{v} = W4[wb + {v}u];")
                    loaded.add(v)
                words.append(f"v{v}.{comp[e]}")
            lines.append(f"    a.{comp[j]} += {cd}(dq_{qtype}_w({_v4_args(qtype, words)}), x{c});")
    lines += pnorm_lines(mode, k, "ss")
    scale = f"inverseSqrt(ss / {float(k)!r} + EPS)" if mode in ("norm", "pnorm") else "1.0"
    lines += [f"    let r = a * {scale};", EPILOGUE_CALL[ep].format(i4="i4"), "}", ""]
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


def pnorm_lines(mode: str, k: int, ss: str) -> list:
    """pnorm: the sum of squares from the K/4 partial sums, 4 per constant-offset (uniform) load."""
    if mode != "pnorm":
        return []
    return [f"    {ss} += dec_pss({i}u);" for i in range(k // 16)]


# how the generated entry points end: store the 4 sums, or hand them to an epilogue
EPILOGUE_CALL = {
    "store": "    store(0u, 4u * {i4}, r.x);\n    store(0u, 4u * {i4} + 1u, r.y);\n"
             "    store(0u, 4u * {i4} + 2u, r.z);\n    store(0u, 4u * {i4} + 3u, r.w);",
    "silu": "    ep_silu({i4}, r);",
    "rope_kv": "    ep_rope_kv({i4}, r);",
    "res_norm": "    ep_res_norm({i4}, r);",
}


def decode_source(nchunks: int, k: int, x_off4: int, mode: str, nf4: int, g_off4: int, eps: float,
                   ep: str = "store") -> str:
    """matmul_decode.wgsl plus its generated entry point: the K loop unrolled (see that file)."""
    xfn = X_FN[mode]
    lines = [load_shader_source("matmul_decode.wgsl"),
             f"const XOFF: u32 = {x_off4}u;\nconst NF: u32 = {nf4}u;\nconst GOFF: u32 = {g_off4}u;",
             f"const EPS: f32 = {float(eps)!r};",
             "@compute @workgroup_size(WG)",
             "fn matmul_decode(@builtin(workgroup_id) wid: vec3<u32>, "
             "@builtin(local_invocation_index) lid: u32) {",
             "    let rows = dec_rows(wid, lid);",
             "    var acc = DecAcc(vec4<f32>(0.0), 0.0);"]
    for c in range(nchunks):
        lines.append(f"    acc = dec_step(acc, rows, {c}u, {xfn}({c}u));")
        if mode == "norm":
            lines.append(f"    acc.ss += dec_sq({c}u);")
    lines += pnorm_lines(mode, k, "acc.ss")
    scale = f"inverseSqrt(acc.ss / {float(k)!r} + EPS)" if mode in ("norm", "pnorm") else "1.0"
    if ep == "store":
        lines.append(f"    dec_end(rows, acc, {scale});")
    else:                                   # RR = 4: rows.r0 = 4 * i4
        lines += [f"    let r = acc.a * {scale};", EPILOGUE_CALL[ep].format(i4="(rows.r0 / 4u)")]
    lines += ["}", ""]
    return "\n".join(lines)
