"""Weights on the GPU in their file layout (GGUF blocks or HF float rows): upload, the one-off
repack of blocks that are not whole u32 words, splitting by rows across buffers, the interleaved
4-row spans of the CPU family's vec4 kernels, and small vectors. The block geometry of every type
comes from the one table in kernels/qtypes.py. Page code: standard library only."""
from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass, field

from ...gpu import Buffer, Device
from ..common import Tensor, check, params
from ..qtypes import QTYPE, QTYPES
from .config import default_config


# from the one table of weight types (kernels/qtypes.py): qtype → (file bytes per block, weights per
# block, GPU bytes per block, byte where the repack inserts zero padding or None)
BLOCKS = {t.name: (t.file_bytes, t.block, t.gpu_bytes, t.pad_at) for t in QTYPE.values() if t.quantized}
FLOAT_BYTES = {t.name: t.file_bytes for t in QTYPE.values() if not t.quantized}
_STAGE_BYTES = 32 << 20    # most file bytes staged at once for a GPU repack
MAX_GROUPS = 65535


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
    chosen: dict = field(default_factory=dict)   # kernels pinned for its life (select._pinned)

    def release(self) -> None:
        for b in self.bufs:
            b.release()


def file_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k weights in the file (GGUF / safetensors) layout."""
    if qtype in FLOAT_BYTES:
        return k * FLOAT_BYTES[qtype]
    fb, qk, _, _ = BLOCKS[qtype]
    return k // qk * fb


def gpu_row_bytes(qtype: str, k: int) -> int:
    if qtype in FLOAT_BYTES:
        return k * FLOAT_BYTES[qtype]
    _, qk, gb, _ = BLOCKS[qtype]
    return k // qk * gb


def check_shape(qtype: str, n: int, k: int, what: str) -> None:
    check(qtype in QTYPES, what, f"unsupported weight type {qtype!r}; supported: {', '.join(QTYPES)}")
    check(n > 0 and k > 0, what, f"empty weight ({n}, {k})")
    qk = BLOCKS[qtype][1] if qtype in BLOCKS else 4
    check(k % qk == 0, what, f"{qtype} weights need k % {qk} == 0, got k={k}")


def grid(groups: int) -> tuple[int, int]:
    """Fold a 1-D workgroup count into (x, y) within the 65535-per-dimension limit."""
    x = min(groups, MAX_GROUPS)
    return max(x, 1), max(1, -(-groups // MAX_GROUPS))


def upload_weight(dev: Device, parts, qtype, n: int, k: int, *, owner: str, label: str = "",
                  max_binding: int | None = None, interleave: bool | None = None) -> QWeight:
    """Upload a (n, k) weight given as one or several byte buffers of whole rows concatenated along
    n (fused QKV or gate+up). `max_binding` (default: the device's limit) caps bytes per buffer.
    `interleave` (default: as the device's MatmulConfig says) stores a single-buffer weight of a
    type with a vec4 decode (qtypes.QType.v4_args) in interleaved 4-row spans (see
    MatmulConfig.interleave). `qtype`: the type of every part, or a list with one type per part —
    K-quant files store some tensors of a fused matrix in a wider type (Q4_K_M: attn_v in Q6_K
    beside Q4_K attn_q / attn_k); parts of different types make a MIXED weight (see
    _upload_mixed)."""
    if not isinstance(qtype, str):
        return _upload_mixed(dev, parts, list(qtype), n, k, owner=owner, label=label,
                             max_binding=max_binding, interleave=interleave)
    check_shape(qtype, n, k, "upload_weight")
    if isinstance(parts, (bytes, bytearray, memoryview)) or hasattr(parts, "__array_interface__"):
        parts = [parts]
    views = [bytes_view(p) for p in parts]
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
            interleave = cfg.interleave and cfg.reads_v4(qtype, n, k)
        interleave = interleave and len(bufs) == 1 and bool(QTYPE[qtype].v4_args) and n >= 32
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
        check_shape(qt, n, k, "upload_weight")
        v, frow = bytes_view(p), file_row_bytes(qt, k)
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
        gx, gy = grid(-(-n4 // 64))
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
    pad_at = BLOCKS[qtype][3] if qtype in BLOCKS else None
    if pad_at is None:
        dev.write(dst, seg, offset)
        return
    fb, _, gb, _ = BLOCKS[qtype]
    nblocks = seg.nbytes // fb
    stage = dev.upload(seg, owner=owner, label=f"{label}:staging")
    p = params(dev, [nblocks, fb, gb // 4, pad_at, gb - fb, offset // 4, 0, 0], owner=owner,
               label=f"{label}:repack")
    try:
        pipe = dev.pipeline("copy.wgsl", "repack_blocks")
        gx, gy = grid(-(-nblocks * (gb // 4) // 64))
        dev.run(pipe, [p, stage, dst], gx, gy)
    finally:
        # WebGPU keeps destroyed buffers alive until the submitted work that uses them completes.
        stage.release()
        p.release()


def bytes_view(data) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def interleave_pairs(gate, up, qtype: str, k: int) -> bytes:
    """The rows of two (F, k) weights (file layout bytes) as one (2F, k) weight whose rows are
    gate and up interleaved in pairs: g0 g1 u0 u1 g2 g3 u2 u3 ... (for matmul(..., silu_out=True)
    and nn.silu_mul(..., pairs=True)). F must be even."""
    g, u = bytes_view(gate), bytes_view(up)
    rb = file_row_bytes(qtype, k)
    check(g.nbytes == u.nbytes and g.nbytes % (2 * rb) == 0, "interleave_pairs",
          f"gate and up must be equal whole, even row counts of {rb} B rows")
    out = bytearray(2 * g.nbytes)
    step = 2 * rb
    for i in range(0, g.nbytes, step):
        out[2 * i:2 * i + step] = g[i:i + step]
        out[2 * i + step:2 * i + 2 * step] = u[i:i + step]
    return bytes(out)


def upload_vector(dev: Device, data, *, dtype: str = "f32", owner: str, label: str = "") -> Tensor:
    """A 1-D f32 tensor from f32/f16/bf16 bytes (norm weights, biases); small, so converted here."""
    mv = bytes_view(data)
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
