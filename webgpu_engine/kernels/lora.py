"""Host functions of the LoRA kernels (shaders/lora.wgsl): the deltas of many adapters in one batch,
each row through its own adapter's slot of a pool (punica / S-LoRA's "bgmv"), a row without one
(slot NONE) left as it is, bit for bit.

    u = lora_shrink(x, A, idx)       u[t] = A[idx[t]] · x[t]         (T, J) f32
    y += lora_expand(u, B, idx)      y[t] += B[idx[t]] · u[t]        (T, N) into y's columns
    y += lora_delta(x, A, B, idx)    the two in one dispatch, a workgroup per row, x RMS-normed on
                                     the way in where given a norm (a decode step's rows); A and B
                                     in a layout of its own (B compact: compact_b), f32, f16 or bf16;
                                     rows=4: 4 rows a workgroup (lora_rows, shaders/lora_rows.wgsl:
                                     a prefill chunk's rows, one adapter's), the same bits
    matmul(..., add=Delta(...))      inside a decode matmul (a CPU adapter's decode and verify
                                     steps): the workgroup makes its rows' u = A · x first
                                     (matmul_source's ep_pro), each invocation adds B · u to its
                                     sums (qkv, gate_up) or to the residual (o, down); no dispatch

A pool holds `slots` adapters: A (slots, J, K) and B (slots, N, J) f32, J = targets x rank, B scaled.
The numpy references are shrink_ref / expand_ref below. Standard library only (runs in the page).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..gpu import Device
from ..gpu.shaders import load_shader_source
from .common import DTYPE_SIZE, Op, Tensor, act_header, check, params, placeholder, window

NONE = 0xFFFFFFFF        # the slot of a row without an adapter
_WG = 64
_KC = 1024             # lora_delta's x values staged at a time (4 KB of workgroup memory)


# lora_delta's A / B element type: a load (`wvec`, VW values) as f32 values (wunpack: `wf`, lo the
# first four, hi the second; 16 bits: a word's low half first) and those dotted with VW x or u values
# in index order (wdotf; x1: the second four); _WDOT's wdot does both (lora_rows unpacks a load once
# for its 4 rows). bf16: a value's f32 bits are its 16 bits shifted up (exact, like f16's)
_WORDS16 = ("alias wvec = vec4<u32>;\nconst VW: u32 = 8u;\n"
            "fn wunpack(w: wvec) -> wf {\n"
            "    return wf(vec4<f32>(half2(w.x), half2(w.y)), vec4<f32>(half2(w.z), half2(w.w)));\n}\n"
            "fn wdotf(acc: f32, x0: vec4<f32>, x1: vec4<f32>, w: wf) -> f32 { return dot_seq(dot_seq(acc, x0, w.lo), x1, w.hi); }\n")
_WEIGHTS = {
    "f32": "alias wvec = vec4<f32>;\nconst VW: u32 = 4u;\n"
           "fn wunpack(w: wvec) -> wf { return wf(w, w); }\n"
           "fn wdotf(acc: f32, x0: vec4<f32>, x1: vec4<f32>, w: wf) -> f32 { return dot_seq(acc, x0, w.lo); }\n",
    "f16": "fn half2(w: u32) -> vec2<f32> { return unpack2x16float(w); }\n" + _WORDS16,
    "bf16": "fn half2(w: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xFFFF0000u)); }\n"
            + _WORDS16,
}
WEIGHT_DTYPES = tuple(_WEIGHTS)          # A and B held as f32, f16 or bf16 (models/lora.py picks)
# lora_delta's (lora.wgsl: A in a4, u in workgroup memory wu, B in b4) and the matmul's
# (lora_matmul.wgsl: ep_la, ep_lu, ep_lb) shrink step and expand, one text (_shared_fns):
# mac3: the shrink's sums of one A load of each of the group's NT targets (row l's VW values at a,
# a + RK, a + 2 RK) against x values x0 (x1: the second 4 where VW = 8);
# expand4: B · u of 4 weight rows (the first's B words at bn; rows 1, 2 the target whose u starts at
# vec4 c.x, rows 3, 4 at c.y), R4 B words a row, each sum in index order
_MAC3 = """fn {name}(acc: vec3<f32>, x0: vec4<f32>, x1: vec4<f32>, a: u32, RK: u32, NT: u32) -> vec3<f32> {{
    var r = acc;
    r.x = wdot(r.x, x0, x1, {a}[a]);
    if (NT > 1u) {{ r.y = wdot(r.y, x0, x1, {a}[a + RK]); }}
    if (NT > 2u) {{ r.z = wdot(r.z, x0, x1, {a}[a + 2u * RK]); }}
    return r;
}}
"""
_EXPAND4 = """fn {name}(c: vec2<u32>, bn: u32, R4: u32) -> vec4<f32> {{
    var acc = vec4<f32>(0.0);
    for (var r4 = 0u; r4 < R4; r4++) {{
        let u0 = {u}[c.x + r4 * (VW / 4u)];
        let u1 = {u}[c.x + r4 * (VW / 4u) + (VW / 4u - 1u)];
        acc.x = wdot(acc.x, u0, u1, {b}[bn + r4]);
        acc.y = wdot(acc.y, u0, u1, {b}[bn + R4 + r4]);
        let u2 = {u}[c.y + r4 * (VW / 4u)];
        let u3 = {u}[c.y + r4 * (VW / 4u) + (VW / 4u - 1u)];
        acc.z = wdot(acc.z, u2, u3, {b}[bn + 2u * R4 + r4]);
        acc.w = wdot(acc.w, u2, u3, {b}[bn + 3u * R4 + r4]);
    }}
    return acc;
}}
"""


def _shared_fns(prefix: str, a: str, u: str, b: str) -> str:
    """`prefix`mac3 and `prefix`expand4 on the module's A, u and B arrays (see _MAC3, _EXPAND4)."""
    return _MAC3.format(name=prefix + "mac3", a=a) + _EXPAND4.format(name=prefix + "expand4", u=u, b=b)


# dot_seq(acc, a, b): acc + a.x b.x + a.y b.y + a.z b.z + a.w b.w, added in that order (lora_shrink /
# lora_expand's)
_WDOT = ("struct wf { lo: vec4<f32>, hi: vec4<f32> }\n"
         "fn dot_seq(acc: f32, a: vec4<f32>, b: vec4<f32>) -> f32 {\n"
         "    var r = acc;\n    r += a.x * b.x;\n    r += a.y * b.y;\n    r += a.z * b.z;\n    r += a.w * b.w;\n"
         "    return r;\n}\n"
         "fn wdot(acc: f32, x0: vec4<f32>, x1: vec4<f32>, w: wvec) -> f32 { return wdotf(acc, x0, x1, wunpack(w)); }\n")


# the shrinks' x through the subgroup (SG: where rows_ok; lane i of each 8 loads only vec4 i of 32
# staged values and subgroup_lanes.wgsl's lanes8 hands the 8 to every lane; the same values into the
# same sums); sg_lane: the lane's place in its 8 (all lanes active where called). Without: stubs
_SUBGROUPS = """enable subgroups;
const SG: bool = true;
fn sg_lane() -> u32 { return subgroupExclusiveAdd(1u) % 8u; }
"""
_NO_SUBGROUPS = """const SG: bool = false;
fn lanes8(v: vec4<f32>) -> array<vec4<f32>, 8> { return array<vec4<f32>, 8>(); }
fn sg_lane() -> u32 { return 0u; }
"""


# lora_delta on a CPU adapter (lavapipe runs a workgroup 8 lanes at a time, masked-off lanes
# included): its widths (K, N, J, R) compiled in, so loops have known trip counts (the same
# operations in the same order), and a workgroup no wider than the shrink's R lanes (rounded up to
# 8; _widths). False: the uniforms' widths and 64 lanes (bench/lora_delta.py compares the two; the
# same bits)
BAKE_SHAPES = True
NARROW_WG = True
# a decode row's lora_delta: one workgroup of 8 lanes, lavapipe's SIMD group (two groups,
# 16 lanes, which lavapipe runs in turn switching at each barrier, took ~0.7 ms more a SmolLM2 step)
DECODE_LANES = 8
SUBGROUP_X = True        # the shrinks' x through the subgroup where rows_ok (False: read by each lane)


@dataclass(frozen=True)
class Delta:
    """A group's LoRA deltas made inside the decode matmul of its projection (matmul(..., add=)):
    a (slots, J, k) and b (slots, n, R) with cols, lora_delta's layout (the pool's); idx (T,) u32
    each row's slot; n the weight's rows, k its columns; `res`: o's or down's, whose delta goes into
    the residual before the next norm's values are stored (matmul_epilogue.wgsl ep_res_norm), else
    into the sums before the RoPE + KV write or act(gate) * up. See matmul_source."""
    a: Tensor
    b: Tensor
    cols: Tensor
    idx: Tensor
    slots: int
    n: int
    k: int
    res: bool = False

    def rows(self, r: int, g: int) -> "Delta":
        """The same for rows r .. r + g - 1 (a matmul over a group of rows)."""
        return replace(self, idx=self.idx.view((g,), r))


def delta_wg(dev: Device, invocations: int, wg: int) -> int:
    """The workgroup of a decode matmul with a Delta: a workgroup makes its rows' u itself before
    the matmul (a barrier between), so as few workgroups as the driver runs at once (lavapipe: a
    thread a CPU, LP_NUM_THREADS where set), each u made once a thread; `wg` the matmul's own, the
    least, in whole groups of 8 lanes."""
    threads = int(os.environ.get("LP_NUM_THREADS") or os.cpu_count() or 1) or 1
    cap = int(dev.limits.get("max-compute-invocations-per-workgroup", 256))
    want = -(-invocations // threads)
    return max(wg, min(cap // 8 * 8, -(-want // 8) * 8))


def matmul_source(d: Delta, extra: dict, T: int, rows: int, *, x_off4: int, x4: int,
                  pnorm: tuple | None = None) -> str:
    """The WGSL a decode matmul of weight (d.n, d.k) takes with `d` (its bindings 15-18 into
    `extra`): ep_pro(lid, t0, nt), which the entry point calls first (uniformly: a barrier ends
    it), makes u = A[s] · x' of each of the workgroup's rows t0 .. t0 + nt - 1 (at most `rows`)
    that has an adapter (slot s; x' = the matmul's x, row t at xword x_off4 + t * x4, times
    1 / rms with `pnorm` (g_off4, g4, eps): the norm's partial sums in binding 5, 1 / rms made as
    the matmul makes it) into workgroup memory, a lane per row of A, its sum in index order; and
    ep_added / ep_resid, which add each row's B · u to weight rows n .. n + 3 as lora_delta's
    expand makes it (rounded to act as its stored y: ep_added; rounded into x as stored:
    ep_resid). A row without an adapter keeps every value."""
    J = d.a.numel // (d.slots * d.k) if d.slots and d.k else 0
    R = d.b.numel // (d.slots * d.n) if d.slots and d.n else 0
    vw = 4 if d.a.dtype == "f32" else 8
    check(d.a.dtype == d.b.dtype and d.a.dtype in WEIGHT_DTYPES and R > 0 and R % vw == 0 and J % R == 0
          and J <= 3 * R and d.k % vw == 0 and d.a.numel == d.slots * J * d.k and d.cols.dtype == "u32"
          and 2 * d.cols.numel == d.n and d.n % 4 == 0 and d.idx.dtype == "u32" and d.idx.numel >= T
          and d.a.offset == 0 and d.b.offset == 0 and d.cols.offset == 0, "matmul",
          f"add's Delta: A{d.a.shape} and B{d.b.shape} must be ({d.slots}, J, {d.k}) and ({d.slots}, {d.n}, R) "
          f"f32, f16 or bf16 (R a multiple of {vw}, J 1-3 times R), cols ({d.n // 2},) u32, idx {T} u32")
    ib, io = window(d.idx, 4, "matmul", "idx")
    extra.update({15: ib, 16: d.b.binding(), 17: d.cols.binding(), 18: d.a.binding()})
    go, g4, eps = pnorm or (0, 0, 0.0)
    consts = dict(LR_IO=io, LR_S=d.slots, LR_J4=J // 4, LR_R=R, LR_NT=J // R, LR_K=d.k, LR_N=d.n,
                  LR_XO=x_off4, LR_X4=x4, LR_GO=go, LR_G4=g4, LR_ROWS=rows)
    head = "".join(f"const {k}: u32 = {v}u;\n" for k, v in consts.items())
    head += f"const LR_PNORM: bool = {str(pnorm is not None).lower()};\nconst LR_EPS: f32 = {float(eps)!r};\n"
    head += f"const LR_RES: bool = {str(d.res).lower()};\n"
    head += _LR_INV if pnorm is not None else "fn lr_inv(t: u32) -> f32 { return 1.0; }\n"
    return (head + _WEIGHTS[d.a.dtype] + _WDOT + _shared_fns("ep_", "ep_la", "ep_lu", "ep_lb")
            + load_shader_source("lora_matmul.wgsl"))


# 1 / rms of row t from the norm's partial sums in binding 5 (matmul_decode.wgsl's g), as the decode
# matmul makes its scale (codegen._row_ends: dec_pss added in order, then inverseSqrt)
_LR_INV = """fn lr_inv(t: u32) -> f32 {
    var ss = 0.0;
    for (var q = 0u; q < LR_K / 16u; q++) { ss += dot(g[LR_GO + t * LR_G4 + q], vec4<f32>(1.0)); }
    return inverseSqrt(ss / f32(LR_K) + LR_EPS);
}
"""


def _pipe(dev: Device, entry: str, dtype: str, j: int = 1, norm: bool = False, store: bool = False,
          wdtype: str = "f32", shape: tuple = (0, 0, 0, 0), wg: tuple = (_WG, _WG), rows: int = 1, sg: bool = False):
    """The pipeline of `entry`; `wg`: (its workgroup, the norm's virtual lanes: _widths)."""
    dims = "".join(f"const SHAPE_{n}: u32 = {v}u;\n" for n, v in zip(("K", "N", "J", "R"), shape))
    subgroups = _SUBGROUPS + load_shader_source("subgroup_lanes.wgsl") if sg or rows > 1 else _NO_SUBGROUPS
    rows_src = f"{load_shader_source('lora_rows.wgsl')}\n" if rows > 1 else ""
    return dev.pipeline("lora.wgsl", entry, header=f"{subgroups}{rows_src}{act_header(dtype)}const WG: u32 = {wg[0]}u;\n"
                                                   f"const VL: u32 = {wg[1]}u;\nconst JMAX: u32 = {j}u;\n"
                                                   f"const NORM: bool = {str(norm).lower()};\n"
                                                   f"const STORE: bool = {str(store).lower()};\nconst KC: u32 = {_KC}u;\n"
                                                   f"{dims}{_WEIGHTS[wdtype]}{_WDOT}"
                                                   + _shared_fns("", "a4", "wu", "b4"))


def lora_shrink(dev: Device, x: Tensor, a: Tensor, idx: Tensor, u: Tensor, *, slots: int) -> Op:
    """u[t, :] = A[idx[t]] · x[t, :] for each row with an adapter.  x (T, K) act; a (slots, J, K)
    f32; idx (T,) u32; u (T, J) f32 (rows without an adapter are not written)."""
    return _pair_op(dev, "lora_shrink", x, a, idx, u, slots)


def lora_expand(dev: Device, u: Tensor, b: Tensor, idx: Tensor, y: Tensor, *, slots: int) -> Op:
    """y[t, :N] += B[idx[t]] · u[t, :] for each row with an adapter.  u (T, J) f32; b (slots, N, J)
    f32; idx (T,) u32; y (T, N) act."""
    return _pair_op(dev, "lora_expand", y, b, idx, u, slots)


def _pair_op(dev: Device, k: str, act: Tensor, w: Tensor, idx: Tensor, u: Tensor, slots: int) -> Op:
    """lora_shrink's (act = x (T, K), w = A) or lora_expand's (act = y (T, N), w = B) checks and op."""
    expand = k == "lora_expand"
    T, width = (int(s) for s in act.shape)
    J = w.numel // (slots * width) if slots and width else 0
    names = ("y", "B", "N", f"({slots}, {width}, J)") if expand else ("x", "A", "K", f"({slots}, J, {width})")
    check(act.dtype in ("f32", "f16") and w.dtype == "f32" and w.numel == slots * J * width and J > 0, k,
          f"{names[0]}{act.shape}/{act.dtype} and {names[1]}{w.shape}/{w.dtype} must be (T, {names[2]}) act "
          f"and {names[3]} f32")
    check(idx.dtype == "u32" and idx.numel >= T and u.dtype == "f32" and u.numel >= T * J, k,
          f"idx{idx.shape} and u{u.shape} must hold {T} rows (u: {T} x {J} f32)")
    (ab, ao), (ib, io), (ub, uo) = (window(t, DTYPE_SIZE[t.dtype], k, n)
                                    for t, n in ((act, names[0]), (idx, "idx"), (u, "u")))
    check(io == 0 and uo == 0 and w.offset == 0, k, f"idx, u and {names[1]} must start at binding-aligned offsets")
    pipe = _pipe(dev, k, act.dtype)
    values = [T, 0, width, J, 0, ao, width, slots] if expand else [T, width, 0, J, ao, 0, 0, slots]
    par = params(dev, values, owner=u.buf.owner, label=k)
    binds = {5: ab, 6: w.binding()} if expand else {3: ab, 4: w.binding()}
    op = Op(name=k)
    op.buffers.append(par)
    return op.add(pipe, dev.bind(pipe, {0: par, 1: ib, 2: ub, **binds}), -(-(width if expand else J) // _WG), T)


def rows_ok(dev: Device) -> bool:
    """Whether lora_delta can take 4 rows a workgroup here, and the shrinks x through the subgroup
    (lora_rows, SUBGROUP_X: subgroups of 8 lanes or more)."""
    from .matmul import wide
    return wide.lanes_ok(dev)


def lora_delta(dev: Device, x: Tensor, a: Tensor, b: Tensor, cols: Tensor, idx: Tensor, y: Tensor, *,
               slots: int, norm: tuple | None = None, store: bool = False, rows: int = 1) -> Op:
    """y[t] += B[idx[t]] · (A[idx[t]] · x'[t]) for each row with an adapter, x' = x, or with `norm`
    (w (K,) f32, eps) x * w / rms(x).  x (T, K) act; a (slots, J, K) f32; b (slots, N, R) f32 and
    cols (N / 2,) u32: B compact (compact_b), cols[p] the first column of rows 2p and 2p + 1's
    target; idx (T,) u32; y (T, N) act. K, N, R and x's and y's offsets multiples of 4; A and B may
    both be f16 or bf16 instead (K and R multiples of 8): the same sums of the same values, half the
    loads.
    `store`: y[t] = the delta instead, -0.0 for a row without an adapter (x + -0.0 is x, bit for
    bit: a matmul adding y to its sums keeps a base row's values). `rows` 4 (where rows_ok): 4 rows
    a workgroup (lora_rows: a prefill chunk's rows, which share an adapter, read A and B once for
    them), each row's values as with 1, bit for bit."""
    k = "lora_delta"
    T, K = (int(s) for s in x.shape)
    N = int(y.shape[1])
    J = a.numel // (slots * K) if slots and K else 0
    R = b.numel // (slots * N) if slots and N else 0
    check(x.dtype == y.dtype and x.dtype in ("f32", "f16") and int(y.shape[0]) == T, k,
          f"x{x.shape}/{x.dtype} and y{y.shape}/{y.dtype} must be (T, K) and (T, N) of one act dtype")
    vw = 4 if a.dtype == "f32" else 8
    check(a.dtype == b.dtype and a.dtype in WEIGHT_DTYPES and J > 0 and R > 0 and J % R == 0 and J <= 3 * R
          and K % vw == 0 and R % vw == 0 and a.numel == slots * K * J and b.numel == slots * R * N, k,
          f"A{a.shape}/{a.dtype} and B{b.shape}/{b.dtype} must be ({slots}, J, {K}) and ({slots}, {N}, R), both "
          f"f32 (K and R multiples of 4) or both f16 or bf16 (of 8), J 1, 2 or 3 times R (the targets)")
    check(cols.dtype == "u32" and 2 * cols.numel == N and N % 4 == 0, k, f"cols{cols.shape} must be ({N // 2},) "
          f"u32 (a row pair's first column), N a multiple of 4")
    check(idx.dtype == "u32" and idx.numel >= T, k, f"idx{idx.shape} must hold {T} rows")
    check(norm is None or (norm[0].dtype == "f32" and norm[0].numel == K), k, f"the norm weight must be ({K},) f32")
    (xb, xo), (yb, yo), (ib, io) = (window(t, DTYPE_SIZE[t.dtype], k, n) for t, n in ((x, "x"), (y, "y"), (idx, "idx")))
    check(io == 0 and a.offset == 0 and b.offset == 0 and cols.offset == 0, k,
          "idx, A, B and cols must start at binding-aligned offsets")
    check(xo % 4 == 0 and yo % 4 == 0, k, f"x and y must start at multiples of 4 elements in their bindings "
          f"(x at {xo}, y at {yo}): they are read 4 values a load")
    wg = _widths(R, rows)
    check(rows == 1 or rows == 4 and rows_ok(dev), k, f"rows must be 1, or 4 with subgroups of 8 lanes, got {rows}")
    pipe = _pipe(dev, "lora_rows" if rows > 1 else k, x.dtype, J, norm is not None, store, a.dtype,
                 (K, N, J, R) if BAKE_SHAPES else (0,) * 4, wg, rows=rows, sg=SUBGROUP_X and rows_ok(dev))
    par = params(dev, [T, K, N, J, xo, yo, slots, float(norm[1]) if norm else 0.0, R], owner=y.buf.owner, label=k)
    w = norm[0].binding() if norm else placeholder(dev)
    op = Op(name=k if rows == 1 else "lora_rows")
    op.buffers.append(par)
    return op.add(pipe, dev.bind(pipe, {1: ib, 3: xb, 5: yb, 8: par, 9: cols.binding(), 10: a.binding(),
                                        11: b.binding(), 12: w}), -(-T // rows))


def _widths(R: int, rows: int = 1) -> tuple[int, int]:
    """(workgroup, virtual lanes) of lora_delta: VL lanes, the shrink's R in whole
    groups of 8 (NARROW_WG), make the norm's partial sums; lora_rows runs VL lanes, a decode row's
    kernels DECODE_LANES of them (each lane the sums of VL / WG virtual lanes: the same bits)."""
    vl = min(_WG, -(-R // 8) * 8) if NARROW_WG else _WG
    return (min(vl, DECODE_LANES) if rows == 1 and NARROW_WG else vl), vl


def compact_b(b, cols, rank: int):
    """lora_delta's B (slots, N, R) from B (slots, N, J) whose row n is zero outside its target's
    columns cols[n] .. cols[n] + R (numpy; cols (N,): lora_delta's cols are cols[::2])."""
    import numpy as np
    b = np.asarray(b, np.float32)
    at = np.asarray(cols, np.int64)[:, None] + np.arange(rank)
    return np.ascontiguousarray(np.take_along_axis(b, np.broadcast_to(at, (b.shape[0],) + at.shape), axis=2))


# ---------------------------------------------------------------------- numpy references
def shrink_ref(x, a, idx, norm: tuple | None = None):
    """u (T, J): A[idx[t]] · x[t] in f64 (x * w / rms(x) with `norm` (w, eps)), zero for rows without
    an adapter."""
    import numpy as np
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    if norm is not None:
        x = x * np.asarray(norm[0], np.float64) / np.sqrt((x * x).mean(axis=1, keepdims=True) + norm[1])
    u = np.zeros((x.shape[0], a.shape[1]))
    for t, s in enumerate(idx):
        if s != NONE:
            u[t] = a[s] @ x[t]
    return u


def expand_ref(u, b, idx, y):
    """y + B[idx[t]] · u[t] per row with an adapter (f64)."""
    import numpy as np
    out = np.array(y, np.float64)
    for t, s in enumerate(idx):
        if s != NONE:
            out[t] += np.asarray(b[s], np.float64) @ np.asarray(u[t], np.float64)
    return out
