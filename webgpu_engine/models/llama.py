"""The Llama-family decoder (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3) on WebGPU: weights, KV
cache, prefill and decode.

    x = embed(ids) (* sqrt(C): Gemma)                          # (T, C)
    for each layer:
        h = rms_norm(x)                                        # (T, C)
        qkv = h · Wqkvᵀ (+ bias)                               # (T, Hq + 2 Hkv, D), Q|K|V fused
        q, k = rms_norm(q head), rms_norm(k head)              # Qwen3, Gemma 3
        rope(q, k); k, v -> cache rows pos0 .. pos0+T-1        # caches (Hkv, ctx, D)
        a = attention(q, cache) · Woᵀ                          # causal GQA (sliding window where the
                                                               # layer has one; Gemma 2: capped scores)
        x += a, or x += rms_norm(a) (Gemma)                    # residual fused in the matmul
        h = rms_norm(x)
        f = (act(h · Wgateᵀ) * (h · Wupᵀ)) · Wdownᵀ            # gate|up fused: (T, 2F); act silu or GELU-tanh
        x += f, or x += rms_norm(f) (Gemma)
    logits = rms_norm(x[T-1]) · Wheadᵀ                          # (1, V); head = embed when tied
    logits = cap * tanh(logits / cap)                          # Gemma 2

Weights go to the GPU as stored (GGUF blocks, HF float rows). Activations are allocated once for
`prefill_chunk` rows. The ops of a forward of T rows are built once per T and replayed; the decode
ops (T = 1) read their input id from `ids`, which the sampler fills on the GPU, so a decode step
writes only the 16-byte step buffer (pos0, n_new, kv_len, 0). Standard library only (runs in the page).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import ContextWindowTooLargeError, GPUOutOfMemoryError, UnsupportedModelError
from ..gpu import Device
from ..kernels import matmul as mm
from ..kernels import nn
from ..kernels.common import DTYPE_SIZE, Op, OpCache, Tensor, new_tensor, pipeline_keys
from ..loaders.model_config import LlamaConfig
from ..loaders.tensor_info import split_fused

# Above this, a model + cache is almost surely a mistake (e.g. a 128k context on a small GPU).
DEFAULT_MAX_TOTAL_BYTES = 12 << 30
_MAX_CACHED_SHAPES = 8


@dataclass
class LlamaLayer:
    """One decoder layer's weights on the GPU (C hidden, F ffn, D head dim, Hq / Hkv heads)."""

    attn_norm: Tensor                  # (C,) f32
    qkv: mm.QWeight                    # (Hq*D + 2*Hkv*D, C): q | k | v rows
    o: mm.QWeight                      # (C, Hq*D)
    ffn_norm: Tensor                   # (C,) f32
    gate_up: mm.QWeight                # (2F, C): gate | up, or their rows in pairs (gate_pairs)
    gate_pairs: bool                   # gate / up rows interleaved: a decode matmul can store act(g)*u
    down: mm.QWeight                   # (C, F)
    qkv_bias: Tensor | None = None     # (Hq*D + 2*Hkv*D,) f32: Qwen2
    o_bias: Tensor | None = None       # (C,) f32
    qk_norm: Tensor | None = None      # (2D,) f32: q_norm | k_norm, per head before RoPE (Qwen3)
    post_attn_norm: Tensor | None = None  # (C,) f32: Gemma's norms of the attention / FFN outputs
    post_ffn_norm: Tensor | None = None


@dataclass(frozen=True)
class FusionPlan:
    """Which fused kernels one forward uses, chosen once per op list from the device's matmul
    strategy (kernels/matmul/: fusable, epilogue_ok, default_config) and the layers' weights. Only
    a decode step (T = 1) fuses; prefill runs every position through the row-invariant kernels.
    The gate activation (cfg.act: SiLU or GELU-tanh) is a parameter of the fused paths
    (matmul gate_act); layers with post norms keep the residual add apart (no res_norm)."""

    norm_in_matmul: bool = False       # RMSNorm folded into the qkv / gate_up matmuls' input
    gate_in_down: bool = False         # act(gate) * up folded into the down matmul's input
    res_norm: bool = False             # o / down store x, x * g of the next norm and sums of x^2;
    #                                    the matmul after scales by 1 / rms (layer 0 keeps its norm)
    head_norm_in_matmul: bool = False  # the final norm folded into the LM head (without res_norm)
    rope_kv: tuple = ()                # per layer: the qkv matmul rotates q, k and writes the caches
    gate_out: tuple = ()               # per layer: the gate_up matmul stores act(gate) * up

    @classmethod
    def choose(cls, dev, cfg: LlamaConfig, layers: list[LlamaLayer], lm_head, decode: bool) -> "FusionPlan":
        n = len(layers)
        if not decode:
            return cls(rope_kv=(False,) * n, gate_out=(False,) * n)
        return cls(
            norm_in_matmul=all(mm.fusable(dev, 1, w) for L in layers for w in (L.qkv, L.gate_up)),
            gate_in_down=all(mm.fusable(dev, 1, L.down, silu=True) and not L.gate_pairs for L in layers),
            res_norm=cfg.hidden_size % 32 == 0 and not cfg.post_norms and mm.default_config(dev).res_norm and all(
                mm.epilogue_ok(dev, w.qtype, w.n, w.k) and len(w.bufs) == 1
                for L in layers for w in (L.o, L.down)),
            head_norm_in_matmul=mm.fusable(dev, 1, lm_head),
            # adjacent-pair rope only, and a head of whole vec4s; q/k norms come between the
            # matmul and RoPE, so those layers keep the separate rope_kv kernel
            rope_kv=tuple(not cfg.rope_neox and cfg.head_dim % 4 == 0 and L.qk_norm is None
                          and cfg.rope_attn_factor == 1.0 and not cfg.rope_local_base
                          and mm.epilogue_ok(dev, L.qkv.qtype, L.qkv.n, L.qkv.k) for L in layers),
            gate_out=tuple(L.gate_pairs for L in layers))


def _floats(t) -> list:
    """The values of a small f32 / f16 / bf16 vector (norm weights)."""
    raw = bytes(t.data)
    if t.qtype == "f32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if t.qtype == "f16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    if t.qtype == "bf16":
        return list(struct.unpack(f"<{len(raw) // 2}f",
                                  b"".join(b"\0\0" + raw[i:i + 2] for i in range(0, len(raw), 2))))
    raise UnsupportedModelError(f"norm weight {t.name} in {t.qtype}: f32, f16 or bf16 expected")


class LlamaModel:
    """One loaded decoder: weights, KV cache and activations, all owned by `owner`."""

    def __init__(self, dev: Device, cfg: LlamaConfig, weights: dict, *, owner: str,
                 context_window: int = 4096, prefill_chunk: int = 256, dtype: str = "f32",
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES, progress=None):
        self.dev, self.cfg, self.owner, self.dtype = dev, cfg, owner, dtype
        limit = cfg.context_length if cfg.context_length > 0 else context_window
        self.ctx = min(context_window, limit) if context_window > 0 else limit
        self.chunk = max(1, min(prefill_chunk, self.ctx))
        self.rope_factors = cfg.rope_factors_for(self.ctx)
        weights = split_fused(weights, cfg.q_dim, cfg.kv_dim, cfg.ffn_size)
        self._check_memory(weights, max_total_bytes)
        try:
            self._upload(weights, progress)
            self._allocate()
        except BaseException:
            dev.release_owner(owner)
            raise
        self._ops = OpCache(_MAX_CACHED_SHAPES)      # (T, with_head) -> list[Op]
        # decode steps record an op's short form when the live keys allow (nn.attention's
        # one-dispatch attention); a switch for A/B benchmarks
        self.short_attention = True
        self.decode_ops = self._build(1, True, decode=True)   # built once, replayed every step

    # ------------------------------------------------------------------ memory plan
    def memory_plan(self, weights: dict) -> dict:
        """Bytes the model will hold on the GPU: weights, KV cache, activations (+ largest tensor)."""
        c, esz, P = self.cfg, DTYPE_SIZE[self.dtype], self.chunk
        w = sum(int(t.nbytes * 1.07) for t in weights.values())       # + repack padding of Q8_0/Q6_K
        kv_layer = c.n_kv_heads * self.ctx * c.head_dim * esz
        act = esz * P * (3 * c.hidden_size + c.qkv_dim + c.q_dim + 3 * c.ffn_size) + 4 * c.vocab_size * 5
        return {"weights": w, "kv_cache": 2 * c.n_layers * kv_layer, "kv_per_layer": kv_layer,
                "activations": act, "total": w + 2 * c.n_layers * kv_layer + act}

    def _check_memory(self, weights: dict, max_total: int) -> None:
        plan = self.memory_plan(weights)
        self.plan = plan
        lim = min(self.dev.max_buffer_size, self.dev.max_storage_binding)
        if plan["kv_per_layer"] > lim:
            raise ContextWindowTooLargeError(
                f"A KV cache of {self.ctx} tokens needs {plan['kv_per_layer']} bytes per layer and "
                f"tensor, more than this device's limit of {lim} bytes per buffer. Use a smaller "
                f"context_window_size.", param="context_window_size")
        if plan["total"] > max_total:
            raise GPUOutOfMemoryError(
                f"The model needs about {plan['total']} bytes on the GPU (weights {plan['weights']}, "
                f"KV cache {plan['kv_cache']} for {self.ctx} tokens, activations {plan['activations']}), "
                f"more than the {max_total} bytes allowed. Use a smaller context_window_size or model.")

    # ------------------------------------------------------------------ weights
    def _upload(self, weights: dict, progress) -> None:
        c, dev, own = self.cfg, self.dev, self.owner

        def get(name):
            t = weights.get(name)
            if t is None:
                raise UnsupportedModelError(f"model weights lack tensor {name!r}")
            return t

        def mat(names, label):
            parts = [get(n) for n in names]
            # K-quant mixes store some parts wider (Q4_K_M: attn_v in Q6_K beside Q4_K q and k):
            # those fused matrices upload as one weight of several types
            qt = [p.qtype for p in parts]
            return mm.upload_weight(dev, [p.data for p in parts], qt[0] if len(set(qt)) == 1 else qt,
                                    sum(p.n for p in parts), parts[0].k, owner=own, label=label)

        def gate_up(p):
            # rows interleaved in pairs when the decode matmul can store act(gate) * up itself
            g, u = get(p + "gate"), get(p + "up")
            if g.qtype == u.qtype and g.n == u.n and g.n % 2 == 0 and \
                    mm.epilogue_ok(dev, g.qtype, 2 * g.n, g.k):
                data = mm.interleave_pairs(g.data, u.data, g.qtype, g.k)
                return mm.upload_weight(dev, data, g.qtype, 2 * g.n, g.k, owner=own, label=p + "gate_up"), True
            return mat([p + "gate", p + "up"], p + "gate_up"), False

        def vec(names, label):
            parts = [get(n) for n in names]
            data = b"".join(bytes(p.data) for p in parts) if len(parts) > 1 else parts[0].data
            return mm.upload_vector(dev, data, dtype=parts[0].qtype, owner=own, label=label)

        def norm(names, label):
            if not c.norm_plus_one:
                return vec(names, label)
            # HF Gemma keeps w and computes x * (1 + w): add the 1 once here (a few KB), so every
            # norm kernel and fused path stays plain; GGUF Gemma files store 1 + w already
            vals = [v + 1.0 for n in names for v in _floats(get(n))]
            return mm.upload_vector(dev, struct.pack(f"<{len(vals)}f", *vals), owner=own, label=label)

        self.embed = mat(["embed"], "embed")                                      # (V, C)
        self.lm_head = self.embed if c.tie_embeddings or "lm_head" not in weights \
            else mat(["lm_head"], "lm_head")                                     # (V, C)
        self.final_norm = norm(["norm"], "norm")                                  # (C,)
        self.layers: list[LlamaLayer] = []
        for i in range(c.n_layers):
            p = f"layers.{i}."
            gu, pairs = gate_up(p)
            self.layers.append(LlamaLayer(
                attn_norm=norm([p + "attn_norm"], p + "attn_norm"),
                qkv=mat([p + "q", p + "k", p + "v"], p + "qkv"),
                o=mat([p + "o"], p + "o"),
                ffn_norm=norm([p + "ffn_norm"], p + "ffn_norm"),
                gate_up=gu, gate_pairs=pairs,
                down=mat([p + "down"], p + "down"),
                qkv_bias=vec([p + "q_bias", p + "k_bias", p + "v_bias"], p + "qkv_bias")
                if p + "q_bias" in weights else None,
                o_bias=vec([p + "o_bias"], p + "o_bias") if p + "o_bias" in weights else None,
                qk_norm=norm([p + "q_norm", p + "k_norm"], p + "qk_norm") if c.qk_norm else None,
                post_attn_norm=norm([p + "post_attn_norm"], p + "post_attn_norm") if c.post_norms else None,
                post_ffn_norm=norm([p + "post_ffn_norm"], p + "post_ffn_norm") if c.post_norms else None))
            if progress:
                progress((i + 1) / c.n_layers, f"uploaded layer {i + 1}/{c.n_layers}")

    # ------------------------------------------------------------------ activations and cache
    def _allocate(self) -> None:
        c, dev, own, dt, P = self.cfg, self.dev, self.owner, self.dtype, self.chunk
        self.step = dev.buffer(16, owner=own, label="step")                 # u32 (pos0, n_new, kv_len, 0)
        self.rope_freq = nn.rope_frequencies(dev, c.rot_dim, c.rope_base, owner=own,
                                             factors=self.rope_factors)
        self.ids = new_tensor(dev, (P,), "u32", owner=own, label="ids")      # (P,)
        self.x = new_tensor(dev, (P, c.hidden_size), dt, owner=own, label="x")            # residual
        self.h = new_tensor(dev, (P, c.hidden_size), dt, owner=own, label="h")            # normed
        self.qkv = new_tensor(dev, (P, c.qkv_dim), dt, owner=own, label="qkv")
        self.attn = new_tensor(dev, (P, c.q_dim), dt, owner=own, label="attn")
        self.gate_up = new_tensor(dev, (P, 2 * c.ffn_size), dt, owner=own, label="gate_up")
        self.ffn = new_tensor(dev, (P, c.ffn_size), dt, owner=own, label="ffn")
        self.last = new_tensor(dev, (1, c.hidden_size), dt, owner=own, label="last")      # normed last row
        # decode: sums of x^2 per 4 rows, from the residual matmuls' epilogue (see _build)
        self.part = new_tensor(dev, (c.hidden_size // 4,), "f32", owner=own, label="norm_partials")
        self.logits = new_tensor(dev, (1, c.vocab_size), dt, owner=own, label="logits")
        shape = (c.n_kv_heads, self.ctx, c.head_dim)
        self.k_cache = [new_tensor(dev, shape, dt, owner=own, label=f"k_cache.{i}") for i in range(c.n_layers)]
        self.v_cache = [new_tensor(dev, shape, dt, owner=own, label=f"v_cache.{i}") for i in range(c.n_layers)]

    # ------------------------------------------------------------------ the forward pass as ops
    def _build(self, T: int, with_head: bool, decode: bool = False) -> list[Op]:
        """The forward of T rows. Prefill (`decode` False) computes every row with kernels whose
        per-row sums do not depend on T (row-invariant matmuls, the causal attention kernel even
        for one row), so a position's logits are the same however the prompt was chunked or how
        much of it was cached. Decode (T = 1) takes the fused, split-key kernels."""
        c, dev, step = self.cfg, self.dev, self.step
        H, Hkv, D, C = c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_size
        x, h = self.x.view((T, C)), self.h.view((T, C))
        qkv = self.qkv.view((T, H + 2 * Hkv, D))
        qkv2 = self.qkv.view((T, c.qkv_dim))
        attn, gu, ffn = self.attn.view((T, H * D)), self.gate_up.view((T, 2 * c.ffn_size)), \
            self.ffn.view((T, c.ffn_size))
        rope_kw = dict(rot_dim=c.rot_dim, base=c.rope_base, neox=c.rope_neox, factors=self.rope_factors,
                       mscale=c.rope_attn_factor)
        eps, ri = c.rms_eps, not decode         # prefill: row-invariant matmuls
        plan = FusionPlan.choose(dev, c, self.layers, self.lm_head, decode)
        if decode:
            self.decode_plan = plan
        rms = (self.part, eps)
        norms_after = [L.attn_norm for L in self.layers[1:]] + [self.final_norm]
        ops = [mm.embedding(dev, self.ids.view((T,)), self.embed, x)]              # x (T, C)
        if c.embed_scale != 1.0:                                                   # Gemma: x *= sqrt(C)
            ops.append(nn.scale(dev, x, x, c.embed_scale))
        for i, L in enumerate(self.layers):
            kc, vc = self.k_cache[i], self.v_cache[i]
            # h = rms_norm(x); qkv = h · Wqkvᵀ (+ bias)                             (T, H+2Hkv, D)
            rope = mm.RopeKV(step, self.rope_freq, kc, vc, H, Hkv, D, c.rot_dim, self.ctx) \
                if plan.rope_kv[i] else None
            if plan.res_norm and i > 0:          # h = x * g from the last residual matmul
                ops.append(mm.matmul(dev, h, L.qkv, qkv2, bias=L.qkv_bias, rms_from=rms, rope_kv=rope))
            elif plan.norm_in_matmul:
                ops.append(mm.matmul(dev, x, L.qkv, qkv2, bias=L.qkv_bias, norm=(L.attn_norm, eps),
                                     rope_kv=rope))
            else:
                ops.append(nn.rms_norm(dev, x, L.attn_norm, h, eps=eps))
                ops.append(mm.matmul(dev, h, L.qkv, qkv2, bias=L.qkv_bias, rope_kv=rope, row_invariant=ri))
            if L.qk_norm is not None:            # q, k = rms_norm per head (before RoPE)
                ops.append(nn.head_rms_norm(dev, qkv, L.qk_norm, n_q_heads=H, n_k_heads=Hkv, head_dim=D,
                                            eps=eps))
            # rope(q, k); k, v -> caches; x += attention(q, caches) · Woᵀ
            if rope is None:
                base, factors = c.rope_of(i, self.rope_factors)
                ops.append(nn.rope_kv(dev, qkv, kc, vc, step, n_q_heads=H, n_kv_heads=Hkv, head_dim=D,
                                      ctx=self.ctx, **{**rope_kw, "base": base, "factors": factors}))
            ops.append(nn.attention(dev, qkv, kc, vc, attn, step, n_q_heads=H, n_kv_heads=Hkv,
                                    head_dim=D, ctx=self.ctx, scale=c.attn_scale or D ** -0.5, max_t=T,
                                    causal=ri, window=c.window_of(i), softcap=c.attn_softcap))
            if L.post_attn_norm is not None:     # x += rms_norm(attn · Woᵀ)
                ops += [mm.matmul(dev, attn, L.o, h, bias=L.o_bias, row_invariant=ri),
                        nn.rms_norm(dev, h, L.post_attn_norm, h, eps=eps), nn.add(dev, x, h, x)]
            else:
                ops.append(mm.matmul(dev, attn, L.o, x, bias=L.o_bias, accumulate=True, row_invariant=ri,
                                     norm_out=mm.NormOut(L.ffn_norm, h, self.part) if plan.res_norm else None))
            # h = rms_norm(x); gu = h · [Wgate | Wup]ᵀ, or act(gate) * up stored by the matmul
            out = ffn if plan.gate_out[i] else gu
            gate = {"silu_out": plan.gate_out[i], "gate_act": c.act}
            if plan.res_norm:
                ops.append(mm.matmul(dev, h, L.gate_up, out, rms_from=rms, **gate))
            elif plan.norm_in_matmul:
                ops.append(mm.matmul(dev, x, L.gate_up, out, norm=(L.ffn_norm, eps), **gate))
            else:
                ops.append(nn.rms_norm(dev, x, L.ffn_norm, h, eps=eps))
                ops.append(mm.matmul(dev, h, L.gate_up, out, row_invariant=ri, **gate))
            # x += (act(gate) * up) · Wdownᵀ (the next layer's norm stored beside when res_norm),
            # act(gate) * up computed by the down matmul itself (gate_in_down), by the gate_up
            # matmul (gate_out) or by its own kernel
            if plan.gate_in_down:
                ffn_in, fused = gu, {"silu": True, "gate_act": c.act}
            else:
                ffn_in, fused = ffn, {"row_invariant": ri}
                if not plan.gate_out[i]:
                    ops.append(nn.silu_mul(dev, gu, ffn, pairs=L.gate_pairs, act=c.act))   # (T, F)
            if L.post_ffn_norm is not None:      # x += rms_norm(ffn · Wdownᵀ)
                ops += [mm.matmul(dev, ffn_in, L.down, h, **fused),
                        nn.rms_norm(dev, h, L.post_ffn_norm, h, eps=eps), nn.add(dev, x, h, x)]
            else:
                nxt = mm.NormOut(norms_after[i], h, self.part) if plan.res_norm else None
                ops.append(mm.matmul(dev, ffn_in, L.down, x, accumulate=True, norm_out=nxt, **fused))
        if with_head:                            # logits = rms_norm(x[T-1]) · Wheadᵀ      (1, V)
            if plan.res_norm:                    # h = x * g_final
                ops.append(mm.matmul(dev, h, self.lm_head, self.logits, rms_from=rms))
            elif plan.head_norm_in_matmul:
                ops.append(mm.matmul(dev, x, self.lm_head, self.logits, norm=(self.final_norm, eps)))
            else:
                ops.append(nn.rms_norm(dev, self.x.view((1, C), (T - 1) * C), self.final_norm, self.last,
                                       eps=eps))                                   # last row only
                # one row whatever T: the same kernel for every prefill
                ops.append(mm.matmul(dev, self.last, self.lm_head, self.logits))
            if c.final_softcap:                  # Gemma 2
                ops.append(nn.softcap(dev, self.logits, self.logits, c.final_softcap))
        return ops

    def ops_for(self, T: int, with_head: bool = True) -> list[Op]:
        """The prefill ops for T rows (1 <= T <= prefill chunk), built once per (T, with_head)."""
        return self._ops.get((T, with_head), lambda: self._build(T, with_head))

    def warm_heights(self) -> list[int]:
        """Row counts whose prefill ops load-time warm-up runs: one row, a full chunk and each tile
        height the few-row matmuls use (any other T uses the same kernels as one of these)."""
        return sorted({1, self.chunk} | {t for t in (2, 4, 8, 16) if t <= self.chunk})

    def compile(self, batch, warmed=frozenset()) -> set:
        """Build every op list a request uses and record one run of each pipeline into `batch`, so
        that nothing compiles on the first prompt: pipelines are created here, and drivers that
        compile on first dispatch (lavapipe's llvmpipe) do so when the batch runs. The prefill ops
        of a full chunk, of one row and of each tile height the few-row matmuls use (2, 4, 8, 16:
        kernels/matmul_batch.py; any other T uses the same kernels as one of these) and the decode
        ops in both forms of the attention. The runs write KV rows from 0, which the first prompt
        overwrites. Nothing is recorded when every pipeline is in `warmed` (already run on this
        device). Returns the pipeline keys."""
        heights = self.warm_heights()
        for T in heights:
            self.ops_for(T, True)
        keys = pipeline_keys([op for ops in self._ops.values() for op in ops] + self.decode_ops)
        if keys <= warmed:
            return keys
        seen: set = set()
        for T in heights:               # a run per height whose ops bring pipelines not yet run
            ks = pipeline_keys(self.ops_for(T, True))
            if not ks <= seen:
                self.record_prefill(batch, [0] * T, 0)
                seen |= ks
        self.set_step(0, 1)
        self._record(batch, self.decode_ops, 1)             # the short attention form
        self._record(batch, self.decode_ops, None)          # the split-key form
        return keys

    def set_step(self, pos0: int, n_new: int) -> None:
        self.dev.write(self.step, struct.pack("<4I", pos0, n_new, pos0 + n_new, 0))

    def record_prefill(self, batch, ids: list[int], pos0: int, with_head: bool = True) -> None:
        """Write ids (T <= chunk) and the step, record the forward of those rows into `batch`."""
        T = len(ids)
        if not 0 < T <= self.chunk:
            raise ValueError(f"prefill of {T} tokens: chunks must have 1..{self.chunk} tokens")
        if pos0 + T > self.ctx:
            raise ContextWindowTooLargeError(f"positions up to {pos0 + T} exceed the context window {self.ctx}")
        self.dev.write(self.ids.buf, struct.pack(f"<{T}I", *ids))
        self.set_step(pos0, T)
        self._record(batch, self.ops_for(T, with_head), None)

    def record_decode(self, batch, pos0: int) -> None:
        """Record one decode step at position pos0; its input id is already in `ids[0]`."""
        if pos0 + 1 > self.ctx:
            raise ContextWindowTooLargeError(f"position {pos0} is outside the context window {self.ctx}")
        self.set_step(pos0, 1)
        self._record(batch, self.decode_ops, pos0 + 1)

    def _record(self, batch, ops: list[Op], n_keys: int | None) -> None:
        """Record ops into batch; a T = 1 step (n_keys: its live KV length) may take ops' short forms."""
        for op in ops:
            op.record(batch, n_keys=n_keys if self.short_attention else None)

    def rebuild_decode_ops(self) -> None:
        """Build the decode step's ops again (the kernel choices changed after the constructor built
        them: a profile stored by tuning at load)."""
        for op in self.decode_ops:
            op.release()
        self.decode_ops = self._build(1, True, decode=True)

    def release(self) -> None:
        self.dev.release_owner(self.owner)
        self._ops.release()
        self.decode_ops = []
