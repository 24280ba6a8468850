"""GGUF v2/v3 reader in pure Python (struct + mmap): metadata, tensor infos, zero-copy tensor bytes.

Runs in the browser too: `GGUFFile` parses any buffer (bytes, memoryview, a Pyodide-converted
ArrayBuffer) as well as a path (mmapped). Tensor data are memoryview slices of that buffer, so quant
blocks go to the GPU exactly as stored. Format: github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import mmap
import os
import re
import struct

from ..errors import ModelFormatError, UnsupportedModelError
from .decoder_config import gguf_config
from .model_config import LlamaConfig
from .tensor_info import QTYPE_BLOCK, SUPPORTED_QTYPES, TensorInfo, tensor_nbytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml_type enum -> our qtype names (only the ones QTYPE_BLOCK knows can be sized)
GGML_TYPES = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 9: "q8_1",
    10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k", 15: "q8_k", 20: "iq4_nl", 23: "iq4_xs",
    24: "i8", 25: "i16", 26: "i32", 27: "i64", 28: "f64", 30: "bf16", 39: "mxfp4",
}
QTYPE_TO_GGML = {v: k for k, v in GGML_TYPES.items()}

# GGUF metadata value types -> struct format of one scalar (8 string, 9 array handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

# The one table from GGUF tensor names to ours ({i}: layer index). Models see only our names.
GGUF_TO_OURS = {
    "token_embd.weight": "embed",                    # (vocab, hidden)
    "output_norm.weight": "norm",                    # (hidden,)
    "output_norm.bias": "norm_bias",                 # LayerNorm families (StableLM)
    "output.weight": "lm_head",                      # (vocab, hidden); absent when tied
    "output.bias": "lm_head_bias",                   # Phi-2
    "rope_freqs.weight": "rope_freqs",               # llama-3.1 rope scaling factors (rot_dim/2,)
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm",
    "blk.{i}.attn_norm.bias": "layers.{i}.attn_norm_bias",
    "blk.{i}.attn_q.weight": "layers.{i}.q",         # (n_heads*head_dim, hidden)
    "blk.{i}.attn_k.weight": "layers.{i}.k",         # (n_kv_heads*head_dim, hidden)
    "blk.{i}.attn_v.weight": "layers.{i}.v",
    "blk.{i}.attn_q.bias": "layers.{i}.q_bias",      # Qwen2
    "blk.{i}.attn_k.bias": "layers.{i}.k_bias",
    "blk.{i}.attn_v.bias": "layers.{i}.v_bias",
    "blk.{i}.attn_qkv.weight": "layers.{i}.qkv",     # Phi-3: q|k|v rows (split on load)
    "blk.{i}.attn_q_norm.weight": "layers.{i}.q_norm",  # Qwen3 (head_dim,)
    "blk.{i}.attn_k_norm.weight": "layers.{i}.k_norm",
    "blk.{i}.attn_output.weight": "layers.{i}.o",    # (hidden, n_heads*head_dim)
    "blk.{i}.attn_output.bias": "layers.{i}.o_bias",
    "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm",
    "blk.{i}.ffn_norm.bias": "layers.{i}.ffn_norm_bias",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attn_norm",  # Gemma 2/3 (1 + w stored)
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_ffn_norm",
    "blk.{i}.ffn_gate.weight": "layers.{i}.gate",    # (ffn, hidden)
    "blk.{i}.ffn_up.weight": "layers.{i}.up",        # (ffn, hidden); Phi-3: gate|up (2 ffn, hidden)
    "blk.{i}.ffn_down.weight": "layers.{i}.down",    # (hidden, ffn)
    "blk.{i}.ffn_gate_inp.weight": "layers.{i}.router",      # MoE: (experts, hidden)
    "blk.{i}.ffn_gate_exps.weight": "layers.{i}.gate_exps",  # (experts, ffn, hidden), experts stacked
    "blk.{i}.ffn_up_exps.weight": "layers.{i}.up_exps",      # (experts, ffn, hidden)
    "blk.{i}.ffn_down_exps.weight": "layers.{i}.down_exps",  # (experts, hidden, ffn)
    "blk.{i}.ffn_gate_up_exps.weight": "layers.{i}.gate_up_exps",  # (experts, 2 ffn, hidden): gate | up
    "blk.{i}.ffn_gate_up_exps.bias": "layers.{i}.gate_up_exps_bias",  # (experts, 2 ffn) (--fuse-gate-up-exps)
    "blk.{i}.ffn_gate_inp.bias": "layers.{i}.router_bias",   # gpt-oss: (experts,)
    "blk.{i}.ffn_gate_exps.bias": "layers.{i}.gate_exps_bias",  # (experts, ffn)
    "blk.{i}.ffn_up_exps.bias": "layers.{i}.up_exps_bias",
    "blk.{i}.ffn_down_exps.bias": "layers.{i}.down_exps_bias",  # (experts, hidden)
    "blk.{i}.attn_sinks.weight": "layers.{i}.sinks",         # (n_heads,)
    # BERT-style encoders (bert, nomic-bert; XLM-R converts as bert): post-norm layers
    "token_types.weight": "type_embed",              # (token types, hidden)
    "position_embd.weight": "pos_embed",             # (positions, hidden); XLM-R: from padding_idx + 1
    "token_embd_norm.weight": "embed_norm",
    "token_embd_norm.bias": "embed_norm_bias",
    "blk.{i}.attn_qkv.bias": "layers.{i}.qkv_bias",
    "blk.{i}.attn_output_norm.weight": "layers.{i}.attn_norm",      # LN after the attention block
    "blk.{i}.attn_output_norm.bias": "layers.{i}.attn_norm_bias",
    "blk.{i}.ffn_up.bias": "layers.{i}.up_bias",
    "blk.{i}.ffn_down.bias": "layers.{i}.down_bias",
    "blk.{i}.layer_output_norm.weight": "layers.{i}.ffn_norm",      # LN after the feed-forward block
    "blk.{i}.layer_output_norm.bias": "layers.{i}.ffn_norm_bias",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# one tensor per expert, as llama.cpp's converter wrote Mixtral before it stacked them (early 2024
# files, still read by llama.cpp): blk.{i}.ffn_{gate,up,down}.{j}.weight
_EXPERT_NAME = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")


def our_name(gguf_name: str, names: dict | None = None) -> str | None:
    """Our name of a GGUF tensor, or None when the model does not use it (`names`: a family's own
    entries, DecoderFamily.gguf_names, before the table's)."""
    table = {**GGUF_TO_OURS, **names} if names else GGUF_TO_OURS
    m = _LAYER_NAME.match(gguf_name)
    if m is None:
        return table.get(gguf_name)
    ours = table.get("blk.{i}." + m.group(2))
    if ours is None and (e := _EXPERT_NAME.match(m.group(2))):
        return f"layers.{m.group(1)}.experts.{e.group(2)}.{e.group(1)}"
    return ours.replace("{i}", m.group(1)) if ours else None


def _as_buffer(source) -> tuple[memoryview, object | None, str]:
    """(bytes view, object to close, description) of a path or any buffer-like input."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:     # ValueError: empty file cannot be mmapped
            raise ModelFormatError(f"Cannot open GGUF file {path}: {e}") from e
        return memoryview(mm), mm, path
    if hasattr(source, "to_py"):               # a Pyodide JsProxy of an ArrayBuffer / Uint8Array
        source = source.to_py()
    mv = memoryview(source)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv, None, "<buffer>"


class MappedFile:
    """A model file read through `_buf` (from _as_buffer: a view of `_mmap`, or of a buffer given);
    its `tensors` are TensorInfo views into it."""

    _buf: memoryview

    def close(self) -> None:
        """Drop the buffer; the mmap closes once no tensor view is alive any more."""
        self.tensors = {}
        self._buf.release()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:                # views handed out are still alive: the GC closes it
                pass
            self._mmap = None


class _Cursor:
    """Little-endian reader over a memoryview; errors name the GGUF part being read."""

    def __init__(self, buf: memoryview, where: str):
        self.buf, self.pos, self.where = buf, 0, where

    def unpack(self, fmt: str):
        try:
            v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as e:
            raise ModelFormatError(f"{self.where}: truncated GGUF header at byte {self.pos}") from e
        self.pos += struct.calcsize("<" + fmt)
        return v

    def string(self) -> str:
        (n,) = self.unpack("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ModelFormatError(f"{self.where}: string of {n} bytes runs past the end of the file")
        s = str(self.buf[self.pos:end], "utf-8", "replace")
        self.pos = end
        return s

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])[0]
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.unpack("IQ")
            if etype in _SCALAR:            # one struct call for a whole numeric array
                return list(self.unpack(f"{count}{_SCALAR[etype]}"))
            return [self.value(etype) for _ in range(count)]
        raise ModelFormatError(f"{self.where}: unknown GGUF metadata value type {vtype} at byte {self.pos}")


class GGUFFile(MappedFile):
    """A parsed GGUF file. `metadata`: {key: value} (arrays as lists); `tensors`: {gguf name: TensorInfo}
    in file order; `version`, `alignment`, `data_offset` (start of the tensor data section)."""

    def __init__(self, source):
        self._buf, self._mmap, self.where = _as_buffer(source)
        cur = _Cursor(self._buf, self.where)
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ModelFormatError(f"{self.where} is not a GGUF file (magic {bytes(self._buf[:4])!r})")
        cur.pos = 4
        (self.version,) = cur.unpack("I")
        if self.version not in (2, 3):
            raise ModelFormatError(f"{self.where}: GGUF version {self.version} is not supported "
                                   "(v2 and v3 little-endian are); re-convert with a recent llama.cpp")
        n_tensors, n_kv = cur.unpack("QQ")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("I")
            self.metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("I")
            ne = cur.unpack(f"{n_dims}Q")
            ggml_type, offset = cur.unpack("IQ")
            infos.append((name, ne, ggml_type, offset))
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, ggml_type, offset in infos:
            qtype = GGML_TYPES.get(ggml_type)
            if qtype is None:
                raise UnsupportedModelError(
                    f"{self.where}: tensor {name} has ggml type {ggml_type}, which this engine cannot "
                    f"read; use a GGUF quantized to one of {' '.join(SUPPORTED_QTYPES)}")
            shape = tuple(int(d) for d in reversed(ne))     # (n rows, k cols)
            try:
                nbytes = tensor_nbytes(qtype, shape)
            except ValueError as e:
                raise ModelFormatError(f"{self.where}: tensor {name}: {e}") from e
            start = self.data_offset + offset
            if start + nbytes > len(self._buf):
                raise ModelFormatError(f"{self.where}: tensor {name} ({nbytes} bytes at {start}) runs past "
                                       f"the end of the file ({len(self._buf)} bytes): truncated download?")
            self.tensors[name] = TensorInfo(name, qtype, shape, self._buf[start:start + nbytes], start)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ model view
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def chat_template(self) -> str | None:
        t = self.metadata.get("tokenizer.chat_template")
        return str(t) if t else None

    def weights(self, names: dict | None = None) -> dict[str, TensorInfo]:
        """{our name: TensorInfo} of the tensors the model uses (see GGUF_TO_OURS; `names`: a
        family's own entries)."""
        out = {}
        for name, t in self.tensors.items():
            ours = our_name(name, names)
            if ours is not None:
                out[ours] = t
        return out

    def meta(self, key: str, default=None, *, required: bool = False):
        """The metadata value `<architecture>.<key>` (llama.cpp's per-architecture keys)."""
        full = f"{self.architecture}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if required:
            raise ModelFormatError(f"{self.where}: GGUF metadata lacks {full}")
        return default

    def model_config(self, family=None) -> LlamaConfig:
        """LlamaConfig of a decoder: the `<arch>.*` keys every family shares (loaders.decoder_config)
        plus what `family` (a DecoderFamily; default: the one registered for this architecture) adds."""
        return gguf_config(self, family)

    def template(self):
        """The chat template as a renderer (loaders.chat_template.ChatTemplate), or None."""
        from .chat_template import from_gguf_metadata
        return from_gguf_metadata(self.metadata)

    def tokenizer(self):
        """The pure-Python tokenizer from `tokenizer.ggml.*`: byte-level BPE (loaders.bpe) or
        SentencePiece (loaders.spm, tokenizer.ggml.model "llama")."""
        if self.metadata.get("tokenizer.ggml.model") == "llama":
            from .spm import SPMTokenizer
            return SPMTokenizer.from_gguf_metadata(self.metadata)
        from .bpe import BPETokenizer
        return BPETokenizer.from_gguf_metadata(self.metadata)

    def __repr__(self) -> str:
        return (f"GGUFFile({self.where!r}, v{self.version}, arch={self.architecture!r}, "
                f"{len(self.metadata)} keys, {len(self.tensors)} tensors)")


__all__ = ["GGUFFile", "GGUF_TO_OURS", "GGML_TYPES", "QTYPE_TO_GGML", "QTYPE_BLOCK", "our_name"]
