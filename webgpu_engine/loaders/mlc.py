"""MLC-LLM artifacts (what WebLLM loads): `mlc-chat-config.json`, a tensor cache and its raw shards.

    art = MLCArtifact(folder)                # reads the chat config and the tensor cache, checks shard sizes
    art.verify()                             # md5 of every shard (ModelFormatError on a mismatch)
    art.config(family)                       # LlamaConfig (MLC's model_config field names mapped)
    art.weights()                            # {our name: TensorInfo}
    art.template()                           # tokenizer_config.json's Jinja template, else ConvTemplate

Layout (TVM's tvmjs tensor-cache writer): `tensor-cache.json` (older artifacts: `ndarray-cache.json`)
lists `records`, one per shard `params_shard_N.bin` (`dataPath`, `format` "raw-shard", `nbytes`,
`md5sum`), each with the tensors it concatenates (`name`, `shape`, `dtype`, `format`, `nbytes`,
`byteOffset`). A `float32` tensor of format `f32-to-bf16` is stored as bf16: it goes to the GPU as
bf16, which the kernels widen exactly.

Quantisations: q0f32 / q0f16 are float weights. q4f16_1 / q4f32_1 (MLC's group quantisation: groups
of 32 along K, `*.q_weight` (N, K/8) u32 with element r of a word at bits 4r, `*.q_scale` (N, K/32)
f16 / f32, value = (q - 7) * scale) are repacked at load, exactly, onto Q4_0 blocks: with
d = -scale and q' = 15 - q, (q' - 8) d = (7 - q)(-scale) = (q - 7) scale for every 4-bit q, and
negating a float is exact. q4f16_1 becomes GGUF's q4_0 (f16 d); q4f32_1 becomes q4_0f32, Q4_0 with an
f32 d (kernels/qtypes.py). The repack moves nibbles (numpy where installed, else the standard library's
byte operations). q3f16_1 is dequantised to f16 on load (loaders/mlc_q3.py). Other quantisations
(q4f16_0's KN layout, AWQ, fp8) are refused by name.

Families: each decoder family declares the MLC model_type values it reads, its parameter names (MLC
stores q|k|v as `qkv_proj` and gate|up as `gate_up_proj`: split into our q, k, v, gate, up on load by
the model, as Phi-3's; a table MLC keeps as a list of column blocks, `name.{i}`, mapped to ours
`name[:, {i}]`, is joined side by side: ColumnBlocks) and what MLC's config class says differently
(DecoderFamily.mlc_*, in models/family_*.py); `model_types()` lists them. A text model's names may
start `language_model.`.
Embedders: bert (WebLLM's snowflake-arctic-embed), in the float quantisations, read by loaders/mlc_bert.py.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from ..config import SAMPLING_FIELDS
from ..errors import ModelFormatError, UnsupportedModelError
from .gguf import _as_buffer
from .mlc_q3 import DequantizedQ3, model_widths
from .model_config import LlamaConfig
from .tensor_info import LazyTensorInfo, TensorInfo, split_fused

CHAT_CONFIG = "mlc-chat-config.json"
CACHE_FILES = ("tensor-cache.json", "ndarray-cache.json")
FLOAT_QUANTS = ("q0f32", "q0f16", "q0bf16")
GROUP_QUANTS = {"q4f16_1": "f16", "q4f32_1": "f32"}      # -> the dtype of q_scale
GROUP_SIZE = 32
# mlc-chat-config.json key -> the ChatConfig default it sets (config.SAMPLING_FIELDS; stop strings come
# from conv_template)
SAMPLING_KEYS = {f.mlc: f.chat_config for f in SAMPLING_FIELDS if f.mlc and f.chat_config}
# MLC dtype -> (ours, bytes per element)
DTYPES = {"float32": ("f32", 4), "float16": ("f16", 2), "bfloat16": ("bf16", 2), "uint32": ("u32", 4)}

# MLC's Llama parameter names (without .weight/.bias/.q_weight/.q_scale) -> ours: the table of every
# family whose DecoderFamily.mlc_names is None; the others declare theirs in models/family_*.py
MLC_LLAMA_TO_OURS = {
    "model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head",
    "model.layers.{i}.input_layernorm": "layers.{i}.attn_norm",
    "model.layers.{i}.post_attention_layernorm": "layers.{i}.ffn_norm",
    "model.layers.{i}.self_attn.qkv_proj": "layers.{i}.qkv",
    "model.layers.{i}.self_attn.o_proj": "layers.{i}.o",
    "model.layers.{i}.mlp.gate_up_proj": "layers.{i}.gate_up",
    "model.layers.{i}.mlp.down_proj": "layers.{i}.down",
}
ENCODERS = {"bert": "bert"}          # MLC model_type -> our embedder architecture (loaders/mlc_bert.py)
_PREFIX = "language_model."          # MLC's Gemma 3 names its text model so
_LAYER = re.compile(r"^(.*?)\.(\d+)\.(.+)$")
_INDEXED = re.compile(r"^(.*?)\.(\d+)$")           # a list's entry with no sub-name (Gemma 4's per-layer tables)
_COLUMNS = re.compile(r"^(.*)\[:, (\d+)\]$")        # ours "name[:, {i}]": column block i of `name`
_PARTS = ("q_weight", "q_scale", "weight", "bias")


def refusal(model_type: str, quantization: str, kind: str = "llm") -> str:
    """Why an MLC artifact of this model_type / quantization is not loaded ("" when it is); kind is
    WebLLM's model type (llm, embedding, vlm)."""
    if kind not in ("llm", "embedding") and (kind, model_type) != ("vlm", "phi3_v"):
        return f"{kind} models of MLC's are not loaded"
    if (model_type not in ENCODERS) if kind == "embedding" else (_family(model_type) is None):
        return f"{'embedding ' if kind == 'embedding' else ''}model_type {model_type or '?'!r}"
    if quantization not in quantizations(model_type):
        return f"quantization {quantization!r}"
    return ""


def _family(model_type: str):
    """The registered decoder family reading this MLC model_type (models.registry registers them)."""
    from .decoder_config import mlc_family
    return mlc_family(model_type)


def model_types() -> tuple[str, ...]:
    """The MLC model_type values the registered decoder families read."""
    from .decoder_config import FAMILIES
    return tuple(t for f in FAMILIES.values() for t in f.mlc_model_types)


def quantizations(model_type: str) -> tuple[str, ...]:
    """The quantisations an artifact of this model_type loads in (embedders: the float ones)."""
    return FLOAT_QUANTS if model_type in ENCODERS else (*FLOAT_QUANTS, *GROUP_QUANTS, "q3f16_1")


def _read_json(p: Path) -> dict:
    try:
        out = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelFormatError(f"{p} is missing: an MLC model folder needs it") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(out, dict):
        raise ModelFormatError(f"{p} is not a JSON object")
    return out


def stop_lists(conv: dict) -> tuple[list[str], list[int]]:
    """conv_template's stop_str and stop_token_ids, checked (ModelFormatError when not lists of those)."""
    out = []
    for key, kind in (("stop_str", str), ("stop_token_ids", int)):
        values = conv.get(key) or []
        if not isinstance(values, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise ModelFormatError(f"conv_template.{key} must be a list of {kind.__name__}, got {values!r}"[:300])
        out.append(list(values))
    return out[0], out[1]


def read_chat_config(folder) -> dict:
    """{"context": the model's context window, "overrides": ChatConfig fields its mlc-chat-config.json
    sets (sampling defaults, stop strings and ids, prefill chunk)}, for the engine's model record; an
    embedder's also says "model_type": "embedding", with no overrides (sampling means nothing there)."""
    cc = _read_json(Path(folder) / CHAT_CONFIG)
    if cc.get("model_type") in ENCODERS:
        return {"model_type": "embedding", "context": 0, "overrides": {}}
    try:
        return _chat_defaults(cc)
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelFormatError(f"{Path(folder) / CHAT_CONFIG}: a field has the wrong type: {e}") from e


def _chat_defaults(cc: dict) -> dict:
    mc = cc.get("model_config") if isinstance(cc.get("model_config"), dict) else {}
    ctx = mc.get("context_window_size") or cc.get("context_window_size") or 0
    over = {field: float(cc[k]) for k, field in SAMPLING_KEYS.items()
            if isinstance(cc.get(k), (int, float)) and not isinstance(cc.get(k), bool)}
    conv = cc.get("conv_template") if isinstance(cc.get("conv_template"), dict) else {}
    stop_str, stop_ids = stop_lists(conv)
    if stop_str:
        over["stop_str"] = stop_str
    if stop_ids:
        over["stop_token_ids"] = stop_ids
    chunk = mc.get("prefill_chunk_size") or cc.get("prefill_chunk_size")
    if isinstance(chunk, int) and chunk > 0:
        over["prefill_chunk_size"] = chunk
    return {"context": int(ctx) if isinstance(ctx, int) and ctx > 0 else 0, "overrides": over}


class MLCArtifact:
    """One MLC model folder, opened: `chat_config` (mlc-chat-config.json), `model_type`,
    `quantization`, `tensors` {MLC name: TensorInfo} (views into the mapped shards)."""

    def __init__(self, folder, *, verify_md5: bool = False):
        self.folder = Path(folder)
        self.chat_config = _read_json(self.folder / CHAT_CONFIG)
        self.model_type = str(self.chat_config.get("model_type", ""))
        self.quantization = str(self.chat_config.get("quantization", ""))
        where = str(self.folder / CHAT_CONFIG)
        self.family = _family(self.model_type)
        if self.family is None and self.model_type not in ENCODERS:
            raise UnsupportedModelError(f"{where}: MLC model_type {self.model_type!r} is not supported; "
                                        f"supported: {', '.join((*model_types(), *ENCODERS))}")
        if self.chat_config.get("model_task") == "embedding" and self.model_type not in ENCODERS:
            raise UnsupportedModelError(f"{where}: an MLC {self.model_type} embedder is not supported; MLC "
                                        f"embedders here: {', '.join(ENCODERS)}")
        if self.quantization not in quantizations(self.model_type):
            raise UnsupportedModelError(f"{where}: MLC quantization {self.quantization!r} is not supported for "
                                        f"{self.model_type}; supported: {', '.join(quantizations(self.model_type))}")
        cache = next((self.folder / n for n in CACHE_FILES if (self.folder / n).is_file()), None)
        if cache is None:
            raise ModelFormatError(f"{self.folder} holds no tensor cache ({' or '.join(CACHE_FILES)})")
        self.cache_path = cache
        self._shards: list[tuple[Path, dict]] = []
        self._maps: list = []
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._open_shards(_read_json(cache))
            if verify_md5:
                self.verify()
        except BaseException:
            self.close()
            raise

    def _open_shards(self, cache: dict) -> None:
        records = cache.get("records")
        if not isinstance(records, list) or not records:
            raise ModelFormatError(f"{self.cache_path}: no shard records")
        for shard in records:
            try:
                path, nbytes = self.folder / str(shard["dataPath"]), int(shard["nbytes"])
                fmt, entries = shard.get("format", "raw-shard"), list(shard["records"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ModelFormatError(f"{self.cache_path}: bad shard record {str(shard)[:200]}") from e
            if fmt != "raw-shard":
                raise UnsupportedModelError(f"{self.cache_path}: shard format {fmt!r} (raw-shard expected)")
            if not path.is_file():
                raise ModelFormatError(f"{path} is missing: the tensor cache lists it")
            size = path.stat().st_size
            if size != nbytes:
                raise ModelFormatError(f"{path} has {size} bytes, the tensor cache says {nbytes}: "
                                       "truncated or a different file")
            buf, mm, _ = _as_buffer(path)
            self._maps.append(mm)
            self._shards.append((path, shard))
            for r in entries:
                t = self._record(r, buf, path, nbytes)
                self.tensors[t.name] = t

    def _record(self, r: dict, buf, path: Path, shard_bytes: int) -> TensorInfo:
        try:
            name, shape, dtype = str(r["name"]), tuple(int(d) for d in r["shape"]), str(r["dtype"])
            fmt, nbytes, off = str(r.get("format", "raw")), int(r["nbytes"]), int(r["byteOffset"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{self.cache_path}: bad tensor record {str(r)[:200]}") from e
        if dtype not in DTYPES:
            raise UnsupportedModelError(f"{self.cache_path}: tensor {name} has dtype {dtype!r}; "
                                        f"supported: {', '.join(DTYPES)}")
        ours, size = DTYPES[dtype]
        # TVM's tensor-cache writer marks every record with the cache's encode format and converts
        # only float32 tensors (a q4f16_1 model's uint32 / float16 records say f32-to-bf16 too)
        if fmt == "f32-to-bf16" and dtype == "float32":
            ours, size = "bf16", 2                  # stored as bf16: the GPU widens it exactly
        elif fmt not in ("raw", "f32-to-bf16"):
            raise UnsupportedModelError(f"{self.cache_path}: tensor {name} has format {fmt!r} (raw, f32-to-bf16)")
        if nbytes != math.prod(shape) * size or min(shape, default=0) < 0 or off < 0 or off + nbytes > shard_bytes:
            raise ModelFormatError(f"{self.cache_path}: tensor {name} ({dtype} {list(shape)}, {fmt}) has "
                                   f"{nbytes} bytes at {off}, which do not fit its shape or {path.name}")
        return TensorInfo(name, ours, shape, buf[off:off + nbytes], off)

    def verify(self) -> None:
        """md5 of every shard against the tensor cache's md5sum (ModelFormatError on a mismatch)."""
        for path, shard in self._shards:
            want = shard.get("md5sum")
            if not want:
                continue
            h = hashlib.md5(usedforsecurity=False)
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != str(want).lower():
                raise ModelFormatError(f"{path}: md5 {h.hexdigest()} differs from the tensor cache's {want}: "
                                       "corrupt or a different file")

    # ------------------------------------------------------------------ config
    def hf_config(self) -> dict:
        """mlc-chat-config.json's model_config in config.json's field names (what the family readers take)."""
        cc = self.chat_config
        c = cc.get("model_config")
        if not isinstance(c, dict) or not c:
            raise ModelFormatError(f"{self.folder / CHAT_CONFIG} has no model_config object")
        c = dict(c)
        if isinstance(c.get("text_config"), dict):          # Gemma 3: the text model's fields
            c = {**c, **c.pop("text_config")}
        if isinstance(c.get("kwargs"), dict):               # fields MLC's config class kept aside
            c = {**c.pop("kwargs"), **c}
        c["model_type"] = self.model_type
        if self.family.mlc is not None:                     # what MLC's config class of the family says its way
            c = self.family.mlc(c)
        if c.get("position_embedding_base"):
            c["rope_theta"] = c["position_embedding_base"]
        ctx = int(c.get("context_window_size") or cc.get("context_window_size") or 0)
        if ctx > 0 and not c.get("max_position_embeddings"):   # Phi-3 keeps its trained length
            c["max_position_embeddings"] = ctx
        # the first positive of MLC's window fields (-1 / 0 / null: none; Gemma 2 keeps `sliding_window`)
        window = next((int(v) for v in (c.get("sliding_window_size"), c.get("sliding_window"),
                                         cc.get("sliding_window_size")) if v and int(v) > 0), -1)
        c["use_sliding_window"] = window > 0
        c["sliding_window"] = window if window > 0 else None
        for key in ("bos_token_id", "eos_token_id"):
            if cc.get(key) is not None:
                c[key] = cc[key]
        conv = cc.get("conv_template")
        stops = stop_lists(conv)[1] if isinstance(conv, dict) else []
        eos = c.get("eos_token_id")
        eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        c["eos_token_id"] = list(dict.fromkeys([*eos, *stops]))
        return c

    def config(self, family=None) -> LlamaConfig:
        from .decoder_config import hf_config_from_dict
        family = family or self.family
        where = str(self.folder / CHAT_CONFIG)
        try:
            cfg = hf_config_from_dict(self.hf_config(), family, where)
        except (TypeError, ValueError, AttributeError) as e:    # a field of the wrong type
            raise ModelFormatError(f"{where}: model_config does not read as a {family.name} config: {e}") from e
        cfg.name = self.folder.name
        cfg.norm_plus_one = False             # MLC's Gemma converters store 1 + w
        return cfg

    # ------------------------------------------------------------------ weights
    def weights(self) -> dict[str, TensorInfo]:
        """{our name: TensorInfo}: MLC names mapped, q4 pairs repacked onto Q4_0 blocks, fused q|k|v
        biases split (fused matrices stay `layers.i.qkv` / `gate_up`: the model splits them)."""
        table = self.family.mlc_names or MLC_LLAMA_TO_OURS
        groups: dict[str, dict[str, TensorInfo]] = {}
        for name, t in self.tensors.items():
            base, _, part = name.removeprefix(_PREFIX).rpartition(".")
            if part not in _PARTS:                          # a parameter without a suffix (Qwen3.5's A_log)
                base, part = name.removeprefix(_PREFIX), "weight"
            key, index = base, None
            if m := _LAYER.match(base):
                key, index = f"{m.group(1)}.{{i}}.{m.group(3)}", m.group(2)
            elif m := _INDEXED.match(base):
                key, index = f"{m.group(1)}.{{i}}", m.group(2)
            ours = table.get(key)
            if ours is None:
                continue
            ours = ours.replace("{i}", index) if index is not None else ours
            groups.setdefault(ours, {})[part] = t
        out: dict[str, TensorInfo] = {}
        widths = model_widths(self.config()) if self.quantization == "q3f16_1" else ()
        for ours, parts in groups.items():
            if widths and {"q_weight", "q_scale"} <= set(parts):
                out[ours] = DequantizedQ3(parts["q_weight"], parts["q_scale"], widths, str(self.cache_path))
            elif "q_weight" in parts or "q_scale" in parts:
                out[ours] = self._q4_pair(ours, parts)
            elif "weight" in parts:
                out[ours] = parts["weight"]
            if "bias" in parts:
                out[ours + "_bias"] = parts["bias"]
        return _split_biases(_join_columns(out), self.config())

    def _q4_pair(self, ours: str, parts: dict) -> TensorInfo:
        qw, qs = parts.get("q_weight"), parts.get("q_scale")
        if qw is None or qs is None:
            raise ModelFormatError(f"{self.cache_path}: {(qw or qs).name} has no "
                                   f"{'q_scale' if qs is None else 'q_weight'} beside it")
        scale = GROUP_QUANTS.get(self.quantization)
        if scale is None:
            raise ModelFormatError(f"{self.cache_path}: {qw.name} is quantised in a {self.quantization} artifact")
        n, k = qw.shape[0], qw.shape[-1] * 8
        # q4f32_1 written by MLC's converter stores its f32 scales as bf16 (f32-to-bf16)
        widen = scale == "f32" and qs.qtype == "bf16"
        if qw.qtype != "u32" or len(qw.shape) != 2 or (qs.qtype != scale and not widen) \
                or tuple(qs.shape) != (n, k // GROUP_SIZE) or k % GROUP_SIZE:
            raise ModelFormatError(f"{self.cache_path}: {qw.name} {qw.qtype} {list(qw.shape)} / {qs.name} {qs.qtype} "
                                   f"{list(qs.shape)} are not {self.quantization}'s (N, K/8) u32 / (N, K/32) {scale}")
        return RepackedQ4(qw, _Bf16AsF32(qs) if widen else qs, n, k, scale)

    # ------------------------------------------------------------------ tokenizer, template
    def template(self):
        """tokenizer_config.json's Jinja chat template when the folder has one, else the chat config's
        conv_template (ConvTemplate), else None."""
        from .chat_template import from_folder
        t = from_folder(self.folder)
        if t is not None:
            return t
        conv = self.chat_config.get("conv_template")
        if not isinstance(conv, dict):
            return None
        try:
            return ConvTemplate(conv)
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelFormatError(f"{self.folder / CHAT_CONFIG}: conv_template does not read: {e}") from e

    def close(self) -> None:
        self.tensors = {}
        for mm in self._maps:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:          # views still alive: the GC closes it with them
                    pass
        self._maps = []


class _Bf16AsF32:
    """A bf16 tensor's bytes widened to f32 (exact: bf16 is f32's top half) when first read."""

    def __init__(self, t: TensorInfo):
        self._t = t

    @property
    def data(self) -> memoryview:
        b = self._t.data.cast("B")
        out = bytearray(2 * len(b))
        out[2::4], out[3::4] = b[0::2], b[1::2]       # little-endian: the bf16 bits are the top two bytes
        return memoryview(out)


class RepackedQ4(LazyTensorInfo):
    """An MLC q4 weight as Q4_0 blocks (q4_0 / q4_0f32), repacked when its bytes are first read (the
    model's upload), not when the headers are read (memory estimates, info)."""

    def __init__(self, q_weight: TensorInfo, q_scale: TensorInfo, n: int, k: int, scale: str):
        self._src = (q_weight, q_scale, scale)
        super().__init__(q_weight.name, "q4_0" if scale == "f16" else "q4_0f32", (n, k), None, q_weight.offset)

    def _make(self) -> memoryview:
        qw, qs, scale = self._src
        return repack_q4(qw.data, qs.data, self.shape[0], self.shape[1], scale)


class ColumnBlocks(LazyTensorInfo):
    """Matrices of the same rows and type side by side, (n, k0 + k1 + ...), made when first read: MLC
    keeps a table HF stores as one (Gemma 4's per-layer embeddings, (V, L P)) as L tables (V, P). A
    row of any type is whole blocks, so a row of the result is the parts' rows' bytes one after another."""

    def __init__(self, name: str, parts: list[TensorInfo]):
        self._parts = parts
        super().__init__(name, parts[0].qtype, (parts[0].n, sum(p.k for p in parts)), None, parts[0].offset)

    def _make(self) -> memoryview:
        n = self.shape[0]
        srcs = [memoryview(p.data).cast("B") for p in self._parts]
        rows = [len(src) // n for src in srcs]
        # copy in the widest words that divide every row (Q4_0's 18-byte blocks: 2 bytes): word w of
        # every row of a part at once, as strided slices of memoryviews
        unit = next(u for u in (8, 4, 2, 1) if all(r % u == 0 for r in rows))
        code = {8: "Q", 4: "I", 2: "H", 1: "B"}[unit]
        width = sum(rows) // unit
        out = bytearray(n * sum(rows))
        dst, at = memoryview(out).cast(code), 0
        for src, r in zip(srcs, rows):
            words, r = src.cast(code), r // unit
            for w in range(r):
                dst[at + w::width] = words[w::r]
            at += r
        return memoryview(out)


def _join_columns(w: dict) -> dict:
    """`name[:, i]` tensors (the family's table says so) as one ColumnBlocks `name`, blocks in order of i."""
    blocks: dict[str, dict[int, TensorInfo]] = {}
    out = {}
    for name, t in w.items():
        m = _COLUMNS.match(name)
        if m:
            blocks.setdefault(m.group(1), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for name, parts in blocks.items():
        ordered = [parts[i] for i in sorted(parts)]
        if sorted(parts) != list(range(len(parts))) or len({(p.qtype, p.n) for p in ordered}) != 1 \
                or any(len(p.shape) != 2 for p in ordered):
            raise ModelFormatError(f"{name}: its column blocks {sorted(parts)} are not 0..{len(parts) - 1} "
                                   f"matrices of the same rows and type: "
                                   f"{[(p.name, p.qtype, list(p.shape)) for p in ordered]}"[:400])
        out[name] = ColumnBlocks(name, ordered)
    return out


def _split_biases(w: dict, cfg: LlamaConfig) -> dict:
    """`layers.i.qkv_bias` (Qwen's c_attn bias, Phi's Wqkv bias) as q_bias | k_bias | v_bias."""
    biases = {n: t for n, t in w.items() if n.endswith(".qkv_bias")}
    try:
        split = split_fused(biases, cfg.q_dim, cfg.kv_dim, cfg.ffn_size)
    except ValueError as e:
        raise ModelFormatError(f"{e}, expected q {cfg.q_dim} | k {cfg.kv_dim} | v {cfg.kv_dim}") from e
    return {**{n: t for n, t in w.items() if n not in biases}, **split}


# byte -> its low / high nibble q as 15 - q, in the low or the high half of a byte (repack_q4)
_LOW, _LOW_UP = bytes((b & 15) ^ 15 for b in range(256)), bytes(((b & 15) ^ 15) << 4 for b in range(256))
_HIGH, _HIGH_UP = bytes((b >> 4) ^ 15 for b in range(256)), bytes(((b >> 4) ^ 15) << 4 for b in range(256))
_SIGN = bytes(b ^ 0x80 for b in range(256))


def _or(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") | int.from_bytes(b, "little")).to_bytes(len(a), "little")


def repack_q4(q_weight, q_scale, n: int, k: int, scale: str):
    """MLC q4 (q_weight (n, k/8) u32, element r of a word at bits 4r; q_scale (n, k/32) f16 / f32;
    value (q - 7) s) as Q4_0 blocks (d f16 | qs[16], or d f32 | qs[16]: byte j holds elements j and
    j + 16; value (q' - 8) d) with d = -s and q' = 15 - q: the same values, bit for bit.

    A group's 16 MLC bytes hold elements 2m (low nibble) and 2m + 1 (high) in byte m, so Q4_0's byte
    2m is the low nibbles of bytes m and m + 8, byte 2m + 1 their high nibbles (15 - q is q ^ 15).
    numpy where it is installed (about 2.5x faster), else the standard library (the page)."""
    from importlib.util import find_spec
    fast = find_spec("numpy") is not None
    return (repack_q4_numpy if fast else repack_q4_stdlib)(q_weight, q_scale, n, k, scale)


def repack_q4_numpy(q_weight, q_scale, n: int, k: int, scale: str) -> memoryview:
    import numpy as np
    groups = n * k // GROUP_SIZE
    qb = np.frombuffer(q_weight, np.uint8, groups * 16).reshape(groups, 16)
    sb = 2 if scale == "f16" else 4
    out = np.empty((groups, sb + 16), np.uint8)
    lo, hi = qb[:, :8], qb[:, 8:]
    out[:, sb::2] = (lo & 0x0F) | (hi << 4)
    out[:, sb + 1::2] = (lo >> 4) | (hi & 0xF0)
    out[:, sb:] ^= 0xFF
    out[:, :sb] = np.frombuffer(q_scale, np.uint8, groups * sb).reshape(groups, sb)
    out[:, sb - 1] ^= 0x80                               # d = -s: the sign bit (little-endian top byte)
    return memoryview(out.reshape(-1))


def repack_q4_stdlib(q_weight, q_scale, n: int, k: int, scale: str) -> memoryview:
    """repack_q4 with byte-wide operations of the standard library (translate tables, strided
    slices, a big-integer OR)."""
    groups = n * k // GROUP_SIZE
    sb = 2 if scale == "f16" else 4
    words = memoryview(q_weight).cast("B")[:groups * 16].cast("Q")   # 8-byte halves of each group
    first, second = words[0::2].tobytes(), words[1::2].tobytes()     # bytes 0..7 and 8..15 of each
    even = _or(first.translate(_LOW), second.translate(_LOW_UP))     # Q4_0 bytes 0, 2, .., 14 of each
    odd = _or(first.translate(_HIGH), second.translate(_HIGH_UP))     # and 1, 3, .., 15
    scales = memoryview(q_scale).cast("B")[:groups * sb]
    block = sb + 16
    out = bytearray(groups * block)
    for p in range(sb - 1):
        out[p::block] = scales[p::sb]
    out[sb - 1::block] = scales[sb - 1::sb].tobytes().translate(_SIGN)   # d = -s: the sign bit
    for m in range(8):
        out[sb + 2 * m::block] = even[m::8]
        out[sb + 2 * m + 1::block] = odd[m::8]
    return memoryview(out)


# --------------------------------------------------------------------------- conv_template
# WebLLM's MessagePlaceholders: the text role_templates put a message's content in
_PLACEHOLDERS = {"user": "{user_message}", "assistant": "{assistant_message}", "tool": "{tool_message}"}


class ConvTemplate:
    """MLC's conversation template (mlc-chat-config.json `conv_template`), rendered as WebLLM's
    conversation.ts getPromptArray does: the system template with the system message (a request's
    replaces the default), no separator after it; per message its role's text (`roles`, or the
    message's `name`), the role separator, the content through `role_templates` (when given) and the
    turn separator `seps[i % len(seps)]`; no role text before the first message after a system prompt
    when `add_role_after_system_message` is false; the generation prompt is the assistant role and
    the empty separator. Same interface as ChatTemplate."""

    def __init__(self, conv: dict):
        self.conv = conv
        self.name = str(conv.get("name", ""))
        self.system_template = conv.get("system_template", "{system_message}")
        self.system_message = conv.get("system_message") or ""
        self.roles = dict(conv.get("roles") or {"user": "user", "assistant": "assistant"})
        self.role_templates = dict(conv.get("role_templates") or {})
        self.seps = list(conv.get("seps") or ["\n"])
        # ": " when absent, as WebLLM; "" stays ""
        self.role_content_sep = ": " if conv.get("role_content_sep") is None else conv["role_content_sep"]
        self.role_empty_sep = ": " if conv.get("role_empty_sep") is None else conv["role_empty_sep"]
        self.stop_str, self.stop_token_ids = stop_lists(conv)
        self.system_prefix_token_ids = [int(i) for i in conv.get("system_prefix_token_ids") or []]
        self.add_role_after_system_message = bool(conv.get("add_role_after_system_message", True))
        texts = (self.system_template, self.system_message, self.role_content_sep, self.role_empty_sep,
                 *self.roles.values(), *self.role_templates.values(), *self.seps)
        if not all(isinstance(t, str) for t in texts) or not isinstance(conv.get("seps") or [], list):
            raise ModelFormatError("conv_template: its templates, roles, role_templates and seps must be "
                                   "strings (seps a list of them)")
        self.source = json.dumps(conv)
        self.bos_token = self.eos_token = ""

    def _text(self, content) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):            # OpenAI content parts: the text parts
            return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "" if content is None else str(content)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **_) -> str:
        system = self.system_message
        turns = []
        for m in messages:
            role = m.get("role")
            if role in ("system", "developer"):
                system = self._text(m.get("content"))
            else:
                turns.append((role, m.get("name") or self.roles.get(role, role), self._text(m.get("content"))))
        # JavaScript's String.replace with a string: the first occurrence only
        out = self.system_template.replace("{system_message}", system, 1)
        for i, (role, role_str, content) in enumerate(turns):
            tpl = self.role_templates.get(role)
            text = tpl.replace(_PLACEHOLDERS.get(role, "{user_message}"), content, 1) \
                .replace("{function_string}", "", 1) if tpl else content
            prefix = "" if i == 0 and out and not self.add_role_after_system_message \
                else role_str + self.role_content_sep
            out += f"{prefix}{text}{self.seps[i % len(self.seps)]}"
        if add_generation_prompt:
            out += f"{self.roles.get('assistant', 'assistant')}{self.role_empty_sep}"
        return out

    def encode(self, tokenizer, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        from .chat_template import encode_template_text
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        ids = encode_template_text(tokenizer, text) if getattr(tokenizer, "special_regex", None) is not None \
            else list(tokenizer.encode(text))
        return [*self.system_prefix_token_ids, *ids]


__all__ = ["CACHE_FILES", "CHAT_CONFIG", "ConvTemplate", "ENCODERS", "MLCArtifact", "MLC_LLAMA_TO_OURS", "model_types", "quantizations",
           "read_chat_config", "refusal", "repack_q4", "repack_q4_numpy", "repack_q4_stdlib", "stop_lists"]
