"""Weights on the GPU (GGUF blocks or HF float rows), y = x·Wᵀ matmul, embedding gather, vectors.

Weights keep their file layout: the host never dequantizes. Block types whose size is not a multiple
of 4 bytes (Q4_0 / IQ4_NL 18 B, Q5_0 22 B, Q8_0 34 B, Q3_K 110 B, Q6_K 210 B) get a one-off GPU
repack at upload that inserts 2 zero bytes per block so that kernels read whole u32 words. A weight
above the device's max storage binding size is split by rows across several buffers; matmul and
embedding dispatch once per buffer.

Kernels: `shaders/matmul.wgsl` (generic loop) and `shaders/embedding.wgsl`, each compiled together
with one `shaders/matmul_<qtype>.wgsl` (the weight binding and its dequantization of 32 weights),
or for the types in DEQUANT_WGSL `shaders/matmul_words.wgsl` plus the shared `shaders/dequant.wgsl`.
Weight types and their block geometry: `kernels/qtypes.py`.
2 ≤ T ≤ 16 (a decode step of several sequences): `kernels/matmul_batch.py`.
T = 1 on CPU adapters: `shaders/matmul_decode.wgsl` (the K loop unrolled by the host) and, for
Q4_0/Q4_1/Q8_0, `shaders/matmul_decode_v4.wgsl` (the same, weights read as vec4<u32>).
Kernel families (`default_config`, one switch for every matmul): "cpu" — the kernels above, shaped
by CPU Vulkan; "gpu" — kernels/matmul_gpu.py (coalesced decode, workgroup-tiled GEMM) for plain
matmuls; "tuned" — per shape, what the adapter's profile (kernels/profiles.py, written by
kernels/tune.py) measured fastest. `WEBGPU_ENGINE_KERNELS=cpu|gpu|tuned` forces one; unset, CPU
adapters run "cpu" and other adapters "tuned" where a profile is stored, else "gpu".
Page code: standard library only.
"""
from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass, field

from ..gpu import Buffer, Device
from ..gpu.shaders import load_shader_source
from .common import DTYPE_SIZE, XREAD, Op, Tensor, act_header, check, params, placeholder, wmap_header
from .common import window as _window
from . import matmul_batch, matmul_gpu, matmul_tiled, profiles
from .qtypes import QTYPE, QTYPES

# from the one table of weight types (kernels/qtypes.py): qtype → (file bytes per block, weights per
# block, GPU bytes per block, byte where the repack inserts zero padding or None)
_BLOCKS = {t.name: (t.file_bytes, t.block, t.gpu_bytes, t.pad_at) for t in QTYPE.values() if t.quantized}
# types decoded by shaders/dequant.wgsl (one decode for every kernel)
DEQUANT_WGSL = tuple(t.name for t in QTYPE.values() if t.decode == "dequant")
_FLOAT_BYTES = {t.name: t.file_bytes for t in QTYPE.values() if not t.quantized}
_STAGE_BYTES = 32 << 20    # most file bytes staged at once for a GPU repack
_MAX_GROUPS = 65535


@dataclass
class MatmulConfig:
    """Per-device kernel strategy: `wg` invocations per workgroup, each owning `rr` weight rows
    (1, 2 or 4) of one activation row; for T > 1 with `tm` = 4, the tile kernel gives each
    invocation `prr` weight rows (1, 2 or 4) x 4 activation rows so a weight chunk is decoded once
    per 4 rows of x (`tm` = 1: the row kernel over every t). No barriers anywhere: on CPU Vulkan
    (lavapipe) barriers are expensive, and several rows per invocation share each x load."""

    wg: int = 32     # small: a 576-row weight still makes 5 workgroups for the driver's threads
    rr: int = 4
    tm: int = 4
    prr: int = 4
    unroll: bool = True   # T = 1: the K loop unrolled by the host (matmul_decode.wgsl) ...
    unroll_max_k: int = 1024   # ... up to this K and N rows (longer straight-line code and the
    unroll_max_n: int = 16384  # 49152-row LM head ran slower unrolled on lavapipe)
    fuse: bool = False    # models fuse RMSNorm into the decode matmul after it (measured: a loss
    fuse_silu: bool = False    # on lavapipe) / SiLU·up into down (its exp per lane: a larger loss)
    tiled: bool = True    # T > 1: kernels/matmul_tiled.py (host-unrolled K, shared-memory x tiles);
    # measured 3-4x on lavapipe, but its unrolled pipelines compile so slowly on SwiftShader (the
    # browser) that the first prefill there took minutes: on only where measured to win
    epilogue: bool = True   # T = 1 with rr = 4: models may fold SiLU·up and RoPE + KV-cache write
    # into the decode matmul's stores (matmul_epilogue.wgsl): 60 fewer dispatches per token
    res_norm: bool = True   # with epilogue: models fold the RMSNorm after a residual matmul into its
    # stores (norm_out) and the next matmul (rms_from): 60 fewer dispatches per token
    interleave: bool = True   # with v4: single-buffer _V4_BLOCK weights stored in interleaved
    # 4-row spans (copy.wgsl span_map) so a SIMD group's lanes read contiguous memory (lavapipe,
    # streaming a decode step's weights: ~10% per matmul); every kernel reads them through wmap4
    xs_fold: bool = True   # v4 Q4_0/Q4_1: quants masked in place (scaled by 256^j) are dotted with
    # unscaled x and the partial sums scaled when reduced, instead of scaling x per chunk (v4_xs)
    v4: bool = True       # T = 1 with rr = 4 and a _V4_BLOCK type: weights read as vec4<u32> from
    v4_max_k: int = 1024  # the GGUF layout (matmul_decode_v4.wgsl), up to this K and N (the K loop
    v4_max_n: int = 1 << 30   # unrolled as in matmul_decode); only where `unroll` is on. lavapipe:
    # 1.2-1.5x per matmul, the 49152-row LM head too. Uncached compile (Mesa caches on disk): K = 576
    # 1.8 s (3.2 s for matmul_decode), K = 1536 9 s for ~0.07 ms per matmul: not worth it
    batch_max_t: int = 16   # 2 <= T <= this (decode of several sequences): kernels/matmul_batch.py,
    # each weight chunk decoded once for all T rows (0: off, the row / tiled kernels as before)
    family: str = "cpu"   # "gpu" / "tuned": plain matmuls (no fused input or epilogue) may run
    # kernels/matmul_gpu.py (see _family_variant); "cpu": the kernels of this module and its helpers


FAMILY_ENV = "WEBGPU_ENGINE_KERNELS"
FAMILIES = ("cpu", "gpu", "tuned")


def is_cpu_adapter(dev: Device) -> bool:
    """lavapipe (adapter type CPU, name llvmpipe): the CPU strategy (unrolled decode, tiled
    prefill) was measured there."""
    info = dev.info
    return "cpu" in info.adapter_type.lower() or "llvmpipe" in info.name.lower()


def is_software_adapter(dev: Device) -> bool:
    """A rasteriser on the CPU: lavapipe, or a browser's fallback adapter (Chromium's SwiftShader:
    isFallbackAdapter, architecture swiftshader). Both keep the CPU family; SwiftShader with the
    plain kernels it ran before the families (its compiler stalls on the unrolled ones)."""
    info = dev.info
    return is_cpu_adapter(dev) or info.adapter_type.lower() == "fallback" or \
        "swiftshader" in info.architecture.lower()


def kernel_family(dev: Device) -> str:
    """The matmul kernel family for `dev`: $WEBGPU_ENGINE_KERNELS when set, else "cpu" on CPU
    adapters (their strategy was measured there) and on other adapters "tuned" where the tuner has
    stored a profile for this adapter, else "gpu"."""
    env = os.environ.get(FAMILY_ENV, "").strip().lower()
    if env:
        check(env in FAMILIES, "matmul", f"{FAMILY_ENV}={env!r}: expected one of {', '.join(FAMILIES)}")
        return env
    if is_software_adapter(dev):
        return "cpu"
    return "tuned" if profiles.has_profile(dev) else "gpu"


def default_config(dev: Device) -> MatmulConfig:
    """The strategy for `dev`. CPU family, measured on lavapipe (bench/kernels.py): 4 rows per
    invocation halves decode cost against 1 (each x load serves 4 rows), the 4x4 tile beats the
    row kernel for prefill, the host-unrolled decode kernel serves CPU drivers' uniform-load
    detection (matmul_decode.wgsl). GPU family: plain matmuls go to kernels/matmul_gpu.py and
    nothing is fused (no unrolled kernels). Tuned: the adapter type's strategy, with the profile's
    kernel per shape for plain matmuls."""
    family = kernel_family(dev)
    cpu = family in ("cpu", "tuned") and is_cpu_adapter(dev)
    return MatmulConfig(**{"unroll": cpu, "tiled": cpu, "family": family, **CONFIG_OVERRIDES})


def _family_variant(dev: Device, cfg: MatmulConfig, w: "QWeight", T: int, row_invariant: bool):
    """The kernels/matmul_gpu.py variant for a plain matmul, or None for this module's kernels:
    the one place where the kernel family picks a kernel."""
    if cfg.family == "cpu":
        return None
    if cfg.family == "tuned":
        key = profiles.choice(dev, w.qtype, w.n, w.k, T, row_invariant)
        if key == profiles.BASE:
            return None
        try:
            v = matmul_gpu.variant(key) if key is not None else None
        except ValueError:             # a key this version does not know: as if not measured
            v = None
        if v is not None and matmul_gpu.fits(v, T, row_invariant):
            return v
        if is_cpu_adapter(dev):        # not measured: the CPU strategy keeps the shape
            return None
    return matmul_gpu.default_variant(w, T, row_invariant)


def _decode_rows_variant(dev: Device, cfg: MatmulConfig, w: "QWeight"):
    """The kernel for `decode_rows` matmuls (continuous batching: each row one sequence's decode
    step, whose sums must not depend on how many rows run): the GPU family's decode kernel, chosen
    for one row and used for every row count (its rows are bit-identical across T = 1..8); None
    where the CPU family's row-invariant kernels serve instead."""
    if cfg.family == "cpu":
        return None
    if cfg.family == "tuned":
        key = profiles.choice(dev, w.qtype, w.n, w.k, 1, False)
        try:
            v = matmul_gpu.variant(key) if key not in (None, profiles.BASE) else None
        except ValueError:
            v = None
        if isinstance(v, matmul_gpu.Decode):
            return v
        if key == profiles.BASE or is_cpu_adapter(dev):
            return None
    return matmul_gpu.default_variant(w, 1, False)


# field -> value applied by default_config (benchmarks' A/B switches, e.g. {"fuse": False})
CONFIG_OVERRIDES: dict = {}


@dataclass
class QWeight:
    """A (n, k) weight on the GPU. `bufs[i]` holds rows [i*rows_per_buf, (i+1)*rows_per_buf)."""

    bufs: list
    rows_per_buf: int
    n: int
    k: int
    qtype: str
    nbytes: int                  # bytes on the GPU (all buffers)
    row_words: int = 0           # u32 words per row in the GPU layout
    label: str = ""
    parts: list = field(default_factory=list)   # (first row, rows) per buffer
    inter_full: int = 0          # interleaved layout: vec4 words in whole 32-row groups (0: rows)
    subs: list = field(default_factory=list)   # qtype MIXED: one QWeight per run of same-type parts

    def release(self) -> None:
        for b in self.bufs:
            b.release()


def file_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k weights in the file (GGUF / safetensors) layout."""
    if qtype in _FLOAT_BYTES:
        return k * _FLOAT_BYTES[qtype]
    fb, qk, _, _ = _BLOCKS[qtype]
    return k // qk * fb


def gpu_row_bytes(qtype: str, k: int) -> int:
    if qtype in _FLOAT_BYTES:
        return k * _FLOAT_BYTES[qtype]
    _, qk, gb, _ = _BLOCKS[qtype]
    return k // qk * gb


def _check_shape(qtype: str, n: int, k: int, what: str) -> None:
    check(qtype in QTYPES, what, f"unsupported weight type {qtype!r}; supported: {', '.join(QTYPES)}")
    check(n > 0 and k > 0, what, f"empty weight ({n}, {k})")
    qk = _BLOCKS[qtype][1] if qtype in _BLOCKS else 4
    check(k % qk == 0, what, f"{qtype} weights need k % {qk} == 0, got k={k}")


def _grid(groups: int) -> tuple[int, int]:
    """Fold a 1-D workgroup count into (x, y) within the 65535-per-dimension limit."""
    x = min(groups, _MAX_GROUPS)
    return max(x, 1), max(1, -(-groups // _MAX_GROUPS))


def upload_weight(dev: Device, parts, qtype, n: int, k: int, *, owner: str, label: str = "",
                  max_binding: int | None = None, interleave: bool | None = None) -> QWeight:
    """Upload a (n, k) weight given as one or several byte buffers of whole rows concatenated along
    n (fused QKV or gate+up). `max_binding` (default: the device's limit) caps bytes per buffer.
    `interleave` (default: as the device's MatmulConfig says) stores a single-buffer Q4_0/Q4_1/Q8_0
    weight in interleaved 4-row spans (see MatmulConfig.interleave). `qtype`: the type of every
    part, or a list with one type per part — K-quant files store some tensors of a fused matrix in
    a wider type (Q4_K_M: attn_v in Q6_K beside Q4_K attn_q / attn_k); parts of different types
    make a MIXED weight (see _upload_mixed)."""
    if not isinstance(qtype, str):
        return _upload_mixed(dev, parts, list(qtype), n, k, owner=owner, label=label,
                             max_binding=max_binding, interleave=interleave)
    _check_shape(qtype, n, k, "upload_weight")
    if isinstance(parts, (bytes, bytearray, memoryview)) or hasattr(parts, "__array_interface__"):
        parts = [parts]
    views = [_bytes_view(p) for p in parts]
    frow, grow = file_row_bytes(qtype, k), gpu_row_bytes(qtype, k)
    total = sum(v.nbytes for v in views)
    check(total == n * frow, "upload_weight",
          f"{label}: {total} bytes given, a ({n}, {k}) {qtype} weight has {n * frow}")
    for v in views:
        check(v.nbytes % frow == 0, "upload_weight", f"{label}: a part is not a whole number of rows")
    limit = min(max_binding or dev.max_storage_binding, dev.max_buffer_size)
    rows_per_buf = min(n, limit // grow)
    check(rows_per_buf > 0, "upload_weight", f"{label}: one row ({grow} B) exceeds the binding limit")
    bufs, spans = [], []
    try:
        for r0 in range(0, n, rows_per_buf):
            rows = min(rows_per_buf, n - r0)
            bufs.append(dev.buffer(rows * grow, owner=owner, label=f"{label}[{len(bufs)}]"))
            spans.append((r0, rows))
        w = QWeight(bufs, rows_per_buf, n, k, qtype, sum(b.size for b in bufs), grow // 4, label, spans)
        if interleave is None:
            cfg = default_config(dev)
            interleave = cfg.interleave and cfg.unroll and cfg.v4 and _use_v4(cfg, w)
        interleave = interleave and len(bufs) == 1 and qtype in _V4_BLOCK and n >= 32
        row = 0
        for v in views:
            prow = v.nbytes // frow
            done = 0
            while done < prow:
                # the rows of this part that land in one destination buffer (and one staging chunk)
                g = row + done
                bi, local = divmod(g, rows_per_buf)
                cnt = min(prow - done, rows_per_buf - local, max(1, _STAGE_BYTES // frow))
                seg = v[done * frow:(done + cnt) * frow]
                _store_rows(dev, bufs[bi], local * grow, seg, qtype, owner, label)
                done += cnt
            row += prow
        if interleave:
            _interleave(dev, w, owner, label)
        return w
    except BaseException:
        for b in bufs:
            b.release()
        raise


MIXED = "mixed"   # QWeight.qtype of a weight whose parts have different types


def _upload_mixed(dev: Device, parts, qtypes: list, n: int, k: int, *, owner: str, label: str,
                  max_binding: int | None, interleave: bool | None) -> QWeight:
    """Parts of one weight in different types: each run of same-type parts is its own QWeight
    (`subs`) whose rows keep their place in the whole (its parts' first rows and `n` are those of
    the whole weight, so its kernels write its rows of y); matmul runs one matmul per sub-weight.
    Every type alike: an ordinary weight."""
    if isinstance(parts, (bytes, bytearray, memoryview)) or hasattr(parts, "__array_interface__"):
        parts = [parts]
    check(len(qtypes) == len(parts), "upload_weight", f"{label}: {len(qtypes)} types for {len(parts)} parts")
    if len(set(qtypes)) == 1:
        return upload_weight(dev, parts, qtypes[0], n, k, owner=owner, label=label, max_binding=max_binding,
                             interleave=interleave)
    runs: list = []                          # [qtype, [views], rows]
    for qt, p in zip(qtypes, parts):
        _check_shape(qt, n, k, "upload_weight")
        v, frow = _bytes_view(p), file_row_bytes(qt, k)
        check(v.nbytes % frow == 0, "upload_weight", f"{label}: a {qt} part is not a whole number of rows")
        if runs and runs[-1][0] == qt:
            runs[-1][1].append(v)
            runs[-1][2] += v.nbytes // frow
        else:
            runs.append([qt, [v], v.nbytes // frow])
    check(sum(r[2] for r in runs) == n, "upload_weight",
          f"{label}: the parts hold {sum(r[2] for r in runs)} rows, a ({n}, {k}) weight has {n}")
    subs: list = []
    try:
        r0 = 0
        for qt, views, rows in runs:
            s = upload_weight(dev, views, qt, rows, k, owner=owner, label=f"{label}:{qt}",
                              max_binding=max_binding, interleave=False)
            s.n, s.parts = n, [(r0 + a, c) for a, c in s.parts]
            subs.append(s)
            r0 += rows
    except BaseException:
        for s in subs:
            s.release()
        raise
    return QWeight([b for s in subs for b in s.bufs], 0, n, k, MIXED, sum(s.nbytes for s in subs), 0, label,
                   [p for s in subs for p in s.parts], subs=subs)


def _interleave(dev: Device, w: QWeight, owner: str, label: str) -> None:
    """Re-lay w's single buffer in interleaved 4-row spans (copy.wgsl interleave_spans)."""
    rw = w.row_words                      # vec4 words per 4-row span (4 * row_words / 4)
    full = (w.n // 32) * 8 * rw           # vec4 words in whole 32-row groups
    src = w.bufs[0]
    n4 = src.size // 16
    dst = dev.buffer(src.size, owner=owner, label=label)
    p = params(dev, [n4, rw, full, 0], owner=owner, label=f"{label}:interleave")
    try:
        pipe = dev.pipeline("copy.wgsl", "interleave_spans")
        gx, gy = _grid(-(-n4 // 64))
        b = dev.batch()
        b.dispatch(pipe, dev.bind(pipe, [p, (src, 0, n4 * 16), (dst, 0, n4 * 16)]), gx, gy)
        if src.size > n4 * 16:            # a last partial vec4 lies past the whole groups: as it is
            b.copy(src, dst, src.size - n4 * 16, n4 * 16, n4 * 16)
        dev.submit(b)
    except BaseException:
        dst.release()
        raise
    finally:
        p.release()
    src.release()
    w.bufs[0] = dst
    w.inter_full = full


def _store_rows(dev: Device, dst: Buffer, offset: int, seg: memoryview, qtype: str, owner: str,
                label: str) -> None:
    pad_at = _BLOCKS[qtype][3] if qtype in _BLOCKS else None
    if pad_at is None:
        dev.write(dst, seg, offset)
        return
    fb, _, gb, _ = _BLOCKS[qtype]
    nblocks = seg.nbytes // fb
    stage = dev.upload(seg, owner=owner, label=f"{label}:staging")
    p = params(dev, [nblocks, fb, gb // 4, pad_at, gb - fb, offset // 4, 0, 0], owner=owner,
               label=f"{label}:repack")
    try:
        pipe = dev.pipeline("copy.wgsl", "repack_blocks")
        gx, gy = _grid(-(-nblocks * (gb // 4) // 64))
        dev.run(pipe, [p, stage, dst], gx, gy)
    finally:
        # WebGPU keeps destroyed buffers alive until the submitted work that uses them completes.
        stage.release()
        p.release()


def _bytes_view(data) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


# --------------------------------------------------------------------------- kernels
def _pipeline(dev: Device, entry: str, w: QWeight, dtype: str, wg: int, rr: int = 1, extra: str = ""):
    generic = load_shader_source("embedding.wgsl" if entry == "embedding" else "matmul.wgsl")
    xread = XREAD[dtype] if entry != "embedding" else ""
    qtype = w.qtype
    header = (f"{act_header(dtype)}const WG: u32 = {wg}u;\nconst RR: u32 = {rr}u;\n{wmap_header(w)}"
              f"{xread}{generic}{extra}")
    if qtype in DEQUANT_WGSL:     # matmul_words.wgsl reads the words, dequant.wgsl decodes them
        header += (f"{load_shader_source('dequant.wgsl')}\n"
                   f"fn wchunk(base: u32, c: u32) -> WChunk {{ return dq_{qtype}(base, c); }}\n")
        return dev.pipeline("matmul_words.wgsl", entry, header=header)
    return dev.pipeline(f"matmul_{qtype}.wgsl", entry, header=header)


# qtype -> u32 words per 32-weight block in the GPU layout, for matmul_decode_v4.wgsl's wblock_<qtype>
_V4_BLOCK = {"q4_1": 5, "q4_0": 5, "q8_0": 9}
_V4_XS = ("q4_1", "q4_0")      # their quants come scaled by 256^j: x is scaled by v4_xs


def _use_v4(cfg: MatmulConfig, w: "QWeight") -> bool:
    return (cfg.unroll and cfg.v4 and cfg.rr == 4 and w.qtype in _V4_BLOCK and w.k % 32 == 0
            and w.k <= cfg.v4_max_k and w.n <= cfg.v4_max_n)


def _decode_v4_source(qtype: str, nchunks: int, k: int, x_off4: int, mode: str, nf4: int, g_off4: int,
                      eps: float, ep: str = "store", inter_full: int = 0, xs_fold: bool = True) -> str:
    """matmul_decode.wgsl + matmul_decode_v4.wgsl plus the generated entry point: 4 rows per
    invocation read as one span of vec4<u32> (every index a constant offset from the invocation's
    base), each vec4 loaded once, at its first use; x chunk c is loaded once for the 4 rows."""
    bw = _V4_BLOCK[qtype]
    rw = nchunks * bw                  # row_words
    xfn = _X_FN[mode]
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
        xs = f"v4_xs({xfn}({c}u))" if qtype in _V4_XS and not xs_fold else f"{xfn}({c}u)"
        cd = "cdot_xs" if qtype in _V4_XS and xs_fold else "cdot"
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
            lines.append(f"    a.{comp[j]} += {cd}(wblock_{qtype}({', '.join(words)}), x{c});")
    lines += _pnorm_lines(mode, k, "ss")
    scale = f"inverseSqrt(ss / {float(k)!r} + EPS)" if mode in ("norm", "pnorm") else "1.0"
    lines += [f"    let r = a * {scale};", _EPILOGUE_CALL[ep].format(i4="i4"), "}", ""]
    return "\n".join(lines)


def _params(dev, w, y, T, rows, r0, x_off, y_off, b_off, has_bias, accumulate):
    """matmul.wgsl's MatmulParams for the weight part of `rows` rows starting at row r0."""
    K = w.k
    flags = (1 if has_bias else 0) | (2 if accumulate else 0)
    return params(dev, [K, rows, T, w.row_words, x_off, y_off, w.n, r0, b_off, flags, K // 32, K // 4],
                  owner=y.buf.owner, label=f"matmul[{w.label}]")


# mode -> the x chunk reader of matmul_decode.wgsl (pnorm reads x as is: it is x0 * g already)
_X_FN = {"plain": "dec_x", "norm": "dec_xn", "silu": "dec_xs", "pnorm": "dec_x"}


def _pnorm_lines(mode: str, k: int, ss: str) -> list:
    """pnorm: the sum of squares from the K/4 partial sums, 4 per constant-offset (uniform) load."""
    if mode != "pnorm":
        return []
    return [f"    {ss} += dec_pss({i}u);" for i in range(k // 16)]


# how the generated entry points end: store the 4 sums, or hand them to an epilogue
_EPILOGUE_CALL = {
    "store": "    store(0u, 4u * {i4}, r.x);\n    store(0u, 4u * {i4} + 1u, r.y);\n"
             "    store(0u, 4u * {i4} + 2u, r.z);\n    store(0u, 4u * {i4} + 3u, r.w);",
    "silu": "    ep_silu({i4}, r);",
    "rope_kv": "    ep_rope_kv({i4}, r);",
    "res_norm": "    ep_res_norm({i4}, r);",
}


def _decode_source(nchunks: int, k: int, x_off4: int, mode: str, nf4: int, g_off4: int, eps: float,
                   ep: str = "store") -> str:
    """matmul_decode.wgsl plus its generated entry point: the K loop unrolled (see that file)."""
    xfn = _X_FN[mode]
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
    lines += _pnorm_lines(mode, k, "acc.ss")
    scale = f"inverseSqrt(acc.ss / {float(k)!r} + EPS)" if mode in ("norm", "pnorm") else "1.0"
    if ep == "store":
        lines.append(f"    dec_end(rows, acc, {scale});")
    else:                                   # RR = 4: rows.r0 = 4 * i4
        lines += [f"    let r = acc.a * {scale};", _EPILOGUE_CALL[ep].format(i4="(rows.r0 / 4u)")]
    lines += ["}", ""]
    return "\n".join(lines)


@dataclass
class NormOut:
    """matmul(..., norm_out=): the next RMSNorm's weight g (N,) f32; where y * g goes (N elements,
    y's dtype); the partial sums of y^2 (N/4,) f32, 4 rows each."""
    g: Tensor
    out: Tensor
    partials: Tensor


@dataclass
class RopeKV:
    """The rope + KV-cache write that matmul(..., rope_kv=...) folds into a decode qkv projection
    (matmul_epilogue.wgsl): `step` holds pos0 (u32) first, `freq` the rot_dim/2 f32 frequencies
    (nn.rope_frequencies), caches (n_kv_heads, ctx, head_dim) in the activation dtype."""

    step: Buffer
    freq: Buffer
    k_cache: Tensor
    v_cache: Tensor
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int
    ctx: int


def matmul(dev: Device, x: Tensor, w: QWeight, y: Tensor, *, bias: Tensor | None = None,
           accumulate: bool = False, config: MatmulConfig | None = None,
           norm: tuple | None = None, silu: bool = False, silu_out: bool = False,
           rope_kv: RopeKV | None = None, norm_out: "NormOut | None" = None,
           rms_from: tuple | None = None, row_invariant: bool = False, decode_rows: bool = False) -> Op:
    """y = x·Wᵀ (+ bias); with `accumulate`, y += x·Wᵀ (+ bias). x (T, K), W (N, K), y (T, N).

    Fused inputs (T = 1 only, see `fusable`): `norm=(g (K,) f32, eps)` multiplies by RMSNorm(x)
    instead of x; `silu=True` takes x (1, 2K) = [gate | up] and multiplies by silu(gate) * up.
    Fused outputs (T = 1 only, see `epilogue_ok`): `silu_out=True` for a weight from
    `interleave_pairs` (gate and up rows in pairs) stores y (1, N/2) = silu(gate) * up;
    `rope_kv` rotates the q and k rows of a fused qkv projection and writes k and v to the caches;
    `norm_out` (y (1, N) the whole row, usually accumulate=True on a residual) also stores y * g
    and the partial sums of y^2 that a following matmul(..., rms_from=(partials, eps)) turns into
    1 / rms: that matmul takes x = y * g and gives RMSNorm(y) · Wᵀ with no norm dispatch between.

    `row_invariant`: each row of y comes out bit for bit the same whatever T is (prefill: a
    position's logits must not depend on how the prompt was chunked or cached): the kernel is
    chosen by the weight and the device alone — the tiled kernel for every T where the device's
    strategy tiles and the weight allows, else matmul.wgsl, whose row kernel and 4-row tile do the
    same sums per row. No fused input or epilogue.
    `decode_rows`: each row is one sequence's decode step in a continuous batch: its sums must not
    depend on how many rows run, though they need not equal a prefill row's — the GPU family's
    decode kernel in groups of up to 8 rows (one weight pass per group), the row-invariant kernels
    in the CPU family (_decode_rows_variant)."""
    if w.subs:       # parts of different types (upload_weight): one matmul per sub-weight
        return _matmul_parts(dev, x, w, y, bias=bias, accumulate=accumulate, config=config, norm=norm,
                             silu=silu, rms_from=rms_from, row_invariant=row_invariant, decode_rows=decode_rows,
                             epilogue=silu_out or rope_kv is not None or norm_out is not None)
    cfg = config or default_config(dev)
    eps_set = [silu_out, rope_kv is not None, norm_out is not None]
    ep = "silu" if silu_out else "rope_kv" if rope_kv is not None else \
        "res_norm" if norm_out is not None else "store"
    if ep != "store":
        check(sum(eps_set) == 1, "matmul", "only one of silu_out, rope_kv and norm_out can be set")
        check(epilogue_ok(dev, w.qtype, w.n, w.k, cfg, force=True) and len(w.bufs) == 1
              and x.shape[0] == 1, "matmul",
              "a fused epilogue needs T = 1, a single-buffer weight with K % 32 == 0 and 4 rows per "
              "invocation")
        check(bias is None or not silu_out, "matmul", "silu_out takes no bias")
        check(not accumulate or ep == "res_norm", "matmul", "this fused epilogue cannot accumulate")
        n_out = w.n // 2 if silu_out else w.n
        check(tuple(y.shape) == (1, n_out), "matmul", f"y is {y.shape}, expected (1, {n_out})")
    check(len(x.shape) == 2 and len(y.shape) == 2, "matmul", f"x {x.shape} and y {y.shape} must be 2-D")
    x_in = x                      # what is bound: (T, 2K) [gate | up] when silu
    if silu:
        check(x.shape[1] % 2 == 0, "matmul", f"silu needs x = [gate | up], got {x.shape}")
        x = Tensor(x.buf, (x.shape[0], x.shape[1] // 2), x.dtype, x.offset)
    if rms_from is not None:
        check(norm is None and not silu, "matmul", "rms_from cannot be combined with norm or silu")
        check(x.shape[0] == 1 and x.shape[1] % 32 == 0, "matmul",
              "rms_from needs T = 1 and K % 32 == 0 (the decode path)")
    if norm is not None or silu:
        check(norm is None or not silu, "matmul", "norm and silu cannot both be fused")
        check(fusable(dev, x.shape[0], w, cfg, force=True), "matmul",
              "fused norm/silu needs T = 1 and a weight with K % 32 == 0 on the decode path")
    T, K = x.shape
    check(K == w.k, "matmul", f"x has {K} columns, the weight {w.label!r} has {w.k}")
    check(silu_out or tuple(y.shape) == (T, w.n), "matmul", f"y is {y.shape}, expected ({T}, {w.n})")
    check(x.dtype == y.dtype, "matmul", f"x is {x.dtype} but y is {y.dtype}")
    check(T > 0, "matmul", "empty input")
    check(K % 4 == 0, "matmul", f"K={K} must be a multiple of 4")
    esz = DTYPE_SIZE[x.dtype]
    xb, x_off = _window(x_in, 4 * esz, "matmul", "x")
    yb, y_off = _window(y, esz, "matmul", "y")
    if bias is not None:
        check(bias.dtype == "f32" and bias.numel == w.n, "matmul", f"bias must be f32 ({w.n},)")
        bb, b_off = _window(bias, 4, "matmul", "bias")
    else:
        bb, b_off = placeholder(dev), 0
    check(cfg.rr in (1, 2, 4) and cfg.prr in (1, 2, 4) and cfg.tm in (1, 4), "matmul",
          f"unsupported strategy {cfg}")
    if row_invariant:
        check(ep == "store" and norm is None and not silu and rms_from is None, "matmul",
              "row_invariant takes no fused input or epilogue")
    plain = ep == "store" and norm is None and not silu and rms_from is None
    if decode_rows:
        check(plain and not row_invariant and config is None, "matmul",
              "decode_rows takes no fused input, epilogue, config or row_invariant")
        v = _decode_rows_variant(dev, cfg, w)
        if v is not None:        # groups of up to 8 rows, each through the same decode kernel
            g = matmul_gpu.MAX_DECODE_T
            ops = [matmul_gpu.matmul(dev, x.view((min(g, T - r), K), r * K), w,
                                     y.view((min(g, T - r), w.n), r * w.n), bias=bias, accumulate=accumulate,
                                     variant=v) for r in range(0, T, g)]
            op = ops[0]
            for o in ops[1:]:
                op = op + o
            return op
        row_invariant = True     # the CPU family: the row-invariant kernels, any T
    variant = _family_variant(dev, cfg, w, T, row_invariant) if plain else None
    if variant is not None:
        return matmul_gpu.matmul(dev, x, w, y, bias=bias, accumulate=accumulate, variant=variant,
                                 row_invariant=row_invariant)
    if 2 <= T <= cfg.batch_max_t and config is None and plain and not row_invariant:
        op = matmul_batch.matmul(dev, x, w, y, bias=bias, accumulate=accumulate)   # decode batches
        if op is not None:
            return op
    if (T > 1 or row_invariant) and config is None and cfg.tiled:
        # prefill tiles; a short row-invariant run takes a tile near its size (same bits per row)
        tile = matmul_batch.tiled_config(dev, w.qtype, T) if T <= cfg.batch_max_t else None
        op = matmul_tiled.matmul(dev, x, w, y, bias=bias, accumulate=accumulate,
                                 any_t=row_invariant, config=tile)
        if op is not None:
            return op
    unrolled = not row_invariant and (_use_v4(cfg, w) or cfg.unroll and K <= cfg.unroll_max_k
                                      and w.n <= cfg.unroll_max_n)
    if T == 1 and K % 32 == 0 and (norm is not None or silu or rms_from is not None or unrolled
                                   or ep in ("silu", "rope_kv")):
        return _matmul_decode(dev, x, w, y, xb, x_off, yb, y_off, bb, b_off, bias is not None,
                              accumulate, cfg, norm, silu, ep, rope_kv, norm_out, rms_from)
    if ep == "res_norm":          # K too long to unroll: the loop kernel with the epilogue
        return _matmul_decode(dev, x, w, y, xb, x_off, yb, y_off, bb, b_off, bias is not None,
                              accumulate, cfg, None, False, ep, None, norm_out, loop=True)
    if T > 1 and cfg.tm == 4:
        entry, rr, tiles = "matmul_tile", cfg.prr, -(-T // 4)
    else:
        entry, rr, tiles = "matmul", cfg.rr, T
    check(tiles <= _MAX_GROUPS, "matmul", f"T={T} needs more than 65535 tiles")
    pipe = _pipeline(dev, entry, w, x.dtype, cfg.wg, rr)
    op = Op(name=f"matmul[{w.label}]")
    for buf, (r0, rows) in zip(w.bufs, w.parts):
        groups = -(-rows // (cfg.wg * rr))
        check(groups <= _MAX_GROUPS, "matmul", f"{rows} rows need more than 65535 workgroups")
        p = _params(dev, w, y, T, rows, r0, x_off, y_off, b_off, bias is not None, accumulate)
        op.buffers.append(p)
        op.add(pipe, dev.bind(pipe, [p, xb, buf, yb, bb]), groups, tiles)
    return op


def _matmul_parts(dev: Device, x: Tensor, w: QWeight, y: Tensor, *, epilogue: bool, **kw) -> Op:
    """A MIXED weight: each sub-weight writes its own rows of y with the same inputs and options
    (fused inputs apply per row; bias and accumulate per output). Fused epilogues need every row
    of a projection in one kernel, so they are refused (epilogue_ok is False for MIXED)."""
    check(not epilogue, "matmul", f"{w.label}: a weight whose parts have different types "
          f"({', '.join(s.qtype for s in w.subs)}) takes no fused epilogue")
    op = Op(name=f"matmul[{w.label}]")
    for s in w.subs:
        op = op + matmul(dev, x, s, y, **kw)
    return op


def fusable(dev: Device, T: int, w: QWeight, config: MatmulConfig | None = None, *,
            silu: bool = False, force: bool = False) -> bool:
    """Whether the model should use matmul(..., norm=...) (or, with `silu`, (..., silu=True)) for T
    rows of x and weight w: possible when T = 1 and K % 32 == 0 (`force`: possible at all), chosen
    when this device's strategy says fusing wins."""
    cfg = config or default_config(dev)
    if T != 1 or w.k % 32:
        return False
    return force or cfg.unroll and (cfg.fuse_silu if silu else cfg.fuse)


def _matmul_decode(dev, x, w, y, xb, x_off, yb, y_off, bb, b_off, has_bias, accumulate, cfg, norm,
                   silu, ep="store", rope: RopeKV | None = None, norm_out: "NormOut | None" = None,
                   rms_from: tuple | None = None, loop: bool = False) -> Op:
    """T = 1: the host-unrolled decode kernel, or with `loop` (an epilogue, K too long to unroll)
    matmul.wgsl's loop over K ending with the epilogue (matmul_epilogue.wgsl matmul_<ep>)."""
    K = w.k
    mode, g_off4, eps, extra = "plain", 0, 0.0, {}
    if rms_from is not None:
        part, eps = rms_from
        check(part.dtype == "f32" and part.numel == K // 4 and K % 16 == 0, "matmul",
              f"rms_from partial sums must be f32 ({K // 4},) with K % 16 == 0")
        pb, g_off4 = _window(part, 16, "matmul", "partial sums")
        mode, extra = "pnorm", {5: pb}
    elif norm is not None:
        g, eps = norm
        check(g.dtype == "f32" and g.numel == K, "matmul", f"norm weight must be f32 ({K},)")
        gb, g_off4 = _window(g, 16, "matmul", "norm weight")
        mode, extra = "norm", {5: gb}
    elif silu:
        mode = "silu"
    entry = "matmul_decode"
    if loop:
        src, entry = "", f"matmul_{ep}"
    elif _use_v4(cfg, w):
        src = _decode_v4_source(w.qtype, K // 32, K, x_off, mode, K // 4, g_off4, eps, ep, w.inter_full,
                                cfg.xs_fold)
    else:
        src = _decode_source(K // 32, K, x_off, mode, K // 4, g_off4, eps, ep)
    if ep != "store":
        src += _epilogue_binds(y, rope, norm_out, extra)
    pipe = _pipeline(dev, entry, w, x.dtype, cfg.wg, cfg.rr, src)
    op = Op(name=f"matmul[{w.label}]")
    for buf, (r0, rows) in zip(w.bufs, w.parts):
        groups = -(-rows // (cfg.wg * cfg.rr))
        check(groups <= _MAX_GROUPS, "matmul", f"{rows} rows need more than 65535 workgroups")
        p = _params(dev, w, y, 1, rows, r0, x_off, y_off, b_off, has_bias, accumulate)
        op.buffers.append(p)
        entries = {0: p, 1: xb, 2: buf, 3: yb, 4: bb, **extra}
        if ep == "silu":
            del entries[4]          # ep_silu reads no bias, so the pipeline's layout has no binding 4
        op.add(pipe, dev.bind(pipe, entries), groups, 1)
    return op


def _epilogue_binds(y: Tensor, rope: RopeKV | None, norm_out: "NormOut | None", extra: dict) -> str:
    """The epilogue's bindings (added to `extra`) and source."""
    esz = DTYPE_SIZE[y.dtype]
    caches = offs = None
    if rope is not None:
        caches = [_window(rope.k_cache, esz, "matmul", "k cache"),
                  _window(rope.v_cache, esz, "matmul", "v cache")]     # (binding, offset) each
        extra.update({6: rope.step, 7: rope.freq, 8: caches[0][0], 9: caches[1][0]})
    if norm_out is not None:
        n = y.numel
        g, out, part = norm_out.g, norm_out.out, norm_out.partials
        check(g.dtype == "f32" and g.numel == n and out.dtype == y.dtype and out.numel == n
              and part.dtype == "f32" and part.numel == n // 4 and n % 4 == 0, "matmul",
              f"norm_out needs g f32 ({n},), out {y.dtype} ({n},) and partials f32 ({n // 4},)")
        wins = [_window(g, 4, "matmul", "norm weight"), _window(out, esz, "matmul", "norm output"),
                _window(part, 4, "matmul", "partial sums")]
        extra.update({10: wins[0][0], 11: wins[1][0], 12: wins[2][0]})
        offs = [o for _, o in wins]
    return _epilogue_source(y.dtype, rope, caches, offs)


def _epilogue_source(dtype: str, rope: RopeKV | None, caches: list | None, norm_offs: list | None = None) -> str:
    """sincos.wgsl + matmul_epilogue.wgsl and its consts (zeros where unused); `caches`: the k and v
    caches' (binding, element offset); `norm_offs`: ep_res_norm's g, out and partials offsets."""
    c = dict(EP_D=1, EP_ROT=0, EP_KLO=0, EP_VLO=0, EP_CTX=0, EP_KC=0, EP_VC=0)
    if rope is not None:
        D = rope.head_dim
        check(D % 4 == 0 and rope.rot_dim % 2 == 0 and 0 <= rope.rot_dim <= D, "matmul",
              "rope epilogue needs head_dim % 4 == 0 and an even rot_dim <= head_dim")
        for t in (rope.k_cache, rope.v_cache):
            check(t.dtype == dtype and t.numel == rope.n_kv_heads * rope.ctx * D, "matmul",
                  f"cache {t.shape} {t.dtype} must be (Hkv={rope.n_kv_heads}, ctx={rope.ctx}, D={D}) {dtype}")
        c = dict(EP_D=D, EP_ROT=rope.rot_dim, EP_KLO=rope.n_q_heads * D,
                 EP_VLO=(rope.n_q_heads + rope.n_kv_heads) * D, EP_CTX=rope.ctx,
                 EP_KC=caches[0][1], EP_VC=caches[1][1])
    c.update(zip(("EP_G", "EP_YG", "EP_PART"), norm_offs or (0, 0, 0)))
    consts = "".join(f"const {k}: u32 = {v}u;\n" for k, v in c.items())
    return consts + load_shader_source("sincos.wgsl") + load_shader_source("matmul_epilogue.wgsl")


def epilogue_ok(dev: Device, qtype: str, n: int, k: int, config: MatmulConfig | None = None, *,
                force: bool = False) -> bool:
    """Whether a (n, k) `qtype` weight's T = 1 matmul can take a fused epilogue (silu_out /
    rope_kv): the decode kernel with 4 rows per invocation, whole 4-row groups and the weight in
    one buffer as upload_weight lays it out (`force`: possible at all); chosen when this device's
    strategy says so (`epilogue` with `unroll`)."""
    cfg = config or default_config(dev)
    if k % 32 or n % 4 or cfg.rr != 4 or qtype not in QTYPES:
        return False
    if n * gpu_row_bytes(qtype, k) > min(dev.max_storage_binding, dev.max_buffer_size):
        return False
    return force or cfg.unroll and cfg.epilogue


def interleave_pairs(gate, up, qtype: str, k: int) -> bytes:
    """The rows of two (F, k) weights (file layout bytes) as one (2F, k) weight whose rows are
    gate and up interleaved in pairs: g0 g1 u0 u1 g2 g3 u2 u3 ... (for matmul(..., silu_out=True)
    and nn.silu_mul(..., pairs=True)). F must be even."""
    g, u = _bytes_view(gate), _bytes_view(up)
    rb = file_row_bytes(qtype, k)
    check(g.nbytes == u.nbytes and g.nbytes % (2 * rb) == 0, "interleave_pairs",
          f"gate and up must be equal whole, even row counts of {rb} B rows")
    out = bytearray(2 * g.nbytes)
    step = 2 * rb
    for i in range(0, g.nbytes, step):
        out[2 * i:2 * i + step] = g[i:i + step]
        out[2 * i + step:2 * i + 2 * step] = u[i:i + step]
    return bytes(out)


def embedding(dev: Device, ids: Tensor, table: QWeight, out: Tensor, *, wg: int = 64) -> Op:
    """out[t, :] = table[ids[t], :] as activations. ids (T,) u32, table (V, C), out (T, C) f32/f16."""
    check(ids.dtype in ("u32", "i32") and len(ids.shape) == 1, "embedding", "ids must be a (T,) u32 tensor")
    check(not table.subs, "embedding", f"{table.label}: a table whose parts have different types")
    T = ids.shape[0]
    C = table.k
    check(tuple(out.shape) == (T, C), "embedding", f"out is {out.shape}, expected ({T}, {C})")
    ib, i_off = _window(ids, 4, "embedding", "ids")
    ob, o_off = _window(out, DTYPE_SIZE[out.dtype], "embedding", "out")
    nchunks = C // 32
    units = nchunks + (C // 4 - 8 * nchunks)
    gx, gy = _grid(-(-T * units // wg))
    pipe = _pipeline(dev, "embedding", table, out.dtype, wg)
    op = Op(name=f"embedding[{table.label}]")
    for buf, (r0, rows) in zip(table.bufs, table.parts):
        p = params(dev, [C, T, table.row_words, o_off, i_off, r0, rows, nchunks, units],
                   owner=out.buf.owner, label=f"embedding[{table.label}]")
        op.buffers.append(p)
        op.add(pipe, dev.bind(pipe, [p, ib, buf, ob]), gx, gy)
    return op


def upload_vector(dev: Device, data, *, dtype: str = "f32", owner: str, label: str = "") -> Tensor:
    """A 1-D f32 tensor from f32/f16/bf16 bytes (norm weights, biases); small, so converted here."""
    mv = _bytes_view(data)
    if dtype == "f32":
        raw = mv
    elif dtype == "f16":
        n = mv.nbytes // 2
        raw = array("f", struct.unpack(f"<{n}e", mv)).tobytes()
    elif dtype == "bf16":
        h = array("H", mv.tobytes())
        raw = array("I", (v << 16 for v in h)).tobytes()
    else:
        raise ValueError(f"upload_vector: dtype must be f32, f16 or bf16, got {dtype!r}")
    n = len(raw) // 4 if isinstance(raw, bytes) else raw.nbytes // 4
    return Tensor(dev.upload(raw, owner=owner, label=label), (n,), "f32")


__all__ = ["QTYPES", "MIXED", "QWeight", "MatmulConfig", "RopeKV", "FAMILY_ENV", "FAMILIES", "kernel_family",
           "is_cpu_adapter", "is_software_adapter", "default_config", "upload_weight", "matmul",
           "fusable", "epilogue_ok", "interleave_pairs", "embedding", "upload_vector", "file_row_bytes",
           "gpu_row_bytes"]
