"""What a model will hold on the GPU (weights, KV cache, activations), from its headers alone:
each family's estimate mirrors what its model class and pipeline allocate (models/llama.py,
models/bert.py, the sampler), so the engine can refuse a load that cannot fit before allocating
anything (engine/memory.py). The registry names each family's estimate. Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .recurrent_snapshots import snapshot_slots


@dataclass
class MemoryEstimate:
    """Bytes one model will hold on the GPU. `kv_per_token`: KV-cache bytes per token of context
    window (0 for encoders); `largest_buffer`: the biggest single allocation, checked against the
    device's per-buffer limits."""

    weights: int
    kv_cache: int = 0
    activations: int = 0
    context_window: int = 0
    kv_per_token: int = 0
    ctx_activations: int = 0         # the part of `activations` that grows with the context window
    largest_buffer: int = 0
    largest_label: str = ""
    source: str = "estimate"         # "estimate" (from the model's headers) | "record" (vram_required_MB)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def _r4(n: int) -> int:
    return max(4, (int(n) + 3) & ~3)


def _weight_bytes(t, max_binding: int) -> tuple[int, int]:
    """(bytes on the GPU, largest buffer) of one tensor: matrices in the GPU row layout (split across
    buffers at the binding limit, as upload_weight does), vectors as f32."""
    from ..kernels.matmul import gpu_row_bytes
    if len(t.shape) < 2:
        return _r4(4 * t.numel), _r4(4 * t.numel)
    n, k = math.prod(t.shape[:-1]), t.shape[-1]      # stacked experts (E, N, K): E * N rows
    row = gpu_row_bytes(t.qtype, k)
    per_buf = max(1, min(n, max_binding // row)) * row
    return _r4(n * row), _r4(min(per_buf, n * row))


def estimate_llm(cfg, tensors: dict, plan, *, max_binding: int) -> MemoryEstimate:
    """A Llama-family decoder as models/llama.py and the batch scheduler (pipelines/scheduler.py)
    allocate it under `plan` (a models/plan.py DecoderPlan: dtype, context, prefill rows, sequences,
    paged pool): weights, activations, the paged KV pool, its logits rows and per-slot samplers; a
    model built by hand (no pool) has its contiguous cache of one sequence, its logits and a sampler
    instead. `tensors`: our weight names → TensorInfo (only names, qtypes and shapes are used)."""
    esz, ctx, P = plan.act_bytes, plan.context, plan.prefill_chunk
    weights, largest, label = 0, 0, ""
    for name, t in tensors.items():
        nb, big = _weight_bytes(t, max_binding)
        weights += nb
        if big > largest:
            largest, label = big, f"weight {name}"
    kv_buf = plan.kv_layer_bytes(cfg)                                      # one (Hkv, ctx, D) cache
    C, V = cfg.hidden_size, cfg.vocab_size
    F = cfg.ffn_size * max(1, cfg.n_experts_used)          # a MoE layer's FFN rows: one per token and expert
    solo = plan.contiguous                                 # a hand-built model: its own cache, logits, sampler
    act = esz * P * (2 * C + cfg.qkv_dim + cfg.q_dim + 3 * F) + 4 * P + esz * (C + V * solo) + P * C   # P * C: norm partials
    act += P * (esz * cfg.n_experts + 4 * (3 + C) * cfg.n_experts_used) + 4 * (cfg.n_experts + 1)   # router
    #    logits; chosen experts, their weights, order and f32 down products; each expert's first slot
    # Gemma 4: the widest layer's heads and FFN beyond the config's, its per-layer inputs (T, L P) x 2, (T, P)
    act += esz * P * ((2 * cfg.n_heads + 2 * cfg.n_kv_heads) * (cfg.max_head_dim - cfg.head_dim)
                      + 3 * (cfg.max_ffn - cfg.ffn_size) + (2 * cfg.n_layers + 1) * cfg.ple_dim)
    act += (4 * V * 3 + 4 * (V + 31) // 32 + 1024) * solo  # sampler: bias, history, scratch, io, params
    act += 64 * 1024                                         # per-op params uniforms (~16 B x ops)
    if getattr(plan, "ring", None) is not None:             # a sliding window's sink queries
        act += esz * P * cfg.q_dim
    # split-key decode attention: per layer (Hq, splits, D/4 + 1) vec4 partials, at most 128 splits
    # of at least 32 keys (kernels/nn.attention; CPU adapters use fewer): grows with the context.
    partials = cfg.n_layers * cfg.n_heads * min(128, -(-ctx // 32)) * (cfg.max_head_dim // 4 + 1) * 16
    act += partials
    for size, what in ((kv_buf, f"KV cache of one layer ({ctx} tokens)"), (esz * P * 2 * F, "gate_up activations"),
                       (4 * P * cfg.n_experts_used * C, "experts' down products"),
                       (4 * V, "logits")):
        if size > largest:
            largest, label = size, what
    # a family's token mixers (Qwen3.5's Gated DeltaNet, LlamaConfig.extra): their wider projections and
    # scratch per row, and their recurrent states per sequence (each slot of the paged batch's and its
    # prefix snapshots', or the hand-built model's one)
    mix = cfg.extra.get("mixer_memory", {}) if isinstance(getattr(cfg, "extra", None), dict) else {}
    act += esz * P * mix.get("row_elems", 0)
    snaps = snapshot_slots(plan.max_sequences, 0, mix.get("slot_bytes", 0), max_binding) if mix else 0
    act += mix.get("state_bytes", 0) * (1 if solo else plan.max_sequences + snaps)
    if not solo:
        act += plan.max_sequences * (esz * 2 * V + 4 * V * 3 + 4 * (V + 31) // 32 + 4096)
    return MemoryEstimate(weights, plan.kv_cache_bytes(cfg), act, ctx, plan.kv_bytes_per_token(cfg), partials,
                          largest, label)


def estimate_bert(cfg, tensors: dict, *, max_batch_size: int, max_seq_length: int, act_dtype: str,
                  max_binding: int) -> MemoryEstimate:
    """A BERT encoder as models/bert.py allocates it, with the activation arena of the largest batch
    (max_batch_size sequences of max_seq_length tokens) and the pipeline's result buffer."""
    esz = 2 if act_dtype == "f16" else 4
    weights, largest, label = 0, 0, ""
    for name, t in tensors.items():
        if "position_ids" in name:                             # a buffer of some checkpoints, not a weight
            continue
        else:
            nb, big = _weight_bytes(t, max_binding)
        weights += nb
        if big > largest:
            largest, label = big, f"weight {name}"
    C, F = cfg.hidden_size, cfg.intermediate_size
    B = max(1, max_batch_size)                 # batches are min(pow2, max_batch_size) sequences
    T = B * max_seq_length
    G = 1 if cfg.ffn == "gelu" else 2                          # gated FFNs hold both halves (T, 2F)
    act = esz * T * (4 * C + 3 * C + (G + 1) * F) + 4 * (3 * T + B) + 3 * 4 * B * C
    act += 2 * 4 * B * C + 64 * 1024                          # result buffer (grows x2), op params
    for size, what in ((esz * T * G * F, f"FFN activations of a {B}x{max_seq_length} batch"),):
        if size > largest:
            largest, label = size, what
    return MemoryEstimate(weights, 0, act, 0, 0, 0, largest, label)
