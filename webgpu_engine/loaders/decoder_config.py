"""The shared reading of decoder configs: GGUF `<arch>.*` metadata and HF `config.json` -> LlamaConfig.

    cfg = gguf_config(gguf_file, family)          # family: a DecoderFamily, or None: the registered one
    cfg = hf_config_from_dict(config, family)     # config.json as a dict
    cfg = load_hf_config(folder, family)          # + generation_config.json's stop ids

Every decoder family spells most of its hyper-parameters the way Llama does (head counts, sizes,
rope base and scaling, partial rotary, context, stop ids); that reading is written once here. What a
family adds (its names in config.json, the defaults its transformers class assumes, how llama.cpp's
converter stores its q/k rows, fields only it has such as Gemma's soft-caps) is a `DecoderFamily`
record in that family's own module, `webgpu_engine/models/family_*.py`. The loaders never import
those modules: `models.registry` registers each family here (`register_family`), and passes the
family in explicitly when it opens a model; a loader called directly (`GGUFFile.model_config()`,
`hf_config.load_llama_config`) looks the family up in the table registered here.
Standard library only (runs in the page).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import ModelFormatError, UnsupportedModelError, supported_entry, unsupported_hf_config
from .model_config import LlamaConfig, llama3_rope_factors


@dataclass(frozen=True)
class DecoderFamily:
    """What one decoder family adds to the shared reading (declared in models/family_<name>.py).

    The hooks take the fields the shared reading made ({LlamaConfig field: value}) and return them
    amended; the record's name becomes LlamaConfig.arch unless a hook sets another."""

    name: str                                # GGUF general.architecture and our architecture name
    hf_architectures: tuple = ()             # config.json `architectures` entries of this family
    hf_model_types: tuple = ()               # config.json `model_type` values (when architectures is absent)
    # config.json keys this family's transformers class defaults differently from Llama's
    # (e.g. Qwen2's attention_bias True, Mistral's sliding window on unless use_sliding_window says no)
    hf_defaults: dict = field(default_factory=dict)
    gguf_neox: bool = False                  # llama.cpp's converter leaves q/k rows unpermuted: rope pairs halves
    hf_names: str | dict = "llama"           # safetensors names: a loaders.hf_config table kind, or its own table
    # GGUF tensor names ({i}: the layer) this family reads as other names of ours than loaders.gguf's
    # table gives them (gpt-oss: its post_attention_norm is the FFN's norm)
    gguf_names: dict = field(default_factory=dict)
    # how its chat answers are written: "" (<think> and tool-call markers, engine/output.py) or
    # "harmony" (gpt-oss's channels, engine/harmony.py)
    chat_format: str = ""
    # ({our name: TensorInfo} of an HF folder) -> the same, tensors the family stores its own way made
    # the ones the model reads (gpt-oss: OpenAI's MXFP4 blocks and scales as ggml's MXFP4 stacks)
    hf_weights: Callable | None = None
    gguf: Callable | None = None             # (GGUFFile, fields) -> fields
    hf: Callable | None = None               # (config.json dict, fields, where) -> fields
    # new math: {point: fn(m, i, t, T) -> [Op]}, ops models/decoder.py runs on tensor t (T rows) at
    # that point of layer i of model m (a LlamaModel: m.dev, m.cfg with its `extra` values):
    # "qkv" (T, Hq + 2 Hkv, D) after the projection (and q/k norms), before RoPE; "attn" (T, Hq * D)
    # the attention's output, before the o projection; "ffn" (T, F) act(gate) * up, before the down
    # projection; "logits" (rows, V) after the LM head (i = -1); "qkv_rows": "qkv"'s point, the fn
    # taking (m, i, t, T, (step, positions or None)) where each row's position is (Ministral 3's query
    # temperature: kernels/rope.py q_temperature); "embed" x (T, C) after the embedding lookup, before
    # image rows take their features, and "inputs" x after them (i = -1); "layer_end" x after layer i's
    # FFN residual: these three take a fifth argument, the forward's models.decoder.Rows (its KV
    # access with the input ids, row mode and matmul flags; Gemma's sqrt(C), Gemma 4's per-layer
    # inputs and layer scalar). The fusions across a point the family uses are off (RoPE in the qkv
    # matmul, act(gate) * up in the down matmul, the next norm in the down matmul after "layer_end").
    ops: dict = field(default_factory=dict)
    # a token mixer other than attention: fn(m, i, weights, mat) -> (layer i's input projection, its
    # mixer: models/llama.py LlamaLayer.mixer), or None where layer i attends (Qwen3.5's Gated DeltaNet)
    mixer: Callable | None = None
    # MLC-LLM artifacts (loaders/mlc.py): the mlc-chat-config.json model_type values of this family; its
    # parameter names ({MLC name less .weight / .bias / .q_weight / .q_scale, `{i}` the layer: ours};
    # None: MLC's Llama names, loaders.mlc.MLC_LLAMA_TO_OURS); a hook (model_config in config.json's
    # names) -> model_config for what MLC's config class of the family says differently
    mlc_model_types: tuple = ()
    mlc_names: dict | None = None
    mlc: Callable | None = None


# name -> DecoderFamily: the families models.registry registered (models/family_*.py)
FAMILIES: dict[str, DecoderFamily] = {}


def register_family(family: DecoderFamily) -> None:
    FAMILIES[family.name] = family


def unregister_family(name: str) -> None:
    FAMILIES.pop(name, None)


def family_named(name: str, where: str = "") -> DecoderFamily:
    """The family of a GGUF general.architecture, or UnsupportedModelError."""
    return supported_entry(FAMILIES, name, "GGUF architecture", where)


def mlc_family(model_type: str) -> DecoderFamily | None:
    """The family an MLC artifact's model_type belongs to (None: no registered family reads it)."""
    return next((f for f in FAMILIES.values() if model_type in f.mlc_model_types), None)


def family_of(c: dict, where: str = "config.json") -> DecoderFamily:
    """The family of a config.json: its first `architectures` entry a family claims, else its model_type."""
    archs = c.get("architectures") or []
    by_arch = {a: f for f in FAMILIES.values() for a in f.hf_architectures}
    fam = next((by_arch[a] for a in archs if a in by_arch), None)
    if fam is None:
        fam = next((f for f in FAMILIES.values() if c.get("model_type") in f.hf_model_types), None)
    if fam is None:
        raise unsupported_hf_config(c, by_arch, where)
    return fam


# --------------------------------------------------------------------------- GGUF
def gguf_fields(g) -> dict:
    """LlamaConfig fields from the `<arch>.*` keys llama.cpp writes for every Llama-style decoder, and
    from the tensors present: q/k/v biases, per-head q/k norms, an untied head, RoPE scaling
    (`rope_freqs.weight`: Llama 3.1+; `rope.scaling.type` linear; Phi-3's longrope factor tensors)."""
    n_heads = int(g.meta("attention.head_count", required=True))
    n_kv = g.meta("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):             # per-layer counts: only uniform ones are supported
        if len(set(n_kv)) != 1:
            raise UnsupportedModelError(f"{g.where}: per-layer kv head counts {set(n_kv)}")
        n_kv = n_kv[0]
    hidden = int(g.meta("embedding_length", required=True))
    head_dim = int(g.meta("attention.key_length", hidden // n_heads))
    rot_dim = int(g.meta("rope.dimension_count", head_dim))
    factors, scaling = _gguf_rope_factors(g, rot_dim)
    long = _gguf_longrope(g, rot_dim) if "rope_factors_long.weight" in g.tensors else {}
    if long:
        factors, scaling = _f32_vector(g, "rope_factors_short.weight", rot_dim // 2), "longrope"
    tokens = g.metadata.get("tokenizer.ggml.tokens") or []
    embd = g.tensors.get("token_embd.weight")
    vocab = g.meta("vocab_size") or len(tokens) or (embd.shape[0] if embd else 0)
    bos = g.metadata.get("tokenizer.ggml.bos_token_id")
    from .bpe import eog_ids                     # lazy: bpe imports nothing heavy, but is big
    sliding = g.meta("attention.sliding_window")
    experts = int(g.meta("expert_count", 0) or 0)
    moe = dict(n_experts=experts, n_experts_used=int(g.meta("expert_used_count", 0) or 0),
               # llama.cpp's graph renormalises the chosen weights unless the file says otherwise
               # (Mixtral, Qwen3-MoE); OLMoE's family turns it off, as llama.cpp's olmoe graph does
               moe_norm_topk=bool(g.meta("expert_weights_norm", True)),
               ffn_size=int(g.meta("expert_feed_forward_length", 0) or g.meta("feed_forward_length", 0))) \
        if experts else {}
    return dict(
        arch=g.architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        n_layers=int(g.meta("block_count", required=True)),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        ffn_size=_first(g.meta("feed_forward_length", 0 if experts else None, required=not experts)),
        rope_base=float(g.meta("rope.freq_base", 10000.0)),
        rot_dim=rot_dim, rope_freq_factors=factors, rope_scaling=scaling, **long,
        **({"rope_attn_factor": _yarn_attention_factor({"factor": g.meta("rope.scaling.factor")})}
           if scaling == "yarn" else {}),
        # llama.cpp's converter permutes llama's q,k rows to adjacent-pair rope (families may differ)
        rope_neox=False,
        rms_eps=float(g.meta("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(g.meta("context_length", 4096)),
        tie_embeddings="output.weight" not in g.tensors,
        qkv_bias="blk.0.attn_q.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        bos_id=int(bos) if bos is not None else None,
        eos_ids=eog_ids(g.metadata),
        sliding_window=int(sliding) if sliding else None,
        name=str(g.metadata.get("general.name", "")),
    ) | moe


def _first(v) -> int:
    """A per-layer array's first value (Gemma 4's FFN widths: its family reads them all), else the value."""
    return int(v[0] if isinstance(v, list) else v)


def gguf_config(g, family: DecoderFamily | None = None) -> LlamaConfig:
    """LlamaConfig of a decoder GGUF: the shared fields, amended by `family` (default: the family
    registered for the file's general.architecture)."""
    family = family or family_named(g.architecture, g.where)
    fields = gguf_fields(g)
    if family.gguf_neox:
        fields["rope_neox"] = True
    if family.gguf is not None:
        fields = family.gguf(g, fields)
    return LlamaConfig(**fields)


def _f32_vector(g, name: str, n: int) -> tuple:
    t = g.tensors.get(name)
    if t is None or t.qtype != "f32" or t.numel != n:
        raise ModelFormatError(f"{g.where}: {name} must be f32 ({n},), got "
                               f"{(t.qtype, t.shape) if t else 'nothing'}")
    return struct.unpack(f"<{n}f", bytes(t.data))


def _gguf_longrope(g, rot_dim: int) -> dict:
    """Phi-3's longrope as llama.cpp's converter writes it: rope_factors_long/short.weight, the
    original context and the attention factor."""
    return dict(rope_long_factors=_f32_vector(g, "rope_factors_long.weight", rot_dim // 2),
                rope_original_context=int(g.meta("rope.scaling.original_context_length", 0)),
                rope_attn_factor=float(g.meta("rope.scaling.attn_factor", 1.0)))


def _gguf_rope_factors(g, rot_dim: int) -> tuple:
    """(per-frequency divisors or None, scaling name): `rope_freqs.weight` (Llama 3.1+: llama.cpp's
    converter stores the llama3 factors there) or `rope.scaling.type` linear with its factor."""
    scaling = str(g.meta("rope.scaling.type", "none") or "none")
    factor = float(g.meta("rope.scaling.factor", 1.0) or 1.0)
    t = g.tensors.get("rope_freqs.weight")
    if t is not None:
        if t.qtype != "f32" or t.numel != rot_dim // 2:
            raise ModelFormatError(f"{g.where}: rope_freqs.weight must be f32 ({rot_dim // 2},), "
                                   f"got {t.qtype} {t.shape}")
        return struct.unpack(f"<{rot_dim // 2}f", bytes(t.data)), "llama3"
    if scaling in ("none", "") or factor == 1.0:
        return None, ""
    if scaling == "linear":
        return (factor,) * (rot_dim // 2), "linear"
    if scaling == "yarn":               # llama.cpp's ggml_rope_yarn_corr_dims: the range floored / ceiled
        return yarn_rope_factors(rot_dim, float(g.meta("rope.freq_base", 10000.0)), factor,
                                 int(g.meta("rope.scaling.original_context_length", required=True)),
                                 float(g.meta("rope.scaling.yarn_beta_fast", 32.0)),
                                 float(g.meta("rope.scaling.yarn_beta_slow", 1.0)), True), "yarn"
    raise UnsupportedModelError(f"{g.where}: rope scaling {scaling!r} (factor {factor}) is not "
                                f"implemented; supported: linear, llama3 (rope_freqs), yarn")


# --------------------------------------------------------------------------- HF config.json
def _legacy_rope(c: dict) -> dict:
    """config.json as transformers 4 wrote it: transformers 5 keeps rope_theta, rope_scaling,
    partial_rotary_factor (and Gemma 3's local base) in `rope_parameters`, one dict or one per
    layer type."""
    rp = c.get("rope_parameters")
    if not isinstance(rp, dict):
        return c
    c = dict(c)
    full = rp.get("full_attention", rp)
    if "sliding_attention" in rp:
        c.setdefault("rope_local_base_freq", rp["sliding_attention"].get("rope_theta"))
    if full.get("rope_theta") is not None:
        c.setdefault("rope_theta", full["rope_theta"])
    if full.get("partial_rotary_factor") is not None:
        c.setdefault("partial_rotary_factor", full["partial_rotary_factor"])
    if full.get("rope_type", "default") != "default" and not c.get("rope_scaling"):
        c["rope_scaling"] = full
    return c


def hf_sliding_window(c: dict) -> int | None:
    """config.json's sliding_window when it applies: when use_sliding_window says so (a family's
    hf_defaults may turn it on by default: Mistral, Phi-3, Gemma)."""
    sliding = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    return int(sliding) if sliding else None


def hf_fields(c: dict, family: DecoderFamily, where: str = "config.json") -> dict:
    """LlamaConfig fields from the config.json keys transformers' Llama-style classes share (c: with
    the family's hf_defaults and the transformers-4 rope keys already applied). RoPE scaling types
    and partial_rotary_factor are transformers' shared rope utilities, so they are read here too."""
    n_heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // n_heads)
    eos = c.get("eos_token_id")
    rot_dim = int(head_dim * float(c.get("partial_rotary_factor", 1.0)))
    factors, scaling = _hf_rope_scaling(c, rot_dim, where)
    long = _hf_longrope(c, rot_dim, where) if scaling == "longrope" else \
        {"rope_attn_factor": _yarn_attention_factor(c["rope_scaling"])} if scaling == "yarn" else {}
    return dict(
        arch=family.name, vocab_size=int(c["vocab_size"]), hidden_size=hidden,
        n_layers=int(c["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads), head_dim=head_dim,
        ffn_size=int(c["intermediate_size"]), rope_base=float(c.get("rope_theta", 10000.0)),
        rot_dim=rot_dim, rope_freq_factors=factors, rope_scaling=scaling, **long,
        rope_neox=True,                     # HF weights: rotate_half pairs (i, i + d/2)
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        context_length=int(c.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=bool(c.get("attention_bias", False)),
        bos_id=c.get("bos_token_id"),
        eos_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
        sliding_window=hf_sliding_window(c),
        name=str(c.get("_name_or_path", "")),
    )


def hf_config_from_dict(c: dict, family: DecoderFamily | None = None, where: str = "config.json") -> LlamaConfig:
    """LlamaConfig of a config.json: the shared fields, amended by `family` (default: the registered
    family its architectures / model_type name)."""
    c = _legacy_rope(c)
    family = family or family_of(c, where)
    if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c:
        # a multimodal folder (Gemma 4 as released): the text model's keys
        c = _legacy_rope({**c["text_config"], "architectures": c.get("architectures") or []})
    c = {**family.hf_defaults, **c}
    try:
        fields = hf_fields(c, family, where)
        if family.hf is not None:
            fields = family.hf(c, fields, where)
        return LlamaConfig(**fields)
    except KeyError as e:
        raise ModelFormatError(f"{where} lacks {e.args[0]}") from e


def read_config_json(folder_or_file) -> tuple[dict, Path]:
    p = Path(folder_or_file)
    p = p / "config.json" if p.is_dir() else p
    try:
        return json.loads(p.read_text(encoding="utf-8")), p
    except FileNotFoundError as e:
        raise ModelFormatError(f"{p} is missing: a Hugging Face model folder needs config.json") from e
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{p} is not valid JSON: {e}") from e


def load_hf_config(folder, family: DecoderFamily | None = None) -> LlamaConfig:
    """LlamaConfig of an HF *ForCausalLM folder; generation_config.json's stop ids join config.json's."""
    c, p = read_config_json(folder)
    cfg = hf_config_from_dict(c, family, str(p))
    gen = p.parent / "generation_config.json"       # often lists more stop ids than config.json
    if gen.is_file():
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        cfg.eos_ids = list(dict.fromkeys([*cfg.eos_ids, *(int(i) for i in extra)]))
    return cfg


def _hf_rope_scaling(c: dict, rot_dim: int, where: str) -> tuple:
    """(per-frequency divisors or None, name) of config.json's `rope_scaling`: "llama3" (Llama 3.1+),
    "linear" and "longrope" / "su" (Phi-3: the short factors here, the long ones in _hf_longrope);
    others are refused by name."""
    rs = c.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type")) if rs else None
    if kind in (None, "default", "mrope"):   # mrope: Qwen2.5-VL's sections, read by its family
        return None, ""
    if kind == "proportional":          # Gemma 4's full-attention layers: its family reads the pairs
        return None, "proportional"
    try:
        if kind in ("longrope", "su"):
            return tuple(float(f) for f in rs["short_factor"]), "longrope"
        factor = float(rs["factor"])
        if kind == "linear":
            return (factor,) * (rot_dim // 2), "linear"
        if kind == "yarn":
            return yarn_rope_factors(rot_dim, float(c.get("rope_theta", 10000.0)), factor,
                                     int(rs["original_max_position_embeddings"]), float(rs.get("beta_fast") or 32),
                                     float(rs.get("beta_slow") or 1), bool(rs.get("truncate", True))), "yarn"
        if kind == "llama3":
            return llama3_rope_factors(rot_dim, float(c.get("rope_theta", 10000.0)), factor,
                                       float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                                       int(rs["original_max_position_embeddings"])), "llama3"
    except KeyError as e:
        raise ModelFormatError(f"{where}: rope_scaling {rs} lacks {e.args[0]}") from e
    raise UnsupportedModelError(f"{where}: rope_scaling type {kind!r} is not implemented; supported: "
                                f"linear, llama3, longrope (su), yarn")


def yarn_rope_factors(rot_dim: int, base: float, factor: float, original: int, beta_fast: float,
                      beta_slow: float, truncate: bool) -> tuple:
    """YaRN's frequency divisors (transformers' _compute_yarn_parameters): frequency i blends its
    interpolated (/ factor) and extrapolated values by a linear ramp over the dimensions between the
    ones that turn beta_fast and beta_slow times in the original context."""
    def dim(rotations):
        return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim(beta_fast), dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    high += 0.001 if low == high else 0.0
    out = []
    for i in range(rot_dim // 2):
        extrapolate = 1.0 - min(1.0, max(0.0, (i - low) / (high - low)))
        out.append(1.0 / (extrapolate + (1.0 - extrapolate) / factor))
    return tuple(out)


def _yarn_attention_factor(rs: dict) -> float:
    """YaRN's scale of cos and sin (q and k): attention_factor, else 0.1 ln(factor) + 1."""
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = float(rs["factor"])
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        def m(s):
            return 0.1 * s * math.log(factor) + 1.0 if factor > 1 else 1.0
        return m(float(rs["mscale"])) / m(float(rs["mscale_all_dim"]))
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def _hf_longrope(c: dict, rot_dim: int, where: str) -> dict:
    """LlamaConfig fields of longrope: long factors, original context and the attention factor
    transformers computes (sqrt(1 + ln(s) / ln(original)), s = max positions / original)."""
    rs = c["rope_scaling"]
    original = int(rs.get("original_max_position_embeddings") or c.get("original_max_position_embeddings") or 0)
    if original <= 0 or "long_factor" not in rs:
        raise ModelFormatError(f"{where}: longrope needs long_factor and original_max_position_embeddings")
    attn = rs.get("attention_factor")
    if attn is None:
        s = int(c.get("max_position_embeddings", original)) / original
        attn = math.sqrt(1 + math.log(s) / math.log(original)) if s > 1 else 1.0
    return dict(rope_long_factors=tuple(float(f) for f in rs["long_factor"]), rope_original_context=original,
                rope_attn_factor=float(attn))


# activation names in config.json -> LlamaConfig.act
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh"}


__all__ = ["DecoderFamily", "FAMILIES", "HF_ACTIVATIONS", "family_named", "family_of", "mlc_family", "gguf_config",
           "gguf_fields", "hf_config_from_dict", "hf_fields", "hf_sliding_window", "load_hf_config",
           "read_config_json", "register_family", "unregister_family"]
