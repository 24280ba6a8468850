"""Hugging Face `config.json` -> LlamaConfig / BertConfig, and the tables of HF tensor names -> ours.

Llama-family safetensors keep q/k rows unpermuted, so rope pairs halves of each head (rope_neox=True);
GGUF llama files differ there (see loaders.gguf). The decoder families' reading of config.json is
loaders.decoder_config (shared) plus each family's module in models/; `load_llama_config` and
`llama_config_from_dict` are its entry points here. Plain JSON parsing: runs in the browser too.
"""
from __future__ import annotations

import re

from ..errors import ModelFormatError, UnsupportedModelError
from .decoder_config import hf_config_from_dict, load_hf_config, read_config_json
from .model_config import BertConfig, LlamaConfig
from .tensor_info import TensorInfo

BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification")
XLMR_ARCHITECTURES = ("XLMRobertaModel", "XLMRobertaForMaskedLM", "XLMRobertaForSequenceClassification")
MODERNBERT_ARCHITECTURES = ("ModernBertModel", "ModernBertForMaskedLM")
NOMIC_ARCHITECTURES = ("NomicBertModel",)                   # nomic-embed-text v1 / v1.5 (remote code on the hub)

# Llama-style decoder names (LlamaForCausalLM) -> ours; ours are the names loaders.gguf also gives. The
# optional ones (biases, Qwen3's q/k norms, Phi-3's fused matrices) mean the same in every family that
# has them; a family whose names mean something else brings its own table (models/family_gemma.py).
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
_TABLES = {"llama": HF_LLAMA_TO_OURS, "bert": HF_BERT_TO_OURS, "nomic": HF_NOMIC_TO_OURS,
           "modernbert": HF_MODERNBERT_TO_OURS}
_LAYER = re.compile(r"^(model\.layers|model\.language_model\.layers|language_model\.model\.layers|model\.text_model\.layers|gpt_neox\.layers|encoder\.layers?|layers)\.(\d+)\.(.+)$")


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


def map_hf_names(tensors: dict[str, TensorInfo], kind: str | dict = "llama") -> dict[str, TensorInfo]:
    """{our name: TensorInfo} of the HF tensors the model uses; kind "llama", "bert", "nomic",
    "modernbert", or a family's own table {HF name pattern: ours} (decoder names, model.layers.{i}...)."""
    table = _TABLES[kind] if isinstance(kind, str) else kind
    out = {}
    for name, t in tensors.items():
        key = _bert_key(name) if kind in ("bert", "nomic", "modernbert") else name
        m = _LAYER.match(key)
        ours = table.get(f"{m.group(1)}.{{i}}.{m.group(3)}") if m else table.get(key)
        if ours is not None:
            out.setdefault(ours.replace("{i}", m.group(2)) if m else ours, t)
    return out


def hf_name(ours: str, kind: str | dict = "llama") -> str:
    """The Hugging Face tensor name of one of our names (for error messages)."""
    table = _TABLES[kind] if isinstance(kind, str) else kind
    m = re.match(r"^layers\.(\d+)\.(.+)$", ours)
    generic = f"layers.{{i}}.{m.group(2)}" if m else ours
    for hf, o in table.items():
        if o == generic:
            return hf.replace("{i}", m.group(1)) if m else hf
    return ours


def named_weight(named: dict[str, TensorInfo], ours: str, kind: str, model: str, checkpoint: str,
                 shape: tuple | None = None) -> TensorInfo:
    """Weight `ours` of map_hf_names(tensors, kind) (`named`), of `shape` when given, else an
    UnsupportedModelError naming its HF name (`model`: "BERT"; `checkpoint`: what the file should be)."""
    t = named.get(ours)
    if t is None:
        raise UnsupportedModelError(f"{model} weight {hf_name(ours, kind)!r} is missing from the model file; "
                                    f"is this a {checkpoint} checkpoint?")
    if shape is not None and tuple(t.shape) != shape:
        raise UnsupportedModelError(f"{model} weight {t.name!r} has shape {tuple(t.shape)}, expected {shape} "
                                    f"from config.json.")
    return t


def llama_config_from_dict(c: dict, where: str = "config.json", family=None) -> LlamaConfig:
    """LlamaConfig of a decoder's config.json (loaders.decoder_config; family: a DecoderFamily, default
    the registered one its architectures / model_type name)."""
    return hf_config_from_dict(c, family, where)


def load_llama_config(folder, family=None) -> LlamaConfig:
    """LlamaConfig of an HF decoder folder (LlamaForCausalLM, Qwen2ForCausalLM, ...: any registered family)."""
    return load_hf_config(folder, family)


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
    c, p = read_config_json(folder)
    return bert_config_from_dict(c, str(p))
