"""Host functions of the mixture-of-experts kernels: routing on the GPU (shaders/moe_route.wgsl) and
products with the selected experts of a stacked expert weight (shaders/moe_matmul.wgsl), so that the
chosen expert ids never leave the GPU and a token reads only its experts' rows.

    logits = h · Wrouterᵀ                          (T, E): the usual matmul
    sel, wts = moe_route(logits)                   (T, k) ids, (T, k) f32 weights
    gu = moe_matmul(h, W_gate_up, sel)             (T k, 2F): each slot's expert, h shared (prefill:
                                                   the slots grouped by expert first, moe_group)
    f = act(gate) * up                             (T k, F): kernels/elementwise.py silu_mul
    x += moe_down(f, W_down, sel, wts)             (T, C): sum over the k slots, weighted

The numpy references are kernels/nn_ref.py moe_route / moe_matmul / moe_down.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..gpu import Device
from .common import DTYPE_SIZE, Op, Tensor, act_header, check, params, placeholder, window
from ..gpu.shaders import load_shader_source
from .matmul.codegen import weight_pipeline
from .matmul.layout import upload_weight

_WG = 64


def moe_route(dev: Device, logits: Tensor, sel: Tensor, wts: Tensor, *, n_sel: int, norm: bool) -> Op:
    """sel[t, :], wts[t, :] = the n_sel largest of softmax(logits[t, :]) (ids, probabilities), the
    probabilities renormalised to sum 1 when `norm`.  logits (T, E) act; sel (T, n_sel) u32; wts
    (T, n_sel) f32."""
    k = "moe_route"
    T, E = (int(s) for s in logits.shape)
    check(logits.dtype in ("f32", "f16"), k, f"logits must be f32 or f16, got {logits.dtype}")
    check(0 < n_sel <= E, k, f"{n_sel} experts per token out of {E}")
    check(sel.dtype == "u32" and sel.numel == T * n_sel and wts.dtype == "f32" and wts.numel == T * n_sel, k,
          f"sel{sel.shape}/{sel.dtype} and wts{wts.shape}/{wts.dtype} must be ({T}, {n_sel}) u32 / f32")
    (lb, lo), (sb, so), (wb, wo) = (window(t, DTYPE_SIZE[t.dtype], k, n)
                                    for t, n in ((logits, "logits"), (sel, "sel"), (wts, "wts")))
    check(so == 0 and wo == 0, k, "sel and wts must start at a binding-aligned offset")
    pipe = dev.pipeline("moe_route.wgsl", k, header=f"{act_header(logits.dtype)}const WG: u32 = {_WG}u;\n"
                                                    f"const NSEL: u32 = {n_sel}u;\n")
    par = params(dev, [T, E, lo, int(bool(norm))], owner=sel.buf.owner, label=k)
    op = Op(name=k)
    op.buffers.append(par)
    return op.add(pipe, dev.bind(pipe, [par, lb, sb, wb]), -(-T // _WG))


@dataclass
class ExpertStack:
    """E experts of `rows` rows each (k columns) stacked on the GPU: parts[i] = (first expert, a
    one-buffer QWeight of whole experts in the row layout), expert e's rows at (e - first) * rows."""

    parts: list
    n_experts: int
    rows: int
    k: int

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.parts)

    def release(self) -> None:
        for _, w in self.parts:
            w.release()


def moe_group(dev: Device, sel: Tensor, order: Tensor, start: Tensor, *, n_experts: int, n_sel: int) -> Op:
    """order, start: the slots of sel (T, n_sel) grouped by expert (expert e's slots, in slot order, at
    order[start[e] .. start[e + 1]]) for moe_matmul's grouped form.  order (T * n_sel,) u32; start
    (n_experts + 1,) u32."""
    k = "moe_group"
    T = sel.numel // n_sel
    check(order.dtype == "u32" and order.numel == T * n_sel and start.dtype == "u32"
          and start.numel == n_experts + 1, k, f"order{order.shape} / start{start.shape} for {T} x {n_sel} slots")
    wins = [window(t, 4, k, n) for t, n in ((sel, "sel"), (order, "order"), (start, "start"))]
    check(all(o == 0 for _, o in wins), k, "sel, order and start must start at binding-aligned offsets")
    pipe = dev.pipeline("moe_route.wgsl", k, header=f"{act_header('f32')}const WG: u32 = {_WG}u;\n"
                                                    f"const NSEL: u32 = {n_sel}u;\n")
    par = params(dev, [T, n_experts, 0, 0], owner=order.buf.owner, label=k)
    op = Op(name=k)
    op.buffers.append(par)
    return op.add(pipe, dev.bind(pipe, {0: par, 2: wins[0][0], 4: wins[1][0], 5: wins[2][0]}), 1)


def _expert_op(dev: Device, entry: str, x: Tensor, w: ExpertStack, sel: Tensor, wts: Tensor | None, y: Tensor,
               *, n_sel: int, T: int, x_slot: bool, accumulate: bool, groups: tuple | None = None,
               bias: Tensor | None = None) -> Op:
    k, N, K = entry, w.rows, w.k
    check(int(x.shape[-1]) == K and K % 4 == 0, k, f"x{x.shape} against {K} columns (a multiple of 4)")
    check(x.dtype in ("f32", "f16") and y.dtype in (x.dtype, "f32"), k, f"x is {x.dtype}, y {y.dtype}")
    check(sel.dtype == "u32" and sel.numel == T * n_sel, k, f"sel{sel.shape} must be ({T}, {n_sel}) u32")
    xb, xo = window(x, 4 * DTYPE_SIZE[x.dtype], k, "x")
    yb, yo = window(y, DTYPE_SIZE[y.dtype], k, "y")
    sb, so = window(sel, 4, k, "sel")
    check(so == 0, k, "sel must start at a binding-aligned offset")
    binds = {1: xb, 3: yb, 4: placeholder(dev), 5: sb}
    if wts is not None:
        check(wts.dtype == "f32" and wts.numel == T * n_sel, k, f"wts{wts.shape} must be ({T}, {n_sel}) f32")
        wb, wo = window(wts, 4, k, "wts")
        check(wo == 0, k, "wts must start at a binding-aligned offset")
        binds[6] = wb
    if groups is not None:                   # (order, start) of moe_group
        (ob, oo), (gb, go) = window(groups[0], 4, k, "order"), window(groups[1], 4, k, "start")
        check(oo == 0 and go == 0, k, "order and start must start at binding-aligned offsets")
        binds.update({7: ob, 8: gb})
        del binds[5]                         # the slots come from order, not sel
        entry = "moe_matmul_grouped"
    bias_fn = "fn expert_bias(e: u32, r: u32) -> f32 { return 0.0; }\n"
    if bias is not None:                     # (E, N) f32: each expert's bias (gpt-oss)
        check(bias.dtype == "f32" and bias.numel == w.n_experts * N, k,
              f"bias{bias.shape}/{bias.dtype} must be ({w.n_experts} x {N},) f32")
        bb, bo = window(bias, 4, k, "bias")
        check(bo == 0, k, "bias must start at a binding-aligned offset")
        binds[9] = bb
        bias_fn = ("@group(0) @binding(9) var<storage, read> ebias: array<f32>;   // (E, N)\n"
                   "fn expert_bias(e: u32, r: u32) -> f32 { return ebias[e * P.rows + r]; }\n")
    rows_out = T if entry == "moe_down" else T * n_sel
    check(rows_out <= 65535, k, f"{rows_out} rows exceed one dispatch")
    op = Op(name=k)
    ends = [e0 for e0, _ in w.parts[1:]] + [w.n_experts]
    for i, ((e0, part), e1) in enumerate(zip(w.parts, ends)):
        check(len(part.bufs) == 1 and not part.inter_full and not part.subs and part.n == (e1 - e0) * N
              and part.k == K, k, f"{part.label}: experts {e0}..{e1 - 1} must be one buffer in the row layout")
        # MatmulParams (shaders/matmul.wgsl): P.rows is one expert's N rows; parts after the first add
        acc = accumulate or (i > 0 and entry == "moe_down")
        values = [K, N, rows_out, part.row_words, xo, yo, N, 0, 0, 2 if acc else 0, K // 32, K // 4]
        par = params(dev, values, owner=y.buf.owner, label=f"{k}[{part.label}]")
        extra = (f"const NSEL: u32 = {n_sel}u;\nconst XSLOT: u32 = {int(x_slot)}u;\n"
                 f"const E0: u32 = {e0}u;\nconst NE: u32 = {e1 - e0}u;\n" + bias_fn)
        pipe = weight_pipeline(dev, entry, part, x.dtype, _WG, 1, y_dtype=y.dtype,
                               extra=extra + load_shader_source("moe_matmul.wgsl"))
        op.buffers.append(par)
        op.add(pipe, dev.bind(pipe, {0: par, 2: part.bufs[0], **binds}), -(-N // _WG),
               e1 - e0 if groups is not None else rows_out)
    return op


def moe_matmul(dev: Device, x: Tensor, w: ExpertStack, sel: Tensor, y: Tensor, *, n_sel: int,
               groups: tuple | None = None, bias: Tensor | None = None) -> Op:
    """y[t*n_sel + j, :] = x[., :] · W[sel[t, j]]ᵀ for each token t's n_sel experts. w: the experts
    stacked (E, N, K); x (T, K) (every slot of t reads row t) or (T * n_sel, K) (a row per slot);
    y (T * n_sel, N). `groups`: moe_group's (order, start), the slots grouped by expert: each weight
    chunk is read once for 4 slots of its expert (a prefill's rows), the same values bit for bit.
    `bias` (E * N,) f32: expert e's bias added to its products (gpt-oss)."""
    T = sel.numel // n_sel
    rows = x.numel // int(x.shape[-1])
    check(rows in (T, T * n_sel), "moe_matmul", f"x has {rows} rows for {T} tokens of {n_sel} slots")
    return _expert_op(dev, "moe_matmul", x, w, sel, None, y, n_sel=n_sel, T=T,
                      x_slot=rows == T * n_sel and n_sel > 1, accumulate=False, groups=groups, bias=bias)


def moe_combine(dev: Device, prods: Tensor, wts: Tensor, y: Tensor, *, n_sel: int, accumulate: bool = True) -> Op:
    """y[t, :] (+)= sum_j wts[t, j] * prods[t*n_sel + j, :] in slot order: moe_down's sums from f32
    products (T * n_sel, N) that moe_matmul's grouped form made.  wts (T, n_sel) f32; y (T, N) act."""
    k = "moe_combine"
    T, N = (int(s) for s in y.shape)
    check(prods.dtype == "f32" and prods.numel == T * n_sel * N and wts.dtype == "f32" and wts.numel == T * n_sel
          and y.dtype in ("f32", "f16"), k, f"prods{prods.shape}/{prods.dtype} wts{wts.shape} y{y.shape}/{y.dtype}")
    (pb, po), (wb, wo), (yb, yo) = (window(t, DTYPE_SIZE[t.dtype], k, n)
                                    for t, n in ((prods, "prods"), (wts, "wts"), (y, "y")))
    check(po == 0 and wo == 0, k, "prods and wts must start at binding-aligned offsets")
    pipe = dev.pipeline("moe_combine.wgsl", k, header=f"{act_header(y.dtype)}const WG: u32 = {_WG}u;\n"
                                                     f"const NSEL: u32 = {n_sel}u;\n")
    par = params(dev, [T, N, yo, int(accumulate)], owner=y.buf.owner, label=k)
    op = Op(name=k)
    op.buffers.append(par)
    check(T <= 65535, k, f"{T} rows exceed one dispatch")
    return op.add(pipe, dev.bind(pipe, [par, pb, wb, yb]), -(-N // _WG), T)


def moe_down(dev: Device, x: Tensor, w: ExpertStack, sel: Tensor, wts: Tensor, y: Tensor, *, n_sel: int,
             accumulate: bool = True, groups: tuple | None = None, prods: Tensor | None = None,
             bias: Tensor | None = None) -> Op:
    """y[t, :] (+)= sum_j wts[t, j] * x[t*n_sel + j, :] · W[sel[t, j]]ᵀ: the experts' outputs of each
    token weighted and summed in slot order (added to y when `accumulate`: the residual). x
    (T * n_sel, K); y (T, N). With moe_group's `groups` (a prefill's rows): each slot's product by
    moe_matmul's grouped form into `prods` (T * n_sel, N) f32, then their weighted sums (moe_combine).
    `bias` (E * N,) f32: each expert's bias, in its product before the weighting (gpt-oss)."""
    T = sel.numel // n_sel
    if groups is not None:
        return moe_matmul(dev, x, w, sel, prods, n_sel=n_sel, groups=groups, bias=bias) + \
            moe_combine(dev, prods, wts, y, n_sel=n_sel, accumulate=accumulate)
    return _expert_op(dev, "moe_down", x, w, sel, wts, y, n_sel=n_sel, T=T,
                      x_slot=True, accumulate=accumulate, bias=bias)


def upload_experts(dev: Device, experts: list, qtype: str, rows: int, k: int, *, owner: str, label: str,
                   max_binding: int | None = None) -> ExpertStack:
    """An ExpertStack of E experts, experts[e] the byte buffers whose whole rows, in turn, make expert
    e's (rows, k) in `qtype`'s file layout (gate then up): as many whole experts per GPU buffer as one
    binding holds (`max_binding`, default the device's)."""
    from .matmul.layout import gpu_row_bytes
    limit = min(max_binding or dev.max_storage_binding, dev.max_buffer_size)
    per = limit // (rows * gpu_row_bytes(qtype, k))
    check(per > 0, "upload_experts", f"{label}: one expert ({rows} rows) exceeds the binding limit")
    out = []
    try:
        for e0 in range(0, len(experts), per):
            group = experts[e0:e0 + per]
            out.append((e0, upload_weight(dev, [b for e in group for b in e], qtype, len(group) * rows, k, owner=owner,
                                          label=f"{label}[{e0}:{e0 + len(group)}]", max_binding=max_binding,
                                          interleave=False)))
    except BaseException:
        for _, w in out:
            w.release()
        raise
    return ExpertStack(out, len(experts), rows, k)


__all__ = ["ExpertStack", "moe_combine", "moe_down", "moe_group", "moe_matmul", "moe_route", "upload_experts"]
