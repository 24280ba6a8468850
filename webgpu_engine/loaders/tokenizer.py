"""Tokenizer factory: the pure-Python tokenizers everywhere, the `tokenizers` library natively when present.

`load_tokenizer(source)` takes a GGUFFile, a GGUF metadata dict, or an HF folder (tokenizer.json) and
returns an object with `encode(text) -> ids`, `decode(ids) -> str`, `bos_id`, `eos_ids`,
`vocab_size`, `token_bytes(id)`. `native=None` uses the Rust `tokenizers` library when it imports
(faster on long prompts) and the pure-Python one otherwise (the browser); both give identical ids.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ModelFormatError, UnsupportedModelError
from .bpe import BPETokenizer


def _have_tokenizers() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


class NativeTokenizer:
    """Encodes/decodes with a `tokenizers.Tokenizer`; vocabulary facts come from the pure-Python twin
    (`base`), so both paths expose the same ids, special tokens and `token_bytes`."""

    def __init__(self, tk, base, plain=None):
        # plain: the same tokenizer without added tokens, for text whose special-token texts must
        # stay text (a mutable flag on `tk` would race between threads encoding at once).
        self._tk, self.base, self._plain = tk, base, plain if plain is not None else tk

    def __getattr__(self, name):           # bos_id, eos_ids, vocab_size, token_bytes, ... from base
        if name in ("base", "_tk", "_plain") or name.startswith("__"):   # not set yet (copy/pickle)
            raise AttributeError(name)
        return getattr(self.base, name)

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        tk = self._tk if parse_special else self._plain
        ids = tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.base.add_bos_token and self.base.bos_id is not None:
            ids = [self.base.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"NativeTokenizer({self.base!r})"


class NativeWordPiece(NativeTokenizer):
    """WordPiece through `tokenizers`: [CLS]/[SEP] by the file's post-processor, truncation to
    `max_length` (specials included) like the pure-Python twin."""

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        return self.encode_batch([text], add_special_tokens, max_length)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True,
                     max_length: int | None = None) -> list[list[int]]:
        limit = self.base.max_length if max_length is None else max_length
        self._tk.enable_truncation(limit)
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def native_bpe(base: BPETokenizer, specials: bool = True):
    """A `tokenizers.Tokenizer` with the same vocabulary, merges, pre-tokenizer and (unless
    specials=False) special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = sorted(base.ranks.items(), key=lambda kv: kv[1])
    tk = Tokenizer(models.BPE(vocab=dict(base.vocab), merges=[pair for pair, _ in merges],
                              unk_token=base.tokens[base.unk_id] if base.unk_id is not None else None,
                              fuse_unk=False, byte_fallback=False, ignore_merges=base.ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if base.split_digits else []
    steps += [pre_tokenizers.Split(Regex(base.pattern), behavior="isolated", invert=False),
              pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    specials = [base.tokens[i] for i in sorted(base.special_ids)] if specials else []
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tk


def _from_folder(folder: Path, native: bool, max_length: int | None, encoder: bool = False):
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        raise ModelFormatError(f"{folder} has no tokenizer.json")
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    st_cfg = folder / "sentence_bert_config.json"
    if max_length is None and st_cfg.is_file():      # sentence-transformers' truncation length (WordPiece)
        max_length = json.loads(st_cfg.read_text(encoding="utf-8")).get("max_seq_length")
    return _from_spec(tj.read_text(encoding="utf-8"), tok_cfg, native, max_length, encoder, tj)


def _from_spec(text: str, tok_cfg: dict, native: bool, max_length: int | None, encoder: bool, tj):
    """The tokenizer of a tokenizer.json's text (`tj`: where it came from, for errors)."""
    spec = json.loads(text)
    kind = (spec.get("model") or {}).get("type")
    if kind == "WordPiece":
        from .wordpiece import WordPieceTokenizer
        base = WordPieceTokenizer.from_tokenizer_json(spec, tok_cfg, max_length=max_length)
    elif kind == "BPE" and (spec.get("model") or {}).get("byte_fallback"):   # SentencePiece-style
        from .spm import SPMTokenizer
        base = SPMTokenizer.from_tokenizer_json(spec, tok_cfg)
    elif kind == "BPE":
        base = BPETokenizer.from_tokenizer_json(spec, tok_cfg)
    elif kind == "Unigram":                               # SentencePiece (XLM-RoBERTa): `tokenizers` only
        from .unigram import UnigramVocab
        base = UnigramVocab.from_tokenizer_json(spec, tok_cfg, max_length=max_length)
        if not native:
            raise UnsupportedModelError(f"{tj}: SentencePiece-Unigram tokenizers need the `tokenizers` "
                                        f"library (there is no pure-Python Unigram encoder yet)")
    else:
        raise UnsupportedModelError(f"{tj}: tokenizer model {kind!r} is not supported (BPE, WordPiece, "
                                    f"Unigram are)")
    if not native:
        if encoder and kind == "BPE":
            raise UnsupportedModelError(f"{tj}: BPE encoders (ModernBERT) need the `tokenizers` library "
                                        f"(the pure-Python BPE does not apply the file's post-processor)")
        return base
    from tokenizers import Tokenizer

    def build(spec_text: str):
        tk = Tokenizer.from_str(spec_text)
        tk.no_truncation()
        tk.no_padding()                               # some files pin padding to a fixed length
        return tk
    if kind in ("WordPiece", "Unigram") or encoder:      # encoders: the file's post-processor, truncation
        return NativeWordPiece(build(text), base)
    try:
        plain = build(json.dumps({**spec, "added_tokens": []}))
    except Exception:  # noqa: BLE001 - a file whose parts need its added tokens: our own twin
        plain = native_bpe(base, specials=False)
    return NativeTokenizer(build(text), base, plain)


def load_tokenizer(source, *, native: bool | None = None, max_length: int | None = None, encoder: bool = False):
    """Tokenizer of a GGUFFile / GGUF metadata dict / HF model folder (see module docstring).
    `max_length`: WordPiece truncation length (None: the folder's model_max_length / 512). `encoder`:
    an embedding model's folder: a BPE tokenizer too adds the file's special tokens and truncates."""
    if native is None:
        native = _have_tokenizers()
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            return _from_folder(path, native, max_length, encoder)
        from .gguf import GGUFFile
        source = GGUFFile(path)
    metadata = source if isinstance(source, dict) else source.metadata
    if metadata.get("tokenizer.ggml.model") in ("bert", "t5"):  # encoders' WordPiece / Unigram vocabularies
        from .gguf_encoder import tokenizer_json
        where = getattr(source, "where", "GGUF")
        spec, tok_cfg = tokenizer_json(metadata, where)
        return _from_spec(json.dumps(spec), tok_cfg, native, max_length, True, f"{where} (its vocabulary)")
    if metadata.get("tokenizer.ggml.model") in ("llama", "gemma4"):   # SentencePiece-style (Llama-2, Mistral, Gemma)
        from .spm import SPMTokenizer, native_spm
        spm = SPMTokenizer.from_gguf_metadata(metadata)
        # Gemma 4's newline runs have no `tokenizers` twin: the pure-Python encoder, as llama.cpp
        return NativeTokenizer(native_spm(spm), spm, native_spm(spm, specials=False)) \
            if native and not spm.newline_runs else spm
    base = BPETokenizer.from_gguf_metadata(metadata)
    return NativeTokenizer(native_bpe(base), base, native_bpe(base, specials=False)) if native else base
