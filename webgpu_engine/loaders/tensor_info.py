"""TensorInfo: one weight tensor of a model file, as loaders hand it to the model (bytes untouched)."""
from __future__ import annotations

import math
from dataclasses import dataclass

# qtype -> (elements per block, bytes per block); the qtypes our kernels read come first.
QTYPE_BLOCK = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q4_k": (256, 144), "q6_k": (256, 210),
    "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18), "q5_k": (256, 176), "q3_k": (256, 110),
    "q2_k": (256, 84), "iq4_xs": (256, 136), "q4_0f32": (32, 20), "mxfp4": (32, 17),
    # parsed so that the error can name them, but no kernel reads them
    "q8_1": (32, 36), "q8_k": (256, 292), "f64": (1, 8), "i8": (1, 1), "i16": (1, 2),
    "i32": (1, 4), "i64": (1, 8),
}
SUPPORTED_QTYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "q5_0", "q5_1", "iq4_nl",
                    "q5_k", "q3_k", "q2_k", "iq4_xs", "q4_0f32", "mxfp4")


def tensor_nbytes(qtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (rows..., k) in `qtype`; k must be a whole number of blocks."""
    block, size = QTYPE_BLOCK[qtype]
    n = 1
    for d in shape:
        n *= d
    if shape and shape[-1] % block:
        raise ValueError(f"{qtype} row length {shape[-1]} is not a multiple of its block {block}")
    return n // block * size


@dataclass
class TensorInfo:
    """`shape` is row-major, outermost first: a matrix is (n rows, k cols) (GGUF's ne reversed), so
    y = x·Wᵀ maps k -> n. `data` is a zero-copy memoryview of the file's bytes (quant blocks as stored);
    `name` is the name in the file; `offset` is where `data` starts in the file."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: memoryview
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def n(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class LazyTensorInfo(TensorInfo):
    """A TensorInfo whose bytes are made from other tensors' (`_make`) when first read, at the
    model's upload, not when headers are read (memory estimates, info)."""

    _data = None

    def _make(self) -> memoryview:
        raise NotImplementedError

    @property
    def data(self) -> memoryview:
        if self._data is None:
            self._data = self._make()
        return self._data

    @data.setter
    def data(self, value) -> None:
        self._data = value

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def split_rows(t: TensorInfo, sizes: list[int], names: list[str]) -> list[TensorInfo]:
    """Row slices of a matrix (n, k) as TensorInfos of sizes[i] rows each: zero-copy views, since a
    row of any qtype is a whole number of blocks."""
    if sum(sizes) != t.n or len(t.shape) != 2:
        raise ValueError(f"{t.name}: {t.shape} does not split into {sizes} rows")
    row = tensor_nbytes(t.qtype, (1, t.k))
    out, r0 = [], 0
    for n, name in zip(sizes, names):
        out.append(TensorInfo(name, t.qtype, (n, t.k), t.data[r0 * row:(r0 + n) * row], t.offset + r0 * row))
        r0 += n
    return out


def split_vector(t: TensorInfo, sizes: list[int], names: list[str]) -> list[TensorInfo]:
    """Slices of a vector (a bias) as TensorInfos of sizes[i] values each: zero-copy views."""
    if sum(sizes) != t.numel:
        raise ValueError(f"{t.name}: {t.numel} values do not split into {sizes}")
    size, out, a = t.nbytes // t.numel, [], 0
    for n, name in zip(sizes, names):
        out.append(TensorInfo(name, t.qtype, (n,), t.data[a * size:(a + n) * size], t.offset + a * size))
        a += n
    return out


def split_heads(t: TensorInfo, n_heads: int, names: list[str]) -> list[TensorInfo]:
    """GPT-NeoX's fused q|k|v in its HF layout, each head's q, k and v rows in turn ((H, 3, D) rows, or
    values of a bias), as q, k and v (H D rows each); likewise Qwen3.5's q|gate ((H, 2, D) rows) with
    two names: gathered copies, not views."""
    n = len(names)
    step, data = t.nbytes // (n * n_heads), bytes(t.data)       # one head's rows of one part
    shape = (t.shape[0] // n, *t.shape[1:])
    return [TensorInfo(name, t.qtype, shape,
                       memoryview(b"".join(data[(n * h + j) * step:(n * h + j + 1) * step] for h in range(n_heads))),
                       t.offset) for j, name in enumerate(names)]


def split_fused(weights: dict, q_rows: int, kv_rows: int, ffn: int, head_dim: int = 0) -> dict:
    """Our names with fused matrices split (Phi-3 files store q|k|v as `layers.i.qkv` and gate|up as
    `layers.i.gate_up`, in GGUF as an `up` of 2*ffn rows without a `gate`; a q|k|v bias,
    `layers.i.qkv_bias`, in Qwen's MLC artifacts and older Phi-2 GGUFs; GPT-NeoX's per-head layout,
    `layers.i.qkv_heads` and `qkv_heads_bias`, split with `head_dim`; Qwen3.5's per-head q and output
    gate, `layers.i.q_gate`, into q and `attn_gate`, and MLC's q|gate, k, v of it, `layers.i.qkv_gate`):
    the model sees the separate q, k, v, gate and up every family has."""
    out = dict(weights)
    for name, t in weights.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers":
            continue
        p = f"layers.{parts[1]}."
        if parts[2] == "qkv_gate":          # Qwen3.5's MLC c_attn: q|gate per head (2 q_rows), k, v
            del out[name]
            qg, k, v = split_rows(t, [2 * q_rows, kv_rows, kv_rows], [name + ".q_gate", name + ".k", name + ".v"])
            out.update({p + "k": k, p + "v": v})
            name, parts[2], t = p + "q_gate", "q_gate", qg
            out[name] = t
        if parts[2] == "q_gate":            # Qwen3.5: each head's q rows, then its output gate's
            if not head_dim or t.n != 2 * q_rows:
                raise ValueError(f"{t.name}: {t.shape} is not per-head q|gate of {q_rows} rows (head_dim {head_dim})")
            del out[name]
            out.update(zip((p + "q", p + "attn_gate"),
                           split_heads(t, q_rows // head_dim, [name + ".q", name + ".gate"])))
            continue
        if parts[2] in ("qkv_heads", "qkv_heads_bias"):
            if not head_dim or q_rows != kv_rows or t.numel % (3 * q_rows):
                raise ValueError(f"{t.name}: {t.shape} is not per-head q|k|v of {q_rows} rows (head_dim {head_dim})")
            del out[name]
            end = "_bias" if parts[2].endswith("_bias") else ""
            out.update(zip((p + "q" + end, p + "k" + end, p + "v" + end),
                           split_heads(t, q_rows // head_dim, [name + ".q", name + ".k", name + ".v"])))
        elif parts[2] == "qkv_bias":
            del out[name]
            out.update(zip((p + "q_bias", p + "k_bias", p + "v_bias"),
                           split_vector(t, [q_rows, kv_rows, kv_rows], [name + ".q", name + ".k", name + ".v"])))
        elif parts[2] == "qkv":
            del out[name]
            out.update(zip((p + "q", p + "k", p + "v"),
                           split_rows(t, [q_rows, kv_rows, kv_rows], [name + ".q", name + ".k", name + ".v"])))
        elif parts[2] == "gate_up" or (parts[2] == "up" and p + "gate" not in weights and t.n == 2 * ffn):
            del out[name]                   # halves (Gemma 4's layers differ in width)
            out.update(zip((p + "gate", p + "up"), split_rows(t, [t.n // 2, t.n // 2], [name + ".gate", name + ".up"])))
    return out
