"""GGUF embedders as llama.cpp's convert_hf_to_gguf.py writes them: `bert` (BERT; XLM-RoBERTa such as
bge-m3 converts as `bert` too, with its position table cut to start at padding_idx + 1) and
`nomic-bert` (nomic-embed-text v1 / v1.5).

    cfg = bert_config(g)                 # BertConfig from the `<arch>.*` keys (g: loaders.gguf.GGUFFile)
    st = embedder_settings(g, path)      # pooling (`<arch>.pooling_type`), L2 normalisation, max length
    spec = tokenizer_json(g.metadata)    # the vocabulary as a tokenizer.json (loaders.tokenizer builds it)

The vector is the pooled one, L2-normalised: what llama.cpp's server (`embd_normalize` 2) and Ollama's
/api/embed return. Pooling: `pooling_type` 1 mean, 2 CLS, 3 last token; a file without the key
pools by mean (what sentence-transformers gives a model without a Pooling module; llama.cpp would
pool nothing and serve per-token vectors, which an embeddings route cannot return); 0 (none) and 4
(rank, a reranker's) are refused by name.

Vocabularies (`tokenizer.ggml.model`):
- "bert": WordPiece. The converter rewrites the pieces to llama.cpp's phantom-space form: a word
  start gets "▁" in front, a "##" continuation loses its "##", control tokens stay as they are. That is
  undone here, and the tokenizer is BERT's (BertNormalizer with `tokenizer.ggml.normalizer.lowercase`
  / `strip_accents`, default true as in llama.cpp; BertPreTokenizer; [CLS] … [SEP]).
- "t5": SentencePiece-Unigram (XLM-RoBERTa): pieces and scores, `precompiled_charsmap` as the
  normaliser with runs of spaces collapsed (as XLM-RoBERTa's tokenizer.json has it), "▁" word
  prefixes (`tokenizer.ggml.add_space_prefix`), <s> … </s>. Runs in the `tokenizers` library only.
Plain Python (base64, json): runs in the browser.
"""
from __future__ import annotations

import base64
from pathlib import Path

from ..errors import ModelFormatError, UnsupportedModelError
from .model_config import BertConfig
from .sentence_transformers import SentenceTransformerConfig

ARCHITECTURES = {"bert": "bert", "nomic-bert": "nomic_bert"}     # GGUF general.architecture -> BertConfig.arch
POOLING_TYPES = {1: "mean", 2: "cls", 3: "lasttoken"}             # llama.cpp's LLAMA_POOLING_TYPE_*
_POOLING_NAMES = {0: "none (per-token vectors)", 4: "rank (a reranker's score)"}
CONTROL = 3                                                       # tokenizer.ggml.token_type of specials
_PHANTOM = "\u2581"


def _meta(g, key: str, default=None, required: bool = False):
    return g.meta(key, default, required=required)


def bert_config(g) -> BertConfig:
    """BertConfig of a bert / nomic-bert GGUF (weights named as loaders.gguf names them)."""
    arch = ARCHITECTURES.get(g.architecture)
    if arch is None:
        raise UnsupportedModelError(f"{g.where}: GGUF architecture {g.architecture!r} is not an encoder "
                                    f"this engine runs ({sorted(ARCHITECTURES)})")
    if _meta(g, "attention.causal", False):
        raise UnsupportedModelError(f"{g.where}: {g.architecture}.attention.causal is true; GGUF encoders "
                                    f"run bidirectional attention only")
    md = g.metadata
    C = int(_meta(g, "embedding_length", required=True))
    H = int(_meta(g, "attention.head_count", required=True))
    tokens = md.get("tokenizer.ggml.tokens")
    embd = g.tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd is not None else len(tokens or ())
    try:
        return BertConfig(
            arch=arch, vocab_size=vocab, hidden_size=C, n_layers=int(_meta(g, "block_count", required=True)),
            n_heads=H, intermediate_size=int(_meta(g, "feed_forward_length", required=True)),
            max_position=int(_meta(g, "context_length", required=True)),
            type_vocab_size=int(md.get("tokenizer.ggml.token_type_count", 2) or 1),
            layer_norm_eps=float(_meta(g, "attention.layer_norm_epsilon", 1e-12)), hidden_act="gelu",
            pad_id=int(md.get("tokenizer.ggml.padding_token_id", 0) or 0), name=str(md.get("general.name", "")),
            rope_base=float(_meta(g, "rope.freq_base", 10000.0)) if arch == "nomic_bert" else 0.0,
            ffn="swiglu" if arch == "nomic_bert" else "gelu", gguf=True)
    except ValueError as e:
        raise ModelFormatError(f"{g.where}: {e}") from None


def pooling(g) -> str:
    """Our pooling name for `<arch>.pooling_type` (mean when absent); typed error for the others."""
    t = _meta(g, "pooling_type")
    if t is None:
        return "mean"
    if int(t) not in POOLING_TYPES:
        what = _POOLING_NAMES.get(int(t), "unknown")
        raise UnsupportedModelError(
            f"{g.where}: {g.architecture}.pooling_type {t} ({what}) is not supported; an embedder here pools "
            f"by mean (1), CLS (2) or last token (3).")
    return POOLING_TYPES[int(t)]


def embedder_settings(g, path) -> SentenceTransformerConfig:
    """How the pipeline turns hidden states into a vector: the file's pooling, L2-normalised, inputs
    truncated to the trained context."""
    kind = g.metadata.get("tokenizer.ggml.model")
    if kind not in ("bert", "t5"):
        raise UnsupportedModelError(f"{g.where}: tokenizer.ggml.model {kind!r} is not an encoder vocabulary "
                                    f"this engine reads (bert: WordPiece, t5: SentencePiece-Unigram)")
    return SentenceTransformerConfig(model_folder=Path(path), pooling=pooling(g), normalize=True,
                                     max_seq_length=int(_meta(g, "context_length", required=True)))


# --------------------------------------------------------------------------- vocabulary
def _special(md: dict, key: str, tokens: list[str]) -> str | None:
    i = md.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def _added(tokens: list[str], types: list[int], names: list[str] | None = None) -> list[dict]:
    names = names or tokens
    return [{"id": i, "content": names[i], "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True} for i, t in enumerate(types) if t == CONTROL]


def _template(first: str | None, last: str | None, vocab: dict[str, int]) -> dict | None:
    single = ([{"SpecialToken": {"id": first, "type_id": 0}}] if first else []) + \
        [{"Sequence": {"id": "A", "type_id": 0}}] + ([{"SpecialToken": {"id": last, "type_id": 0}}] if last else [])
    specials = {t: {"id": t, "ids": [vocab[t]], "tokens": [t]} for t in (first, last) if t}
    return {"type": "TemplateProcessing", "single": single, "pair": single, "special_tokens": specials}


def tokenizer_json(md: dict, where: str = "GGUF") -> tuple[dict, dict]:
    """(tokenizer.json spec, tokenizer_config) of a "bert" or "t5" GGUF vocabulary."""
    kind = md.get("tokenizer.ggml.model")
    tokens = [str(t) for t in md.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise ModelFormatError(f"{where}: GGUF metadata lacks tokenizer.ggml.tokens")
    types = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise ModelFormatError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for "
                               f"{len(tokens)} tokens")
    if kind == "bert":
        return _wordpiece(md, tokens, types, where)
    if kind == "t5":
        return _unigram(md, tokens, types, where)
    raise UnsupportedModelError(f"{where}: GGUF tokenizer model {kind!r} is not an encoder vocabulary here "
                                f"(bert, t5)")


def _wordpiece(md: dict, tokens: list[str], types: list[int], where: str) -> tuple[dict, dict]:
    # undo the converter's phantom-space rewrite: "▁word" -> "word", "piece" -> "##piece" (files from
    # converters before that rewrite keep BERT's own "##" pieces and no "▁": taken as they are)
    legacy = any(t.startswith("##") for t in tokens) and not any(t.startswith(_PHANTOM) for t in tokens)
    names = tokens if legacy else [t if ty == CONTROL else t[1:] if t.startswith(_PHANTOM) else "##" + t
                                   for t, ty in zip(tokens, types)]
    vocab: dict[str, int] = {}
    for i, n in enumerate(names):
        vocab.setdefault(n, i)
    cls_t, sep_t = _special(md, "cls", names) or "[CLS]", _special(md, "seperator", names) or "[SEP]"
    unk_t, pad_t = _special(md, "unknown", names) or "[UNK]", _special(md, "padding", names) or "[PAD]"
    for t in (cls_t, sep_t, unk_t):
        if t not in vocab:
            raise ModelFormatError(f"{where}: the WordPiece vocabulary lacks {t}")
    lower = bool(md.get("tokenizer.ggml.normalizer.lowercase", True))
    strip = bool(md.get("tokenizer.ggml.normalizer.strip_accents", lower))
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added(tokens, types, names),
            "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                           "strip_accents": strip, "lowercase": lower},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "post_processor": _template(cls_t, sep_t, vocab),
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
            "model": {"type": "WordPiece", "unk_token": unk_t, "continuing_subword_prefix": "##",
                      "max_input_chars_per_word": 100, "vocab": vocab}}
    return spec, {"cls_token": cls_t, "sep_token": sep_t, "unk_token": unk_t, "pad_token": pad_t}


def _unigram(md: dict, tokens: list[str], types: list[int], where: str) -> tuple[dict, dict]:
    scores = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk = md.get("tokenizer.ggml.unknown_token_id")
    bos, eos = _special(md, "bos", tokens), _special(md, "eos", tokens)
    bos = bos if md.get("tokenizer.ggml.add_bos_token", True) else None
    eos = eos if md.get("tokenizer.ggml.add_eos_token", True) else None
    norms = []
    charsmap = md.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        norms.append({"type": "Precompiled",
                      "precompiled_charsmap": base64.b64encode(bytes(int(b) & 0xFF for b in charsmap)).decode()})
    norms.append({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "})
    prefix = "always" if md.get("tokenizer.ggml.add_space_prefix", True) else "never"
    vocab = {t: i for i, t in enumerate(tokens)}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added(tokens, types),
            "normalizer": {"type": "Sequence", "normalizers": norms},
            "pre_tokenizer": {"type": "Metaspace", "replacement": _PHANTOM, "prepend_scheme": prefix, "split": True},
            "post_processor": _template(bos, eos, vocab),
            "decoder": {"type": "Metaspace", "replacement": _PHANTOM, "prepend_scheme": prefix, "split": True},
            "model": {"type": "Unigram", "unk_id": None if unk is None else int(unk), "byte_fallback": False,
                      "vocab": [[t, float(s)] for t, s in zip(tokens, scores)]}}
    return spec, {"bos_token": bos, "eos_token": eos, "unk_token": tokens[int(unk)] if unk is not None else None}
