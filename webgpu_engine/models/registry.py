"""The model families the engine runs, in one table, and one way to open any model on disk.

    arch = architecture("qwen2")          # -> Architecture (UnsupportedModelError names the supported)
    m = open_model(path)                  # a .gguf file, an HF folder or a sentence-transformers folder
    m.arch, m.kind, m.config, m.weights   # weights: {our name: TensorInfo}, bytes still in the file
    m.tokenizer(); m.template(); m.close()

Each `Architecture` says how its config is read (from GGUF metadata and from an HF config.json),
which model class runs it, which pipeline serves it (`kind`) and what it will hold on the GPU (its
memory estimate, computed from the headers alone). The pipelines and the engine's memory check
look a family up here; nothing else names families. Model classes are imported on first use (a
page loads only what it runs). Standard library only (runs in the page).

A decoder family is one module, `models/family_<name>.py`, whose `FAMILIES` holds its
`DecoderFamily` records (loaders.decoder_config: its HF names, the defaults its transformers class
assumes, its GGUF / config.json fields beyond the shared reading), and one entry in
`DECODER_FAMILY_MODULES` below; `register()` adds a record at run time (its Architecture, its HF
names, and the loaders' family table, so `GGUFFile.model_config()` reads it too).
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import ModelFormatError, UnsupportedModelError, supported_entry, unsupported_hf_config
from ..loaders import decoder_config, hf_config
from ..loaders.decoder_config import DecoderFamily
from . import memory, plan

LLM, EMBEDDING = "llm", "embedding"      # the engine's model types (engine/records.py)


@dataclass(frozen=True)
class Architecture:
    name: str
    kind: str                                  # LLM or EMBEDDING: the pipeline that serves it
    model: str                                 # "module:Class" under webgpu_engine.models
    gguf_config: Callable | None               # GGUFFile -> config (None: no GGUF form)
    hf_config: Callable | None                 # HF folder -> config
    hf_names: str | dict                       # safetensors names: a loaders.hf_config table kind or a
    #                                            family's own table; "": HF names
    estimate: Callable                         # (config, {name: shape}, **options) -> MemoryEstimate
    family: DecoderFamily | None = None        # a decoder family's record (models/family_*.py)

    def model_class(self) -> type:
        mod, cls = self.model.split(":")
        return getattr(importlib.import_module(f"{__package__}.{mod}"), cls)


# The decoder families: each module's FAMILIES (DecoderFamily records), registered below in this order
DECODER_FAMILY_MODULES = ("family_llama", "family_qwen", "family_mistral", "family_phi3", "family_gemma",
                          "family_olmo", "family_stablelm", "family_phi", "family_gptneox", "family_moe",
                          "family_gemma4", "family_qwen35", "family_gptoss", "family_idefics3",
                          "family_ministral3", "family_llava", "family_qwen25vl")


def _decoder(family: DecoderFamily, model: str = "llama:LlamaModel", estimate: Callable = memory.estimate_llm
             ) -> Architecture:
    return Architecture(family.name, LLM, model, lambda g: decoder_config.gguf_config(g, family),
                        lambda folder: decoder_config.load_hf_config(folder, family), family.hf_names,
                        estimate, family)


def _gguf_encoder(g):
    from ..loaders.gguf_encoder import bert_config
    return bert_config(g)


ARCHITECTURES: dict[str, Architecture] = {
    # GGUF: llama.cpp's converter writes BERT and XLM-RoBERTa (bge-m3) as `bert` (loaders/gguf_encoder.py)
    "bert": Architecture("bert", EMBEDDING, "bert:BertModel", _gguf_encoder, hf_config.load_bert_config, "",
                         memory.estimate_bert),
    # BERT with positions offset by padding_idx + 1 and a SentencePiece tokenizer (bge-m3, multilingual-e5)
    "xlm-roberta": Architecture("xlm-roberta", EMBEDDING, "bert:BertModel", None, hf_config.load_bert_config,
                                "", memory.estimate_bert),
    # nomic-embed-text v1 / v1.5: rotary positions, SwiGLU, no biases (a BertModel plan)
    "nomic_bert": Architecture("nomic_bert", EMBEDDING, "bert:BertModel", None, hf_config.load_bert_config,
                               "", memory.estimate_bert),
    # its GGUF form (llama.cpp's name)
    "nomic-bert": Architecture("nomic-bert", EMBEDDING, "bert:BertModel", _gguf_encoder, None, "",
                               memory.estimate_bert),
    # gte-modernbert, modernbert-embed: pre-norm, GeGLU, rotary, local / global attention layers
    "modernbert": Architecture("modernbert", EMBEDDING, "modernbert:ModernBertModel", None,
                               hf_config.load_bert_config, "", memory.estimate_bert),
}


def _embedder_config(folder):
    return importlib.import_module(f"{__package__}.decoder_embedder").load_config(folder)


def _embedder_estimate(cfg, tensors: dict, *, max_batch_size: int, max_seq_length: int, act_dtype: str,
                       max_binding: int):
    mod = importlib.import_module(f"{__package__}.decoder_embedder")
    rows = mod.cache_rows(cfg)                  # the model sizes its cache by the config, as here
    ctx = plan.model_context(cfg, rows)
    dp = plan.DecoderPlan(act_dtype, ctx, plan.prefill_rows(min(mod.PREFILL_CHUNK, rows), ctx), 1)
    est = memory.estimate_llm(cfg, mod.decoder_names(tensors), dp, max_binding=max_binding)
    return replace(est, context_window=0)    # its cache is sized by max_seq_length, not context_window_size


def _decoder_embedder(name: str) -> Architecture:
    return Architecture(name, EMBEDDING, "decoder_embedder:DecoderEmbedder", None, _embedder_config, "",
                        _embedder_estimate)


# A decoder in a sentence-transformers folder (modules.json: Transformer -> Pooling lasttoken ->
# Normalize) is an embedder: Qwen3-Embedding, gte-Qwen2. Same weights, the decoder_embedder model.
DECODER_EMBEDDERS: dict[str, Architecture] = {}

# HF config.json `architectures` / `model_type` -> our architecture name (decoders: their families')
HF_ARCHITECTURES = {**{a: "bert" for a in hf_config.BERT_ARCHITECTURES},
                    **{a: "xlm-roberta" for a in hf_config.XLMR_ARCHITECTURES},
                    **{a: "nomic_bert" for a in hf_config.NOMIC_ARCHITECTURES},
                    **{a: "modernbert" for a in hf_config.MODERNBERT_ARCHITECTURES}}
HF_MODEL_TYPES = {"bert": "bert", "xlm-roberta": "xlm-roberta", "nomic_bert": "nomic_bert",
                  "modernbert": "modernbert"}


def register(family: DecoderFamily, model: str = "llama:LlamaModel",
             estimate: Callable = memory.estimate_llm) -> Architecture:
    """Add a decoder family: its Architecture (model class, memory estimate), its HF names, its
    decoder-embedder form (families with the shared name table) and the loaders' family table."""
    arch = ARCHITECTURES[family.name] = _decoder(family, model, estimate)
    HF_ARCHITECTURES.update({a: family.name for a in family.hf_architectures})
    HF_MODEL_TYPES.update({t: family.name for t in family.hf_model_types})
    if family.hf_names == "llama":
        DECODER_EMBEDDERS[family.name] = _decoder_embedder(family.name)
    decoder_config.register_family(family)
    return arch


def unregister(name: str) -> None:
    """Remove a family `register` added (and its HF names, embedder form, loader entry)."""
    arch = ARCHITECTURES.get(name)
    if arch is None or arch.family is None:
        return
    del ARCHITECTURES[name]
    for table in (HF_ARCHITECTURES, HF_MODEL_TYPES):
        for k in [k for k, v in table.items() if v == name]:
            del table[k]
    DECODER_EMBEDDERS.pop(name, None)
    decoder_config.unregister_family(name)


for _mod in DECODER_FAMILY_MODULES:
    for _family in importlib.import_module(f"{__package__}.{_mod}").FAMILIES:
        register(_family)


def architecture(name: str, where: str = "") -> Architecture:
    """The family `name` (GGUF general.architecture or ours), or UnsupportedModelError."""
    return supported_entry(ARCHITECTURES, name, "architecture", where)


def hf_architecture(config: dict, where: str = "config.json") -> Architecture:
    """The family of an HF config.json (its `architectures`, else its `model_type`)."""
    archs = config.get("architectures") or []
    name = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None) \
        or HF_MODEL_TYPES.get(config.get("model_type", ""))
    if name is None:
        raise unsupported_hf_config(config, HF_ARCHITECTURES, where)
    return ARCHITECTURES[name]


@dataclass
class OpenedModel:
    """A model on disk, opened: its family, config and weights (TensorInfo views into the files;
    nothing is read until the model uploads them). `close()` releases the files."""

    arch: Architecture
    config: Any
    weights: dict
    path: Path
    close: Callable[[], None]
    tokenizer: Callable[..., Any]          # (**options) -> tokenizer, built on demand
    template: Callable[[], Any]            # () -> ChatTemplate | None
    extra: Any = None                      # sentence-transformers settings (pooling, ...)

    @property
    def kind(self) -> str:
        return self.arch.kind


def open_model(path, kind: str | None = None) -> OpenedModel:
    """Open a GGUF file, an HF folder (config.json + safetensors + tokenizer) or a sentence-transformers
    folder (modules.json). `kind` (LLM / EMBEDDING), when given, must match what the files are."""
    from ..loaders.tokenizer import load_tokenizer
    path = Path(path)
    if path.is_file():
        from ..loaders.gguf import GGUFFile
        g = GGUFFile(path)
        try:
            arch = architecture(g.architecture, str(path))
            if arch.gguf_config is None:
                raise UnsupportedModelError(f"{path}: {arch.name} models are not read from GGUF files")
            extra = None
            if arch.kind == EMBEDDING:                 # pooling and normalisation from the file
                from ..loaders.gguf_encoder import embedder_settings
                extra = embedder_settings(g, path)
            m = OpenedModel(arch, arch.gguf_config(g), g.weights(arch.family.gguf_names if arch.family else None),
                            path, g.close,
                            lambda **kw: load_tokenizer(g, **kw), g.template, extra)
        except BaseException:
            g.close()
            raise
    elif path.is_dir() and (path / "mlc-chat-config.json").is_file():
        m = _open_mlc(path)
    elif path.is_dir():
        m = _open_folder(path)
    else:
        raise ModelFormatError(f"No model at {path}: expected a .gguf file or a Hugging Face folder")
    if kind is not None and m.kind != kind:
        m.close()
        raise ModelFormatError(f"{path} holds a {m.arch.name} model ({m.kind}), not an {kind} model")
    return m


def _open_mlc(path: Path) -> OpenedModel:
    """An MLC-LLM artifact (WebLLM's models): loaders.mlc maps its config and names onto a family, an
    embedder's (MLC's bert) onto BERT's HF names with its pooling (loaders.mlc_bert)."""
    from ..loaders.mlc import ENCODERS, MLCArtifact
    from ..loaders.tokenizer import load_tokenizer
    art = MLCArtifact(path)
    try:
        if art.model_type in ENCODERS:
            from ..loaders import mlc_bert
            arch = architecture(ENCODERS[art.model_type], str(path))
            config, weights, extra = mlc_bert.bert_config(art), mlc_bert.bert_weights(art), \
                mlc_bert.embedder_settings(art)
            template = lambda: None   # noqa: E731
        else:
            arch = architecture(art.family.name, str(path))
            config, weights, extra, template = art.config(arch.family), art.weights(), art, art.template
    except BaseException:
        art.close()
        raise
    return OpenedModel(arch, config, weights, path, art.close, lambda **kw: load_tokenizer(path, **kw),
                       template, extra)


def _open_folder(path: Path) -> OpenedModel:
    from ..loaders.safetensors import SafetensorsFolder
    from ..loaders.sentence_transformers import load_sentence_transformer_config
    from ..loaders.tokenizer import load_tokenizer
    st = None
    folder = path
    if (path / "modules.json").is_file():              # sentence-transformers: the encoder may sit deeper
        st = load_sentence_transformer_config(path)
        folder = Path(st.model_folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelFormatError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_file} is not valid JSON: {e}") from e
    arch = hf_architecture(raw, str(cfg_file))
    if st is not None and arch.name in DECODER_EMBEDDERS:     # a sentence-transformers decoder
        arch = DECODER_EMBEDDERS[arch.name]
    if arch.kind == EMBEDDING and st is None:
        st = load_sentence_transformer_config(path)      # a bare HF encoder: the defaults
    config = arch.hf_config(folder)
    files = SafetensorsFolder(folder)
    try:
        weights = files.weights(arch.hf_names) if arch.hf_names else dict(files.tensors)
        if arch.family is not None and arch.family.hf_weights is not None:
            weights = arch.family.hf_weights(weights)
    except BaseException:
        files.close()
        raise

    def template():
        from ..loaders.chat_template import ChatTemplate
        tc = folder / "tokenizer_config.json"
        return ChatTemplate.from_tokenizer_config(json.loads(tc.read_text(encoding="utf-8"))) \
            if tc.is_file() else None
    return OpenedModel(arch, config, weights, path, files.close,
                       lambda **kw: load_tokenizer(folder, **kw), template, st)


__all__ = ["ARCHITECTURES", "Architecture", "DECODER_FAMILY_MODULES", "EMBEDDING", "LLM", "OpenedModel",
           "architecture", "hf_architecture", "open_model", "register", "unregister"]
