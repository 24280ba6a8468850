"""The decoder layer, sequenced once for every Llama-family model and every way of running it.

    x = embed(ids)                                             # (T, C)
    x = family's "embed" ops (x)                               # Gemma: x *= sqrt(C)
    x[t] = image features where row t holds an image token     # vision-language models, PREFILL
    family's "inputs" ops (x)                                  # Gemma 4: per-layer inputs e (T, L, P)
    for each layer:
        h = rms_norm(x), or LayerNorm(x) (StableLM),
            or h = x (OLMo-2: no pre norms)                    # (T, C)
        qkv = h · Wqkvᵀ (+ bias)                               # (T, Hq + 2 Hkv, D), Q|K|V fused
        q, k = rms_norm(q head), rms_norm(k head)              # Qwen3, Gemma 3
        q, k = rms_norm(q), rms_norm(k) over Hq D, Hkv D       # OLMo-2
        q, k = rotate by each row's M-RoPE offsets             # Qwen2.5-VL's prompt rows, PREFILL (image rows)
        rope(q, k); k, v -> the KV cache                       # kv.rope_kv (or fused into the matmul)
        a = attention(q, cache) · Woᵀ                          # kv.attention: causal GQA, sliding
                                                               # window where the layer has one,
                                                               # Gemma 2's capped scores, gpt-oss's sinks
          (* sigmoid(h · Wgᵀ) before Wo: Qwen3.5's output gate)
          or a = mixer(qkv, the sequence's states) · Woᵀ        # a layer's own token mixer (L.mixer:
                                                               # Qwen3.5's Gated DeltaNet, family module)
        x += a, or x += rms_norm(a) (Gemma, OLMo-2)            # residual fused in the matmul
        h = rms_norm(x), LayerNorm(x), or h = x                # parallel layers (Phi, GPT-NeoX): the
                                                               # norm(s) of the layer's input, before x += a
        f = (act(h · Wgateᵀ) * (h · Wupᵀ)) · Wdownᵀ            # gate|up fused: (T, 2F); act SiLU or GELU-tanh
          or act(h · Wupᵀ + b) · Wdownᵀ + b                    # dense (Phi, GPT-NeoX): GELU, tanh or erf
        x += f, or x += rms_norm(f) (Gemma, OLMo-2)
        or, a MoE layer: e, w = top-k(softmax(h · Wrouterᵀ (+ b)))  # (T, k) on the GPU
           x += sum_j w_j * FFN_{e_j}(h)                       # only the chosen experts' rows read
                                                               # (gpt-oss: biases, clamped SwiGLU)
        x = family's "layer_end" ops (x)                       # Gemma 4: x += its per-layer input;
                                                               # x *= the layer's scalar
    logits = rms_norm(x) (or LayerNorm(x)) · Wheadᵀ (+ b)      # the last row, or every row
    logits = family's "logits" ops (logits)                    # Gemma 2, 4: cap * tanh(logits / cap)

Two things vary, and each is a parameter, never a copy of the recipe:

- how the KV cache is reached (`kv`, a KVAccess): one sequence's contiguous rows with positions from
  a step uniform (models/llama.py), or paged blocks of many sequences with per-row positions, slots
  and block tables (models/paged.py). It supplies the input ids, the logits, the RoPE + KV-write op,
  the attention op and, where it can, the RoPE + KV-write epilogue of the fused qkv matmul;
- the row mode: DECODE (one row through the fused one-row kernels a FusionPlan picks), ROWS (one
  decode row per sequence, matmul sums independent of the row count: continuous batching; logits of
  every row; where kv.fused_rows, each row through the DECODE plan's fused kernels as DECODE computes
  it alone, else plain row-invariant kernels) or PREFILL (row-invariant kernels: a position's values do not depend on how the prompt
  was chunked or cached; logits of the last row).

A family's new math is its module's: values in LlamaConfig.extra and ops at the points a family
may use (DecoderFamily.ops: "embed", "inputs", "qkv", "qkv_rows", "attn", "ffn", "layer_end", "logits"),
each an op in kernels/ (host function, WGSL, numpy reference). What several families share stays here
as parts of the recipe that their config or weights turn on: LayerNorm or RMSNorm, no pre norms, post
norms, q/k norms, parallel layers, dense or MoE FFNs, capped or windowed attention, image rows.
Standard library only (runs in the page).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..kernels import matmul as mm
from ..kernels import deltanet, moe, nn
from ..kernels.common import Op, Tensor
from ..loaders.decoder_config import FAMILIES
from ..loaders.model_config import LlamaConfig

DECODE, ROWS, PREFILL = "decode", "rows", "prefill"

# the matmul flags of each row mode's plain (unfused) matmuls
_ROW_FLAGS = {DECODE: {}, ROWS: {"decode_rows": True}, PREFILL: {"row_invariant": True}}


@dataclass(frozen=True)
class FusionPlan:
    """Which fused kernels one forward uses, chosen once per op list from the device's matmul
    strategy (kernels/matmul/: fusable, epilogue_ok, default_config) and the layers' weights. The
    DECODE mode fuses, and ROWS where kv.fused_rows; the other modes run every row through plain
    kernels.
    The gate activation (cfg.act: SiLU or GELU-tanh) is a parameter of the fused paths
    (matmul gate_act); layers with post norms or a family's ops at their end keep the residual add
    apart (no res_norm: the next norm must see x as those leave it)."""

    norm_in_matmul: bool = False       # RMSNorm folded into the qkv / gate_up matmuls' input
    gate_in_down: bool = False         # act(gate) * up folded into the down matmul's input
    res_norm: bool = False             # o / down store x, x * g of the next norm and sums of x^2;
    #                                    the matmul after scales by 1 / rms (layer 0 keeps its norm)
    head_norm_in_matmul: bool = False  # the final norm folded into the LM head (without res_norm)
    rope_kv: tuple = ()                # per layer: the qkv matmul rotates q, k and writes the caches
    gate_out: tuple = ()               # per layer: the gate_up matmul stores act(gate) * up

    @classmethod
    def choose(cls, dev, cfg: LlamaConfig, layers: list, lm_head, decode: bool,
               fused_rope: bool = True) -> "FusionPlan":
        """`fused_rope`: whether the KV access offers the qkv matmul's RoPE + KV-write epilogue (off
        too where the family has ops between the projection and RoPE, as for ops on act(gate) * up:
        family_ops)."""
        n = len(layers)
        points = family_ops(cfg)
        fused_rope = fused_rope and not {"qkv", "qkv_rows"} & set(points)
        if not decode:
            return cls(rope_kv=(False,) * n, gate_out=(False,) * n)
        rms = cfg.norm == "rms"              # the fused paths fold RMSNorms only
        dense = not cfg.n_experts            # a MoE layer's FFN runs its own kernels (_experts)
        return cls(
            norm_in_matmul=rms and dense and cfg.pre_norms and all(mm.fusable(dev, 1, w) for L in layers
                                                         for w in (L.qkv, L.gate_up, L.attn_gate) if w),
            gate_in_down=dense and "ffn" not in points and cfg.ffn_gated and all(mm.fusable(dev, 1, L.down, silu=True) and not L.gate_pairs
                                                     for L in layers),
            res_norm=rms and dense and cfg.hidden_size % 32 == 0 and not cfg.post_norms and "layer_end" not in points
            and mm.default_config(dev).res_norm
            and all(
                mm.epilogue_ok(dev, w.qtype, w.n, w.k) and len(w.bufs) == 1
                for L in layers for w in (L.o, L.down)),
            head_norm_in_matmul=rms and mm.fusable(dev, 1, lm_head),
            # adjacent-pair rope only, and a head of whole vec4s; q/k norms come between the
            # matmul and RoPE, so those layers keep the separate rope_kv kernel
            rope_kv=tuple(fused_rope and not cfg.rope_neox and cfg.head_dim % 4 == 0 and L.qk_norm is None
                          and L.mixer is None and cfg.rope_attn_factor == 1.0 and not cfg.rope_local_base
                          and mm.epilogue_ok(dev, L.qkv.qtype, L.qkv.n, L.qkv.k) for L in layers),
            gate_out=tuple(L.gate_pairs for L in layers))


@dataclass(frozen=True)
class Attention:
    """What layer i's attention computes, whatever the cache: heads, score scale, window, cap."""

    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    window: int
    softcap: float
    sinks: Tensor | None = None        # (Hq,) f32: each head's logit in its softmax's denominator (gpt-oss)

    def heads(self) -> dict:
        return {"n_q_heads": self.n_q_heads, "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim}

    def masking(self) -> dict:
        return {"window": self.window, "softcap": self.softcap, **({"sinks": self.sinks} if self.sinks is not None else {})}


@dataclass(frozen=True)
class Rows:
    """What the ops at a family's "embed", "inputs" and "layer_end" points get of the forward: its KV
    access (kv.ids: the input ids), its row mode and that mode's matmul flags (row_flags), which a
    matmul there takes so that its rows keep the mode's invariance."""

    kv: "KVAccess"
    mode: str
    flags: dict


def family_ops(cfg: LlamaConfig) -> dict:
    """{point: fn(m, i, t, T) -> [Op]}: the new math of cfg's family (DecoderFamily.ops; "embed",
    "inputs" and "layer_end" take a fifth argument, the forward's Rows)."""
    fam = FAMILIES.get(cfg.arch)
    return fam.ops if fam is not None else {}


def row_flags(kv: "KVAccess", mode: str) -> dict:
    """The matmul flags of a row mode through `kv`: ROWS takes the fused one-row kernels where the
    KV access says so (kv.fused_rows: every row as a DECODE row alone, with the DECODE fusion plan),
    else the kernels whose row sums do not depend on the row count (decode_rows)."""
    return {"fused_rows": True} if mode == ROWS and kv.fused_rows else _ROW_FLAGS[mode]


class KVAccess(Protocol):
    """How one forward reaches its KV cache and its per-step inputs (see the module's note)."""

    ids: Tensor                        # (P,) u32 input ids
    head_flags: dict                   # matmul flags of the PREFILL head's one-row matmul
    fused_rows: bool                   # ROWS mode through the fused one-row kernels (fused_rows)

    def logits_for(self, rows: int) -> Tensor: ...
    def fused_rope(self, i: int) -> "mm.RopeKV | None": ...
    def rope_kv(self, i: int, qkv: Tensor, T: int, rope: dict) -> Op: ...
    def rope_q(self, i: int, qkv: Tensor, T: int, rope: dict) -> Op: ...   # q heads only (cfg.kv_sources)
    def attention(self, i: int, qkv: Tensor, attn: Tensor, T: int, mode: str, spec: Attention) -> Op: ...
    # layer i's recurrent states (a token mixer's: LlamaLayer.mixer), the step buffer, and None (one
    # sequence: slot 0, positions from the step) or the rows' (positions, state slots)
    def states(self, i: int, T: int) -> tuple[list[Tensor], object, tuple | None]: ...


class ForwardOps(list):
    """A forward's ops; the head's (final norm, LM head, soft-cap) are the last `n_head`."""

    n_head = 0

    def body(self) -> list:
        """The ops without the head (a prefill chunk before the last one)."""
        return self[:len(self) - self.n_head]


def forward(m, kv: KVAccess, T: int, mode: str, *, with_head: bool = True,
            plan: FusionPlan | None = None, lora=None) -> ForwardOps:
    """The ops of one forward of T rows of model `m` (a LlamaModel: weights and activations) through
    `kv` in row mode `mode` (DECODE: T = 1). `lora` (models/lora.py LoraRows): each row adds its
    adapter's delta after each projection (with the fusions that hide one off)."""
    c, dev = m.cfg, m.dev
    H, Hkv, C = c.n_heads, c.n_kv_heads, c.hidden_size
    x, h = m.x.view((T, C)), m.h.view((T, C))
    eps, flags = c.rms_eps, row_flags(kv, mode)
    if plan is None:
        plan = FusionPlan.choose(dev, c, m.layers, m.lm_head, mode == DECODE or "fused_rows" in flags,
                                 kv.fused_rope(0) is not None)
    if lora is not None:
        plan = lora.plan(plan)
    delta = lora.delta if lora is not None else (lambda *a: [])
    points = family_ops(c)
    part = m.part.view((T * C // 4,))        # sums of x^2 per 4 columns, per row (res_norm)
    rms = (part, eps)
    norms_after = [L.attn_norm for L in m.layers[1:]] + [m.final_norm]
    rows = Rows(kv, mode, flags)
    ops = ForwardOps([mm.embedding(dev, kv.ids.view((T,)), m.embed, x)])          # x (T, C)
    ops += _at(points, "embed", m, -1, x, T, rows)
    ops += _image_splice(m, kv, x, T, mode)  # image tokens' rows take their image's features
    ops += _at(points, "inputs", m, -1, x, T, rows)
    for i, L in enumerate(m.layers):
        D, F = c.head_dim_of(i), c.ffn_of(i)   # Gemma 4's layers differ in width
        qkv2 = m.qkv.view((T, (H + 2 * Hkv) * D))
        attn, gu, ffn = m.attn.view((T, H * D)), m.gate_up.view((T, 2 * F)), m.ffn.view((T, F))
        if L.mixer is not None:              # a token mixer other than attention: its projection's width
            qkv2, attn = m.qkv.view((T, L.qkv.n)), m.attn.view((T, L.o.k))
        # h = rms_norm(x); qkv = h · Wqkvᵀ (+ bias)                               (T, H+2Hkv, D)
        rope = kv.fused_rope(i) if plan.rope_kv[i] else None
        if not c.pre_norms:                  # OLMo-2: the projection reads x
            src, how = x, {}
        elif plan.res_norm and i > 0:        # h = x * g from the last residual matmul
            src, how = h, {"rms_from": rms}
        elif plan.norm_in_matmul:
            src, how = x, {"norm": (L.attn_norm, eps)}
        else:
            src, how = h, {}
            ops.append(_norm(m, x, L.attn_norm, L.attn_norm_bias, h))
        normed = c.pre_norms and (plan.norm_in_matmul or plan.res_norm and i > 0)
        add = lora.pre(i, "qkv", T, "norm" not in how) if lora is not None and rope is not None else None
        if isinstance(add, Tensor):          # the deltas first: the matmul adds them before its RoPE + KV write
            ops += _lora_delta(m, lora, i, "qkv", x, h, L.attn_norm, L.attn_norm_bias, add, T, normed, True)
        ops.append(mm.matmul(dev, src, L.qkv, qkv2, bias=L.qkv_bias, rope_kv=rope, add=add, **how, **flags))
        if L.attn_gate is not None:          # the attention's output gate g = h · Wgᵀ (Qwen3.5)     (T, H D)
            gate = m.attn_gate_out.view((T, H * D))
            ops.append(mm.matmul(dev, src, L.attn_gate, gate, **how, **flags))
        if lora is not None and add is None:  # the input as the matmul sees it (normed here where it norms x itself)
            ops += _lora_delta(m, lora, i, "qkv", x, h, L.attn_norm, L.attn_norm_bias, qkv2, T, normed)
        if L.mixer is not None:              # a token mixer other than attention (Qwen3.5's Gated DeltaNet)
            ops += L.mixer.ops(m, kv, i, qkv2, attn, T)
        else:
            ops += _attention(m, kv, i, T, mode, rope)
        if c.parallel_norms == 2:            # GPT-NeoX: h = the FFN's norm of the layer's input
            ops.append(_norm(m, x, L.ffn_norm, L.ffn_norm_bias, h))
        if L.post_attn_norm is not None:     # x += rms_norm(attn · Woᵀ)
            ops += [mm.matmul(dev, attn, L.o, h, bias=L.o_bias, **flags), *delta(i, "o", attn, h, T),
                    nn.rms_norm(dev, h, L.post_attn_norm, h, eps=eps), nn.add(dev, x, h, x)]
        else:
            res = _residual(m, lora, plan, L, i, "o", T)    # made by the matmul, or
            if res is None:
                ops += delta(i, "o", attn, x, T)   # into x first: the matmul's norm_out sees the sum
            ops.append(mm.matmul(dev, attn, L.o, x, bias=L.o_bias, accumulate=True, **flags, add=res,
                                 norm_out=mm.NormOut(L.ffn_norm, h, part) if plan.res_norm else None))
        if L.experts is not None:            # x += the chosen experts' FFNs of rms_norm(x)
            ops += _experts(m, L, x, h, T, mode, flags) + _at(points, "layer_end", m, i, x, T, rows)
            continue
        # h = rms_norm(x); gu = h · [Wgate | Wup]ᵀ, or act(gate) * up stored by the matmul; a dense
        # FFN's h · Wupᵀ + b
        out = ffn if plan.gate_out[i] or not c.ffn_gated else gu
        gate = {"silu_out": plan.gate_out[i], "gate_act": c.act, **flags} if c.ffn_gated else flags
        normed = c.pre_norms and not c.parallel_norms and (plan.res_norm or plan.norm_in_matmul)
        own_norm = c.pre_norms and not c.parallel_norms and not normed
        if own_norm:                         # h = norm(x) first: the deltas the matmul adds read it too
            ops.append(_norm(m, x, L.ffn_norm, L.ffn_norm_bias, h))
        norm_in = c.pre_norms and not c.parallel_norms and not plan.res_norm and plan.norm_in_matmul
        add = lora.pre(i, "gate_up", T, not norm_in) if lora is not None and plan.gate_out[i] else None
        if add is not None:                  # the deltas first: the matmul adds them before act(gate) * up
            if isinstance(add, Tensor):
                ops += _lora_delta(m, lora, i, "gate_up", x, h, L.ffn_norm, L.ffn_norm_bias, add, T, normed, True)
            gate = {**gate, "add": add}
        if c.parallel_norms:                 # h holds the norm of the layer's input (above)
            ops.append(mm.matmul(dev, h, L.gate_up, out, bias=L.up_bias, **gate))
        elif not c.pre_norms:
            ops.append(mm.matmul(dev, x, L.gate_up, out, **gate))
        elif plan.res_norm:
            ops.append(mm.matmul(dev, h, L.gate_up, out, rms_from=rms, **gate))
        elif plan.norm_in_matmul:
            ops.append(mm.matmul(dev, x, L.gate_up, out, norm=(L.ffn_norm, eps), **gate))
        else:                                # own_norm: h made above
            ops.append(mm.matmul(dev, h, L.gate_up, out, bias=L.up_bias, **gate))
        if lora is not None and add is None:
            ops += _lora_delta(m, lora, i, "gate_up", x, h, L.ffn_norm, L.ffn_norm_bias, out, T, normed)
        # x += (act(gate) * up) · Wdownᵀ (the next layer's norm stored beside when res_norm),
        # act(gate) * up computed by the down matmul itself (gate_in_down), by the gate_up
        # matmul (gate_out) or by its own kernel
        if plan.gate_in_down:
            ffn_in, fused = gu, {"silu": True, "gate_act": c.act, **flags}
        else:
            ffn_in, fused = ffn, flags
            if not c.ffn_gated:              # f = act(f) in place
                ops.append((nn.gelu_tanh if c.act == "gelu_tanh" else nn.gelu)(dev, ffn, ffn))
            elif not plan.gate_out[i]:
                ops.append(nn.silu_mul(dev, gu, ffn, pairs=L.gate_pairs, act=c.act))      # (T, F)
            if "ffn" in points:
                ops += points["ffn"](m, i, ffn, T)
        if L.post_ffn_norm is not None:      # x += rms_norm(ffn · Wdownᵀ)
            ops += [mm.matmul(dev, ffn_in, L.down, h, **fused), *delta(i, "down", ffn_in, h, T),
                    nn.rms_norm(dev, h, L.post_ffn_norm, h, eps=eps), nn.add(dev, x, h, x)]
        else:
            nxt = mm.NormOut(norms_after[i], h, part) if plan.res_norm else None
            res = _residual(m, lora, plan, L, i, "down", T)
            if res is None:
                ops += delta(i, "down", ffn_in, x, T)
            ops.append(mm.matmul(dev, ffn_in, L.down, x, bias=L.down_bias, accumulate=True, norm_out=nxt, add=res,
                                 **fused))
        ops += _at(points, "layer_end", m, i, x, T, rows)
    if with_head:
        n_body = len(ops)
        ops += _head(m, kv, T, mode, plan)
        ops.n_head = len(ops) - n_body
    return ops


def _at(points: dict, point: str, *args) -> list[Op]:
    """The family's ops at `point`, none where it has none there."""
    return points[point](*args) if point in points else []


def _attention(m, kv: KVAccess, i: int, T: int, mode: str, rope) -> list[Op]:
    """Layer i's attention from its q|k|v rows in m.qkv into m.attn: q / k norms, RoPE and the K / V
    write (unless the qkv matmul did them: `rope`), the attention, the output gate (Qwen3.5) and
    the family's ops at its points."""
    c, dev, eps, points = m.cfg, m.dev, m.cfg.rms_eps, family_ops(m.cfg)
    H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim_of(i)
    L = m.layers[i]
    qkv, qkv2 = m.qkv.view((T, H + 2 * Hkv, D)), m.qkv.view((T, (H + 2 * Hkv) * D))
    attn = m.attn.view((T, H * D))
    ops = []
    if L.qk_norm is not None and c.qk_norm_whole:   # q, k = rms_norm of each projection (before RoPE)
        ops.append(nn.proj_rms_norm(dev, qkv2, L.qk_norm, q_dim=c.q_dim, k_dim=c.kv_dim, eps=eps))
    elif L.qk_norm is not None:          # q, k = rms_norm per head (before RoPE)
        ops.append(nn.head_rms_norm(dev, qkv, L.qk_norm, n_q_heads=H, n_k_heads=Hkv, head_dim=D, eps=eps,
                                    n_v_heads=Hkv if c.v_norm else 0))
    if "qkv" in points:
        ops += points["qkv"](m, i, qkv, T)
    if "qkv_rows" in points:             # the same point, with where the rows' positions are: (step, None)
        _, step, rows = kv.states(i, T)  # for one sequence (pos0 + t), else (step, positions (T,) u32)
        ops += points["qkv_rows"](m, i, qkv, T, (step, rows[0] if rows is not None else None))
    rows = _images(kv, mode)
    if rows is not None:                 # M-RoPE: prompt rows rotated by their offsets first (image_rows.py)
        ops += rows.rotate(m, i, qkv, T)
    # rope(q, k); k, v -> caches; x += attention(q, caches) · Woᵀ
    if rope is None:
        base, factors = c.rope_of(i, m.rope_factors)
        rot = dict(rot_dim=c.rot_dim_of(i), base=base, neox=c.rope_neox, factors=factors,
                   mscale=c.rope_attn_factor)
        # a layer attending an earlier layer's cache rotates its q heads only and stores nothing
        ops.append(kv.rope_kv(i, qkv, T, rot) if c.kv_source(i) == i else kv.rope_q(i, qkv, T, rot))
    spec = Attention(H, Hkv, D, c.attn_scale or D ** -0.5, c.window_of(i), c.attn_softcap, L.sinks)
    ops += [kv.attention(i, qkv, attn, T, mode, spec), *_image_attention(m, kv, i, qkv, attn, T, mode, spec)]
    if "attn" in points:
        ops += points["attn"](m, i, attn, T)
    if L.attn_gate is not None:          # attn *= sigmoid(g)
        ops.append(deltanet.sigmoid_gate(dev, attn, m.attn_gate_out.view((T, H * D))))
    return ops


def _experts(m, L, x: Tensor, h: Tensor, T: int, mode: str, flags: dict) -> list[Op]:
    """A MoE layer's FFN (kernels/moe.py): h = rms_norm(x); the router's top-k experts of each row,
    chosen on the GPU; each row's k experts' gate|up (T k, 2F), act(gate) * up (T k, F) and x += the
    weighted sum of their down products. PREFILL groups the rows by expert first, so that each weight
    chunk is read once per 4 of an expert's rows (the same values: a row's are the same in any
    chunking, and with the experts' stacks in one buffer each, as decode computes them)."""
    c, dev, E, k, F = m.cfg, m.dev, m.cfg.n_experts, m.cfg.n_experts_used, m.cfg.ffn_size
    ids, wts = m.expert_ids.view((T, k)), m.expert_weights.view((T, k))
    logits, gu, ffn = m.router_logits.view((T, E)), m.gate_up.view((T * k, 2 * F)), m.ffn.view((T * k, F))
    ops = [_norm(m, x, L.ffn_norm, L.ffn_norm_bias, h),
           mm.matmul(dev, h, L.experts.router, logits, bias=L.experts.router_bias, **flags),
           moe.moe_route(dev, logits, ids, wts, n_sel=k, norm=c.moe_norm_topk)]
    groups, prods = None, None
    if mode == PREFILL:
        groups, prods = (m.expert_order.view((T * k,)), m.expert_start), m.expert_prods.view((T * k, c.hidden_size))
        ops.append(moe.moe_group(dev, ids, *groups, n_experts=E, n_sel=k))
    return ops + [moe.moe_matmul(dev, h, L.experts.gate_up, ids, gu, n_sel=k, groups=groups, bias=L.experts.gate_up_bias),
                  nn.silu_mul(dev, gu, ffn, act=c.act, alpha=c.act_alpha, limit=c.act_limit),
                  moe.moe_down(dev, ffn, L.experts.down, ids, wts, x, n_sel=k, groups=groups, prods=prods,
                               bias=L.experts.down_bias)]


def _residual(m, lora, plan: FusionPlan, L, i: int, group: str, T: int):
    """Layer i's o or down deltas made by its matmul (models/lora.py LoraRows.residual: a Delta, into
    x before the next norm's values) where that matmul stores the residual with the next RMSNorm's
    x * g and partial sums (res_norm), in a plain pre-norm layer of attention and a dense FFN; else
    None."""
    c = m.cfg
    if (lora is None or not plan.res_norm or not c.pre_norms or c.parallel_norms or c.norm == "layer"
            or L.mixer is not None or L.experts is not None):
        return None
    return lora.residual(i, group, T)


def _lora_delta(m, lora, i: int, group: str, x: Tensor, h: Tensor, w: Tensor, b: Tensor | None, y: Tensor,
                T: int, normed_in_matmul: bool, store: bool = False) -> list[Op]:
    """y += each row's LoRA delta of layer i's projection `group` of the layer's norm: h (x without
    pre norms), or where the matmul norms x itself (res_norm, norm_in_matmul) the norm of x, computed
    by the delta's kernels (a LayerNorm: here, into the pool's own rows); the matmul's fused norm
    stays as it is for every row. `store`: y = the deltas (LoraRows.pre)."""
    if not normed_in_matmul:
        return lora.delta(i, group, h if m.cfg.pre_norms or m.cfg.parallel_norms else x, y, T, store=store)
    if m.cfg.norm != "layer":
        return lora.delta(i, group, x, y, T, norm=(w, m.cfg.rms_eps), store=store)
    normed = lora.pool.h.view((T, m.cfg.hidden_size))
    return [_norm(m, x, w, b, normed), *lora.delta(i, group, normed, y, T, store=store)]


def _norm(m, x: Tensor, w: Tensor, b: Tensor | None, y: Tensor) -> Op:
    """y = rms_norm(x) * w, or LayerNorm(x) * w + b where the family's norms are LayerNorms."""
    if m.cfg.norm == "layer":
        return nn.layer_norm(m.dev, x, w, b, y, eps=m.cfg.rms_eps)
    return nn.rms_norm(m.dev, x, w, y, eps=m.cfg.rms_eps)


def _images(kv: KVAccess, mode: str):
    """The ImageRows (models/image_rows.py) of a vision-language model's PREFILL forward through a
    contiguous cache, else None (decode rows, the paged batch and text-only models take no images)."""
    return getattr(kv, "images", None) if mode == PREFILL else None


def _image_splice(m, kv: KVAccess, x: Tensor, T: int, mode: str) -> list[Op]:
    """x[t] = the image feature of row t where it holds an image token (Gemma 3: after the scale)."""
    rows = _images(kv, mode)
    return [rows.splice(m, x, T)] if rows is not None else []


def _image_attention(m, kv: KVAccess, i: int, qkv: Tensor, attn: Tensor, T: int, mode: str,
                     spec: Attention) -> list[Op]:
    """An image's rows attend every key of their image (both ways), over what the causal attention wrote."""
    rows = _images(kv, mode)
    return rows.attention(m, i, qkv, attn, T, spec) if rows is not None else []


def row_heads(m, kv: KVAccess, T: int, outs: list[Tensor]) -> list[Op]:
    """The LM head of each of T PREFILL rows into outs[r] (1, V), every row as a one-row prefill's
    head computes its last row (speculative decoding checks its guesses with these)."""
    plan = FusionPlan.choose(m.dev, m.cfg, m.layers, m.lm_head, False)
    return [op for r in range(T) for op in _head(m, kv, T, PREFILL, plan, row=r, out=outs[r])]


def _head(m, kv: KVAccess, T: int, mode: str, plan: FusionPlan, row: int | None = None,
          out: Tensor | None = None) -> list[Op]:
    """logits = rms_norm(x) · Wheadᵀ (+ b) (+ soft-cap): every row in ROWS mode, else the last row (or
    row `row`, into `out`)."""
    c, dev, eps, C, b = m.cfg, m.dev, m.cfg.rms_eps, m.cfg.hidden_size, m.lm_head_bias
    logits = out if out is not None else kv.logits_for(T if mode == ROWS else 1)
    r = T - 1 if row is None else row
    flags = row_flags(kv, mode) if mode == ROWS else {}
    if plan.res_norm:                        # h = x * g_final
        ops = [mm.matmul(dev, m.h.view((T, C)), m.lm_head, logits, bias=b,
                         rms_from=(m.part.view((T * C // 4,)), eps), **flags)]
    elif plan.head_norm_in_matmul:
        ops = [mm.matmul(dev, m.x.view((T, C)), m.lm_head, logits, bias=b, norm=(m.final_norm, eps), **flags)]
    elif mode == ROWS:
        h = m.h.view((T, C))
        ops = [_norm(m, m.x.view((T, C)), m.final_norm, m.final_norm_bias, h),
               mm.matmul(dev, h, m.lm_head, logits, bias=b, **flags)]
    else:                                    # the last row only: one row whatever T
        ops = [_norm(m, m.x.view((1, C), r * C), m.final_norm, m.final_norm_bias, m.last),
               mm.matmul(dev, m.last, m.lm_head, logits, bias=b, **kv.head_flags)]
    return ops + _at(family_ops(c), "logits", m, -1, logits, logits.shape[0])
