"""Hugging Face `config.json` -> LlamaConfig / BertConfig, and the one table of HF tensor names -> ours.

Llama-family safetensors keep q/k rows unpermuted, so rope pairs halves of each head (rope_neox=True);
GGUF llama files differ there (see loaders.gguf). Plain JSON parsing: runs in the browser too.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import ModelFormatError, UnsupportedModelError
from .model_config import BertConfig, LlamaConfig, llama3_rope_factors
from .tensor_info import TensorInfo

# HF architectures -> our LlamaConfig.arch
LLAMA_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                       "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                       "Gemma3ForCausalLM": "gemma3"}
# config.json model_type, when architectures is absent -> our arch
LLAMA_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "phi3": "phi3",
                     "gemma2": "gemma2", "gemma3_text": "gemma3"}
BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification")
XLMR_ARCHITECTURES = ("XLMRobertaModel", "XLMRobertaForMaskedLM", "XLMRobertaForSequenceClassification")
MODERNBERT_ARCHITECTURES = ("ModernBertModel", "ModernBertForMaskedLM")
NOMIC_ARCHITECTURES = ("NomicBertModel",)                   # nomic-embed-text v1 / v1.5 (remote code on the hub)

# Llama / Qwen2 / Mistral names (LlamaForCausalLM) -> ours; ours are the names loaders.gguf also gives.
HF_LLAMA_TO_OURS = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.q",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.k",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.v",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.q_bias",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.k_bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.v_bias",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm",      # Qwen3 (D,)
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm",
    "model.layers.{i}.self_attn.qkv_proj.weight": "layers.{i}.qkv",      # Phi-3: q|k|v rows (split on load)
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.o",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.gate",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.up",
    "model.layers.{i}.mlp.gate_up_proj.weight": "layers.{i}.gate_up",     # Phi-3: gate|up rows
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down",
}
# Gemma 2 / 3: post_attention_layernorm is the norm of the attention output; the FFN has pre and post norms
HF_GEMMA_TO_OURS = {**{k: v for k, v in HF_LLAMA_TO_OURS.items() if v != "layers.{i}.ffn_norm"},
                    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm",
                    "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.ffn_norm",
                    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_ffn_norm"}
# BertModel names ("bert." prefix of BertForX stripped) -> ours
HF_BERT_TO_OURS = {
    "embeddings.word_embeddings.weight": "embed",                       # (V, C)
    "embeddings.position_embeddings.weight": "pos_embed",               # (P, C)
    "embeddings.token_type_embeddings.weight": "type_embed",            # (2, C)
    "embeddings.LayerNorm.weight": "embed_norm",
    "embeddings.LayerNorm.bias": "embed_norm_bias",
    "encoder.layer.{i}.attention.self.query.weight": "layers.{i}.q",
    "encoder.layer.{i}.attention.self.query.bias": "layers.{i}.q_bias",
    "encoder.layer.{i}.attention.self.key.weight": "layers.{i}.k",
    "encoder.layer.{i}.attention.self.key.bias": "layers.{i}.k_bias",
    "encoder.layer.{i}.attention.self.value.weight": "layers.{i}.v",
    "encoder.layer.{i}.attention.self.value.bias": "layers.{i}.v_bias",
    "encoder.layer.{i}.attention.output.dense.weight": "layers.{i}.o",
    "encoder.layer.{i}.attention.output.dense.bias": "layers.{i}.o_bias",
    "encoder.layer.{i}.attention.output.LayerNorm.weight": "layers.{i}.attn_norm",
    "encoder.layer.{i}.attention.output.LayerNorm.bias": "layers.{i}.attn_norm_bias",
    "encoder.layer.{i}.intermediate.dense.weight": "layers.{i}.up",     # (F, C)
    "encoder.layer.{i}.intermediate.dense.bias": "layers.{i}.up_bias",
    "encoder.layer.{i}.output.dense.weight": "layers.{i}.down",         # (C, F)
    "encoder.layer.{i}.output.dense.bias": "layers.{i}.down_bias",
    "encoder.layer.{i}.output.LayerNorm.weight": "layers.{i}.ffn_norm",
    "encoder.layer.{i}.output.LayerNorm.bias": "layers.{i}.ffn_norm_bias",
    # cross-encoders' head on the first token: dense + tanh, then the labels
    # (BertForSequenceClassification: pooler + classifier; XLMRobertaForSequenceClassification:
    # classifier.dense + classifier.out_proj)
    "pooler.dense.weight": "head_dense",                                # (C, C)
    "pooler.dense.bias": "head_dense_bias",
    "classifier.dense.weight": "head_dense",
    "classifier.dense.bias": "head_dense_bias",
    "classifier.weight": "head_out",                                    # (num_labels, C)
    "classifier.bias": "head_out_bias",
    "classifier.out_proj.weight": "head_out",
    "classifier.out_proj.bias": "head_out_bias",
}
# NomicBertModel names -> ours (its HF code lives on the hub as remote code)
HF_NOMIC_TO_OURS = {
    "embeddings.word_embeddings.weight": "embed",
    "embeddings.token_type_embeddings.weight": "type_embed",
    "emb_ln.weight": "embed_norm",
    "emb_ln.bias": "embed_norm_bias",
    "encoder.layers.{i}.attn.Wqkv.weight": "layers.{i}.qkv",           # (3C, C) rows [q | k | v]
    "encoder.layers.{i}.attn.Wqkv.bias": "layers.{i}.qkv_bias",
    "encoder.layers.{i}.attn.out_proj.weight": "layers.{i}.o",
    "encoder.layers.{i}.attn.out_proj.bias": "layers.{i}.o_bias",
    "encoder.layers.{i}.norm1.weight": "layers.{i}.attn_norm",
    "encoder.layers.{i}.norm1.bias": "layers.{i}.attn_norm_bias",
    "encoder.layers.{i}.mlp.fc11.weight": "layers.{i}.up",               # SwiGLU: fc11(x) * silu(fc12(x))
    "encoder.layers.{i}.mlp.fc11.bias": "layers.{i}.up_bias",
    "encoder.layers.{i}.mlp.fc12.weight": "layers.{i}.gate",
    "encoder.layers.{i}.mlp.fc12.bias": "layers.{i}.gate_bias",
    "encoder.layers.{i}.mlp.fc1.weight": "layers.{i}.up",                # the GELU variant
    "encoder.layers.{i}.mlp.fc1.bias": "layers.{i}.up_bias",
    "encoder.layers.{i}.mlp.fc2.weight": "layers.{i}.down",
    "encoder.layers.{i}.mlp.fc2.bias": "layers.{i}.down_bias",
    "encoder.layers.{i}.norm2.weight": "layers.{i}.ffn_norm",
    "encoder.layers.{i}.norm2.bias": "layers.{i}.ffn_norm_bias",
}
# ModernBertModel names ("model." prefix of ModernBertForX stripped) -> ours
HF_MODERNBERT_TO_OURS = {
    "embeddings.tok_embeddings.weight": "embed",
    "embeddings.norm.weight": "embed_norm",
    "embeddings.norm.bias": "embed_norm_bias",
    "layers.{i}.attn_norm.weight": "layers.{i}.attn_norm",              # absent in layer 0
    "layers.{i}.attn_norm.bias": "layers.{i}.attn_norm_bias",
    "layers.{i}.attn.Wqkv.weight": "layers.{i}.qkv",                    # (3C, C) rows [q | k | v]
    "layers.{i}.attn.Wqkv.bias": "layers.{i}.qkv_bias",
    "layers.{i}.attn.Wo.weight": "layers.{i}.o",
    "layers.{i}.attn.Wo.bias": "layers.{i}.o_bias",
    "layers.{i}.mlp_norm.weight": "layers.{i}.ffn_norm",
    "layers.{i}.mlp_norm.bias": "layers.{i}.ffn_norm_bias",
    "layers.{i}.mlp.Wi.weight": "layers.{i}.up",                        # (2F, C) rows [input | gate]
    "layers.{i}.mlp.Wi.bias": "layers.{i}.up_bias",
    "layers.{i}.mlp.Wo.weight": "layers.{i}.down",
    "layers.{i}.mlp.Wo.bias": "layers.{i}.down_bias",
    "final_norm.weight": "norm",
    "final_norm.bias": "norm_bias",
}
_TABLES = {"llama": HF_LLAMA_TO_OURS, "bert": HF_BERT_TO_OURS, "nomic": HF_NOMIC_TO_OURS, "gemma": HF_GEMMA_TO_OURS,
           "modernbert": HF_MODERNBERT_TO_OURS}
_LAYER = re.compile(r"^(model\.layers|encoder\.layers?|layers)\.(\d+)\.(.+)$")


_BERT_PREFIXES = ("bert.", "roberta.", "model.")   # BertForX / XLMRobertaForX nest the encoder


def _bert_key(name: str) -> str:
    """A BERT tensor name as HF_BERT_TO_OURS spells it: no "bert."/"model." prefix, and TF-era
    LayerNorm gamma / beta as weight / bias."""
    for p in _BERT_PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
            break
    if ".LayerNorm." in name:
        if name.endswith(".gamma"):
            name = name[:-len("gamma")] + "weight"
        elif name.endswith(".beta"):
            name = name[:-len("beta")] + "bias"
    return name


def map_hf_names(tensors: dict[str, TensorInfo], kind: str = "llama") -> dict[str, TensorInfo]:
    """{our name: TensorInfo} of the HF tensors the model uses; kind "llama", "bert" or "nomic"."""
    table = _TABLES[kind]
    out = {}
    for name, t in tensors.items():
        key = _bert_key(name) if kind in ("bert", "nomic", "modernbert") else name
        m = _LAYER.match(key)
        ours = table.get(f"{m.group(1)}.{{i}}.{m.group(3)}") if m else table.get(key)
        if ours is not None:
            out.setdefault(ours.replace("{i}", m.group(2)) if m else ours, t)
    return out


def hf_name(ours: str, kind: str = "llama") -> str:
    """The Hugging Face tensor name of one of our names (for error messages)."""
    table = _TABLES[kind]
    m = re.match(r"^layers\.(\d+)\.(.+)$", ours)
    generic = f"layers.{{i}}.{m.group(2)}" if m else ours
    for hf, o in table.items():
        if o == generic:
            return hf.replace("{i}", m.group(1)) if m else hf
    return ours


def _read(folder_or_file) -> tuple[dict, Path]:
    p = Path(folder_or_file)
    p = p / "config.json" if p.is_dir() else p
    try:
        return json.loads(p.read_text(encoding="utf-8")), p
    except FileNotFoundError as e:
        raise ModelFormatError(f"{p} is missing: a Hugging Face model folder needs config.json") from e
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{p} is not valid JSON: {e}") from e


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


def llama_config_from_dict(c: dict, where: str = "config.json") -> LlamaConfig:
    c = _legacy_rope(c)
    archs = c.get("architectures") or []
    arch = next((LLAMA_ARCHITECTURES[a] for a in archs if a in LLAMA_ARCHITECTURES), None)
    if arch is None:
        arch = LLAMA_MODEL_TYPES.get(c.get("model_type"))
    if arch is None:
        raise UnsupportedModelError(f"{where}: architectures {archs} / model_type {c.get('model_type')!r} "
                                    f"is not supported; supported: {sorted(LLAMA_ARCHITECTURES)}")
    try:
        n_heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        head_dim = int(c.get("head_dim") or hidden // n_heads)
        eos = c.get("eos_token_id")
        # Mistral, Phi-3 and Gemma apply `sliding_window` when set; Qwen2/3 only with use_sliding_window
        always = arch in ("mistral", "phi3", "gemma2", "gemma3")
        sliding = c.get("sliding_window") if c.get("use_sliding_window", always) else None
        rot_dim = int(head_dim * float(c.get("partial_rotary_factor", 1.0)))
        factors, scaling = _rope_scaling(c, rot_dim, where)
        long = _longrope(c, rot_dim, where) if scaling == "longrope" else {}
        gemma = _gemma(c, arch, hidden, where) if arch in ("gemma2", "gemma3") else {}
        return LlamaConfig(
            arch=arch, vocab_size=int(c["vocab_size"]), hidden_size=hidden,
            n_layers=int(c["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(c.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            ffn_size=int(c["intermediate_size"]), rope_base=float(c.get("rope_theta", 10000.0)),
            rot_dim=rot_dim, rope_freq_factors=factors, rope_scaling=scaling, **long, **gemma,
            rope_neox=True,                     # HF weights: rotate_half pairs (i, i + d/2)
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            context_length=int(c.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(c.get("tie_word_embeddings", arch in ("gemma2", "gemma3"))),
            qkv_bias=bool(c.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "gemma3"),
            bos_id=c.get("bos_token_id"),
            eos_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
            sliding_window=int(sliding) if sliding else None,
            name=str(c.get("_name_or_path", "")),
        )
    except KeyError as e:
        raise ModelFormatError(f"{where} lacks {e.args[0]}") from e


def _rope_scaling(c: dict, rot_dim: int, where: str) -> tuple:
    """(per-frequency divisors or None, name) of config.json's `rope_scaling`: "llama3" (Llama 3.1+)
    and "linear"; others are refused by name."""
    rs = c.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type")) if rs else None
    if kind in (None, "default"):
        return None, ""
    try:
        if kind in ("longrope", "su"):          # Phi-3: short factors here, long ones in _longrope
            return tuple(float(f) for f in rs["short_factor"]), "longrope"
        factor = float(rs["factor"])
        if kind == "linear":
            return (factor,) * (rot_dim // 2), "linear"
        if kind == "llama3":
            return llama3_rope_factors(rot_dim, float(c.get("rope_theta", 10000.0)), factor,
                                       float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                                       int(rs["original_max_position_embeddings"])), "llama3"
    except KeyError as e:
        raise ModelFormatError(f"{where}: rope_scaling {rs} lacks {e.args[0]}") from e
    raise UnsupportedModelError(f"{where}: rope_scaling type {kind!r} is not implemented; supported: "
                                f"linear, llama3, longrope (su)")


_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
         "gelu_new": "gelu_tanh"}


def _gemma(c: dict, arch: str, hidden: int, where: str) -> dict:
    """LlamaConfig fields of Gemma 2 / 3: GeGLU, (1 + w) norms, sqrt(C) embeddings, post norms,
    query_pre_attn_scalar, soft-capping, which layers slide (layer_types, else Gemma 2 every
    other layer from the first, Gemma 3 all but every sliding_window_pattern-th) and Gemma 3's
    local rope base."""
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTS:
        raise UnsupportedModelError(f"{where}: activation {act!r} is not implemented; supported: {sorted(_ACTS)}")
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types:
        local = tuple(t == "sliding_attention" for t in types)
    elif arch == "gemma2":
        local = tuple(i % 2 == 0 for i in range(n))
    else:
        pattern = int(c.get("sliding_window_pattern", 6))
        local = tuple((i + 1) % pattern != 0 for i in range(n))
    scalar = c.get("query_pre_attn_scalar")
    return dict(act=_ACTS[act], embed_scale=float(hidden) ** 0.5, post_norms=True, norm_plus_one=True,
                attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
                attn_softcap=float(c.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(c.get("final_logit_softcapping") or 0.0),
                window_layers=local if c.get("sliding_window") else None,
                rope_local_base=float(c.get("rope_local_base_freq") or 0.0) if arch == "gemma3" else 0.0)


def _longrope(c: dict, rot_dim: int, where: str) -> dict:
    """LlamaConfig fields of Phi-3's longrope: long factors, original context and the attention
    factor transformers computes (sqrt(1 + ln(s) / ln(original)), s = max positions / original)."""
    import math
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


def load_llama_config(folder) -> LlamaConfig:
    """LlamaConfig of an HF LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM folder."""
    c, p = _read(folder)
    cfg = llama_config_from_dict(c, str(p))
    gen = p.parent / "generation_config.json"       # often lists more stop ids than config.json
    if gen.is_file():
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        cfg.eos_ids = list(dict.fromkeys([*cfg.eos_ids, *(int(i) for i in extra)]))
    return cfg


def _classifier(c: dict, archs: list) -> tuple[int, str]:
    """(num_labels, activation) of a cross-encoder's config; (0, "identity") for an encoder."""
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return 0, "identity"
    n = len(c["id2label"]) if isinstance(c.get("id2label"), dict) else int(c.get("num_labels", 2))
    st = c.get("sentence_transformers") or {}
    path = str(st.get("activation_fn") or c.get("sbert_ce_default_activation_function") or "")
    name = path.rsplit(".", 1)[-1]
    if name in ("Sigmoid", "Identity"):
        return n, name.lower()
    if path:
        raise UnsupportedModelError(f"cross-encoder activation {path!r} is not supported (Sigmoid, Identity)")
    return n, "sigmoid" if n == 1 else "identity"      # CrossEncoder's default


def nomic_config_from_dict(c: dict, where: str = "config.json") -> BertConfig:
    """NomicBert's GPT-2-style config (n_embd, n_head, ...): post-norm encoder, rotary positions."""
    for key, ok in (("prenorm", False), ("parallel_block", False), ("use_rms_norm", False), ("causal", False),
                    ("rotary_emb_interleaved", False), ("rotary_emb_scale_base", None)):
        if c.get(key, ok) != ok:
            raise UnsupportedModelError(f"{where}: NomicBert with {key}={c[key]!r} is not supported")
    act = c.get("activation_function", "swiglu")
    if act not in ("swiglu", "gelu"):
        raise UnsupportedModelError(f"{where}: NomicBert activation {act!r} is not supported (swiglu, gelu)")
    if float(c.get("rotary_emb_fraction", 0.0)) <= 0:
        raise UnsupportedModelError(f"{where}: NomicBert without rotary positions is not supported")
    try:
        C, H = int(c["n_embd"]), int(c["n_head"])
        vocab, mult = int(c["vocab_size"]), int(c.get("pad_vocab_size_multiple") or 1)
        positions = int(c.get("n_positions", 2048))
        if c.get("rotary_scaling_factor"):
            # dynamic NTK scaling changes the base past max_trained_positions: stay below it
            positions = min(positions, int(c.get("max_trained_positions", 2048)))
        return BertConfig(
            arch="nomic_bert", vocab_size=-(-vocab // mult) * mult, hidden_size=C, n_layers=int(c["n_layer"]),
            n_heads=H, intermediate_size=int(c.get("n_inner") or 4 * C), max_position=positions,
            type_vocab_size=int(c.get("type_vocab_size", 2)), layer_norm_eps=float(c.get("layer_norm_epsilon", 1e-12)),
            hidden_act="gelu", pad_id=int(c.get("pad_token_id") or 0), rope_base=float(c.get("rotary_emb_base", 10000)),
            rot_dim=int(C // H * float(c["rotary_emb_fraction"])), ffn=act, name=str(c.get("_name_or_path", "")))
    except KeyError as e:
        raise ModelFormatError(f"{where} lacks {e.args[0]}") from e


def modernbert_config_from_dict(c: dict, where: str = "config.json") -> BertConfig:
    """ModernBERT: pre-norm, GeGLU, rotary positions, every `global_attn_every_n_layers`-th layer
    global and the others local (keys within local_attention / 2), transformers 4 or 5 keys."""
    act = c.get("hidden_activation", "gelu")
    if act != "gelu":
        raise UnsupportedModelError(f"{where}: ModernBERT hidden_activation {act!r} is not supported (gelu)")
    try:
        n_layers = int(c["num_hidden_layers"])
        every = int(c.get("global_attn_every_n_layers", 3))
        types = c.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                         for i in range(n_layers)]
        rope = c.get("rope_parameters") or {}
        glob = float((rope.get("full_attention") or {}).get("rope_theta", c.get("global_rope_theta", 160000.0)))
        loc = float((rope.get("sliding_attention") or {}).get("rope_theta", c.get("local_rope_theta", 10000.0)))
        for kind in ("full_attention", "sliding_attention"):
            if (rope.get(kind) or {}).get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"{where}: ModernBERT rope_type {rope[kind]['rope_type']!r} is not "
                                            f"supported (default)")
        half = int(c.get("local_attention", 128)) // 2
        return BertConfig(
            arch="modernbert", vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            n_layers=n_layers, n_heads=int(c["num_attention_heads"]),
            intermediate_size=int(c["intermediate_size"]), max_position=int(c.get("max_position_embeddings", 8192)),
            type_vocab_size=1, layer_norm_eps=float(c.get("norm_eps", 1e-5)), hidden_act="gelu",
            pad_id=int(c.get("pad_token_id") or 0), rope_base=glob, ffn="geglu",
            layer_windows=tuple(half if t == "sliding_attention" else 0 for t in types), local_rope_base=loc,
            name=str(c.get("_name_or_path", "")))
    except KeyError as e:
        raise ModelFormatError(f"{where} lacks {e.args[0]}") from e


def bert_config_from_dict(c: dict, where: str = "config.json") -> BertConfig:
    archs = c.get("architectures") or []
    if c.get("model_type") == "nomic_bert" or any(a in NOMIC_ARCHITECTURES for a in archs):
        return nomic_config_from_dict(c, where)
    if c.get("model_type") == "modernbert" or any(a in MODERNBERT_ARCHITECTURES for a in archs):
        return modernbert_config_from_dict(c, where)
    xlmr = c.get("model_type") == "xlm-roberta" or any(a in XLMR_ARCHITECTURES for a in archs)
    if c.get("model_type") != "bert" and not xlmr and not any(a in BERT_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(f"{where}: model_type {c.get('model_type')!r} / architectures {archs} "
                                    "is not a BERT model")
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"{where}: position_embedding_type {c['position_embedding_type']!r} "
                                    "is not supported (absolute only)")
    try:
        pad = int(c.get("pad_token_id") or (1 if xlmr else 0))
        num_labels, activation = _classifier(c, archs)
        return BertConfig(
            arch="xlm-roberta" if xlmr else "bert",
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            n_layers=int(c["num_hidden_layers"]), n_heads=int(c["num_attention_heads"]),
            intermediate_size=int(c["intermediate_size"]),
            max_position=int(c.get("max_position_embeddings", 512)),
            type_vocab_size=int(c.get("type_vocab_size", 2)),
            layer_norm_eps=float(c.get("layer_norm_eps", 1e-12)),
            hidden_act=str(c.get("hidden_act", "gelu")), pad_id=pad,
            # RoBERTa numbers positions from padding_idx + 1 (its position table has those rows)
            position_offset=pad + 1 if xlmr else 0,
            num_labels=num_labels, classifier_activation=activation,
            name=str(c.get("_name_or_path", "")),
        )
    except KeyError as e:
        raise ModelFormatError(f"{where} lacks {e.args[0]}") from e


def load_bert_config(folder) -> BertConfig:
    """BertConfig of an HF BertModel folder (config.json)."""
    c, p = _read(folder)
    return bert_config_from_dict(c, str(p))
