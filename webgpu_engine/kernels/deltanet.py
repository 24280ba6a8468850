"""Host functions of Gated DeltaNet's kernels (Qwen3.5's linear-attention layers) and of its
full-attention layers' output gate: causal_conv1d (shaders/conv1d.wgsl), gated_delta_rule
(shaders/deltanet.wgsl), sigmoid_gate (shaders/deltanet_gate.wgsl). Numpy references in
kernels/deltanet_ref.py.

The conv and delta kernels keep a state per sequence (`slot`) across calls: the recurrence runs over
a call's rows in order, so a prefill chunk continues where the last one stopped, and a row at position
0 starts from zeros. `rows` says where each row's position and slot come from: None for one sequence
(positions pos0 + t from the step buffer, slot 0), or (positions, slots) u32 tensors of one entry per
row (the paged batch: a decode row per sequence, or a prefill chunk of one sequence). A row's slots
entry (`row_slot`) may also name a save slot: the state after that row is copied there too (a
snapshot of the sequence at that position); state_copy (shaders/deltanet_copy.wgsl) copies a slot
back into a sequence's.
"""
from __future__ import annotations

from ..gpu import Device
from .common import Op, Tensor, act_header, check, params, placeholder
from .nn_base import _act, _op, _step_entry, _window

MAX_TAPS = 8
# each row's position and sequence slot (conv1d.wgsl and deltanet.wgsl declare p.per_row, step,
# positions and slots)
_ROWS_WGSL = """
fn row_pos(t: u32) -> u32 {
    if (p.per_row == 1u) { return positions[t]; }
    return step[0] + t;
}

fn row_slot(t: u32) -> u32 {
    if (p.per_row == 1u) { return slots[t] & 0xffffu; }
    return 0u;
}

fn row_save(t: u32) -> u32 {
    if (p.per_row == 1u) { return slots[t] >> 16u; }
    return 0u;
}
"""
SAVE_SHIFT = 16     # a row's slots entry: its sequence's slot | (the slot its state is saved to + 1) << 16


def row_slot(slot: int, save: int | None = None) -> int:
    """A row's slots entry: the state of sequence slot `slot`, and after the row a copy of it into
    slot `save` (a snapshot; None: none)."""
    return slot | (0 if save is None else (save + 1) << SAVE_SHIFT)


def _row_entries(dev: Device, step, rows, T: int, kernel: str) -> tuple[list, int]:
    """The bindings of step, positions and slots, and per_row."""
    if rows is None:
        ph = (placeholder(dev), 0, 16)
        return [_step_entry(step), ph, ph], 0
    pos, slots = rows
    check(pos.dtype == slots.dtype == "u32" and pos.numel >= T and slots.numel >= T, kernel,
          f"positions {pos.shape} and slots {slots.shape} must be u32 with a value per row ({T})")
    ph = (placeholder(dev), 0, 16)
    return [ph, (pos.buf, pos.offset, 4 * T), (slots.buf, slots.offset, 4 * T)], 1


def causal_conv1d(dev: Device, x: Tensor, w: Tensor, state: Tensor, y: Tensor, step=None, *, channels: int,
                  rows: tuple | None = None) -> Op:
    """y[t, c] = silu(sum_j w[c, j] xs[t + j, c]) over the first `channels` columns of x (T, N), xs
    the sequence's state (its last K-1 inputs, kept in `state`) followed by the rows; y (T, C) act;
    w (C, K) f32; state (slots, C, K-1) f32."""
    k = "causal_conv1d"
    dt = _act(k, x, y)
    T, n = int(x.shape[0]), int(x.shape[-1])
    taps = int(w.shape[-1])
    check(w.dtype == state.dtype == "f32" and w.numel == channels * taps and 1 <= taps <= MAX_TAPS
          and channels <= n and y.numel == T * channels and state.numel % (channels * max(taps - 1, 1)) == 0, k,
          f"x{x.shape} w{w.shape} state{state.shape} y{y.shape}, {channels} channels, {taps} taps (1..{MAX_TAPS})")
    (xe, xo), (ye, yo) = (_window(dev, t, k) for t in (x, y))
    ents, per_row = _row_entries(dev, step, rows, T, k)
    par = params(dev, [T, channels, taps, n, xo, yo, per_row, 0], owner=y.buf.owner, label=k)
    return _op(dev, k, "conv1d.wgsl", k, act_header(dt) + _ROWS_WGSL, par,
               [xe, w.binding(), state.binding(), ye, *ents], channels)


def gated_delta_rule(dev: Device, qkv: Tensor, proj: Tensor, hw: Tensor, state: Tensor, y: Tensor, step=None, *,
                     n_k_heads: int, n_v_heads: int, k_dim: int, v_dim: int, z_col: int, eps: float,
                     rows: tuple | None = None, tiled: bool = False) -> Op:
    """The gated delta rule over T rows (see shaders/deltanet.wgsl) and the gated RMSNorm of its
    output: qkv (T, 2 Hk Dk + Hv Dv) the convolved q | k | v; proj (T, M) holding z (Hv Dv values from
    column z_col), then b and a (Hv each); hw (2 Hv + Dv,) f32: A_log | dt_bias | the norm's w; state
    (slots, Hv, Dk, Dv) f32; y (T, Hv Dv) act. Value head h reads key head h / (Hv / Hk) (HF's order),
    or h % Hk with `tiled` (llama.cpp's GGUF files: value heads reordered so that ggml's broadcast
    repeats the key heads)."""
    k = "gated_delta_rule"
    dt = _act(k, qkv, proj, y)
    T, width, m = int(qkv.shape[0]), int(qkv.shape[-1]), int(proj.shape[-1])
    Hk, Hv, Dk, Dv = n_k_heads, n_v_heads, k_dim, v_dim
    b_col = z_col + Hv * Dv
    check(width == 2 * Hk * Dk + Hv * Dv and Hv % Hk == 0 and b_col + 2 * Hv <= m and int(proj.shape[0]) == T
          and y.numel == T * Hv * Dv and hw.dtype == state.dtype == "f32" and hw.numel == 2 * Hv + Dv
          and state.numel % (Hv * Dk * Dv) == 0 and Dv <= 256 and Dk <= 256 and Dk % 4 == 0, k,
          f"qkv{qkv.shape} proj{proj.shape} hw{hw.shape} state{state.shape} y{y.shape} for Hk {Hk}, Hv {Hv}, "
          f"Dk {Dk} (a multiple of 4), Dv {Dv} (<= 256), z at column {z_col}")
    (qe, qo), (pe, po), (ye, yo) = (_window(dev, t, k) for t in (qkv, proj, y))
    ents, per_row = _row_entries(dev, step, rows, T, k)
    par = params(dev, [T, Hk, Hv, width, qo, po, yo, m, z_col, b_col, b_col + Hv, per_row, float(eps), int(tiled), 0, 0],
                 owner=y.buf.owner, label=k)
    header = act_header(dt) + f"const DK: u32 = {Dk}u;\nconst DV: u32 = {Dv}u;\n" + _ROWS_WGSL
    pipe = dev.pipeline("deltanet.wgsl", k, None, header=header)
    op = Op(name=k)
    op.buffers.append(par)
    op.add(pipe, dev.bind(pipe, [par, qe, pe, hw.binding(), state.binding(), ye, *ents]), Hv)
    return op


def state_copy(dev: Device, state: Tensor, pairs: Tensor, max_pairs: int) -> Op:
    """state[dst] = state[src] for the first pairs[0] (src, dst) slot pairs of pairs[1:] (see
    shaders/deltanet_copy.wgsl); state (slots, ...) f32, pairs (1 + 2 max_pairs,) u32, written by the
    host before the op runs."""
    k = "state_copy"
    slots = int(state.shape[0])
    elems = state.numel // slots
    groups = -(-elems // 256)
    check(state.dtype == "f32" and pairs.dtype == "u32" and pairs.numel >= 1 + 2 * max_pairs and max_pairs >= 1
          and groups <= 65535, k, f"state{state.shape} {state.dtype}, pairs{pairs.shape} {pairs.dtype} for "
          f"{max_pairs} pairs (a slot of at most {65535 * 256} elements)")
    par = params(dev, [elems, 0, 0, 0], owner=state.buf.owner, label=k)
    pipe = dev.pipeline("deltanet_copy.wgsl", k, None)
    op = Op(name=k)
    op.buffers.append(par)
    op.add(pipe, dev.bind(pipe, [par, state.binding(), pairs.binding()]), groups, int(max_pairs))
    return op


def sigmoid_gate(dev: Device, y: Tensor, g: Tensor) -> Op:
    """y *= sigmoid(g), in place; y, g (T, N) act."""
    k = "sigmoid_gate"
    dt = _act(k, y, g)
    check(y.numel == g.numel, k, f"shapes y{y.shape} g{g.shape}")
    (ye, yo), (ge, go) = (_window(dev, t, k) for t in (y, g))
    par = params(dev, [y.numel, yo, go, 0], owner=y.buf.owner, label=k)
    return _op(dev, k, "deltanet_gate.wgsl", k, act_header(dt), par, [ye, ge], y.numel)


__all__ = ["MAX_TAPS", "SAVE_SHIFT", "causal_conv1d", "gated_delta_rule", "row_slot", "sigmoid_gate", "state_copy"]
