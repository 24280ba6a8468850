"""What a T = 1 decode matmul can do with its sums before storing them (`shaders/matmul_epilogue.wgsl`):
SiLU·up of interleaved gate/up rows, RoPE + KV-cache write of a fused qkv projection (`RopeKV`),
and the next RMSNorm's scaled copy and partial sums after a residual add (`NormOut`). Page code:
standard library only."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...gpu import Buffer, Device
from ...gpu.shaders import load_shader_source
from ..common import DTYPE_SIZE, Tensor, check
from ..common import window as _window
from ..qtypes import QTYPES
from .config import MatmulConfig, default_config
from .layout import gpu_row_bytes


@dataclass
class NormOut:
    """matmul(..., norm_out=): the next RMSNorm's weight g (N,) f32; where y * g goes (N elements,
    y's dtype); the partial sums of y^2 (N/4,) f32, 4 rows each."""
    g: Tensor
    out: Tensor
    partials: Tensor


@dataclass(frozen=True)
class RopeKV:
    """The rope + KV-cache write that matmul(..., rope_kv=...) folds into a decode qkv projection
    (matmul_epilogue.wgsl), `freq` the rot_dim/2 f32 frequencies (nn.rope_frequencies), caches in
    the activation dtype. Two caches (row t of a fused_rows matmul is its own decode step):
    - one sequence's contiguous caches (n_kv_heads, ctx, head_dim): `step` holds pos0 (u32) first,
      row t is at position pos0 + row0 + t (row0: the first row of a group of rows);
    - a paged pool (n_blocks, block_size, n_kv_heads, head_dim), `positions` and `slots` (u32, one
      per row) given: row t is at position positions[t] and goes to pool row slots[t] (0xffffffff:
      rotate only); `step` and `ctx` are unused."""

    step: Buffer | None
    freq: Buffer
    k_cache: Tensor
    v_cache: Tensor
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int
    ctx: int
    positions: Tensor | None = None
    slots: Tensor | None = None
    row0: int = 0

    def rows_from(self, r: int) -> "RopeKV":
        """The same write for rows r .. of the matmul (a group of fused rows starting at row r)."""
        if self.slots is None:
            return replace(self, row0=self.row0 + r)
        return replace(self, positions=self.positions.view((self.positions.numel - r,), r),
                       slots=self.slots.view((self.slots.numel - r,), r))


def epilogue_binds(y: Tensor, rope: RopeKV | None, norm_out: "NormOut | None", extra: dict,
                   add: Tensor | None = None, n: int = 0, lora: str = "") -> str:
    """The epilogue's bindings (added to `extra`) and source; `add` (T, n) values added to the
    sums of the n weight rows before the epilogue (ep_added); `lora`: instead, kernels/lora.py
    matmul_source's text (ep_pro, ep_added, ep_resid: a row's LoRA deltas made here)."""
    esz = DTYPE_SIZE[y.dtype]
    added = _ADDED_NONE
    if lora:
        check(add is None, "matmul", "add and a LoRA delta cannot both be given")
        added = ""
    elif add is not None:
        check(add.dtype == y.dtype and add.numel >= y.shape[0] * n, "matmul",
              f"add must be ({y.shape[0]}, {n}) {y.dtype}, got {add.shape} {add.dtype}")
        ab, ao = _window(add, esz, "matmul", "add")
        extra[14] = ab
        added = (_ADDED4 if ao % 4 == 0 and n % 4 == 0 else _ADDED).format(off=ao, n=n)
    caches = offs = None
    if rope is not None:
        caches = [_window(rope.k_cache, esz, "matmul", "k cache"),
                  _window(rope.v_cache, esz, "matmul", "v cache")]     # (binding, offset) each
        extra.update({7: rope.freq, 8: caches[0][0], 9: caches[1][0]})
        if rope.slots is None:
            extra[6] = rope.step
        else:                                                            # + positions, slots offsets
            pos, slots = _window(rope.positions, 4, "matmul", "positions"), _window(rope.slots, 4, "matmul", "slots")
            extra.update({6: pos[0], 13: slots[0]})
            caches += [pos, slots]
    if norm_out is not None:
        T, n = y.shape
        g, out, part = norm_out.g, norm_out.out, norm_out.partials
        check(g.dtype == "f32" and g.numel == n and out.dtype == y.dtype and out.numel == T * n
              and part.dtype == "f32" and part.numel == T * n // 4 and n % 4 == 0, "matmul",
              f"norm_out needs g f32 ({n},), out {y.dtype} ({T * n},) and partials f32 ({T * n // 4},)")
        wins = [_window(g, 4, "matmul", "norm weight"), _window(out, esz, "matmul", "norm output"),
                _window(part, 4, "matmul", "partial sums")]
        extra.update({10: wins[0][0], 11: wins[1][0], 12: wins[2][0]})
        offs = [o for _, o in wins]
    return epilogue_source(y.dtype, rope, caches, offs) + added + (lora or _NO_PRO)


# ep_added(t, n, r): the sums r of weight rows n .. n + 3 of row t, plus what the op adds to them
# before its epilogue (the rows' LoRA deltas, stored beforehand: models/lora.py)
_ADDED_NONE = "fn ep_added(t: u32, n: u32, r: vec4<f32>) -> vec4<f32> { return r; }\n"
# the entry points' first call and ep_res_norm's addition to x: nothing (kernels/lora.py matmul_source's
# where a matmul makes LoRA deltas)
_NO_PRO = ("fn ep_pro(lid: u32, t0: u32, nt: u32) {}\n"
           "fn ep_resid(t: u32, n: u32, v: vec4<f32>) -> vec4<f32> { return v; }\n")
# (the 4 values in one load where they are 4-aligned: on a CPU adapter a load costs per invocation)
_ADDED4 = """@group(0) @binding(14) var<storage, read> ep_add: array<act4>;
fn ep_added(t: u32, n: u32, r: vec4<f32>) -> vec4<f32> {{
    return r + vec4<f32>(ep_add[({off}u + t * {n}u + n) / 4u]);
}}
"""
_ADDED = """@group(0) @binding(14) var<storage, read> ep_add: array<act>;
fn ep_added(t: u32, n: u32, r: vec4<f32>) -> vec4<f32> {{
    let o = {off}u + t * {n}u + n;
    return r + vec4<f32>(f32(ep_add[o]), f32(ep_add[o + 1u]), f32(ep_add[o + 2u]), f32(ep_add[o + 3u]));
}}
"""


def epilogue_source(dtype: str, rope: RopeKV | None, caches: list | None, norm_offs: list | None = None) -> str:
    """sincos.wgsl + matmul_epilogue.wgsl and its consts (zeros where unused); `caches`: the k and v
    caches' (binding, element offset); `norm_offs`: ep_res_norm's g, out and partials offsets."""
    c = dict(EP_D=1, EP_ROT=0, EP_KLO=0, EP_VLO=0, EP_CTX=0, EP_KC=0, EP_VC=0)
    where = _CONTIGUOUS_ROWS
    if rope is not None:
        D, Hkv = rope.head_dim, rope.n_kv_heads
        check(D % 4 == 0 and rope.rot_dim % 2 == 0 and 0 <= rope.rot_dim <= D, "matmul",
              "rope epilogue needs head_dim % 4 == 0 and an even rot_dim <= head_dim")
        paged = rope.slots is not None
        for t in (rope.k_cache, rope.v_cache):
            if paged:
                check(t.dtype == dtype and t.numel % (Hkv * D) == 0, "matmul",
                      f"pool {t.shape} {t.dtype} must be (blocks, block size, Hkv={Hkv}, D={D}) {dtype}")
            else:
                check(t.dtype == dtype and t.numel == Hkv * rope.ctx * D, "matmul",
                      f"cache {t.shape} {t.dtype} must be (Hkv={Hkv}, ctx={rope.ctx}, D={D}) {dtype}")
        c = dict(EP_D=D, EP_ROT=rope.rot_dim, EP_KLO=rope.n_q_heads * D,
                 EP_VLO=(rope.n_q_heads + Hkv) * D, EP_CTX=rope.ctx,
                 EP_KC=caches[0][1], EP_VC=caches[1][1], EP_T0=rope.row0)
        if paged:
            c.update(EP_HKV=Hkv, EP_POS=caches[2][1], EP_SLOT=caches[3][1])
            where = _PAGED_ROWS
    c.update(zip(("EP_G", "EP_YG", "EP_PART"), norm_offs or (0, 0, 0)))
    c.setdefault("EP_T0", 0)
    consts = "".join(f"const {k}: u32 = {v}u;\n" for k, v in c.items())
    return consts + where + load_shader_source("sincos.wgsl") + load_shader_source("matmul_epilogue.wgsl")


# ep_rope_kv's position of row t and the cache row (of head rows) its kv head g goes to (0xffffffff:
# none): one sequence's contiguous caches (position pos0 + row), or a paged pool (per-row positions
# and slots; the slots binding exists in this form only)
_CONTIGUOUS_ROWS = """fn ep_pos(t: u32) -> u32 { return ep_step[0] + EP_T0 + t; }
fn ep_row(g: u32, t: u32, pos: u32) -> u32 { return select(0xffffffffu, g * EP_CTX + pos, pos < EP_CTX); }
"""
_PAGED_ROWS = """@group(0) @binding(13) var<storage, read> ep_slot: array<u32>;    // (T) pool rows
fn ep_pos(t: u32) -> u32 { return ep_step[EP_POS + t]; }
fn ep_row(g: u32, t: u32, pos: u32) -> u32 {
    let s = ep_slot[EP_SLOT + t];
    return select(s * EP_HKV + g, s, s == 0xffffffffu);
}
"""


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
