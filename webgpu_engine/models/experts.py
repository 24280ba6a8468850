"""A MoE layer's weights on the GPU: the router and every expert's gate|up and down, stacked
(kernels/moe.py ExpertStack: whole experts per buffer, as many as one binding holds). HF folders
hold one tensor per expert (layers.i.experts.j.gate / up / down); llama.cpp's GGUFs hold them
stacked (layers.i.gate_exps (E, F, C), up_exps, down_exps): both become gate_up (E * 2F, C), expert
e's gate rows then its up rows (kernels/elementwise.py silu_mul's [gate | up]), and down (E * C, F).
Rows of any type are whole blocks, so an expert's slice of a stacked tensor is a view. gpt-oss's HF
folders stack them for x · W rather than x · Wᵀ (gate_up_exps_t (E, C, 2F), gate and up columns
interleaved; down_exps_t (E, F, C)): those floats are transposed on the host when uploaded (numpy
where installed). gpt-oss also has biases: the router's (E,), each expert's gate / up (E, F) (its HF
folder's gate_up_exps_t_bias (E, 2F) interleaved; a fused GGUF's gate_up_exps_bias (E, 2F)) and down
(E, C). A GGUF written with llama.cpp's --fuse-gate-up-exps holds gate_up_exps (E, 2F, C), each
expert's gate rows then its up rows. Standard library only (runs in the page).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..kernels import matmul as mm
from ..kernels.common import Tensor
from ..kernels.moe import ExpertStack, upload_experts as upload_stack
from ..loaders.tensor_info import LazyTensorInfo, TensorInfo, split_rows, tensor_nbytes


@dataclass
class Experts:
    """One layer's experts (E of them, C hidden, F each expert's FFN)."""

    router: mm.QWeight                 # (E, C)
    gate_up: ExpertStack               # (E, 2F, C): expert e's gate rows, then its up rows
    down: ExpertStack                  # (E, C, F)
    router_bias: Tensor | None = None  # (E,) f32: gpt-oss
    gate_up_bias: Tensor | None = None  # (E * 2F,) f32: expert e's gate biases, then its up biases
    down_bias: Tensor | None = None    # (E * C,) f32


class Transposed(LazyTensorInfo):
    """Columns col0, col0 + step, ... of a stacked float matrix's expert e (E, k, cols) as rows
    (n, k), copied when its bytes are first read."""

    def __init__(self, t: TensorInfo, e: int, col0: int, step: int):
        E, k, cols = t.shape
        self._src = (t, e, col0, step)
        super().__init__(f"{t.name}[{e}]ᵀ", t.qtype, (len(range(col0, cols, step)), k), None, t.offset)

    def _make(self) -> memoryview:
        t, e, col0, step = self._src
        _, k, cols = t.shape
        size = tensor_nbytes(self.qtype, (1,))
        return transpose(t.data[e * k * cols * size:(e + 1) * k * cols * size], k, cols, size, col0, step)


def transpose(src, rows: int, cols: int, size: int, col0: int = 0, step: int = 1) -> memoryview:
    """Columns col0::step of a (rows, cols) matrix of `size`-byte floats as the rows of a new one."""
    from importlib.util import find_spec
    if find_spec("numpy") is not None:
        import numpy as np
        a = np.frombuffer(src, f"u{size}", rows * cols).reshape(rows, cols)
        return memoryview(np.ascontiguousarray(a[:, col0::step].T).reshape(-1).view(np.uint8))
    from array import array
    a = array("H" if size == 2 else "I", bytes(src))
    n = len(range(col0, cols, step))
    out = array(a.typecode, bytes(n * rows * size))
    for r in range(rows):
        out[r::rows] = a[r * cols + col0:(r + 1) * cols:step]
    return memoryview(out).cast("B")


def _per_expert(weights: dict, p: str, part: str, E: int) -> list[TensorInfo]:
    """Expert 0..E-1's (rows, k) matrix `part` (gate, up, down) of layer prefix p, from any layout."""
    hf = weights.get(f"{p}{'gate_up' if part in ('gate', 'up') else part}_exps_t")
    if hf is not None:                      # gpt-oss's HF folder: x · W, gate and up interleaved
        if len(hf.shape) != 3 or hf.shape[0] != E or hf.qtype not in ("f32", "f16", "bf16"):
            raise UnsupportedModelError(f"{hf.name}: {hf.qtype} {hf.shape} is not {E} stacked float experts")
        col0, step = {"gate": (0, 2), "up": (1, 2)}.get(part, (0, 1))
        return [Transposed(hf, e, col0, step) for e in range(E)]
    fused = weights.get(f"{p}gate_up_exps") if part in ("gate", "up") else None
    if fused is not None:                   # llama.cpp's --fuse-gate-up-exps: (E, 2F, C), gate | up
        F = fused.shape[1] // 2
        flat = TensorInfo(fused.name, fused.qtype, (2 * E * F, fused.shape[2]), fused.data, fused.offset)
        halves = split_rows(flat, [F] * 2 * E, [f"{fused.name}[{e // 2}].{('gate', 'up')[e % 2]}" for e in range(2 * E)])
        return halves[part == "up"::2]
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


def _biases(dev, weights: dict, p: str, E: int, owner: str) -> dict:
    """gpt-oss's router and expert biases (f32 on the GPU; none in other families)."""
    if p + "router_bias" not in weights:
        return {}

    def up(name, data, dtype):
        return mm.upload_vector(dev, data, dtype=dtype, owner=owner, label=p + name)
    hf = weights.get(p + "gate_up_exps_t_bias")
    if p + "gate_up_exps_bias" in weights:  # (E, 2F): [gate | up] per expert already
        gu = up("gate_up_bias", weights[p + "gate_up_exps_bias"].data, weights[p + "gate_up_exps_bias"].qtype)
    elif hf is not None:                    # (E, 2F), gate and up interleaved: [gate | up] per expert
        F = hf.shape[-1] // 2
        size = tensor_nbytes(hf.qtype, (1,))
        gate, ups = transpose(hf.data, E * F, 2, size, 0), transpose(hf.data, E * F, 2, size, 1)
        gate_up = b"".join(bytes(v[e * F * size:(e + 1) * F * size]) for e in range(E) for v in (gate, ups))
        gu = up("gate_up_bias", gate_up, hf.qtype)
    else:
        g, u = weights[p + "gate_exps_bias"], weights[p + "up_exps_bias"]
        row = g.nbytes // E
        gu = up("gate_up_bias", b"".join(bytes(t.data[e * row:(e + 1) * row]) for e in range(E) for t in (g, u)),
                g.qtype)
    d, r = weights[p + "down_exps_bias"], weights[p + "router_bias"]
    return {"router_bias": up("router_bias", r.data, r.qtype), "gate_up_bias": gu,
            "down_bias": up("down_bias", d.data, d.qtype)}


def upload_experts(dev, weights: dict, i: int, n_experts: int, owner: str, router: mm.QWeight,
                   max_binding: int | None = None) -> Experts:
    """Layer i's experts on the GPU (router already uploaded by the caller's matrix reader)."""
    p = f"layers.{i}."
    gate, up = _per_expert(weights, p, "gate", n_experts), _per_expert(weights, p, "up", n_experts)
    gate_up = _stack(dev, [[gate[e], up[e]] for e in range(n_experts)], p + "experts.gate_up", owner, max_binding)
    down = _stack(dev, [[t] for t in _per_expert(weights, p, "down", n_experts)], p + "experts.down", owner,
                  max_binding)
    return Experts(router, gate_up, down, **_biases(dev, weights, p, n_experts, owner))


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
