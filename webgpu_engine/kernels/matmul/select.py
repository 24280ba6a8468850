"""The one selector: `matmul` checks its arguments and picks the kernel for a call — the kernel
family's variant (gpu.py), the few-row batch kernel (batch.py), the tiled prefill kernel (tiled.py),
the host-unrolled decode kernel with fused inputs and epilogues, or the generic loop — and
`embedding` gathers rows. Page code: standard library only."""
from __future__ import annotations

from dataclasses import replace

from ...gpu import Device
from .. import lora as lora_kernels
from .. import profiles
from ..common import DTYPE_SIZE, Op, Tensor, check, params
from ..common import window as _window
from . import batch as matmul_batch
from . import gpu as matmul_gpu
from . import tiled as matmul_tiled
from . import wide as matmul_wide
from .codegen import (GATE_ACTS, DecRows, decode_source, decode_v4_source, gate_act_source,
                      weight_pipeline)
from .config import MatmulConfig, default_config, is_cpu_adapter
from .dispatch import Operands, dispatch_parts, operands, row_groups
from .epilogues import NormOut, RopeKV, epilogue_binds, epilogue_ok
from .layout import MAX_GROUPS, QWeight, grid


MAX_DECODE_ROWS = 4          # fused_rows: activation rows one unrolled kernel takes (1, 2 or 4)


def bucket_rows(T: int) -> int:
    """The rows of the unrolled kernel that runs T fused rows: 1, 2 or 4 (a few pipelines)."""
    return 1 << (T - 1).bit_length()


def wide_fits(dev: Device, T: int, w: QWeight) -> bool:
    """Whether fused_rows over T > MAX_DECODE_ROWS rows runs one wide kernel (matmul/wide.py)."""
    return T <= matmul_wide.MAX_ROWS and w.k % 32 == 0 and w.qtype in matmul_wide.EXACT and matmul_wide.ok(dev)


def fused_rows_max(dev: Device) -> int:
    """The most sequences whose decode rows the paged forward runs through fused_rows: 16 where the
    wide kernel runs (matmul/wide.py `ok`), else MAX_DECODE_ROWS."""
    return matmul_wide.MAX_ROWS if matmul_wide.ok(dev) else MAX_DECODE_ROWS


def fused_rows_ok(dev: Device) -> bool:
    """Whether `matmul(..., fused_rows=True)` runs here: the CPU family's unrolled decode kernels."""
    return default_config(dev).unroll


def _family_variant(dev: Device, cfg: MatmulConfig, w: "QWeight", T: int, row_invariant: bool):
    """The gpu.py variant for a plain matmul, or None for this module's kernels:
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


def _pinned(w: QWeight, kind: str, config: MatmulConfig | None, choose):
    """The family variant of `w`'s `kind` matmuls, chosen at the first call and kept for the
    weight's life, as is the strategy they run under (matmul pins `config`): their rows must not
    depend on when the ops were built (a profile stored by another model's tuning, or the family
    switching to "tuned", must not change a loaded model's prefill kernel between two chunk
    heights). An explicit `config` chooses afresh."""
    if config is not None:
        return choose()
    if kind not in w.chosen:
        w.chosen[kind] = choose()
    return w.chosen[kind]


def matmul(dev: Device, x: Tensor, w: QWeight, y: Tensor, *, bias: Tensor | None = None,
           accumulate: bool = False, config: MatmulConfig | None = None,
           norm: tuple | None = None, silu: bool = False, silu_out: bool = False,
           rope_kv: RopeKV | None = None, norm_out: "NormOut | None" = None,
           rms_from: tuple | None = None, row_invariant: bool = False, decode_rows: bool = False,
           fused_rows: bool = False, gate_act: str = "silu", add: "Tensor | lora_kernels.Delta | None" = None) -> Op:
    """y = x·Wᵀ (+ bias); with `accumulate`, y += x·Wᵀ (+ bias). x (T, K), W (N, K), y (T, N).

    Fused inputs (T = 1 only, see `fusable`): `norm=(g (K,) f32, eps)` multiplies by RMSNorm(x)
    instead of x; `silu=True` takes x (1, 2K) = [gate | up] and multiplies by act(gate) * up.
    Fused outputs (T = 1 only, see `epilogue_ok`): `silu_out=True` for a weight from
    `interleave_pairs` (gate and up rows in pairs) stores y (1, N/2) = act(gate) * up;
    act is `gate_act`: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma);
    `rope_kv` rotates the q and k rows of a fused qkv projection and writes k and v to the caches;
    `norm_out` (y (1, N) the whole row, usually accumulate=True on a residual) also stores y * g
    and the partial sums of y^2 that a following matmul(..., rms_from=(partials, eps)) turns into
    1 / rms: that matmul takes x = y * g and gives RMSNorm(y) · Wᵀ with no norm dispatch between.
    `add` (T, N) (with silu_out or rope_kv) is added to the sums (+ bias) before the epilogue (a
    row's LoRA deltas, stored beforehand), or a kernels/lora.py Delta (with silu_out, rope_kv or
    norm_out, x plain or rms_from): each row's LoRA deltas made in this matmul (lora_matmul.wgsl),
    added to the sums, or to y before norm_out's values with Delta.res.

    `row_invariant`: each row of y comes out bit for bit the same whatever T is (prefill: a
    position's logits must not depend on how the prompt was chunked or cached): the kernel is
    chosen by the weight and the device alone — the tiled kernel for every T where the device's
    strategy tiles and the weight allows, else matmul.wgsl, whose row kernel and 4-row tile do the
    same sums per row. No fused input or epilogue.
    `decode_rows`: each row is one sequence's decode step in a continuous batch: its sums must not
    depend on how many rows run, though they need not equal a prefill row's — the GPU family's
    decode kernel in groups of up to 8 rows (one weight pass per group), the row-invariant kernels
    in the CPU family (_decode_rows_variant). No fused input or epilogue.
    `fused_rows` (where fused_rows_ok): each row of x is one sequence's decode step, computed bit for
    bit as the one-row (T = 1) decode kernel computes it alone, with the same fused inputs and
    epilogues (rope_kv: row t at its own position, RopeKV): the unrolled kernel of 1, 2 or 4 rows
    (MAX_DECODE_ROWS; more in groups), each weight chunk decoded once for its rows."""
    if w.subs:       # parts of different types (upload_weight): one matmul per sub-weight
        return _matmul_parts(dev, x, w, y, bias=bias, accumulate=accumulate, config=config, norm=norm,
                             silu=silu, gate_act=gate_act, rms_from=rms_from, row_invariant=row_invariant,
                             decode_rows=decode_rows, fused_rows=fused_rows,
                             epilogue=silu_out or rope_kv is not None or norm_out is not None)
    cfg = config or default_config(dev)
    if config is None and (row_invariant or decode_rows or fused_rows):
        cfg = w.chosen.setdefault("config", cfg)      # with the kernels: pinned for the weight's life
    check(gate_act in GATE_ACTS, "matmul", f"gate_act must be one of {', '.join(GATE_ACTS)}, got {gate_act!r}")
    eps_set = [silu_out, rope_kv is not None, norm_out is not None]
    ep = "silu" if silu_out else "rope_kv" if rope_kv is not None else \
        "res_norm" if norm_out is not None else "store"
    check(add is None or ep != "store", "matmul", "add needs silu_out or rope_kv (a residual Delta: norm_out)")
    if ep != "store":
        check(sum(eps_set) == 1, "matmul", "only one of silu_out, rope_kv and norm_out can be set")
        check(epilogue_ok(dev, w.qtype, w.n, w.k, cfg, force=True) and len(w.bufs) == 1
              and (x.shape[0] == 1 or fused_rows), "matmul",
              "a fused epilogue needs T = 1 (or fused_rows), a single-buffer weight with "
              "K % 32 == 0 and 4 rows per invocation")
        check(bias is None or not silu_out, "matmul", "silu_out takes no bias")
        check(not accumulate or ep == "res_norm", "matmul", "this fused epilogue cannot accumulate")
        check(add is None or ep in ("silu", "rope_kv") or ep == "res_norm" and _is_delta(add) and add.res,
              "matmul", "add needs silu_out or rope_kv (a residual Delta: norm_out)")
        check(not _is_delta(add) or (add.res == (ep == "res_norm") and add.n == w.n and add.k == w.k
                                     and norm is None and not silu), "matmul",
              "a Delta is for this weight, with norm_out where res, and takes x plain or rms_from")
        n_out = w.n // 2 if silu_out else w.n
        check(tuple(y.shape) == (x.shape[0], n_out), "matmul", f"y is {y.shape}, expected ({x.shape[0]}, {n_out})")
    check(len(x.shape) == 2 and len(y.shape) == 2, "matmul", f"x {x.shape} and y {y.shape} must be 2-D")
    x_in = x                      # what is bound: (T, 2K) [gate | up] when silu
    if silu:
        check(x.shape[1] % 2 == 0, "matmul", f"silu needs x = [gate | up], got {x.shape}")
        x = Tensor(x.buf, (x.shape[0], x.shape[1] // 2), x.dtype, x.offset)
    if rms_from is not None:
        check(norm is None and not silu, "matmul", "rms_from cannot be combined with norm or silu")
        check((x.shape[0] == 1 or fused_rows) and x.shape[1] % 32 == 0, "matmul",
              "rms_from needs T = 1 (or fused_rows) and K % 32 == 0 (the decode path)")
    if norm is not None or silu:
        check(norm is None or not silu, "matmul", "norm and silu cannot both be fused")
        check(fusable(dev, 1 if fused_rows else x.shape[0], w, cfg, force=True), "matmul",
              "fused norm/silu needs T = 1 (or fused_rows) and a weight with K % 32 == 0 on the "
              "decode path")
    io = operands(dev, x, w, y, bias, "matmul", x_bind=x_in, y_shape=not silu_out)
    T, K = io.T, io.K
    check(cfg.rr in (1, 2, 4) and cfg.prr in (1, 2, 4) and cfg.tm in (1, 4), "matmul",
          f"unsupported strategy {cfg}")
    if row_invariant:
        check(ep == "store" and norm is None and not silu and rms_from is None, "matmul",
              "row_invariant takes no fused input or epilogue")
    plain = ep == "store" and norm is None and not silu and rms_from is None
    rows = fused_rows            # every row as the T = 1 decode path makes it
    if fused_rows:
        check(not row_invariant and not decode_rows and config is None and cfg.unroll, "matmul",
              "fused_rows takes no config, row_invariant or decode_rows, and needs the CPU family's "
              "unrolled kernels (fused_rows_ok)")
        if T > MAX_DECODE_ROWS and not wide_fits(dev, T, w):  # groups of rows at offsets of their own
            return _row_groups(dev, x_in, w, y, bias=bias, accumulate=accumulate, norm=norm, silu=silu,
                               silu_out=silu_out, rope_kv=rope_kv, norm_out=norm_out, rms_from=rms_from,
                               gate_act=gate_act, add=add)
    if rows and T > MAX_DECODE_ROWS:  # the wide kernel: each weight chunk once, every row as at T = 1
        return _matmul_decode(dev, x, w, y, io, accumulate, cfg, norm, silu, ep, rope_kv, norm_out, rms_from,
                              gate_act=gate_act, x_row4=x_in.shape[1] // 4, add=add)
    if decode_rows:
        check(plain and not row_invariant and config is None, "matmul",
              "decode_rows takes no fused input, epilogue, config or row_invariant")
        v = _pinned(w, "decode_rows", config, lambda: _decode_rows_variant(dev, cfg, w))
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
    if plain and row_invariant:
        variant = _pinned(w, "row_invariant", config, lambda: _family_variant(dev, cfg, w, T, True))
    else:
        variant = _family_variant(dev, cfg, w, T, row_invariant) if plain and not rows else None
    if variant is not None:
        return matmul_gpu.matmul(dev, x, w, y, bias=bias, accumulate=accumulate, variant=variant,
                                 row_invariant=row_invariant)
    if 2 <= T <= cfg.batch_max_t and config is None and plain and not row_invariant and not rows:
        op = matmul_batch.matmul(dev, x, w, y, bias=bias, accumulate=accumulate)   # decode batches
        if op is not None:
            return op
    if (T > 1 or row_invariant) and config is None and cfg.tiled and not rows:
        # prefill tiles; a short row-invariant run takes a tile near its size (same bits per row)
        tile = matmul_batch.tiled_config(dev, w.qtype, T) if T <= cfg.batch_max_t else None
        op = matmul_tiled.matmul(dev, x, w, y, bias=bias, accumulate=accumulate,
                                 any_t=row_invariant, config=tile)
        if op is not None:
            return op
    unrolled = not row_invariant and (cfg.reads_v4(w.qtype, w.n, w.k) or cfg.unroll and K <= cfg.unroll_max_k
                                      and w.n <= cfg.unroll_max_n)
    if (T == 1 or rows) and K % 32 == 0 and (norm is not None or silu or rms_from is not None or unrolled
                                             or ep in ("silu", "rope_kv")):
        return _matmul_decode(dev, x, w, y, io, accumulate, cfg, norm, silu, ep, rope_kv, norm_out, rms_from,
                              gate_act=gate_act, x_row4=x_in.shape[1] // 4, add=add)
    if ep == "res_norm":          # K too long to unroll: the loop kernel with the epilogue
        return _matmul_decode(dev, x, w, y, io, accumulate, cfg, None, False, ep, None, norm_out, loop=True, add=add)
    if T > 1 and (rows or cfg.tm == 4):  # each row's sums as the row kernel's (fused_rows: RR as at T = 1)
        entry, rr, tiles = "matmul_tile", cfg.rr if rows else cfg.prr, -(-T // 4)
    else:
        entry, rr, tiles = "matmul", cfg.rr, T
    check(tiles <= MAX_GROUPS, "matmul", f"T={T} needs more than 65535 tiles")
    pipe = weight_pipeline(dev, entry, w, x.dtype, cfg.wg, rr)
    return dispatch_parts(dev, Op(name=f"matmul[{w.label}]"), pipe, w, y, io, "matmul",
                          row_groups(cfg.wg * rr, "matmul", tiles), accumulate=accumulate)


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


def _row_groups(dev, x_in: Tensor, w: QWeight, y: Tensor, *, norm_out, rms_from, rope_kv, add, **kw) -> Op:
    """fused_rows over more than MAX_DECODE_ROWS rows: a matmul per group of rows, with views of
    x, y and the row-wise fused operands (pnorm partials, norm_out's outputs, rope_kv's rows)."""
    T, K, N = x_in.shape[0], w.k, y.shape[1]
    op = Op(name=f"matmul[{w.label}]")
    for r in range(0, T, MAX_DECODE_ROWS):
        g = min(MAX_DECODE_ROWS, T - r)
        rf = no = None
        if rms_from is not None:
            rf = (rms_from[0].view((g * K // 4,), r * K // 4), rms_from[1])
        if norm_out is not None:
            no = NormOut(norm_out.g, norm_out.out.view((g * N,), r * N),
                         norm_out.partials.view((g * N // 4,), r * N // 4))
        op = op + matmul(dev, x_in.view((g, x_in.shape[1]), r * x_in.shape[1]), w, y.view((g, N), r * N),
                         norm_out=no, rms_from=rf, rope_kv=rope_kv and rope_kv.rows_from(r), fused_rows=True,
                         add=_add_rows(add, r, g, w.n), **kw)
    return op


def _add_rows(add, r: int, g: int, n: int):
    """matmul's `add` for rows r .. r + g - 1: a view of the stored (T, n) values, or a Delta's rows."""
    if add is None:
        return None
    return add.view((g, n), r * n) if isinstance(add, Tensor) else add.rows(r, g)


def _is_delta(add) -> bool:
    return isinstance(add, lora_kernels.Delta)


def _matmul_decode(dev, x, w, y, io: Operands, accumulate, cfg, norm, silu, ep="store",
                   rope: RopeKV | None = None, norm_out: "NormOut | None" = None,
                   rms_from: tuple | None = None, loop: bool = False, gate_act: str = "silu",
                   x_row4: int = 0, add: "Tensor | lora_kernels.Delta | None" = None) -> Op:
    """T = 1: the host-unrolled decode kernel, or with `loop` (an epilogue, K too long to unroll)
    matmul.wgsl's loop over K ending with the epilogue (matmul_epilogue.wgsl matmul_<ep>).
    T rows (fused_rows, T <= MAX_DECODE_ROWS): the unrolled kernel for the bucket of T rows (1, 2
    or 4; rows past T are computed and not stored) with row t's x at x_row4 xwords from row t - 1,
    or the loop kernel over 4 rows at a time (matmul_tile_<ep>): every row's sums as at T = 1."""
    K, T = w.k, io.T
    wide = T > MAX_DECODE_ROWS
    rows = DecRows(matmul_wide.bucket(T) if wide else bucket_rows(T), x_row4, K // 16)
    delta = add if _is_delta(add) else None
    if delta is not None:         # a workgroup makes its rows' LoRA shrinks first: few workgroups
        add = None
        cfg = replace(cfg, wg=lora_kernels.delta_wg(dev, -(-w.n // cfg.rr), cfg.wg))
    mode, g_off4, eps, extra = "plain", 0, 0.0, {}
    if rms_from is not None:
        part, eps = rms_from
        check(part.dtype == "f32" and part.numel == T * K // 4 and K % 16 == 0, "matmul",
              f"rms_from partial sums must be f32 ({T * K // 4},) with K % 16 == 0")
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
    v4 = not loop and cfg.reads_v4(w.qtype, w.n, w.k)
    if wide:
        src = matmul_wide.source(w.qtype, K // 32, K, io.x_off, mode, K // 4, g_off4, eps, ep, rows,
                                 v4=v4, inter_full=w.inter_full, xs_fold=cfg.xs_fold)
    elif loop:                    # several rows: 4 at a time (matmul_tile_<ep>), each as one alone
        src, entry = "", f"matmul_tile_{ep}" if T > 1 else f"matmul_{ep}"
    elif v4:
        src = decode_v4_source(w.qtype, K // 32, K, io.x_off, mode, K // 4, g_off4, eps, ep, w.inter_full,
                                cfg.xs_fold, rows)
    else:
        src = decode_source(K // 32, K, io.x_off, mode, K // 4, g_off4, eps, ep, rows)
    if ep != "store":
        lora = ""
        if delta is not None:
            check(mode in ("plain", "pnorm") and cfg.rr == 4, "matmul", "a Delta takes x plain or rms_from")
            lora = lora_kernels.matmul_source(delta, extra, T, 4 if loop and T > 1 else 1 if loop else rows.n,
                                              x_off4=io.x_off, x4=K // 4,
                                              pnorm=(g_off4, K // 16, eps) if mode == "pnorm" else None)
        src += epilogue_binds(y, rope, norm_out, extra, add, w.n, lora)
    src += gate_act_source(gate_act)
    pipe = weight_pipeline(dev, entry, w, x.dtype, cfg.wg, cfg.rr, src, inplace=v4)
    # T = 1: matmul.wgsl's MatmulParams; ep_silu reads no bias, so the pipeline's layout has no binding 4
    name = f"matmul[{w.label}]" + ("+lora" if delta is not None else "")       # (with the rows' LoRA deltas)
    return dispatch_parts(dev, Op(name=name), pipe, w, y, io, "matmul",
                          row_groups(cfg.wg * cfg.rr, "matmul", -(-T // 4) if loop else 1), accumulate=accumulate,
                          extra=extra, bind_bias=ep != "silu")


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
    gx, gy = grid(-(-T * units // wg))
    pipe = weight_pipeline(dev, "embedding", table, out.dtype, wg)
    op = Op(name=f"embedding[{table.label}]")
    for buf, (r0, rows) in zip(table.bufs, table.parts):
        p = params(dev, [C, T, table.row_words, o_off, i_off, r0, rows, nchunks, units],
                   owner=out.buf.owner, label=f"embedding[{table.label}]")
        op.buffers.append(p)
        op.add(pipe, dev.bind(pipe, [p, ib, buf, ob]), gx, gy)
    return op
