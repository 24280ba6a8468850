"""Host functions of RoPE and the KV-cache write (shaders/rope.wgsl): the frequency table,
rope in place on q and k heads, kv_write into the contiguous caches, and rope_kv (both fused, the
decode path). Positions come from the `step` buffer, so an op built once stays right while the
context grows. q_temperature (shaders/q_temperature.wgsl): Llama 4's position-dependent query scale.
rope_sections (shaders/rope_sections.wgsl): each frequency pair rotated by one of three per-row
positions (M-RoPE's t / h / w sections, a ViT's 2D RoPE).
"""
from __future__ import annotations

import struct

from ..gpu import Buffer, Device
from ..gpu.shaders import load_shader_source
from .common import Op, Ring, Tensor, act_header, check, params, placeholder, ring_header, ring_query
from .nn_base import _act, _op, _qkv_heads, _step_entry, _window


def rope_frequencies(dev: Device, rot_dim: int, base: float, *, owner: str, factors=None) -> Buffer:
    """The f32 table of rot_dim/2 RoPE frequencies base^(-2i/rot_dim) that rope kernels bind, each
    divided by `factors[i]` when given (RoPE scaling: Llama 3.1+'s rope_freqs, linear scaling)."""
    # Computed on the host in float64 and rounded once, so every device (and the numpy reference)
    # multiplies the same f32 frequencies: at pos ~4000 a 1-ulp frequency error moves the angle 2e-4.
    half = rot_dim // 2
    check(factors is None or len(factors) == half, "rope", f"need {half} frequency factors")
    vals = [float(base) ** (-(2.0 * i) / rot_dim) / (float(factors[i]) if factors else 1.0)
            for i in range(half)] or [0.0]
    return dev.upload(struct.pack(f"<{len(vals)}f", *vals), owner=owner, label="rope.inv_freq")


def _rope_op(dev, k, entry, qkv, step, *, h_lo, n_h, n_rot, head_dim, rot_dim, base, neox,
             k_lo=0, n_kv=0, ctx=0, caches=None, factors=None, mscale=1.0, ring=None, q_sink=None) -> Op:
    dt = _act(k, qkv, *(caches or ()))
    rows, heads = _qkv_heads(k, qkv, head_dim)
    check(head_dim % 2 == 0 and rot_dim % 2 == 0 and 0 <= rot_dim <= head_dim, k,
          f"need even rot_dim <= head_dim, got rot_dim={rot_dim} head_dim={head_dim}")
    check(not neox or rot_dim % 4 == 0, k, f"neox rope needs rot_dim % 4 == 0, got {rot_dim}")
    check(h_lo + n_h <= heads, k, f"heads [{h_lo}, {h_lo + n_h}) exceed the {heads} heads of a qkv row")
    owner = qkv.buf.owner
    qe, qo = _window(dev, qkv, k, 2)
    entries = [_step_entry(step), qe]
    kco = vco = 0
    if entry != "kv_write":
        freq = rope_frequencies(dev, rot_dim, base, owner=owner, factors=factors)
        entries.append((freq, 0, freq.size))
    if caches is not None:
        for c in caches:
            check(c.numel == n_kv * ctx * head_dim, k,
                  f"cache {c.shape} must be (Hkv={n_kv}, ctx={ctx}, D={head_dim})")
        (ke, kco), (ve, vco) = _window(dev, caches[0], k, 2), _window(dev, caches[1], k, 2)
        entries += [ke, ve]
    entries += ring_query(k, ring, q_sink, rows, k_lo, head_dim, ctx)
    half = rot_dim // 2
    # units per head: vec2 pairs, except that a neox head's rotated part goes in quads
    units = half // 2 + (head_dim - rot_dim) // 2 if neox else head_dim // 2
    par = params(dev, [rows, heads, head_dim // 2, half, h_lo, n_h, n_rot, int(bool(neox)),
                       k_lo, n_kv, ctx, qo, kco, vco, units, float(mscale)], owner=owner, label=k)
    header = act_header(dt) + ring_header(ring, rope=True) + load_shader_source("sincos.wgsl")
    op = _op(dev, k, "rope.wgsl", entry, header, par, entries, rows * n_h * units)
    if entry != "kv_write":
        op.buffers.append(freq)
    return op


def rope(dev: Device, qkv: Tensor, step, *, n_heads: int, head_dim: int, rot_dim: int | None = None,
         base: float = 10000.0, neox: bool = False, factors=None, mscale: float = 1.0) -> Op:
    """Rotates, in place, the first `n_heads` heads (q then k) of each row of qkv (T, H_all, D);
    row t has position step.pos0 + t (step[3] = S > 0: pos0 + t % S, for B padded sequences of S rows). neox=False: adjacent pairs (GGUF llama layout); True: half split.
    `factors`: RoPE scaling, frequency i divided by factors[i] (see rope_frequencies); `mscale`:
    the rotated values multiplied by it (longrope's attention factor)."""
    rot = head_dim if rot_dim is None else rot_dim
    return _rope_op(dev, "rope", "rope", qkv, step, h_lo=0, n_h=n_heads, n_rot=n_heads,
                    head_dim=head_dim, rot_dim=rot, base=base, neox=neox, factors=factors, mscale=mscale)


def kv_write(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
             n_kv_heads: int, head_dim: int, ctx: int) -> Op:
    """Copies the k and v heads of qkv rows (T, Hq+2Hkv, D) into caches (Hkv, ctx, D) at rows pos0+t."""
    return _rope_op(dev, "kv_write", "kv_write", qkv, step, h_lo=n_q_heads, n_h=2 * n_kv_heads,
                    n_rot=0, head_dim=head_dim, rot_dim=0, base=1.0, neox=False, k_lo=n_q_heads,
                    n_kv=n_kv_heads, ctx=ctx, caches=(k_cache, v_cache))


def rope_kv(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step, *, n_q_heads: int,
            n_kv_heads: int, head_dim: int, ctx: int, rot_dim: int | None = None,
            base: float = 10000.0, neox: bool = False, factors=None, mscale: float = 1.0,
            ring: Ring | None = None, q_sink: Tensor | None = None) -> Op:
    """rope on the q and k heads followed by kv_write, fused into one dispatch (the decode path).
    `ring` (kernels/common.py Ring): positions past ctx go to the ring's rows, and each q head is also
    written to q_sink (T, Hq, D) rotated at min(position, ring.window), for attention's sinks."""
    rot = head_dim if rot_dim is None else rot_dim
    n_rot = n_q_heads + n_kv_heads
    return _rope_op(dev, "rope_kv", "rope_kv", qkv, step, h_lo=0, n_h=n_q_heads + 2 * n_kv_heads,
                    n_rot=n_rot, head_dim=head_dim, rot_dim=rot, base=base, neox=neox,
                    k_lo=n_q_heads, n_kv=n_kv_heads, ctx=ctx, caches=(k_cache, v_cache), factors=factors,
                    mscale=mscale, ring=ring, q_sink=q_sink)


def q_temperature(dev: Device, qkv: Tensor, step=None, *, n_q_heads: int, head_dim: int, beta: float,
                  length: int, positions: Tensor | None = None) -> Op:
    """q *= 1 + beta * ln(1 + floor(pos / length)), in place, on the first n_q_heads heads of each row of
    qkv (T, H_all, D): Llama 4's attention temperature (Ministral 3). Row t's position is step.pos0 + t
    (as rope's), or positions[t] (u32, the paged batch's rows) when given."""
    k = "q_temperature"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    check(0 < n_q_heads <= heads and int(length) > 0, k,
          f"{n_q_heads} q heads of {heads}, length {length} (> 0)")
    qe, qo = _window(dev, qkv, k)
    ph = (placeholder(dev), 0, 16)
    if positions is None:
        ents, per_row = [_step_entry(step), ph], 0
    else:
        check(positions.dtype == "u32" and positions.numel >= rows, k,
              f"positions {positions.shape} must be u32 with a value per row ({rows})")
        ents, per_row = [ph, (positions.buf, positions.offset, 4 * rows)], 1
    par = params(dev, [rows, n_q_heads * head_dim, heads * head_dim, qo, per_row, int(length), float(beta), 0],
                 owner=qkv.buf.owner, label=k)
    return _op(dev, k, "q_temperature.wgsl", k, act_header(dt), par, [qe, *ents], rows * n_q_heads * head_dim)


def rope_sections(dev: Device, qkv: Tensor, positions: Tensor, freq: Tensor, *, n_rot: int, head_dim: int,
                  sections: tuple[int, int]) -> Op:
    """Rotates, in place, the first n_rot heads of each row of qkv (T, H_all, D), half-split pairs, pair i
    by positions[t, axis(i)] * freq[i]: axis 0 below sections[0], 1 below sections[1], else 2 (M-RoPE's
    temporal / height / width pairs; a ViT's 2D RoPE with sections (0, D/4)). positions (T, 3) i32;
    freq (D/2,) f32. numpy reference: nn_ref.rope_sections."""
    k = "rope_sections"
    dt = _act(k, qkv)
    rows, heads = _qkv_heads(k, qkv, head_dim)
    half = head_dim // 2
    s1, s2 = (int(s) for s in sections)
    check(head_dim % 2 == 0 and 0 < n_rot <= heads and 0 <= s1 <= s2 <= half, k,
          f"head_dim {head_dim} even, {n_rot} rotated heads of {heads}, sections {sections} within {half} pairs")
    check(positions.dtype == "i32" and positions.numel >= 3 * rows, k,
          f"positions {positions.shape} must be i32 (>= {rows}, 3)")
    check(freq.dtype == "f32" and freq.numel == half, k, f"freq {freq.shape} must be f32 ({half},)")
    (qe, qo), (pe, po), (fe, _) = (_window(dev, t, k) for t in (qkv, positions, freq))
    par = params(dev, [rows, heads, half, n_rot, s1, s2, qo, po], owner=qkv.buf.owner, label=k)
    header = act_header(dt) + load_shader_source("sincos.wgsl")
    return _op(dev, k, "rope_sections.wgsl", k, header, par, {1: pe, 2: qe, 3: fe}, rows * n_rot * half)
