"""Conventions shared by every kernel host function: tensors, prebuilt ops, params, variants.

A kernel host function checks shapes, writes its static parameters into a small uniform buffer once,
builds the bind group once, and returns an `Op` (a prebuilt list of dispatches). The model records
`Op`s into a `Batch` each step (`op.record(batch)`) without creating anything: per-step values
(position, kv length) live in a `step` storage buffer (u32[4] = pos0, n_new, kv_len, 0) that the
pipeline writes once per step and that kernels needing them bind.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Sequence

from ..gpu import UNIFORM, Batch, Buffer, Device, Pipeline

ACT_DTYPES = ("f32", "f16")
DTYPE_SIZE = {"f32": 4, "f16": 2, "bf16": 2, "u32": 4, "i32": 4}
BIND_ALIGN = 256          # WebGPU's default minStorageBufferOffsetAlignment

# how the matmul kernels read 4 activations (`xword` / `xget`): f16 as a pair of u32 words (CPU
# drivers load storage one component per invocation, so 2 words beat 4 halves), f32 as a vec4
XREAD = {
    "f32": "alias xword = vec4<f32>;\nfn xget(i: u32) -> vec4<f32> { return x[i]; }\n",
    "f16": "alias xword = vec2<u32>;\nfn xget(i: u32) -> vec4<f32> {\n    let p = x[i];\n"
           "    return vec4<f32>(unpack2x16float(p.x), unpack2x16float(p.y));\n}\n",
}


@dataclass
class Tensor:
    """A view of a GPU buffer as a dense row-major array. `offset` is in bytes."""

    buf: Buffer
    shape: tuple
    dtype: str = "f32"
    offset: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZE[self.dtype]

    def binding(self):
        """(buffer, offset, size) for a bind group entry, size rounded up to 4 bytes."""
        return (self.buf, self.offset, (self.nbytes + 3) & ~3)

    def view(self, shape: tuple, offset_elems: int = 0) -> "Tensor":
        return Tensor(self.buf, tuple(shape), self.dtype, self.offset + offset_elems * DTYPE_SIZE[self.dtype])


def new_tensor(dev: Device, shape: Sequence[int], dtype: str = "f32", *, owner: str, label: str = "") -> Tensor:
    n = 1
    for s in shape:
        n *= int(s)
    return Tensor(dev.buffer(n * DTYPE_SIZE[dtype], owner=owner, label=label), tuple(int(s) for s in shape), dtype)


@dataclass
class Op:
    """Prebuilt dispatches (pipeline, bind group, workgroups) plus the params buffers they own."""

    dispatches: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    name: str = ""
    short: list = field(default_factory=list)    # see record
    max_keys: int = 0

    def add(self, pipeline: Pipeline, bind_group, x: int, y: int = 1, z: int = 1) -> "Op":
        self.dispatches.append((pipeline, bind_group, int(x), int(y), int(z)))
        return self

    def record(self, batch: Batch, n_keys: int | None = None) -> Batch:
        """Append the dispatches to `batch`. `n_keys` (the live KV length of a decode step, when
        the caller knows it) lets an op with a short form (`short`, used up to `max_keys` keys)
        record that instead."""
        use_short = self.short and n_keys is not None and n_keys <= self.max_keys
        for p, bg, x, y, z in (self.short if use_short else self.dispatches):
            batch.dispatch(p, bg, x, y, z)
        return batch

    def finish(self) -> None:
        """Make what the op makes at its first record rather than with the op (nothing here)."""

    def __add__(self, other: "Op") -> "Op":
        return Op(self.dispatches + other.dispatches, self.buffers + other.buffers, self.name)

    def release(self) -> None:
        for b in self.buffers:
            b.release()
        self.buffers.clear()


class OpCache:
    """Op lists built once per key and replayed, the `limit` most recently used kept (a list
    pushed out releases its params buffers)."""

    def __init__(self, limit: int):
        from collections import OrderedDict
        self.limit, self._lists = limit, OrderedDict()

    def get(self, key, build) -> list:
        ops = self._lists.get(key)
        if ops is None:
            if len(self._lists) >= self.limit:
                for op in self._lists.popitem(last=False)[1]:
                    op.release()
            ops = self._lists[key] = build()
        else:
            self._lists.move_to_end(key)
        return ops

    def values(self):
        return self._lists.values()

    def release(self) -> None:
        for ops in self._lists.values():
            for op in ops:
                op.release()
        self._lists.clear()


def run_ops(dev: Device, *ops: Op) -> None:
    """Record and submit ops at once (tests, one-off work)."""
    b = dev.batch()
    for op in ops:
        op.record(b)
    dev.submit(b)


def act_header(dtype: str) -> str:
    """WGSL header for an activation-dtype variant: `act`/`act4` aliases (f32 accumulation always)."""
    if dtype == "f16":
        return "enable f16;\nalias act = f16;\nalias act4 = vec4<f16>;\n"
    if dtype == "f32":
        return "alias act = f32;\nalias act4 = vec4<f32>;\n"
    raise ValueError(f"activation dtype must be f32 or f16, got {dtype!r}")


@dataclass(frozen=True)
class Ring:
    """WebLLM's sliding window with attention sinks (context_window_size -1, sliding_window_size
    `window` = W, attention_sink_size `sinks` = S) over a contiguous cache of ctx rows, ctx >= W plus
    the rows of one forward: positions 0..S-1 stay in rows 0..S-1, position pos >= S goes to row
    S + (pos - S) % (ctx - S). A query at position pos sees the sinks and the W - S positions before
    it (a ring, one position dropped per token: MLC's), and itself. RoPE as MLC applies it in that
    mode, where a key's position is its place in the cache: the window's keys keep their distance
    to the query (t - k, RoPE is relative, so they are rotated at their own positions), the sinks sit
    at distance min(pos, W) - j (the query of the sinks is rotated at min(pos, W): rope_kv writes it
    beside qkv, attention scores the sinks with it)."""

    sinks: int
    window: int


def ring_header(ring: "Ring | None", rope: bool = False, binding: int = 6) -> str:
    """The WGSL constants of a Ring (RING false: none) for attention.wgsl, and with `rope` rope.wgsl's
    store of the sink queries, `put_q_sink(i, v)` (qsk (T, Hq, D) at `binding`: 6, rope_paged.wgsl's 8;
    without a ring it stores nothing and binds nothing)."""
    if ring is None:
        out = "const RING: bool = false;\nconst SINKS: u32 = 0u;\nconst RING_W: u32 = 0u;\n"
        return out + ("fn put_q_sink(i: u32, v: vec2<f32>) {}\n" if rope else "")
    out = f"const RING: bool = true;\nconst SINKS: u32 = {ring.sinks}u;\nconst RING_W: u32 = {ring.window}u;\n"
    return out + (f"@group(0) @binding({binding}) var<storage, read_write> qsk: array<vec2<act>>;\n"
                  "fn put_q_sink(i: u32, v: vec2<f32>) { qsk[i] = vec2<act>(v); }\n" if rope else "")


def ring_query(k: str, ring: "Ring | None", q_sink: "Tensor | None", rows: int, n_q_heads: int, head_dim: int,
               ctx: int) -> list:
    """The binding of a Ring's sink queries (qsk in rope.wgsl and attention.wgsl, (T, Hq, D), a
    buffer of its own): none without a ring."""
    if ring is None:
        return []
    check(0 <= ring.sinks < ring.window <= ctx, k, f"ring {ring} needs 0 <= sinks < window <= ctx {ctx}")
    check(q_sink is not None and q_sink.numel >= rows * n_q_heads * head_dim and q_sink.offset == 0, k,
          f"a ring needs q_sink of ({rows}, Hq={n_q_heads}, D={head_dim}) at the start of its buffer")
    return [(q_sink.buf, 0, q_sink.nbytes)]


def params(dev: Device, fields: Sequence, *, owner: str, label: str = "params") -> Buffer:
    """A uniform buffer with the given scalars packed as 4-byte words (int → u32/i32, float → f32),
    padded to 16 bytes as WGSL uniform structs require."""
    raw = b"".join(struct.pack("<f", v) if isinstance(v, float)
                   else struct.pack("<i" if v < 0 else "<I", v) for v in fields)
    raw += b"\0" * (-len(raw) % 16 or 0)
    if not raw:
        raw = b"\0" * 16
    return dev.upload(raw, usage=UNIFORM, owner=owner, label=label)


def check(cond: bool, kernel: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{kernel}: {msg}")


def window(t: Tensor, unit: int, kernel: str, name: str):
    """(binding, offset in `unit`-byte elements) of a tensor: binding offsets must be BIND_ALIGN-
    aligned, so bind from the aligned offset below and pass the rest to the kernel."""
    base = t.offset & ~(BIND_ALIGN - 1)
    rest = t.offset - base
    check(rest % unit == 0, kernel, f"{name} offset {t.offset} is not a multiple of {unit} bytes")
    size = (rest + t.nbytes + 3) & ~3
    return (t.buf, base, size), rest // unit


def placeholder(dev: Device) -> Buffer:
    """The device's one 16-byte storage buffer bound where a kernel's optional input (a bias) is absent.
    Kept on the device itself: a table keyed weakly by device whose values (buffers) point back at
    their device would keep every device alive, with its pipelines' memory."""
    b = getattr(dev, "_placeholder", None)
    if b is None or not b.alive:
        b = dev._placeholder = dev.buffer(16, owner="kernels", label="unused-binding")
    return b


def wmap_header(w, full_param: str = "") -> str:
    """WGSL `wmap4(v)`: where vec4 word v of a weight's row layout is stored — identity, or for a
    weight in interleaved 4-row spans (QWeight.inter_full > 0) copy.wgsl's span_map. The identity
    header is the same text for every weight, so those pipelines stay shared. `full_param`: a WGSL
    expression (a params field) that gives inter_full at run time, so that interleaved weights of
    the same row length share one pipeline too (the caller passes w.inter_full in that field)."""
    full = w.inter_full
    rw = w.row_words if full else 1
    bound = full_param if full and full_param else "WI_FULL"
    return (f"const WI_RW: u32 = {rw}u;\nconst WI_FULL: u32 = {full if bound == 'WI_FULL' else 0}u;\n"
            f"fn wmap4(v: u32) -> u32 {{\n    if (v >= {bound}) {{ return v; }}\n"
            "    let r = v % (8u * WI_RW);\n    return v - r + (r % WI_RW) * 8u + r / WI_RW;\n}\n")


def pipeline_keys(ops) -> set:
    """The pipelines (their keys) that `ops` dispatch, short forms included."""
    return {d[0].key for op in ops for d in list(op.dispatches) + list(op.short)}


async def warm_up(dev, record) -> None:
    """Run once, at load, the pipelines `record(batch, warmed) -> keys` records into `batch` (it
    records nothing when every key is in `warmed`, the pipelines already run on this device), and
    remember them: drivers such as lavapipe compile a pipeline on its first dispatch."""
    batch = dev.batch()
    keys = record(batch, dev.warmed_pipelines)
    dev.submit(batch)
    await dev.sync()
    dev.warmed_pipelines |= keys

