"""The Llama-family decoder (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, ...) on WebGPU: weights and
activations. A loaded chat model's forwards run over the batch scheduler's paged KV pool
(models/paged.py PagedForward, pipelines/scheduler.py): the model allocates no cache of its own.

A model built by hand runs through the same paged forward with a pool of one sequence
(models/paged_sequence.py: the golden tests' drivers). Only the decoder embedder
(models/decoder_embedder.py) builds one without a pool: it keeps a contiguous cache of one sequence
and runs prefill forwards over it (ContiguousKV; no decode step): per layer a K and a V tensor
(Hkv, ctx, D) whose row p is position p, positions pos0 .. pos0+T-1 from the 16-byte step uniform
(pos0, n_new, kv_len, 0).

The layer recipe is models/decoder.py's. Weights go to the GPU as stored (GGUF blocks, HF float rows).
Activations are allocated once for `prefill_chunk` rows. Standard library only (runs in the page).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import ContextWindowTooLargeError, GPUOutOfMemoryError, UnsupportedModelError
from ..gpu import Device
from ..kernels import matmul as mm
from ..kernels import nn
from ..kernels.common import Op, OpCache, Tensor, new_tensor
from ..loaders.decoder_config import FAMILIES
from ..loaders.model_config import LlamaConfig
from ..loaders.tensor_info import split_fused
from . import decoder
from .memory import estimate_llm
from .plan import DecoderPlan, cache_rows
from .experts import Experts, upload_experts
from .decoder import FusionPlan  # noqa: F401  (re-exported: the plan's home was this module)

# Above this, a model + cache is almost surely a mistake (e.g. a 128k context on a small GPU).
DEFAULT_MAX_TOTAL_BYTES = 12 << 30
_MAX_CACHED_SHAPES = 8


@dataclass
class LlamaLayer:
    """One decoder layer's weights on the GPU (C hidden, F ffn, D head dim, Hq / Hkv heads)."""

    attn_norm: Tensor | None           # (C,) f32 (None: no pre norms, OLMo-2)
    qkv: mm.QWeight                    # (Hq*D + 2*Hkv*D, C): q | k | v rows
    o: mm.QWeight                      # (C, Hq*D)
    ffn_norm: Tensor | None            # (C,) f32
    gate_up: mm.QWeight | None         # (2F, C): gate | up, or their rows in pairs (gate_pairs); (F, C): up
    #                                    alone in a dense FFN (cfg.ffn_gated False); None in a MoE layer
    gate_pairs: bool                   # gate / up rows interleaved: a decode matmul can store act(g)*u
    down: mm.QWeight | None            # (C, F); None in a MoE layer
    qkv_bias: Tensor | None = None     # (Hq*D + 2*Hkv*D,) f32: Qwen2
    o_bias: Tensor | None = None       # (C,) f32
    qk_norm: Tensor | None = None      # (2D,) f32: q_norm | k_norm, per head before RoPE (Qwen3);
    #                                    (Hq D + Hkv D,) over the whole projections (OLMo-2)
    post_attn_norm: Tensor | None = None  # (C,) f32: Gemma's norms of the attention / FFN outputs
    post_ffn_norm: Tensor | None = None
    attn_norm_bias: Tensor | None = None  # (C,) f32: LayerNorm's biases (cfg.norm "layer": StableLM)
    ffn_norm_bias: Tensor | None = None
    up_bias: Tensor | None = None      # (F,) f32: a dense FFN's biases (Phi)
    down_bias: Tensor | None = None    # (C,) f32
    ple_gate: mm.QWeight | None = None  # (P, C): per-layer inputs (cfg.ple_dim, Gemma 4): the gate of x
    ple_proj: mm.QWeight | None = None  # (C, P): its projection back
    ple_norm: Tensor | None = None     # (C,) f32: the projection's norm
    scale: float = 1.0                 # x *= scale at the layer's end (Gemma 4's layer_scalar)
    experts: Experts | None = None     # a MoE layer's router and stacked experts (cfg.n_experts)
    attn_gate: mm.QWeight | None = None  # (Hq*D, C): the attention's output gate, attn *= sigmoid(h · Wgᵀ)
    #                                    (Qwen3.5; `layers.i.attn_gate`)
    mixer: object = None               # a token mixer other than attention (its family's: Qwen3.5's
    #                                    Gated DeltaNet): ops(m, kv, i, proj, out, T), state_shapes(slots),
    #                                    scratch; qkv is then its input projection, o its output's
    sinks: Tensor | None = None        # (Hq,) f32: each head's sink logit (cfg.attn_sinks: gpt-oss)


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


class ContiguousKV:
    """decoder.KVAccess of one sequence's contiguous cache for PREFILL forwards (the decoder
    embedder's): rows 0 .. ctx-1 of each layer's K and V tensors, positions from the model's step
    uniform."""

    head_flags: dict = {}              # the prefill head's one-row matmul: the decode kernel
    fused_rows = False                 # one sequence: no ROWS mode

    def __init__(self, m: "LlamaModel"):
        self.m, self.ids = m, m.ids

    @property
    def images(self):
        """The model's ImageRows (a vision-language model's image features and rows), else None."""
        return self.m.images

    def logits_for(self, rows: int) -> Tensor:
        return self.m.logits

    def fused_rope(self, i: int):
        return None                    # prefill: RoPE and the KV write by rope_kv

    def rope_kv(self, i: int, qkv: Tensor, T: int, rope: dict):
        m, c = self.m, self.m.cfg
        return nn.rope_kv(m.dev, qkv, m.k_cache[i], m.v_cache[i], m.step, n_q_heads=c.n_heads,
                          n_kv_heads=c.n_kv_heads, head_dim=c.head_dim_of(i), ctx=m.ctx, **rope)

    def rope_q(self, i: int, qkv: Tensor, T: int, rope: dict):
        m, c = self.m, self.m.cfg
        return nn.rope(m.dev, qkv, m.step, n_heads=c.n_heads, head_dim=c.head_dim_of(i), **rope)

    def attention(self, i: int, qkv: Tensor, attn: Tensor, T: int, mode: str, spec: decoder.Attention):
        m = self.m
        return nn.attention(m.dev, qkv, m.k_cache[i], m.v_cache[i], attn, m.step, **spec.heads(), ctx=m.ctx,
                            scale=spec.scale, max_t=T, causal=True, **spec.masking())

    def states(self, i: int, T: int):
        return self.m.mixer_states[i], self.m.step, None


class LlamaModel:
    """One loaded decoder: weights and activations, all owned by `owner` (its KV cache is the paged
    forward's pool; only a model without a pool, the decoder embedder's, has a contiguous cache of its
    own, for prefill forwards: record_prefill)."""

    def __init__(self, dev: Device, cfg: LlamaConfig, weights: dict, *, owner: str,
                 context_window: int = 4096, prefill_chunk: int = 256, dtype: str = "f32",
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES, progress=None, plan: DecoderPlan | None = None):
        """`plan`: the load's models/plan.py DecoderPlan (its context, prefill chunk, dtypes, ring and
        paged pool); without it (the decoder embedder) one made of context_window, prefill_chunk and
        dtype, for the prefill forwards of one sequence in a contiguous cache."""
        if plan is None:
            plan = DecoderPlan(dtype, *cache_rows(cfg, context_window, prefill_chunk), 1)
        self.plan = plan
        self.dev, self.cfg, self.owner, self.dtype = dev, cfg, owner, plan.dtype
        self.kv_cache_dtype = plan.kv_cache_dtype          # "q8_0", "q4_0" or "" (= dtype)
        # a sliding window with sinks (kernels/common.py Ring): the cache holds the window and the rows
        # of one forward, past its end a ring; positions are not bounded by it
        self.ring = plan.ring
        self.ctx, self.chunk = plan.context, plan.prefill_chunk
        self.rope_factors = cfg.rope_factors_for(self.ctx)
        weights = split_fused(weights, cfg.q_dim, cfg.kv_dim, cfg.ffn_size, cfg.head_dim)
        self._check_memory(weights, max_total_bytes)
        try:
            self._upload(weights, progress)
            self._allocate()
        except BaseException:
            dev.release_owner(owner)
            raise
        self._ops = OpCache(_MAX_CACHED_SHAPES)      # (T, with_head) -> list[Op] (contiguous cache)
        self._decode_plan = None
        if plan.contiguous and dev.deferring:
            # pipelines queue on the background compiler in the order built: the decoder embedder's
            # forward of a full chunk (tiled as most inputs are, being over 8 rows; no LM head)
            self.ops_for(self.chunk, False)

    # ------------------------------------------------------------------ memory
    def _check_memory(self, weights: dict, max_total: int) -> None:
        """Refuse, before any allocation, a cache buffer over the device's per-buffer limit or a model
        over `max_total` bytes (the estimate the engine's pre-load check uses: models/memory.py)."""
        lim = min(self.dev.max_buffer_size, self.dev.max_storage_binding)
        plan = self.plan          # with a pool: the scheduler's too (made right after the model)
        est, kv_layer = estimate_llm(self.cfg, weights, plan, max_binding=lim), plan.kv_layer_bytes(self.cfg)
        if kv_layer > lim:
            raise ContextWindowTooLargeError(
                f"A KV cache of {self.ctx} tokens needs {kv_layer} bytes per layer and "
                f"tensor, more than this device's limit of {lim} bytes per buffer. Use a smaller "
                f"context_window_size.", param="context_window_size")
        if est.total > max_total:
            raise GPUOutOfMemoryError(
                f"The model needs about {est.total} bytes on the GPU (weights {est.weights}, "
                f"KV cache {est.kv_cache} for {self.ctx} tokens, activations {est.activations}), "
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
            if not c.ffn_gated:                           # a dense FFN: up alone
                return mat([p + "up"], p + "up"), False
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
        layer_norm = c.norm == "layer"                    # LayerNorms have biases
        self.final_norm_bias = vec(["norm_bias"], "norm_bias") if layer_norm else None

        def bias(name):                                   # an optional bias vector
            return vec([name], name) if name in weights else None
        self.lm_head_bias = bias("lm_head_bias")                                  # (V,): Phi
        if c.ple_dim:                                     # per-layer inputs (decoder.py)
            self.ple_embed = mat(["ple_embed"], "ple_embed")                      # (V, L P)
            self.ple_model_proj = mat(["ple_model_proj"], "ple_model_proj")       # (L P, C)
            self.ple_norm = norm(["ple_norm"], "ple_norm")                        # (P,)

        def qk_norm(p, kvp):                              # q_norm | k_norm (| ones: each v head's norm)
            t = norm([p + "q_norm", kvp + "k_norm"], p + "qk_norm")
            if not c.v_norm:
                return t
            D = t.numel // 2
            vals = _floats(get(p + "q_norm")) + _floats(get(kvp + "k_norm")) + [1.0] * D
            return mm.upload_vector(dev, struct.pack(f"<{3 * D}f", *vals), owner=own, label=p + "qkv_norm")

        def per_layer(p):                                 # Gemma 4: the layer's per-layer input and scalar
            out = {"scale": _floats(weights[p + "scalar"])[0]} if p + "scalar" in weights else {}
            if c.ple_dim:
                out.update(ple_gate=mat([p + "ple_gate"], p + "ple_gate"), ple_proj=mat([p + "ple_proj"], p + "ple_proj"),
                           ple_norm=norm([p + "ple_norm"], p + "ple_norm"))
            return out
        ffn_norm = c.pre_norms and c.parallel_norms != 1  # Phi's FFN shares the attention's norm
        fam = FAMILIES.get(c.arch)
        mixer_of = fam.mixer if fam is not None else None   # (in-projection, mixer) of a layer, or None
        self.layers: list[LlamaLayer] = []
        for i in range(c.n_layers):
            p = f"layers.{i}."
            # a layer attending an earlier layer's cache has no k / v of its own: its source's k / v
            # rows keep the q|k|v layout (computed, never stored)
            kvp = f"layers.{c.kv_source(i)}."
            moe = upload_experts(dev, weights, i, c.n_experts, own, mat([p + "router"], p + "router")) \
                if c.n_experts else None
            gu, pairs = gate_up(p) if moe is None else (None, False)
            mix = mixer_of(self, i, weights, mat) if mixer_of is not None else None
            self.layers.append(LlamaLayer(
                attn_norm=norm([p + "attn_norm"], p + "attn_norm") if c.pre_norms else None,
                qkv=mix[0] if mix else mat([p + "q", kvp + "k", kvp + "v"], p + "qkv"),
                mixer=mix[1] if mix else None,
                attn_gate=mat([p + "attn_gate"], p + "attn_gate") if p + "attn_gate" in weights else None,
                o=mat([p + "o"], p + "o"),
                ffn_norm=norm([p + "ffn_norm"], p + "ffn_norm") if ffn_norm else None,
                gate_up=gu, gate_pairs=pairs,
                down=mat([p + "down"], p + "down") if moe is None else None, experts=moe,
                qkv_bias=vec([p + "q_bias", p + "k_bias", p + "v_bias"], p + "qkv_bias")
                if p + "q_bias" in weights else None,
                o_bias=bias(p + "o_bias"), up_bias=bias(p + "up_bias"), down_bias=bias(p + "down_bias"),
                qk_norm=qk_norm(p, kvp) if c.qk_norm and not mix else None,
                post_attn_norm=norm([p + "post_attn_norm"], p + "post_attn_norm") if c.post_norms else None,
                post_ffn_norm=norm([p + "post_ffn_norm"], p + "post_ffn_norm") if c.post_norms else None,
                attn_norm_bias=vec([p + "attn_norm_bias"], p + "attn_norm_bias") if layer_norm else None,
                ffn_norm_bias=vec([p + "ffn_norm_bias"], p + "ffn_norm_bias") if layer_norm and ffn_norm else None,
                sinks=vec([p + "sinks"], p + "sinks") if c.attn_sinks else None,
                **per_layer(p)))
            if progress:
                progress((i + 1) / c.n_layers, f"uploaded layer {i + 1}/{c.n_layers}")

    # ------------------------------------------------------------------ activations and cache
    def _allocate(self) -> None:
        c, dev, own, dt, P = self.cfg, self.dev, self.owner, self.dtype, self.chunk
        self.rope_freq = nn.rope_frequencies(dev, c.rot_dim, c.rope_base, owner=own,
                                             factors=self.rope_factors)
        self.x = new_tensor(dev, (P, c.hidden_size), dt, owner=own, label="x")            # residual
        self.h = new_tensor(dev, (P, c.hidden_size), dt, owner=own, label="h")            # normed
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.max_head_dim        # the widest layer's heads
        mixers = [L.mixer for L in self.layers if L.mixer is not None]    # and token mixers' projections
        self.qkv = new_tensor(dev, (P, max([(H + 2 * Hkv) * D] + [L.qkv.n for L in self.layers if L.mixer])), dt,
                              owner=own, label="qkv")
        self.attn = new_tensor(dev, (P, max([H * D] + [L.o.k for L in self.layers if L.mixer])), dt, owner=own,
                               label="attn")
        if any(L.attn_gate is not None for L in self.layers):
            self.attn_gate_out = new_tensor(dev, (P, H * D), dt, owner=own, label="attn_gate")
        if mixers:                              # the mixers' scratch
            self.mixer_scratch = new_tensor(dev, (P, max(x.scratch for x in mixers)), dt, owner=own,
                                            label="mixer_scratch")
        slots = P * max(1, c.n_experts_used)         # a MoE layer's FFN rows: one per token and expert
        self.gate_up = new_tensor(dev, (slots, 2 * c.max_ffn), dt, owner=own, label="gate_up")
        self.ffn = new_tensor(dev, (slots, c.max_ffn), dt, owner=own, label="ffn")
        if c.n_experts:                              # router logits, chosen experts and their weights
            self.router_logits = new_tensor(dev, (P, c.n_experts), dt, owner=own, label="router_logits")
            self.expert_ids = new_tensor(dev, (slots,), "u32", owner=own, label="expert_ids")
            self.expert_weights = new_tensor(dev, (slots,), "f32", owner=own, label="expert_weights")
            # a prefill's slots grouped by expert (kernels/moe.py moe_group) and their down products
            self.expert_order = new_tensor(dev, (slots,), "u32", owner=own, label="expert_order")
            self.expert_start = new_tensor(dev, (c.n_experts + 1,), "u32", owner=own, label="expert_start")
            self.expert_prods = new_tensor(dev, (slots, c.hidden_size), "f32", owner=own, label="expert_prods")
        self.last = new_tensor(dev, (1, c.hidden_size), dt, owner=own, label="last")      # normed last row
        # decode: sums of x^2 per 4 columns of each row, from the residual matmuls' epilogue (see
        # _build; one row per sequence of a batched decode step)
        self.part = new_tensor(dev, (P * c.hidden_size // 4,), "f32", owner=own, label="norm_partials")
        if c.ple_dim:                           # every layer's inputs (T, L P), a scratch of that, one gate (T, P)
            self.ple = new_tensor(dev, (P, c.n_layers * c.ple_dim), dt, owner=own, label="ple")
            self.ple_tmp = new_tensor(dev, (P, c.n_layers * c.ple_dim), dt, owner=own, label="ple_tmp")
            self.ple_act = new_tensor(dev, (P, c.ple_dim), dt, owner=own, label="ple_act")
        if self.plan.contiguous:
            self._allocate_contiguous()

    def _allocate_contiguous(self) -> None:
        """The decoder embedder's cache of one sequence, its input ids, step uniform, logits row and
        recurrent states (ContiguousKV)."""
        c, dev, own, dt, P = self.cfg, self.dev, self.owner, self.dtype, self.chunk
        self.step = dev.buffer(16, owner=own, label="step")                 # u32 (pos0, n_new, kv_len, 0)
        self.ids = new_tensor(dev, (P,), "u32", owner=own, label="ids")      # (P,)
        self.logits = new_tensor(dev, (1, c.vocab_size), dt, owner=own, label="logits")
        self.mixer_states = [[new_tensor(dev, shape, "f32", owner=own, label=f"mixer_state.{i}")
                              for shape in L.mixer.state_shapes(1)] if L.mixer is not None else None
                             for i, L in enumerate(self.layers)]
        self.k_cache, self.v_cache = [], []
        for i in range(c.n_layers):             # a layer attending an earlier one's cache stores none
            src, D = c.kv_source(i), c.head_dim_of(i)
            for caches, kind in ((self.k_cache, "k"), (self.v_cache, "v")):
                caches.append(caches[src] if src != i else
                              new_tensor(dev, (c.n_kv_heads, self.ctx, D), dt, owner=own, label=f"{kind}_cache.{i}"))
        self.kv = ContiguousKV(self)

    # ------------------------------------------------------------------ the forward pass as ops
    @property
    def decode_plan(self) -> "decoder.FusionPlan":
        """The fusions a decode row takes where it goes through the fused one-row kernels (the paged
        forward's fused_rows: models/paged.py), chosen on first use."""
        if self._decode_plan is None:
            self._decode_plan = decoder.FusionPlan.choose(self.dev, self.cfg, self.layers, self.lm_head, True)
        return self._decode_plan

    def ops_for(self, T: int, with_head: bool = True) -> list[Op]:
        """The contiguous cache's prefill ops for T rows (1 <= T <= prefill chunk), built once per
        (T, with_head): row-invariant kernels, so a position's values do not depend on the chunking."""
        return self._ops.get((T, with_head), lambda: decoder.forward(self, self.kv, T, decoder.PREFILL,
                                                                     with_head=with_head))

    def warm_heights(self) -> list[int]:
        """Row counts whose prefill ops load-time warm-up runs: one row, a full chunk and each tile
        height the few-row matmuls use (any other T uses the same kernels as one of these)."""
        return sorted({1, self.chunk} | {t for t in (2, 4, 8, 16) if t <= self.chunk})

    VERIFY_ROWS = 17                   # the most rows one verify step checks per sequence (16 guesses + 1)

    @property
    def recurrent(self) -> bool:
        """Whether a layer keeps a state per sequence (a token mixer's: Qwen3.5): a forward continues
        the sequence from the last one, so no cached prefix shorter than what the states saw is reused."""
        return any(L.mixer is not None for L in self.layers)

    @property
    def verify_rows_per_pass(self) -> int | None:
        """The rows the fused decode kernels take in one pass over the weights where verify rows go
        through them (the CPU family: each row as a decode step computes it), else None:
        Speculation.with_k picks k from it."""
        return mm.MAX_DECODE_ROWS if mm.fused_rows_ok(self.dev) else None

    images = None                      # ImageRows of a vision-language model (enable_images)

    def enable_images(self, features: int, width: int, bidirectional: bool = True) -> None:
        """Make the PREFILL forwards take image features: `features` rows of `width` (the text model's
        hidden size) and per-row image rows (models/image_rows.py), an image's rows attending each
        other both ways where `bidirectional` (Gemma 3); rebuilds the prefill op lists."""
        from .image_rows import ImageRows
        self.images = ImageRows(self.dev, rows=self.chunk, features=features, width=width,
                                owner=self.owner, bidirectional=bidirectional)
        self._ops.release()

    # ------------------------------------------------------------------ the decoder embedder's steps
    def record_prefill(self, batch, ids: list[int], pos0: int, with_head: bool = True) -> None:
        """Write ids (T <= chunk) and the step, record the forward of those rows into `batch`."""
        if not 0 < len(ids) <= self.chunk:
            raise ValueError(f"prefill of {len(ids)} tokens: chunks must have 1..{self.chunk} tokens")
        T = len(ids)
        if pos0 + T > self.ctx:
            raise ContextWindowTooLargeError(f"positions up to {pos0 + T} exceed the context window {self.ctx}")
        self.dev.write(self.ids.buf, struct.pack(f"<{T}I", *ids))
        self.dev.write(self.step, struct.pack("<4I", pos0, T, pos0 + T, 0))
        if self.images is not None:          # the rows holding image tokens (staged by the caller)
            self.images.write(T)
        for op in self.ops_for(T, with_head):
            op.record(batch)

    def release(self) -> None:
        self.dev.release_owner(self.owner)
        self._ops.release()
