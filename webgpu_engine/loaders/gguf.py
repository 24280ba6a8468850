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
from .model_config import LLAMA_ARCHS, LlamaConfig
from .tensor_info import QTYPE_BLOCK, SUPPORTED_QTYPES, TensorInfo, tensor_nbytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml_type enum -> our qtype names (only the ones QTYPE_BLOCK knows can be sized)
GGML_TYPES = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 9: "q8_1",
    10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k", 15: "q8_k", 20: "iq4_nl", 23: "iq4_xs",
    24: "i8", 25: "i16", 26: "i32", 27: "i64", 28: "f64", 30: "bf16",
}
QTYPE_TO_GGML = {v: k for k, v in GGML_TYPES.items()}

# GGUF metadata value types -> struct format of one scalar (8 string, 9 array handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

# The one table from GGUF tensor names to ours ({i}: layer index). Models see only our names.
GGUF_TO_OURS = {
    "token_embd.weight": "embed",                    # (vocab, hidden)
    "output_norm.weight": "norm",                    # (hidden,)
    "output.weight": "lm_head",                      # (vocab, hidden); absent when tied
    "rope_freqs.weight": "rope_freqs",               # llama-3.1 rope scaling factors (rot_dim/2,)
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm",
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
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attn_norm",  # Gemma 2/3 (1 + w stored)
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_ffn_norm",
    "blk.{i}.ffn_gate.weight": "layers.{i}.gate",    # (ffn, hidden)
    "blk.{i}.ffn_up.weight": "layers.{i}.up",        # (ffn, hidden); Phi-3: gate|up (2 ffn, hidden)
    "blk.{i}.ffn_down.weight": "layers.{i}.down",    # (hidden, ffn)
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def our_name(gguf_name: str) -> str | None:
    """Our name of a GGUF tensor, or None when the model does not use it."""
    m = _LAYER_NAME.match(gguf_name)
    if m is None:
        return GGUF_TO_OURS.get(gguf_name)
    ours = GGUF_TO_OURS.get("blk.{i}." + m.group(2))
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


class GGUFFile:
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

    def weights(self) -> dict[str, TensorInfo]:
        """{our name: TensorInfo} of the tensors the model uses (see GGUF_TO_OURS)."""
        out = {}
        for name, t in self.tensors.items():
            ours = our_name(name)
            if ours is not None:
                out[ours] = t
        return out

    def _meta(self, key: str, default=None, *, required: bool = False):
        full = f"{self.architecture}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if required:
            raise ModelFormatError(f"{self.where}: GGUF metadata lacks {full}")
        return default

    def model_config(self) -> LlamaConfig:
        """LlamaConfig from `<arch>.*` metadata (the names llama.cpp writes for llama/qwen2/qwen3/mistral)."""
        arch = self.architecture
        if arch not in LLAMA_ARCHS:
            raise UnsupportedModelError(
                f"{self.where}: GGUF architecture {arch!r} is not supported; supported: {LLAMA_ARCHS}")
        n_heads = int(self._meta("attention.head_count", required=True))
        n_kv = self._meta("attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):             # per-layer counts: only uniform ones are supported
            if len(set(n_kv)) != 1:
                raise UnsupportedModelError(f"{self.where}: per-layer kv head counts {set(n_kv)}")
            n_kv = n_kv[0]
        hidden = int(self._meta("embedding_length", required=True))
        head_dim = int(self._meta("attention.key_length", hidden // n_heads))
        rot_dim = int(self._meta("rope.dimension_count", head_dim))
        factors, scaling = self._rope_factors(rot_dim)
        long = self._longrope(rot_dim) if "rope_factors_long.weight" in self.tensors else {}
        if long:
            factors, scaling = self._f32_vector("rope_factors_short.weight", rot_dim // 2), "longrope"
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        embd = self.tensors.get("token_embd.weight")
        vocab = self._meta("vocab_size") or len(tokens) or (embd.shape[0] if embd else 0)
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        from .bpe import eog_ids                     # lazy: bpe imports nothing heavy, but is big
        sliding = self._meta("attention.sliding_window")
        gemma = self._gemma(hidden, n_heads, head_dim) if arch in ("gemma2", "gemma3") else {}
        return LlamaConfig(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            n_layers=int(self._meta("block_count", required=True)),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            ffn_size=int(self._meta("feed_forward_length", required=True)),
            rope_base=float(self._meta("rope.freq_base", 10000.0)),
            rot_dim=rot_dim, rope_freq_factors=factors, rope_scaling=scaling, **long, **gemma,
            # llama.cpp's converter permutes llama/mistral q,k rows to adjacent-pair rope; the rest are NEOX
            rope_neox=arch in ("qwen2", "qwen3", "phi3", "gemma2", "gemma3"),
            rms_eps=float(self._meta("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(self._meta("context_length", 4096)),
            tie_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            bos_id=int(bos) if bos is not None else None,
            eos_ids=eog_ids(self.metadata),
            sliding_window=int(sliding) if sliding else None,
            name=str(self.metadata.get("general.name", "")),
        )

    def _gemma(self, hidden: int, n_heads: int, head_dim: int) -> dict:
        """Gemma 2 / 3 settings as llama.cpp reads them: the norms hold 1 + w already; sliding
        layers every other one from the first (Gemma 2) or all but every sixth (Gemma 3, local
        rope base 10000 unless the file says); scores scaled by head_dim^-0.5, except for the 27B
        models (46 / 62 layers), whose query_pre_attn_scalar is hidden / heads."""
        arch, n = self.architecture, int(self._meta("block_count", required=True))
        pattern = self._meta("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        if isinstance(pattern, list):           # per-layer flags, as newer converters write them
            local = tuple(bool(x) for x in pattern)
        else:
            local = tuple(i % 2 == 0 if arch == "gemma2" else (i + 1) % int(pattern) != 0 for i in range(n))
        big = n == (46 if arch == "gemma2" else 62)
        return dict(act="gelu_tanh", embed_scale=float(hidden) ** 0.5, post_norms=True,
                    attn_scale=float(hidden // n_heads if big else head_dim) ** -0.5,
                    attn_softcap=float(self._meta("attn_logit_softcapping", 0.0) or 0.0),
                    final_softcap=float(self._meta("final_logit_softcapping", 0.0) or 0.0),
                    window_layers=local if self._meta("attention.sliding_window") else None,
                    rope_local_base=float(self._meta("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else 0.0)

    def _f32_vector(self, name: str, n: int) -> tuple:
        t = self.tensors.get(name)
        if t is None or t.qtype != "f32" or t.numel != n:
            raise ModelFormatError(f"{self.where}: {name} must be f32 ({n},), got "
                                   f"{(t.qtype, t.shape) if t else 'nothing'}")
        return struct.unpack(f"<{n}f", bytes(t.data))

    def _longrope(self, rot_dim: int) -> dict:
        """Phi-3's longrope as llama.cpp's converter writes it: rope_factors_long/short.weight, the
        original context and the attention factor."""
        return dict(rope_long_factors=self._f32_vector("rope_factors_long.weight", rot_dim // 2),
                    rope_original_context=int(self._meta("rope.scaling.original_context_length", 0)),
                    rope_attn_factor=float(self._meta("rope.scaling.attn_factor", 1.0)))

    def _rope_factors(self, rot_dim: int) -> tuple:
        """(per-frequency divisors or None, scaling name): `rope_freqs.weight` (Llama 3.1+: llama.cpp's
        converter stores the llama3 factors there) or `rope.scaling.type` linear with its factor."""
        scaling = str(self._meta("rope.scaling.type", "none") or "none")
        factor = float(self._meta("rope.scaling.factor", 1.0) or 1.0)
        t = self.tensors.get("rope_freqs.weight")
        if t is not None:
            if t.qtype != "f32" or t.numel != rot_dim // 2:
                raise ModelFormatError(f"{self.where}: rope_freqs.weight must be f32 ({rot_dim // 2},), "
                                       f"got {t.qtype} {t.shape}")
            return struct.unpack(f"<{rot_dim // 2}f", bytes(t.data)), "llama3"
        if scaling in ("none", "") or factor == 1.0:
            return None, ""
        if scaling == "linear":
            return (factor,) * (rot_dim // 2), "linear"
        raise UnsupportedModelError(f"{self.where}: rope scaling {scaling!r} (factor {factor}) is not "
                                    f"implemented; supported: linear, llama3 (rope_freqs)")

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
