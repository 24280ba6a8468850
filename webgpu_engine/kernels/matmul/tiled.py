"""Tiled matmul for T > 1 (prefill, BERT encoders): y = x·Wᵀ, each weight decoded once per tile.

`matmul(dev, x, w, y, bias=, accumulate=)` has the semantics of `matmul.matmul` and returns None
where it does not apply (T == 1, a weight buffer that is not whole 16-byte words) so that the
caller falls back. The kernel (`shaders/matmul_tiled.wgsl`) stages tiles of TM rows of x in
workgroup memory and lets every invocation own one weight row: each 32-weight chunk of the row is
decoded once into registers and multiplied with all TM activation rows. The K loop is written out
in the pipeline (one pipeline per K block length), so long K runs as several dispatches. Tile sizes
are per-device parameters (`TiledConfig`).
Page code: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...gpu import Device
from ...gpu.shaders import load_shader_source
from ..common import XREAD, Op, Tensor, act_header, check, wmap_header
from ..qtypes import QTYPE, QTYPES
from .codegen import dequant_source
from .dispatch import dispatch_parts, operands, row_groups
from .layout import MAX_GROUPS, QWeight

_QK = {t.name: t.block for t in QTYPE.values() if t.quantized}   # weights per block
_MAX_TM = 32               # accumulators written out in the shader
_WG_BYTES = 32768          # workgroup memory WebGPU guarantees (and lavapipe's maximum)
COLD_TM = 8                # the stand-in tile while a pipeline compiles (_cold_stand_in)


@dataclass
class TiledConfig:
    """Per-device tile: `tm` activation rows per workgroup (the accumulators each invocation keeps
    in registers, 1..32), `wg` invocations per workgroup (each owns one weight row), `kb` 32-wide K
    chunks staged per barrier (1..8; the two x tiles take 2 x tm x kb x 128 B of the 32 KiB of
    workgroup memory), and `kmax` chunks per pipeline: the K loop is written out, so longer K is
    split into blocks of at most `kmax` chunks, one dispatch each, the later ones accumulating.
    A larger `tm` reads the weights fewer times; a larger `wg` amortises the staging of each x
    tile over more rows; `kmax` trades compile time (superlinear in the code length) against one
    extra read-modify-write of y per block. Below `min_t` activation rows `matmul` returns None:
    a tile mostly of padding rows loses to the row kernels of select.py."""

    tm: int = 16
    wg: int = 192    # SmolLM2 and MiniLM row counts (576, 960, 1152, 1536, 3072) are multiples
    kb: int = 6
    kmax: int = 18
    min_t: int = 8   # lavapipe, 3072x576 Q4_1: 1.6x slower than select.py's row kernels at T = 4, even at 8


def default_config(dev: Device, qtype: str = "q4_1") -> TiledConfig:
    """The tile for `dev` and a weight type, measured on lavapipe (8-wide SIMD, a workgroup per
    thread, costly barriers) with bench/prefill.py: 16 activation rows for block-quantized weights,
    whose loads are few (24 or 32 rows ran 10-15% slower); float weights load a word per one or
    two weights per lane, so 24 rows (4 chunks per barrier to fit workgroup memory) amortise them
    better, and shorter K blocks keep their longer code's compile time near that of the quantized
    kernels: 24 rows took 13-16% less CPU time than 32 at MiniLM's GEMMs, for f32 weights and for
    f16 ones alike (32 accumulators and the weights overflow the registers), with the same sums
    per row, and compile faster (f16, LLVM with Mesa's cache off: 4.6 s against 6.1).
    Other adapters get the same until measured there."""
    if qtype in ("f32", "f16", "bf16"):
        return TiledConfig(tm=24, kb=4, kmax=12)
    return TiledConfig()


# --------------------------------------------------------------------------- helpers
# u32 words of one 32-wide chunk of a row; K-quants: words per 256-wide super-block (8 chunks)
_CHUNK_WORDS = {t.name: t.chunk_words for t in QTYPE.values() if t.block <= 32}
_SUPER_WORDS = {t.name: t.block_words for t in QTYPE.values() if t.block == 256}


def _k_blocks(qtype: str, nch: int, kmax: int) -> int:
    """Chunks per K block (one pipeline): blocks as even as possible, whole super-blocks."""
    kblk = -(-nch // -(-nch // kmax))
    if qtype in _SUPER_WORDS:
        kblk = -(-kblk // 8) * 8
    return kblk


def _pipeline(dev: Device, w: QWeight, dtype: str, kblk: int, cfg: TiledConfig):
    qtype, row_words = w.qtype, w.row_words
    kb = min(cfg.kb, kblk)
    ng = -(-kblk // kb)
    # the K loop written out (see `step` in the shader for why)
    steps = "".join(f"    step({g}u, {g % 2}u, {min(kb, kblk - g * kb)}u, base, t0, lid);\n"
                    for g in range(ng))
    if QTYPE[qtype].quantized:
        # dequant.wgsl's decode, expanded to plain values; its blocks are vec4-aligned (BA) when both
        # the block and the row are whole vec4 words
        aligned = QTYPE[qtype].block_words % 4 == 0 and row_words % 4 == 0
        decode = (f"const BA: bool = {'true' if aligned else 'false'};\n{dequant_source(qtype)}"
                  f"fn wblock(base: u32, c: u32) -> array<vec4<f32>, 8> {{\n"
                  f"    return wvalues(wchunk(base, c));\n}}\n")
    else:
        decode = ("const BA: bool = false;\n"
                  f"fn wblock(base: u32, c: u32) -> array<vec4<f32>, 8> {{ return wb_{qtype}(base, c); }}\n")
    header = (f"{act_header(dtype)}const TM: u32 = {cfg.tm}u;\nconst WG: u32 = {cfg.wg}u;\n"
              f"const KB: u32 = {kb}u;\nconst XR: u32 = {8 * kb}u;\nconst NG: u32 = {ng}u;\n"
              f"const WA: bool = {'true' if row_words % 4 == 0 else 'false'};\n{XREAD[dtype]}{wmap_header(w, 'P.wi_full')}"
              f"{decode}fn chunks(base: u32, t0: u32, lid: u32) {{\n{steps}}}\n{load_shader_source('matmul_io.wgsl')}")
    return dev.pipeline("matmul_tiled.wgsl", "matmul_tiled", header=header)


def _cold_stand_in(dev: Device, pipe, w: QWeight, dtype: str, kblk: int, cfg: TiledConfig, T: int) -> None:
    """Compiling in the background: until `pipe` has compiled, the cold tile (COLD_TM rows, the
    cheapest to compile of the tiles that run a full chunk at a fair speed) runs in its place: for
    a few-row tile one tile of it, for a taller one `tm / COLD_TM` of them per tile (a row's sums do
    not depend on the tile's height; rows past T are not written). The tile a request meets cold
    then costs lavapipe ~1.4 s of LLVM rather than the full tile's ~2.2 (compiler.py). Float weights
    (embedders, whose first batch compiles its whole list, not a batch's) keep the default tile."""
    tm = COLD_TM if QTYPE[w.qtype].quantized else default_config(dev, w.qtype).tm
    cold = replace(cfg, tm=tm, kb=min(cfg.kb, _WG_BYTES // (tm * 256)))
    if cfg.tm == tm or min(cold.kb, kblk) != min(cfg.kb, kblk):
        return
    if cfg.tm < tm and T <= cfg.tm:
        pipe.stand_in, pipe.stand_in_y = _pipeline(dev, w, dtype, kblk, cold), 1
    elif cfg.tm > tm and cfg.tm % tm == 0:
        pipe.stand_in, pipe.stand_in_y = _pipeline(dev, w, dtype, kblk, cold), cfg.tm // tm


def supports(w: QWeight, T: int, config: TiledConfig | None = None, any_t: bool = False) -> bool:
    """Whether `matmul` below handles this weight at T activation rows (else it returns None):
    T >= the config's min_t (default: 8), and weight buffers of whole 16-byte words, as the kernel
    reads weights as vec4 words (true of f32 and Q4_K weights, and of other types when rows x row
    bytes is a multiple of 16). `any_t`: every T >= 1 (callers that need the same kernel for every
    T, so that a row's sums do not depend on T)."""
    if T < (1 if any_t else max(2, (config or TiledConfig()).min_t)) or w.qtype not in QTYPES:
        return False
    qk = _QK.get(w.qtype, 4)
    return w.k % qk == 0 and all(b.size % 16 == 0 for b in w.bufs)


def matmul(dev: Device, x: Tensor, w: QWeight, y: Tensor, *, bias: Tensor | None = None,
           accumulate: bool = False, config: TiledConfig | None = None,
           any_t: bool = False) -> Op | None:
    """y = x·Wᵀ (+ bias); with `accumulate`, y += x·Wᵀ (+ bias). x (T, K), W (N, K), y (T, N).
    None when the tiled kernel does not apply (T < min_t unless `any_t`, or a weight it cannot
    read)."""
    check(len(x.shape) == 2 and len(y.shape) == 2, "matmul_tiled",
          f"x {x.shape} and y {y.shape} must be 2-D")
    T, K = x.shape
    cfg = config or default_config(dev, w.qtype)
    if not supports(w, T, cfg, any_t):
        return None
    check(1 <= cfg.tm <= _MAX_TM and 1 <= cfg.wg <= 1024 and 1 <= cfg.kb <= 8 and cfg.kmax >= 1
          and cfg.tm * cfg.kb * 256 <= _WG_BYTES, "matmul_tiled", f"unsupported tile {cfg}")
    io = operands(dev, x, w, y, bias, "matmul_tiled")
    tiles = -(-T // cfg.tm)
    check(tiles <= MAX_GROUPS, "matmul_tiled", f"T={T} needs more than 65535 tiles of {cfg.tm} rows")
    nch = -(-K // 32)
    kblk = _k_blocks(w.qtype, nch, cfg.kmax)
    pipe = _pipeline(dev, w, x.dtype, kblk, cfg)
    if dev.deferring and pipe.stand_in is None:
        _cold_stand_in(dev, pipe, w, x.dtype, kblk, cfg, T)

    def blocks(r0: int, rows: int):
        for c0 in range(0, nch, kblk):
            # block 0 applies bias and the caller's accumulate; later blocks add to y
            first = c0 == 0
            flags = (1 if io.has_bias and first else 0) | (2 if accumulate or not first else 0)
            w_off = (c0 // 8 * _SUPER_WORDS[w.qtype] if w.qtype in _SUPER_WORDS
                     else c0 * _CHUNK_WORDS[w.qtype])   # u32 words into each row
            yield [K, rows, T, w.row_words, io.x_off, io.y_off, w.n, r0, io.b_off, flags, w_off, K // 4, c0 * 8, w.inter_full]

    return dispatch_parts(dev, Op(name=f"matmul_tiled[{w.label}]"), pipe, w, y, io, "matmul_tiled",
                          row_groups(cfg.wg, "matmul_tiled", tiles), blocks=blocks)


__all__ = ["QTYPES", "TiledConfig", "default_config", "supports", "matmul"]
