"""A MoE layer's weights on the GPU: the router and every expert's gate|up and down, stacked
(kernels/moe.py ExpertStack: whole experts per buffer, as many as one binding holds). HF folders
hold one tensor per expert (layers.i.experts.j.gate / up / down); llama.cpp's GGUFs hold them
stacked (layers.i.gate_exps (E, F, C), up_exps, down_exps): both become gate_up (E * 2F, C), expert
e's gate rows then its up rows (kernels/elementwise.py silu_mul's [gate | up]), and down (E * C, F).
Rows of any type are whole blocks, so an expert's slice of a stacked tensor is a view. Standard
library only (runs in the page).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..kernels import matmul as mm
from ..kernels.moe import ExpertStack, upload_experts as upload_stack
from ..loaders.tensor_info import TensorInfo, split_rows


@dataclass
class Experts:
    """One layer's experts (E of them, C hidden, F each expert's FFN)."""

    router: mm.QWeight                 # (E, C)
    gate_up: ExpertStack               # (E, 2F, C): expert e's gate rows, then its up rows
    down: ExpertStack                  # (E, C, F)


def _per_expert(weights: dict, p: str, part: str, E: int) -> list[TensorInfo]:
    """Expert 0..E-1's (rows, k) matrix `part` (gate, up, down) of layer prefix p, from either layout."""
    stacked = weights.get(f"{p}{part}_exps")
    if stacked is not None:
        if len(stacked.shape) != 3 or stacked.shape[0] != E:
            raise UnsupportedModelError(f"{stacked.name}: {stacked.shape} is not {E} stacked experts")
        rows = stacked.shape[1]
        flat = TensorInfo(stacked.name, stacked.qtype, (E * rows, stacked.shape[2]), stacked.data, stacked.offset)
        return split_rows(flat, [rows] * E, [f"{stacked.name}[{e}]" for e in range(E)])
    try:
        return [weights[f"{p}experts.{e}.{part}"] for e in range(E)]
    except KeyError as e:
        raise UnsupportedModelError(f"model weights lack tensor {e.args[0]!r}") from None


def _stack(dev, experts: list[list[TensorInfo]], label: str, owner: str, max_binding: int | None) -> ExpertStack:
    """experts[e]: the matrices whose rows, in turn, make expert e's rows."""
    types = {t.qtype for parts in experts for t in parts}
    if len(types) != 1:
        raise UnsupportedModelError(f"{label}: experts stored in several types {sorted(types)}")
    first = experts[0]
    return upload_stack(dev, [[t.data for t in parts] for parts in experts], first[0].qtype, sum(t.n for t in first),
                        first[0].k, owner=owner, label=label, max_binding=max_binding)


def upload_experts(dev, weights: dict, i: int, n_experts: int, owner: str, router: mm.QWeight,
                   max_binding: int | None = None) -> Experts:
    """Layer i's experts on the GPU (router already uploaded by the caller's matrix reader)."""
    p = f"layers.{i}."
    gate, up = _per_expert(weights, p, "gate", n_experts), _per_expert(weights, p, "up", n_experts)
    gate_up = _stack(dev, [[gate[e], up[e]] for e in range(n_experts)], p + "experts.gate_up", owner, max_binding)
    down = _stack(dev, [[t] for t in _per_expert(weights, p, "down", n_experts)], p + "experts.down", owner,
                  max_binding)
    return Experts(router, gate_up, down)


def decode_weight_bytes(model) -> tuple[int, int]:
    """(weight bytes one decode step of a loaded LlamaModel reads, bytes of all its experts), from the
    kernels' layout: every dense matrix whole (q|k|v, o, gate|up, down, routers, the LM head), one
    embedding row, and per MoE layer the k chosen experts' rows of gate|up and down (moe_matmul /
    moe_down dispatch k slots of N rows each). bench/llm.py and bench/moe.py report it."""
    c = model.cfg
    read, experts = model.embed.nbytes // c.vocab_size, 0
    if model.lm_head is not model.embed:
        read += model.lm_head.nbytes
    else:                                   # a tied head reads the whole table
        read += model.embed.nbytes
    for layer in model.layers:             # bytes only: decoder.py sequences the layer
        read += layer.qkv.nbytes + layer.o.nbytes
        if layer.experts is None:
            read += layer.gate_up.nbytes + layer.down.nbytes
            continue
        read += layer.experts.router.nbytes
        for stack in (layer.experts.gate_up, layer.experts.down):
            experts += stack.nbytes
            read += c.n_experts_used * stack.nbytes // c.n_experts
    return read, experts
