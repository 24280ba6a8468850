"""The q8_0 KV cache (kv_cache_dtype "q8_0"; layout in shaders/kv_quant.wgsl): its sizes, the
kv_quant write of a forward's k and v heads, and the WGSL the attention kernels read it with.
A cache is one u32 tensor per layer and kind (K or V); row r = h * ctx + pos."""
from __future__ import annotations

from ..gpu import Device
from ..gpu.shaders import load_shader_source
from .common import Op, Tensor, act_header, check, params
from .nn_base import _act, _op, _qkv_heads, _step_entry, _window

KV_DTYPES = ("f32", "f16", "q8_0")
Q8_BLOCK = 32                       # values per scale


def q8_scale_words(head_dim: int) -> int:
    """u32 words of one row's f16 scales (two per word)."""
    return -(-head_dim // (2 * Q8_BLOCK))


def q8_cache_words(n_kv_heads: int, ctx: int, head_dim: int) -> int:
    """u32 words of one layer's K (or V) cache: the signed bytes, then the scales."""
    return n_kv_heads * ctx * (head_dim // 4 + q8_scale_words(head_dim))


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one head row of the cache (one position of one kv head, K or V)."""
    if kv_dtype == "q8_0":
        return head_dim + 4 * q8_scale_words(head_dim)
    return head_dim * {"f32": 4, "f16": 2}[kv_dtype]


def q8_supported(head_dim: int) -> bool:
    return head_dim % Q8_BLOCK == 0


def q8_header(head_dim: int, rows: int) -> str:
    """SW, Q8_SOFF (the first scale word of a cache of `rows` head rows) and i8x4(word): a word's
    four signed bytes (the low byte first)."""
    return (f"const SW: u32 = {q8_scale_words(head_dim)}u;\nconst Q8_SOFF: u32 = {rows * (head_dim // 4)}u;\n"
            "fn i8x4(w: u32) -> vec4<f32> {\n"
            "  return vec4<f32>(vec4<i32>(bitcast<i32>(w << 24u), bitcast<i32>(w << 16u), "
            "bitcast<i32>(w << 8u), bitcast<i32>(w)) >> vec4<u32>(24u));\n}\n")


def _write_header(dtype: str, head_dim: int, rows: int) -> str:
    """The header of the kernels that write a q8_0 cache of `rows` head rows: act, D4, q8_header and
    q8_write.wgsl (the quantising they share)."""
    return (act_header(dtype) + f"const D4: u32 = {head_dim // 4}u;\n" + q8_header(head_dim, rows)
            + load_shader_source("q8_write.wgsl"))


def check_q8_caches(k: str, caches, n_kv_heads: int, ctx: int, head_dim: int) -> None:
    check(q8_supported(head_dim), k, f"a q8_0 KV cache needs head_dim a multiple of {Q8_BLOCK}, got {head_dim}")
    for c in caches:
        check(c.dtype == "u32" and c.offset == 0 and c.numel == q8_cache_words(n_kv_heads, ctx, head_dim), k,
              f"q8_0 cache {c.shape} {c.dtype} must be {q8_cache_words(n_kv_heads, ctx, head_dim)} u32 words "
              f"at offset 0 (Hkv={n_kv_heads}, ctx={ctx}, D={head_dim})")


def kv_quant(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
             n_kv_heads: int, head_dim: int, ctx: int) -> Op:
    """The k heads and v heads of qkv (T, Hq+2Hkv, D) rows t < step.n_new (0: all) into the q8_0
    caches at rows step.pos0 + t (after RoPE: the k heads are stored as they are)."""
    k = "kv_quant"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    check(heads >= n_q_heads + 2 * n_kv_heads, k, f"qkv rows have {heads} heads, need {n_q_heads}+2*{n_kv_heads}")
    check_q8_caches(k, (k_cache, v_cache), n_kv_heads, ctx, head_dim)
    qe, qo = _window(dev, qkv, k, 4)
    par = params(dev, [rows, heads, n_q_heads, n_kv_heads, ctx, qo, 0, 0], owner=qkv.buf.owner, label=k)
    header = _write_header(dt, head_dim, n_kv_heads * ctx)
    entries = [_step_entry(step), qe, (k_cache.buf, 0, k_cache.nbytes), (v_cache.buf, 0, v_cache.nbytes)]
    return _op(dev, k, "kv_quant.wgsl", "kv_quant", header, par, entries,
               rows * 2 * n_kv_heads * q8_scale_words(head_dim))


# ---------------------------------------------------------------------------- the paged pool
def q8_pool_shape(n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> tuple:
    """A q8_0 pool's u32 tensor shape: (n_blocks, BS, Hkv, D/4 + SW) words in all, the bytes of
    every row first, then every row's scales (not row-major: the shape carries the geometry)."""
    return (n_blocks, block_size, n_kv_heads, head_dim // 4 + q8_scale_words(head_dim))


def q8_pool_rows(pool: Tensor) -> int:
    n_blocks, bs, hkv, _ = pool.shape
    return int(n_blocks) * int(bs) * int(hkv)


def kv_quant_slots(dev: Device, qkv: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor, step=None, *,
                   n_q_heads: int, n_kv_heads: int, head_dim: int) -> Op:
    """The k and v heads of qkv rows (T, Hq+2Hkv, D) (rows t < step.n_new; no step: all) into q8_0
    pool rows slots[t] * Hkv + h (slot 0xffffffff: skipped), after RoPE."""
    k = "kv_quant_slots"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    check(heads >= n_q_heads + 2 * n_kv_heads, k, f"qkv rows have {heads} heads, need {n_q_heads}+2*{n_kv_heads}")
    check(q8_supported(head_dim), k, f"a q8_0 KV cache needs head_dim a multiple of {Q8_BLOCK}, got {head_dim}")
    for c in (k_pool, v_pool):
        check(c.dtype == "u32" and c.offset == 0 and len(c.shape) == 4
              and c.shape[2:] == q8_pool_shape(1, 1, n_kv_heads, head_dim)[2:], k,
              f"q8_0 pool {c.shape} {c.dtype} must be (n_blocks, BS, {n_kv_heads}, {head_dim // 4 + q8_scale_words(head_dim)}) u32")
    check(slots.dtype == "u32" and slots.numel >= rows, k, f"slots {slots.shape} must hold {rows} u32")
    qe, qo = _window(dev, qkv, k, 4)
    se, so = _window(dev, slots, k)
    owner = k_pool.buf.owner
    par = params(dev, [rows, heads, n_q_heads, n_kv_heads, 0, qo, so, 0], owner=owner, label=k)
    header = _write_header(dt, head_dim, q8_pool_rows(k_pool))
    extra = []
    if step is None:                # all rows: a step of its own whose n_new is 0
        step = dev.upload(bytes(16), owner=owner, label="kv_quant_slots.step")
        extra = [step]
    entries = [_step_entry(step), qe, (k_pool.buf, 0, k_pool.nbytes), (v_pool.buf, 0, v_pool.nbytes), se]
    op = _op(dev, k, "kv_quant.wgsl", k, header, par, entries, rows * 2 * n_kv_heads * q8_scale_words(head_dim))
    op.buffers += extra
    return op


def rope_kv_q8(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
               n_kv_heads: int, head_dim: int, ctx: int, rot_dim: int | None = None, base: float = 10000.0,
               neox: bool = False, factors=None, mscale: float = 1.0) -> Op:
    """nn.rope_kv for q8_0 caches in one dispatch (shaders/rope_kv_q8.wgsl): the q heads of qkv rows
    t < step.n_new rotated in place at step.pos0 + t; the k heads, rotated in f32, and the v heads
    quantised into cache row pos0 + t (qkv's k heads stay unrotated: attention reads the cache)."""
    from .rope import rope_frequencies
    k = "rope_kv_q8"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    rot = head_dim if rot_dim is None else rot_dim
    check(rot % 2 == 0 and 0 <= rot <= head_dim and (not neox or rot % 4 == 0), k,
          f"rot_dim {rot} must be even (neox: a multiple of 4) and <= head_dim {head_dim}")
    check(heads >= n_q_heads + 2 * n_kv_heads, k, f"qkv rows have {heads} heads, need {n_q_heads}+2*{n_kv_heads}")
    check_q8_caches(k, (k_cache, v_cache), n_kv_heads, ctx, head_dim)
    owner = qkv.buf.owner
    qe, qo = _window(dev, qkv, k, 2)
    freq = rope_frequencies(dev, rot, base, owner=owner, factors=factors)
    half = rot // 2
    units = half // 2 + (head_dim - rot) // 2 if neox else head_dim // 2       # as nn._rope_op's
    par = params(dev, [rows, heads, head_dim // 2, half, 0, n_q_heads, n_q_heads, int(bool(neox)), n_q_heads,
                       n_kv_heads, ctx, qo, 0, 0, units, float(mscale)], owner=owner, label=k)
    header = (_write_header(dt, head_dim, n_kv_heads * ctx) + load_shader_source("sincos.wgsl")
              + load_shader_source("rope.wgsl"))
    entries = [_step_entry(step), qe, (freq, 0, freq.size), (k_cache.buf, 0, k_cache.nbytes),
               (v_cache.buf, 0, v_cache.nbytes)]
    op = _op(dev, k, "rope_kv_q8.wgsl", k, header, par, entries,
             rows * n_q_heads * units + rows * 2 * n_kv_heads * q8_scale_words(head_dim))
    op.buffers.append(freq)
    return op
