"""Host functions of the mixture-of-experts kernels: routing on the GPU (shaders/moe_route.wgsl) and
products with the selected experts of a stacked expert weight (shaders/moe_matmul.wgsl), so that the
chosen expert ids never leave the GPU and a token reads only its experts' rows.

    logits = h · Wrouterᵀ                          (T, E): the usual matmul
    sel, wts = moe_route(logits)                   (T, k) ids, (T, k) f32 weights
    gu = moe_matmul(h, W_gate_up, sel)             (T k, 2F): each slot's expert, h shared
    f = act(gate) * up                             (T k, F): kernels/elementwise.py silu_mul
    x += moe_down(f, W_down, sel, wts)             (T, C): sum over the k slots, weighted

The numpy references are kernels/nn_ref.py moe_route / moe_matmul / moe_down.
"""
from __future__ import annotations

from ..gpu import Device
from .common import DTYPE_SIZE, Op, Tensor, act_header, check, params, placeholder, window
from .matmul.codegen import weight_pipeline
from .matmul.layout import QWeight

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


def _expert_op(dev: Device, entry: str, x: Tensor, w: QWeight, sel: Tensor, wts: Tensor | None, y: Tensor,
               *, n_experts: int, n_sel: int, T: int, x_slot: bool, accumulate: bool) -> Op:
    k = entry
    check(w.n % n_experts == 0, k, f"{w.label}: {w.n} rows are not {n_experts} experts")
    check(len(w.bufs) == 1 and not w.inter_full and not w.subs, k,
          f"{w.label}: a stacked expert weight must be one buffer in the row layout")
    N, K = w.n // n_experts, w.k
    check(int(x.shape[-1]) == K and K % 4 == 0, k, f"x{x.shape} against {K} columns (a multiple of 4)")
    check(x.dtype == y.dtype and x.dtype in ("f32", "f16"), k, f"x is {x.dtype}, y {y.dtype}")
    check(sel.dtype == "u32" and sel.numel == T * n_sel, k, f"sel{sel.shape} must be ({T}, {n_sel}) u32")
    esz = DTYPE_SIZE[x.dtype]
    xb, xo = window(x, 4 * esz, k, "x")
    yb, yo = window(y, esz, k, "y")
    sb, so = window(sel, 4, k, "sel")
    binds = {1: xb, 2: w.bufs[0], 3: yb, 4: placeholder(dev), 5: sb}
    if wts is not None:
        check(wts.dtype == "f32" and wts.numel == T * n_sel, k, f"wts{wts.shape} must be ({T}, {n_sel}) f32")
        wb, wo = window(wts, 4, k, "wts")
        binds[6] = wb
        check(wo == 0, k, "wts must start at a binding-aligned offset")
    check(so == 0, k, "sel must start at a binding-aligned offset")
    rows_out = T * n_sel if entry == "moe_matmul" else T
    # MatmulParams (shaders/matmul.wgsl): P.rows is one expert's N rows
    values = [K, N, rows_out, w.row_words, xo, yo, N, 0, 0, 2 if accumulate else 0, K // 32, K // 4]
    par = params(dev, values, owner=y.buf.owner, label=f"{k}[{w.label}]")
    extra = f"const NSEL: u32 = {n_sel}u;\nconst XSLOT: u32 = {int(x_slot)}u;\n"
    from ..gpu.shaders import load_shader_source
    pipe = weight_pipeline(dev, entry, w, x.dtype, _WG, 1, extra=extra + load_shader_source("moe_matmul.wgsl"))
    op = Op(name=k)
    op.buffers.append(par)
    check(rows_out <= 65535, k, f"{rows_out} rows exceed one dispatch")
    return op.add(pipe, dev.bind(pipe, {0: par, **binds}), -(-N // _WG), rows_out)


def moe_matmul(dev: Device, x: Tensor, w: QWeight, sel: Tensor, y: Tensor, *, n_experts: int,
               n_sel: int) -> Op:
    """y[t*n_sel + j, :] = x[., :] · W[sel[t, j]]ᵀ for each token t's n_sel experts. w: the experts
    stacked (E * N, K); x (T, K) (every slot of t reads row t) or (T * n_sel, K) (a row per slot);
    y (T * n_sel, N)."""
    T = sel.numel // n_sel
    rows = x.numel // int(x.shape[-1])
    check(rows in (T, T * n_sel), "moe_matmul", f"x has {rows} rows for {T} tokens of {n_sel} slots")
    return _expert_op(dev, "moe_matmul", x, w, sel, None, y, n_experts=n_experts, n_sel=n_sel, T=T,
                      x_slot=rows == T * n_sel and n_sel > 1, accumulate=False)


def moe_down(dev: Device, x: Tensor, w: QWeight, sel: Tensor, wts: Tensor, y: Tensor, *, n_experts: int,
             n_sel: int, accumulate: bool = True) -> Op:
    """y[t, :] (+)= sum_j wts[t, j] * x[t*n_sel + j, :] · W[sel[t, j]]ᵀ: the experts' outputs of each
    token weighted and summed in slot order (added to y when `accumulate`: the residual). x
    (T * n_sel, K); y (T, N)."""
    T = sel.numel // n_sel
    return _expert_op(dev, "moe_down", x, w, sel, wts, y, n_experts=n_experts, n_sel=n_sel, T=T,
                      x_slot=True, accumulate=accumulate)


__all__ = ["moe_down", "moe_matmul", "moe_route"]
