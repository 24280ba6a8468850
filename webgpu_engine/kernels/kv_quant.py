"""Quantised KV caches (kv_cache_dtype "q8_0" or "q4_0"; layout in shaders/kv_quant.wgsl): each block
type's sizes, the kv_quant writes of a forward's k and v heads, and the WGSL header the attention
kernels read them with. A cache is one u32 tensor per layer and kind (K or V); row r = h * ctx + pos.
Both block types share everything but their bits per value (KVQuant): one write kernel and one
read path serve both, the block type a compile-time constant (shaders/kv_blocks.wgsl)."""
from __future__ import annotations

from dataclasses import dataclass

from ..gpu import Device
from ..gpu.shaders import load_shader_source
from .common import Op, Ring, Tensor, act_header, check, params, ring_header, ring_query
from .nn_base import _act, _op, _qkv_heads, _step_entry, _window

KV_BLOCK = 32                       # values per scale, both block types


@dataclass(frozen=True)
class KVQuant:
    """A KV block type: blocks of 32 values of a head row share one f16 scale; `bits` per value,
    packed into u32 words so that a row's vec4 i lies in word i // vec4s_per_word."""

    name: str
    bits: int                       # 8: signed bytes (q8_0); 4: nibbles q + 8 (q4_0)

    @property
    def vec4s_per_word(self) -> int:
        return 8 // self.bits

    def value_words(self, head_dim: int) -> int:
        """u32 words of one row's values."""
        return head_dim * self.bits // 32

    def row_words(self, head_dim: int) -> int:
        """u32 words of one row: its values and its scales."""
        return self.value_words(head_dim) + scale_words(head_dim)

    def cache_words(self, n_kv_heads: int, ctx: int, head_dim: int) -> int:
        """u32 words of one layer's K (or V) cache: every row's values, then every row's scales."""
        return n_kv_heads * ctx * self.row_words(head_dim)

    def pool_shape(self, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> tuple:
        """A pool's u32 tensor shape: (n_blocks, BS, Hkv, row words) words in all, the values of every
        row first, then every row's scales (not row-major: the shape carries the geometry)."""
        return (n_blocks, block_size, n_kv_heads, self.row_words(head_dim))


KV_QUANTS = {q.name: q for q in (KVQuant("q8_0", 8), KVQuant("q4_0", 4))}
KV_DTYPES = ("f32", "f16") + tuple(KV_QUANTS)


def scale_words(head_dim: int) -> int:
    """u32 words of one row's f16 scales (two per word)."""
    return -(-head_dim // (2 * KV_BLOCK))


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one head row of the cache (one position of one kv head, K or V)."""
    if kv_dtype in KV_QUANTS:
        return 4 * KV_QUANTS[kv_dtype].row_words(head_dim)
    return head_dim * {"f32": 4, "f16": 2}[kv_dtype]


def quant_supported(head_dim: int) -> bool:
    return head_dim % KV_BLOCK == 0


@dataclass(frozen=True)
class QuantCache:
    """A quantised cache (or pool) as its kernels compile it in: the block type and the head rows it
    holds (the scales start after every row's values)."""

    kind: KVQuant
    rows: int

    def header(self, head_dim: int) -> str:
        """KV_BITS, KV_VPW (row vec4s per word), SW, KV_SOFF (the first scale word) and
        kv_blocks.wgsl (the block type's codes: kv_unpack, kv_scale, kv_code)."""
        k = self.kind
        return (f"const KV_BITS: u32 = {k.bits}u;\nconst KV_VPW: u32 = {k.vec4s_per_word}u;\n"
                f"const SW: u32 = {scale_words(head_dim)}u;\n"
                f"const KV_SOFF: u32 = {self.rows * k.value_words(head_dim)}u;\n"
                + load_shader_source("kv_blocks.wgsl"))


def check_quant_caches(k: str, caches, rows: int, head_dim: int) -> QuantCache:
    """The block type of quantised caches of `rows` head rows (u32 tensors bound whole, at offset 0),
    told by their size."""
    check(quant_supported(head_dim), k, f"a quantised KV cache needs head_dim a multiple of {KV_BLOCK}, "
                                        f"got {head_dim}")
    kind = next((q for q in KV_QUANTS.values() if caches[0].numel == rows * q.row_words(head_dim)), None)
    want = " or ".join(f"{rows * q.row_words(head_dim)} ({q.name})" for q in KV_QUANTS.values())
    for c in caches:
        check(kind is not None and c.dtype == "u32" and c.offset == 0 and c.numel == caches[0].numel, k,
              f"quantised cache {c.shape} {c.dtype} must be {want} u32 words at offset 0 "
              f"({rows} head rows of D={head_dim})")
    return QuantCache(kind, rows)


def _write_header(dtype: str, head_dim: int, quant: QuantCache) -> str:
    """The header of the kernels that write a quantised cache: act, D4, the block type's header and
    quant_write.wgsl (the quantising they share)."""
    return (act_header(dtype) + f"const D4: u32 = {head_dim // 4}u;\n" + quant.header(head_dim)
            + load_shader_source("quant_write.wgsl"))


def _write_lanes(rows: int, n_kv_heads: int, head_dim: int) -> int:
    """The writers' lanes: one per (row, k|v, kv head, scale word)."""
    return rows * 2 * n_kv_heads * scale_words(head_dim)


def _check_heads(k: str, heads: int, n_q_heads: int, n_kv_heads: int) -> None:
    check(heads >= n_q_heads + 2 * n_kv_heads, k, f"qkv rows have {heads} heads, need {n_q_heads}+2*{n_kv_heads}")


def kv_quant(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
             n_kv_heads: int, head_dim: int, ctx: int) -> Op:
    """The k heads and v heads of qkv (T, Hq+2Hkv, D) rows t < step.n_new (0: all) into the quantised
    caches (q8_0 or q4_0, told by their size) at rows step.pos0 + t (after RoPE: the k heads are
    stored as they are)."""
    k = "kv_quant"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    _check_heads(k, heads, n_q_heads, n_kv_heads)
    quant = check_quant_caches(k, (k_cache, v_cache), n_kv_heads * ctx, head_dim)
    qe, qo = _window(dev, qkv, k, 4)
    par = params(dev, [rows, heads, n_q_heads, n_kv_heads, ctx, qo, 0, 0], owner=qkv.buf.owner, label=k)
    entries = [_step_entry(step), qe, (k_cache.buf, 0, k_cache.nbytes), (v_cache.buf, 0, v_cache.nbytes)]
    return _op(dev, k, "kv_quant.wgsl", "kv_quant", _write_header(dt, head_dim, quant), par, entries,
               _write_lanes(rows, n_kv_heads, head_dim))


# ---------------------------------------------------------------------------- the paged pool
def check_quant_pools(k: str, k_pool: Tensor, v_pool: Tensor, n_kv_heads: int, head_dim: int) -> QuantCache:
    """The block type of quantised pools (n_blocks, BS, Hkv, row words), told by their shape."""
    check(len(k_pool.shape) == 4 and k_pool.shape == v_pool.shape, k,
          f"pools {k_pool.shape} / {v_pool.shape} must both be (n_blocks, BS, Hkv, row words)")
    n_blocks, bs, hkv, _ = (int(s) for s in k_pool.shape)
    quant = check_quant_caches(k, (k_pool, v_pool), n_blocks * bs * hkv, head_dim)
    check(hkv == n_kv_heads, k, f"{quant.kind.name} pool {k_pool.shape} must be (n_blocks, BS, {n_kv_heads}, "
                                f"{quant.kind.row_words(head_dim)}) u32")
    return quant


def kv_quant_slots(dev: Device, qkv: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor, step=None, *,
                   n_q_heads: int, n_kv_heads: int, head_dim: int) -> Op:
    """The k and v heads of qkv rows (T, Hq+2Hkv, D) (rows t < step.n_new; no step: all) into quantised
    pool rows slots[t] * Hkv + h (slot 0xffffffff: skipped), after RoPE."""
    k = "kv_quant_slots"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    _check_heads(k, heads, n_q_heads, n_kv_heads)
    quant = check_quant_pools(k, k_pool, v_pool, n_kv_heads, head_dim)
    check(slots.dtype == "u32" and slots.numel >= rows, k, f"slots {slots.shape} must hold {rows} u32")
    qe, qo = _window(dev, qkv, k, 4)
    se, so = _window(dev, slots, k)
    owner = k_pool.buf.owner
    par = params(dev, [rows, heads, n_q_heads, n_kv_heads, 0, qo, so, 0], owner=owner, label=k)
    extra = []
    if step is None:                # all rows: a step of its own whose n_new is 0
        step = dev.upload(bytes(16), owner=owner, label="kv_quant_slots.step")
        extra = [step]
    entries = [_step_entry(step), qe, (k_pool.buf, 0, k_pool.nbytes), (v_pool.buf, 0, v_pool.nbytes), se]
    op = _op(dev, k, "kv_quant.wgsl", k, _write_header(dt, head_dim, quant), par, entries,
             _write_lanes(rows, n_kv_heads, head_dim))
    op.buffers += extra
    return op


def rope_kv_quant(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
                  n_kv_heads: int, head_dim: int, ctx: int, rot_dim: int | None = None, base: float = 10000.0,
                  neox: bool = False, factors=None, mscale: float = 1.0, ring: Ring | None = None,
                  q_sink: Tensor | None = None) -> Op:
    """nn.rope_kv for quantised caches in one dispatch (shaders/rope_kv_quant.wgsl): the q heads of
    qkv rows t < step.n_new rotated in place at step.pos0 + t; the k heads, rotated in f32, and the v
    heads quantised into cache row pos0 + t (qkv's k heads stay unrotated: attention reads the cache).
    `ring`, `q_sink`: as nn.rope_kv's."""
    from .rope import rope_frequencies
    k = "rope_kv_quant"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    rot = head_dim if rot_dim is None else rot_dim
    check(rot % 2 == 0 and 0 <= rot <= head_dim and (not neox or rot % 4 == 0), k,
          f"rot_dim {rot} must be even (neox: a multiple of 4) and <= head_dim {head_dim}")
    _check_heads(k, heads, n_q_heads, n_kv_heads)
    quant = check_quant_caches(k, (k_cache, v_cache), n_kv_heads * ctx, head_dim)
    owner = qkv.buf.owner
    qe, qo = _window(dev, qkv, k, 2)
    freq = rope_frequencies(dev, rot, base, owner=owner, factors=factors)
    half = rot // 2
    units = half // 2 + (head_dim - rot) // 2 if neox else head_dim // 2       # as nn._rope_op's
    par = params(dev, [rows, heads, head_dim // 2, half, 0, n_q_heads, n_q_heads, int(bool(neox)), n_q_heads,
                       n_kv_heads, ctx, qo, 0, 0, units, float(mscale)], owner=owner, label=k)
    header = (_write_header(dt, head_dim, quant) + ring_header(ring, rope=True) + load_shader_source("sincos.wgsl")
              + load_shader_source("rope.wgsl"))
    entries = [_step_entry(step), qe, (freq, 0, freq.size), (k_cache.buf, 0, k_cache.nbytes),
               (v_cache.buf, 0, v_cache.nbytes)] + ring_query(k, ring, q_sink, rows, n_q_heads, head_dim, ctx)
    op = _op(dev, k, "rope_kv_quant.wgsl", k, header, par, entries,
             rows * n_q_heads * units + _write_lanes(rows, n_kv_heads, head_dim))
    op.buffers.append(freq)
    return op
