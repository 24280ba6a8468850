"""Host functions for paged attention (shaders/attention_paged.wgsl, rope_paged.wgsl): RoPE at per-row
positions fused with the KV write into pool blocks (or the KV write alone), ragged-batch decode
attention over per-sequence block tables (split-key + combine, or one dispatch while the keys are
few) and chunked-prefill attention of one sequence.

The pool of a layer is two tensors (n_blocks, block_size, Hkv, D), K and V, in the activation dtype
(or q8_0 / q4_0: kernels/kv_quant.py's u32 pools, written by its kv_quant_slots after the rotation);
models/kv_pool.py decides which blocks a sequence owns. Per-step values live in small u32 buffers
the caller rewrites each step, so ops are built once: `slots` (T,) pool rows for the KV write
(block * block_size + offset, 0xffffffff = skip), `lens` (S,) keys per decoding sequence (0 = idle
slot) with `tables` (S, max_blocks) block ids, and for prefill the usual `step` (pos0, n_new, ., .)
with the sequence's table. The attention arithmetic is attention.wgsl's, key for key: for the same
keys and the same split size a sequence's output equals the contiguous kernel's.

A Ring (WebLLM's sliding window with sinks) makes each sequence's table of max_blocks * block_size
rows a ring cache: ring_row(pos) is the table row of a position (sinks fixed, the rest modulo the
ring), the KV write's slot that row's; decode's lens carry positions + 1, not key counts.
"""
from __future__ import annotations

from ..gpu import Device
from ..gpu.shaders import load_shader_source
from .common import Op, Ring, Tensor, act_header, check, new_tensor, params, ring_header, ring_query
from .kv_quant import KV_QUANTS, QuantCache, check_quant_pools, kv_quant_slots, kv_row_bytes
from .attention import check_attention, check_sinks, decode_geometry
from .nn import (MAX_WG, WG, _act, _attn_header, _grid, _heads_per_lane, _op, _qkv_heads, _step_entry, _vec_entry,
                 _window, rope_frequencies)

__all__ = ["new_kv_pool", "max_pool_blocks", "paged_rope_kv", "paged_kv_write", "paged_decode", "paged_prefill",
           "ring_row", "SKIP_SLOT"]

FILE = "attention_paged.wgsl"
_BLK = 16                 # attention_common.wgsl's BLK: keys per fold of the online softmax
_NWB = 2                  # blocks per window of paged_causal_window (CPU adapters: 4 ran 10% faster, twice the compile)
SKIP_SLOT = 0xFFFFFFFF


def ring_row(ring: Ring, pos: int, rows: int) -> int:
    """The table row of position pos in a sequence's ring of `rows` rows (rope.wgsl's cache_row): the
    sinks and the first rows in place, past the end SINKS + (pos - SINKS) % (rows - SINKS)."""
    return pos if pos < rows else ring.sinks + (pos - ring.sinks) % (rows - ring.sinks)


def _ring_sink(k: str, ring: Ring | None, q_sink: Tensor | None, quant, rows: int, n_q_heads: int,
               head_dim: int, cap: int) -> dict:
    """{9: the sink queries' binding} of a paged attention with a ring ({} without)."""
    check(ring is None or not quant, k, "a ring over a quantised pool is not supported; use an f32 or f16 pool")
    return dict(zip([9], ring_query(k, ring, q_sink, rows, n_q_heads, head_dim, cap)))


def new_kv_pool(dev: Device, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                dtype: str = "f32", *, owner: str, label: str = "kv_pool") -> tuple[Tensor, Tensor]:
    """One layer's K and V pools, each (n_blocks, block_size, Hkv, D); "q8_0" / "q4_0": u32 pools of
    that block type's KVQuant.pool_shape."""
    shape = (n_blocks, block_size, n_kv_heads, head_dim)
    if dtype in KV_QUANTS:
        shape, dtype = KV_QUANTS[dtype].pool_shape(n_blocks, block_size, n_kv_heads, head_dim), "u32"
    return (new_tensor(dev, shape, dtype, owner=owner, label=f"{label}.k"),
            new_tensor(dev, shape, dtype, owner=owner, label=f"{label}.v"))


def max_pool_blocks(dev: Device, block_size: int, n_kv_heads: int, head_dim: int, dtype: str = "f32") -> int:
    """The most blocks one layer's pool may hold: each pool is bound whole, so it must fit the
    device's largest storage binding (128 MiB on lavapipe). dtype: f32, f16, q8_0 or q4_0."""
    limit = int(dev.limits.get("max-storage-buffer-binding-size", 1 << 27))
    return limit // (block_size * n_kv_heads * kv_row_bytes(dtype, head_dim))


def _pool_geometry(dev: Device, k: str, k_pool: Tensor, v_pool: Tensor, n_kv_heads: int,
                   head_dim: int) -> tuple[int, int]:
    check(k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype and len(k_pool.shape) == 4, k,
          f"pools {k_pool.shape} / {v_pool.shape} must both be (n_blocks, block_size, Hkv, D)")
    n_blocks, bs, hkv, d = (int(s) for s in k_pool.shape)
    quant = _pool_quant(k, k_pool, v_pool, n_kv_heads, head_dim)       # checks a quantised pool's Hkv and D
    check(quant or (hkv == n_kv_heads and d == head_dim), k,
          f"pool heads {hkv} x {d} != Hkv={n_kv_heads} x D={head_dim}")
    cap = max_pool_blocks(dev, bs, n_kv_heads, head_dim, quant.kind.name if quant else k_pool.dtype)
    check(n_blocks <= cap, k, f"a pool of {n_blocks} blocks exceeds the device's largest storage binding "
                              f"({cap} blocks)")
    check(head_dim % 4 == 0, k, f"head_dim {head_dim} must be a multiple of 4")
    return n_blocks, bs


def _pool_quant(k: str, k_pool: Tensor, v_pool: Tensor, n_kv_heads: int, head_dim: int) -> QuantCache | None:
    """The block type and rows of quantised (u32) pools; None for pools in the activations' dtype."""
    return check_quant_pools(k, k_pool, v_pool, n_kv_heads, head_dim) if k_pool.dtype == "u32" else None


def _u32(dev: Device, t: Tensor, k: str, name: str, n: int) -> tuple:
    check(t.dtype == "u32" and t.numel >= n, k, f"{name} {t.shape}/{t.dtype} must hold {n} u32")
    return _window(dev, t, k)


def _header(dt: str, head_dim: int, g: int, swg: int, packed: bool, bs: int, window: int = 0,
            softcap: float = 0.0, quant: QuantCache | None = None, sinks: bool = False,
            ring: Ring | None = None, spans: bool = False, kv: tuple = ("kc", "vc")) -> str:
    """nn's attention header plus the block size and whether the window / soft-cap code is compiled in.
    quant: quantised pools' block type and rows (None: act pools); sinks: per-head sink logits;
    ring: a sliding window with sinks; spans: prefill rows' image spans (binding 10), else none bound."""
    return _attn_header(dt, head_dim, g, swg, packed and not quant, windowed=window > 0, capped=softcap > 0,
                        quant=quant, sinks=sinks, ring=ring, kv=kv) + f"const BS: u32 = {bs}u;\n" + (
        "@group(0) @binding(10) var<storage, read> spans: array<u32>;   // (T, 2): feature row | image end\n"
        "fn key_end(t: u32, lim: u32, cap: u32) -> u32 { return max(lim, min(spans[p.idx_off + 2u * t + 1u], cap)); }\n"
        if spans else "fn key_end(t: u32, lim: u32, cap: u32) -> u32 { return lim; }\n")


def _windows_header(dt: str, head_dim: int, g: int, bs: int, window: int, softcap: float, sinks: bool) -> str:
    """paged_causal_window's header: nn's attention header reading keys and values from the
    workgroup tiles ksh / vsh (row j of a block at j * D4); fold_staged, attention_common's fold_block
    over one whole block, and fold_window, a window's NWB blocks, both written out (see the shader);
    the state's loads and stores (st: (T, Hq, D4 + 1) vec4<f32>, acc then (max, sum, 0, 0))."""
    n, gs = head_dim // 4, range(g)
    seen = "j0 + {j}u < lim && (!WINDOWED || j0 + {j}u >= lo)"
    fold = "".join(f"    let s{j} = select(sv(MASKED), score({j * n}u), {seen.format(j=j)});\n"
                   f"    mb = max(mb, s{j});\n" for j in range(_BLK))
    fold += "    let corr = exp(m_run - mb);\n    l_run *= corr;\n    acc_scale(corr);\n"
    fold += "".join(f"    let e{j} = exp(s{j} - mb);\n    l_run += e{j};\n    acc_add(e{j}, {j * n}u);\n"
                    for j in range(_BLK))
    blocks = "".join(f"    stage_block(j0 + {b * _BLK}u, hk, n_wg, lid);\n    workgroupBarrier();\n"
                     f"    fold_staged(j0 + {b * _BLK}u, lo, lim);\n    workgroupBarrier();\n" for b in range(_NWB))
    comp = (lambda v: v) if g == 1 else (lambda v: f"sv({', '.join(f'ml{j}.{v}' for j in gs)})")
    load = "".join(f"    a{j}_{i} = st[sb + {j * (n + 1) + i}u];\n" for j in gs for i in range(n))
    load += "".join(f"    let ml{j} = st[sb + {j * (n + 1) + n}u];\n" for j in gs)
    load += f"    m_run = {comp('x') if g > 1 else 'ml0.x'};\n    l_run = {comp('y') if g > 1 else 'ml0.y'};\n"
    save = "".join(f"    st[sb + {j * (n + 1) + i}u] = a{j}_{i};\n" for j in gs for i in range(n))
    save += "".join(f"    st[sb + {j * (n + 1) + n}u] = vec4<f32>(sv_get(m_run, {j}u), sv_get(l_run, {j}u), 0.0, 0.0);\n"
                    for j in gs)
    return (_header(dt, head_dim, g, WG, False, bs, window, softcap, None, sinks, kv=("ksh", "vsh"))
            + f"const NWB: u32 = {_NWB}u;\n"
            + f"var<workgroup> ksh: array<vec4<f32>, {_BLK * n}>;\nvar<workgroup> vsh: array<vec4<f32>, {_BLK * n}>;\n"
            + "@group(0) @binding(11) var<storage, read_write> st: array<vec4<f32>>;\n"
            + "@group(0) @binding(12) var<storage, read> wread: array<u32>;         // [0]: the window\n"
            + "@group(0) @binding(13) var<storage, read_write> wwrite: array<u32>;  // [0]: the next one\n"
            + "fn fold_staged(j0: u32, lo: u32, lim: u32) {\n    var mb = m_run;\n" + fold + "    m_run = mb;\n}\n"
            + "fn fold_window(j0: u32, hk: u32, n_wg: u32, lo: u32, lim: u32, lid: u32) {\n" + blocks + "}\n"
            + "fn load_state(sb: u32) {\n" + load + "}\nfn save_state(sb: u32) {\n" + save + "}\n"
            + load_shader_source("attention_paged_windows.wgsl"))


def _cpu_family(dev: Device) -> bool:
    """The CPU kernel family on a CPU adapter (lavapipe): where the kernels below were measured."""
    from .matmul import is_cpu_adapter, kernel_family     # the matmul package does not import this module
    return kernel_family(dev) == "cpu" and is_cpu_adapter(dev)


def _windowed(dev: Device, head_dim: int, quant, ring, spans) -> bool:
    """Whether a prefill takes paged_causal_window: the CPU family on a CPU adapter, a pool in the
    activations' dtype, no ring and no image spans, tiles of at most 16 KiB."""
    return (_cpu_family(dev) and quant is None and ring is None and spans is None
            and 2 * _BLK * head_dim * 4 <= 16384)


class _KeyWindows(Op):
    """paged_prefill's op on CPU adapters: dispatches (paged_causal, then paged_causal_window with its
    three bind groups, made at the first record: a pipeline made while the device compiles in the
    background is queued behind the ones made before it, so the load's queue keeps the kernels a first
    request needs ahead of this one's longer compile). record(n_keys=at least the chunk's keys,
    pos0 + rows) records paged_causal_window once per window of `kw` keys, each over the query blocks
    that reach it (see the shader); without n_keys, for every key a table holds (`keys`). Its bind
    groups: the first window reads zeros as its index, the later ones two counts in turn. Until the
    window kernel is compiled, paged_causal runs in its place: the same outputs, bit for bit."""

    kw: int = 0
    keys: int = 0
    rows: int = 0
    n_hg: int = 0
    make: object = None

    def finish(self) -> None:
        """Make the window kernel and its bind groups (at the first record, or at the end of a load
        that queues its kernels: then behind every other kernel of the load)."""
        if self.make is not None:
            self.make, make = None, self.make
            make(self)

    def record(self, batch, n_keys: int | None = None):
        self.finish()
        loop, *windows = self.dispatches
        if not windows[0][0].ready:
            batch.dispatch(*loop)
            return batch
        n, n_blk = min(self.keys if n_keys is None else n_keys, self.keys), -(-self.rows // WG)
        for w in range(max(1, -(-n // self.kw))):
            x, y = _grid(min(n_blk, -(-(n - w * self.kw) // WG)) * self.n_hg * WG, "paged_prefill")
            pipe, group = windows[0 if w == 0 else 1 + (w - 1) % 2][:2]
            batch.dispatch(pipe, group, x, y, 1)
        return batch


# the window kernel's state per attention output buffer: id -> (that buffer, the state's); the ops
# writing one output buffer (a forward's layers, its op lists of other row counts) run one after
# another, so they share one state, freed with its owner (a model's buffers)
_STATES: dict[int, tuple] = {}


def _shared_state(dev: Device, out: Tensor, size: int):
    """The state buffer (at least `size` bytes) of the window kernels writing `out`'s buffer."""
    for k in [k for k, (o, st) in _STATES.items() if not (o.alive and st.alive)]:
        del _STATES[k]
    o, st = _STATES.get(id(out.buf), (None, None))
    if o is not out.buf or st.size < size:
        st = dev.buffer(size, owner=out.buf.owner, label="paged_prefill.state")
        _STATES[id(out.buf)] = (out.buf, st)
    return st


def _prefill_windows(dev: Device, loop: Op, out: Tensor, header: str, entries: dict, t_max: int, n_q_heads: int,
                     g: int, head_dim: int, keys: int) -> Op:
    """paged_prefill's _KeyWindows: the loop kernel's op `loop` (paged_causal) and paged_causal_window
    with `header` (heads_per_lane g) writing `out`, its state and window counts."""
    par = loop.buffers[0]
    st = _shared_state(dev, out, t_max * n_q_heads * (head_dim // 4 + 1) * 16)
    counts = [dev.upload(bytes(16), owner=par.owner, label="paged_prefill.window") for _ in range(3)]
    op = _KeyWindows(list(loop.dispatches), [par, *counts], "paged_prefill")
    op.kw, op.keys, op.rows, op.n_hg = _NWB * _BLK, keys, t_max, n_q_heads // g

    def make(op: Op) -> None:
        pipe = dev.pipeline(FILE, "paged_causal_window", header=header)
        for r, w in ((0, 1), (1, 2), (2, 1)):      # zeros -> a, a -> b, b -> a
            binds = {0: par, **entries, 11: (st, 0, st.size), 12: (counts[r], 0, 16), 13: (counts[w], 0, 16)}
            op.add(pipe, dev.bind(pipe, binds), 0)
    op.make = make
    return op


def _bindings(dev: Device, k: str, qkv: Tensor, out: Tensor, k_pool: Tensor, v_pool: Tensor, n_kv_heads: int,
              head_dim: int) -> tuple:
    """(qkv, out, k pool, v pool) as (bind-group entry, offset in act4 units), and quantised pools'
    block type and rows (None: pools in the activations' dtype; a quantised pool is bound whole, at 0)."""
    q, o = _window(dev, qkv, k, 4), _window(dev, out, k, 4)
    quant = _pool_quant(k, k_pool, v_pool, n_kv_heads, head_dim)
    if quant:
        return q, o, ((k_pool.buf, 0, k_pool.nbytes), 0), ((v_pool.buf, 0, v_pool.nbytes), 0), quant
    return q, o, _window(dev, k_pool, k, 4), _window(dev, v_pool, k, 4), None


def paged_rope_kv(dev: Device, qkv: Tensor, k_pool: Tensor, v_pool: Tensor, positions: Tensor, slots: Tensor,
                  step=None, *, n_q_heads: int, n_kv_heads: int, head_dim: int, rot_dim: int | None = None,
                  base: float = 10000.0, neox: bool = False, factors=None, mscale: float = 1.0,
                  ring: Ring | None = None, q_sink: Tensor | None = None) -> Op:
    """nn.rope_kv for the paged pool, each row at a position of its own: rotates the q and k heads of
    each qkv row (T, Hq+2Hkv, D) in place at positions[t], then writes its k and v heads to pool row
    slots[t] (0xffffffff: rotate only). positions, slots: (T,) u32 starting at a binding-aligned
    offset. step (optional): rows t >= step.n_new are skipped. The decode step's one dispatch for
    rope and the KV write, as nn.rope_kv is for the contiguous cache. `ring`: each q head is also
    stored rotated at min(positions[t], ring.window) in q_sink (T, Hq, D), the sinks' query."""
    k = "rope_kv_paged"
    quant = k_pool.dtype == "u32"
    dt = _act(k, qkv) if quant else _act(k, qkv, k_pool, v_pool)
    _pool_geometry(dev, k, k_pool, v_pool, n_kv_heads, head_dim)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    rot = head_dim if rot_dim is None else rot_dim
    check(rot % 2 == 0 and 0 <= rot <= head_dim and (not neox or rot % 4 == 0), k,
          f"rot_dim {rot} must be even (neox: a multiple of 4) and <= head_dim {head_dim}")
    check(heads >= n_q_heads + 2 * n_kv_heads, k, f"qkv rows have {heads} heads, need {n_q_heads}+2*{n_kv_heads}")
    for name, t in (("positions", positions), ("slots", slots)):
        check(t.dtype == "u32" and t.numel >= rows, k, f"{name} {t.shape}/{t.dtype} must hold {rows} u32")
    owner = k_pool.buf.owner
    qe, qo = _window(dev, qkv, k, 2)
    (ke, ko), (ve, vo) = ((None, 0), (None, 0)) if quant else (_window(dev, x, k, 2) for x in (k_pool, v_pool))
    freq = rope_frequencies(dev, rot, base, owner=owner, factors=factors)
    half = rot // 2
    # units per head as in nn._rope_op: vec2 pairs, a neox head's rotated part in quads
    units = half // 2 + (head_dim - rot) // 2 if neox else head_dim // 2
    n_h = n_q_heads + 2 * n_kv_heads
    par = params(dev, [rows, heads, head_dim // 2, half, 0, n_h, n_q_heads + n_kv_heads, int(bool(neox)),
                       n_q_heads, n_kv_heads, 0, qo, ko, vo, units, float(mscale)], owner=owner, label=k)
    check(ring is None or not quant, k, "a ring over a quantised pool is not supported; use an f32 or f16 pool")
    sink = ring_query(k, ring, q_sink, rows, n_q_heads, head_dim, ring.window if ring else 0)
    header = (act_header(dt) + ring_header(ring, rope=True, binding=8) + load_shader_source("sincos.wgsl")
              + load_shader_source("rope.wgsl"))
    if step is None:                # all rows: a step of its own whose n_new is 0
        step = dev.upload(bytes(16), owner=owner, label="rope_kv_paged.step")
        extra = [step]
    else:
        extra = []
    if quant:   # rotate q and k in place, then the quantising write (kernels/kv_quant.py)
        entries = {1: _step_entry(step), 2: qe, 3: (freq, 0, freq.size), 6: _vec_entry(dev, positions, k)}
        op = _op(dev, k, "rope_paged.wgsl", "rope_paged", header, par, entries, rows * n_h * units)
        op.buffers += [freq] + extra
        return op + kv_quant_slots(dev, qkv, k_pool, v_pool, slots, step, n_q_heads=n_q_heads,
                                   n_kv_heads=n_kv_heads, head_dim=head_dim)
    entries = [_step_entry(step), qe, (freq, 0, freq.size), ke, ve,
               _vec_entry(dev, positions, k), _vec_entry(dev, slots, k)] + sink
    if ring is None and not neox and _cpu_family(dev):    # a lane per (row, pair): sin and cos once a row
        op = _op(dev, k, "rope_paged.wgsl", "rope_kv_rows", header, par, entries, rows * head_dim // 2)
    else:
        op = _op(dev, k, "rope_paged.wgsl", k, header, par, entries, rows * n_h * units)
    op.buffers += [freq] + extra
    return op


def paged_kv_write(dev: Device, qkv: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor, *,
                   n_q_heads: int, n_kv_heads: int, head_dim: int, rows: int | None = None) -> Op:
    """Copies the k and v heads of qkv rows (T, Hq+2Hkv, D), already rotated, into pool row
    slots[t] (block * block_size + offset) of k_pool / v_pool; rows with slot 0xffffffff are skipped.
    rows: rows dispatched (default T)."""
    k = "paged_kv_write"
    dt = _act(k, qkv, k_pool, v_pool)
    n_blocks, bs = _pool_geometry(dev, k, k_pool, v_pool, n_kv_heads, head_dim)
    n_rows, heads = _qkv_heads(k, qkv, head_dim)
    t = n_rows if rows is None else int(rows)
    check(0 < t <= n_rows and heads >= n_q_heads + 2 * n_kv_heads, k,
          f"{t} rows of qkv {qkv.shape} with {n_q_heads}+2*{n_kv_heads} heads")
    (qe, qo), (ke, ko), (ve, vo) = (_window(dev, x, k, 4) for x in (qkv, k_pool, v_pool))
    se, so = _u32(dev, slots, k, "slots", t)
    par = params(dev, [t, n_q_heads, 1, heads, n_kv_heads, 0, 0, 1.0, qo, ko, vo, 0, 0, 0, 0.0, 0, so, 0, 0, 0],
                 owner=k_pool.buf.owner, label=k)
    return _op(dev, k, FILE, k, _header(dt, head_dim, 1, WG, False, bs), par, [se, qe, ke, ve],
               t * 2 * n_kv_heads * (head_dim // 4))


class _KeySplits(Op):
    """paged_decode's op: record(n_keys=the longest sequence's keys) dispatches, of the split
    dispatch, each sequence's row of workgroups as long as the splits those keys reach need (`lanes`:
    head groups of one split), then the combine; up to max_keys keys the short form; without n_keys,
    every split. A lane's work does not depend on which lanes run beside it: the same outputs."""

    lanes: int = 0
    chunk: int = 0
    swg: int = 0

    def row(self, splits: int) -> int:
        """Workgroups of one sequence's row of the split dispatch for `splits` splits."""
        return -(-splits * self.lanes // self.swg)

    def record(self, batch, n_keys: int | None = None):
        if n_keys is None or (self.short and n_keys <= self.max_keys):
            return super().record(batch, n_keys)
        (pipe, group, x, y, z), comb = self.dispatches
        batch.dispatch(pipe, group, min(x, self.row(-(-n_keys // self.chunk))), y, z)
        batch.dispatch(*comb)
        return batch


def paged_decode(dev: Device, qkv: Tensor, k_pool: Tensor, v_pool: Tensor, out: Tensor, lens: Tensor,
                 tables: Tensor, *, n_q_heads: int, n_kv_heads: int, head_dim: int, max_seqs: int,
                 max_blocks: int, scale: float, window: int = 0, softcap: float = 0.0,
                 min_chunk: int | None = None, max_splits: int = 128, heads_per_lane: int | None = None,
                 split_wg: int | None = None, short_keys: int | None = None, sinks: Tensor | None = None,
                 ring: Ring | None = None, q_sink: Tensor | None = None) -> Op:
    """Decode attention of S = max_seqs sequences, one query row each: row q of qkv (S, Hq+2Hkv, D)
    at position lens[q] - 1 attends keys 0 .. lens[q]-1 of its table tables[q] (max_blocks block
    ids), which already hold this step's key; lens[q] == 0 leaves out row q alone. out (S, Hq*D).
    GQA, window and softcap as nn.attention. Split-key + combine sized once for max_blocks *
    block_size keys (splits past a sequence's keys exit at once); a sequence of at most
    `short_keys` keys (default op.max_keys, nn.attention's bound for its one-dispatch form; 0:
    never) is attended by one lane per head group in the split dispatch instead, chosen by its own
    length alone: every sequence's output equals the contiguous cache's decode at its length.
    record(batch, n_keys=the longest sequence's keys) leaves out the combine when nothing needs it.
    `sinks` (Hq,) f32: per-head logits in each softmax's denominator (nn.attention's). `ring`: each
    table a ring of max_blocks * block_size rows, lens[q] the position of row q + 1 (0: idle), q_sink
    (S, Hq, D) the sink queries paged_rope_kv wrote: row q attends what nn.attention's ring attends."""
    k = "paged_decode"
    dt, heads = check_attention(k, qkv, k_pool, v_pool, out, n_q_heads, n_kv_heads, head_dim, max_seqs,
                            window, softcap)
    n_blocks, bs = _pool_geometry(dev, k, k_pool, v_pool, n_kv_heads, head_dim)
    owner = out.buf.owner
    group = n_q_heads // n_kv_heads
    g = _heads_per_lane(k, group, head_dim, heads_per_lane)
    (qe, qo), (oe, oo), (ke, ko), (ve, vo), quant = _bindings(dev, k, qkv, out, k_pool, v_pool, n_kv_heads,
                                                              head_dim)
    le, lo = _u32(dev, lens, k, "lens", max_seqs)
    te, to = _u32(dev, tables, k, "tables", max_seqs * max_blocks)
    packed = dt == "f16" and head_dim % 8 == 0 and ko % 2 == 0 and vo % 2 == 0
    chunk, n_splits, swg, max_keys = decode_geometry(dev, max_blocks * bs, n_q_heads // g, min_chunk, max_splits,
                                                     split_wg)
    short = max_keys if short_keys is None else short_keys
    sinked = check_sinks(dev, k, sinks, n_q_heads)
    check(ring is None or window == 0, k, "a ring replaces the model's own sliding window")
    rung = _ring_sink(k, ring, q_sink, quant, max_seqs, n_q_heads, head_dim, max_blocks * bs)
    header = _header(dt, head_dim, g, swg, packed, bs, window, softcap, quant, bool(sinked), ring)
    par = params(dev, [max_seqs, n_q_heads, group, heads, n_kv_heads, chunk, n_splits, float(scale), qo, ko, vo,
                       oo, max_blocks, int(window), float(softcap), to, lo, 0, short, 0], owner=owner, label=k)
    part = dev.buffer(max_seqs * n_q_heads * n_splits * (head_dim // 4 + 1) * 16, owner=owner,
                      label="paged_decode.partials")
    op = _KeySplits(name=k, buffers=[par, part])
    op.lanes, op.chunk, op.swg = n_q_heads // g, chunk, swg
    split = dev.pipeline(FILE, "paged_split", header=header)
    x, y = op.row(n_splits), max_seqs                  # a row of workgroups per sequence
    check(x <= MAX_WG and y <= MAX_WG, k, f"{max_seqs} sequences x {n_splits} splits exceed a dispatch's grid")
    op.add(split, dev.bind(split, {**dict(enumerate([par, le, qe, ke, ve, (part, 0, part.size), te, oe])),
                                   **sinked, **rung}), x, y)
    comb = dev.pipeline(FILE, "paged_combine", header=header)
    x, y = _grid(max_seqs * n_q_heads * head_dim // 4, k)
    op.add(comb, dev.bind(comb, {**dict(enumerate([par, le, (part, 0, part.size), oe])), **sinked}), x, y)
    # a step whose every sequence takes the short form (record(n_keys=longest) <= max_keys) has
    # nothing to combine: paged_short, the split dispatch's short-form lanes alone (the same outputs,
    # a dispatch fewer, and a workgroup per SWG lanes of them rather than per SWG lanes of every split:
    # lavapipe starts each of those in turn, 2.8 us apiece, a third of the attention at 4 sequences)
    brief = dev.pipeline(FILE, "paged_short", header=header)
    x, y = _grid(-(-max_seqs * n_q_heads // g // swg) * WG, k)
    op.short = [(brief, dev.bind(brief, {**dict(enumerate([par, le, qe, ke, ve])), 6: te, 7: oe, **sinked, **rung}),
                 x, y, 1)]
    op.max_keys = short
    return op


def paged_prefill(dev: Device, qkv: Tensor, k_pool: Tensor, v_pool: Tensor, out: Tensor, step, table: Tensor, *,
                  n_q_heads: int, n_kv_heads: int, head_dim: int, max_blocks: int, scale: float,
                  max_t: int | None = None, window: int = 0, softcap: float = 0.0,
                  heads_per_lane: int | None = None, sinks: Tensor | None = None, ring: Ring | None = None,
                  q_sink: Tensor | None = None, spans: Tensor | None = None) -> Op:
    """Causal attention of one sequence's chunk: rows t < step.n_new (0: all max_t) of qkv
    (T, Hq+2Hkv, D) at positions step.pos0 + t see keys 0 .. pos0+t through `table` (max_blocks
    block ids), whose blocks already hold keys 0 .. pos0+n_new-1 (paged_kv_write first). out
    (T, Hq*D). A query folds its keys in the same 16-key blocks as nn.attention's causal kernel.
    `sinks` (Hq,) f32: per-head logits in each softmax's denominator. `ring`: the table a ring of
    max_blocks * block_size rows (positions pos0 + t unbounded), q_sink (T, Hq, D) the chunk's sink
    queries: each row attends what nn.attention's ring attends. `spans` (>= T, 2) u32 (models/image_rows.py's
    rows): a row t with spans[t, 1] = end > pos0 + t + 1 (inside an image whose tokens attend each other
    both ways, Gemma 3) sees keys up to end - 1 too, which this chunk's blocks must hold; the window
    still bounds its keys from below; a row with end 0 keeps its causal keys, bit for bit."""
    k = "paged_prefill"
    n_rows = _qkv_heads(k, qkv, head_dim)[0]
    t_max = n_rows if max_t is None else int(max_t)
    check(0 < t_max <= n_rows, k, f"max_t={max_t} must be in 1..{n_rows}")
    dt, heads = check_attention(k, qkv, k_pool, v_pool, out, n_q_heads, n_kv_heads, head_dim, t_max,
                            window, softcap)
    n_blocks, bs = _pool_geometry(dev, k, k_pool, v_pool, n_kv_heads, head_dim)
    group = n_q_heads // n_kv_heads
    g = _heads_per_lane(k, group, head_dim, heads_per_lane)
    (qe, qo), (oe, oo), (ke, ko), (ve, vo), quant = _bindings(dev, k, qkv, out, k_pool, v_pool, n_kv_heads,
                                                              head_dim)
    te, to = _u32(dev, table, k, "table", max_blocks)
    packed = dt == "f16" and head_dim % 8 == 0 and ko % 2 == 0 and vo % 2 == 0
    n_blk = -(-t_max // WG)
    (se, so) = _u32(dev, spans, k, "spans", 2 * t_max) if spans is not None else (None, 0)
    par = params(dev, [t_max, n_q_heads, group, heads, n_kv_heads, 0, 0, float(scale), qo, ko, vo, oo,
                       max_blocks, int(window), float(softcap), to, so, n_blk, 0, 0], owner=out.buf.owner, label=k)
    sinked = check_sinks(dev, k, sinks, n_q_heads)
    check(ring is None or window == 0, k, "a ring replaces the model's own sliding window")
    rung = _ring_sink(k, ring, q_sink, quant, t_max, n_q_heads, head_dim, max_blocks * bs)
    entries = {**dict(enumerate([_step_entry(step), qe, ke, ve, oe, te], 1)), **sinked, **rung,
               **({10: se} if se is not None else {})}
    loop = _op(dev, k, FILE, "paged_causal",
               _header(dt, head_dim, g, WG, packed, bs, window, softcap, quant, bool(sinked), ring, se is not None),
               par, entries, n_blk * (n_q_heads // g) * WG)
    if not _windowed(dev, head_dim, quant, ring, spans):
        return loop
    g = g if heads_per_lane else 1           # one head a lane: the fewest registers (measured the fastest)
    return _prefill_windows(dev, loop, out, _windows_header(dt, head_dim, g, bs, window, softcap, bool(sinked)),
                            entries, t_max, n_q_heads, g, head_dim, max_blocks * bs)
