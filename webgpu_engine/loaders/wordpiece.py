"""Pure-Python BERT WordPiece tokenizer from a `tokenizer.json` (what the browser uses).

Follows Hugging Face `tokenizers`: BertNormalizer (clean text, space around CJK ideographs, strip
accents, lowercase), BertPreTokenizer (split on whitespace and punctuation), greedy longest-match
WordPiece with `##` continuations and [UNK] for words it cannot cover, then [CLS] ... [SEP] and
truncation to `max_length` tokens (specials included), as sentence-transformers calls it.
"""
from __future__ import annotations

import unicodedata

from ..errors import UnsupportedModelError
from .special_text import special_pattern, split_special

# Unicode White_Space (Rust's char::is_whitespace)
_WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
                        "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def _is_cjk(cp: int) -> bool:
    return any(a <= cp <= b for a, b in _CJK)


def _is_punct(c: str) -> bool:
    return c in _ASCII_PUNCT or unicodedata.category(c).startswith("P")


def _is_control(c: str) -> bool:
    # tab/newline/CR count as whitespace, not control; every other C* category is dropped
    return c not in "\t\n\r" and unicodedata.category(c).startswith("C")


class WordPieceTokenizer:
    """`encode(text)` -> [CLS] ids [SEP] truncated to `max_length`; `encode_batch(texts)`."""

    def __init__(self, vocab: dict[str, int], *, unk_token: str = "[UNK]", prefix: str = "##",
                 max_chars: int = 100, lowercase: bool = True, strip_accents: bool | None = None,
                 clean_text: bool = True, chinese_chars: bool = True, cls_token: str = "[CLS]",
                 sep_token: str = "[SEP]", pad_token: str = "[PAD]", special_tokens: list[str] | None = None,
                 max_length: int = 512):
        self.vocab = dict(vocab)
        self.id_to_tok = {i: t for t, i in self.vocab.items()}
        self.unk_token, self.prefix, self.max_chars = unk_token, prefix, max_chars
        self.lowercase, self.clean_text, self.chinese_chars = lowercase, clean_text, chinese_chars
        self.strip_accents = lowercase if strip_accents is None else strip_accents
        self.unk_id = self.vocab.get(unk_token)
        self.cls_id, self.sep_id = self.vocab.get(cls_token), self.vocab.get(sep_token)
        self.pad_id = self.vocab.get(pad_token, 0)
        self.max_length = max_length
        specials = [t for t in (special_tokens or []) if t in self.vocab]
        self.special_ids = {self.vocab[t] for t in specials}
        self._special_re = special_pattern(specials)
        self._word_cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_tokenizer_json(cls, spec: dict, tok_cfg: dict | None = None, *, max_length: int | None = None):
        model = spec.get("model") or {}
        if model.get("type") != "WordPiece":
            raise UnsupportedModelError(f"tokenizer.json model {model.get('type')!r} is not WordPiece")
        norm = spec.get("normalizer") or {}
        if norm and norm.get("type") != "BertNormalizer":
            raise UnsupportedModelError(f"tokenizer.json normalizer {norm.get('type')!r} is not supported "
                                        "(BertNormalizer is)")
        pre = (spec.get("pre_tokenizer") or {}).get("type")
        if pre not in (None, "BertPreTokenizer"):
            raise UnsupportedModelError(f"tokenizer.json pre-tokenizer {pre!r} is not supported")
        tok_cfg = tok_cfg or {}
        if max_length is None:
            max_length = int(tok_cfg.get("model_max_length", 512))
            max_length = max_length if 0 < max_length <= 1 << 20 else 512   # HF's "infinite" sentinel
        return cls(model["vocab"], unk_token=model.get("unk_token", "[UNK]"),
                   prefix=model.get("continuing_subword_prefix", "##"),
                   max_chars=int(model.get("max_input_chars_per_word", 100)),
                   lowercase=bool(norm.get("lowercase", True)), strip_accents=norm.get("strip_accents"),
                   clean_text=bool(norm.get("clean_text", True)),
                   chinese_chars=bool(norm.get("handle_chinese_chars", True)),
                   special_tokens=[t["content"] for t in spec.get("added_tokens") or []],
                   max_length=max_length)

    # ------------------------------------------------------------------ facts
    @property
    def vocab_size(self) -> int:
        return max(self.vocab.values(), default=-1) + 1

    @property
    def bos_id(self) -> int | None:
        return self.cls_id

    @property
    def eos_ids(self) -> list[int]:
        return [self.sep_id] if self.sep_id is not None else []

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        return self.id_to_tok[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        return self.id_to_tok.get(token_id, "").encode("utf-8")

    # ------------------------------------------------------------------ encode
    def normalize(self, text: str) -> str:
        if self.clean_text:
            text = "".join(" " if c in _WHITESPACE else c for c in text
                           if c not in "\x00\ufffd" and not _is_control(c))
        if self.chinese_chars:
            text = "".join(f" {c} " if _is_cjk(ord(c)) else c for c in text)
        if self.strip_accents:
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        if self.lowercase:
            text = text.lower()
        return text

    @staticmethod
    def pre_tokenize(text: str) -> list[str]:
        words, cur = [], []
        for c in text:
            if c in _WHITESPACE:
                if cur:
                    words.append("".join(cur))
                    cur = []
            elif _is_punct(c):
                if cur:
                    words.append("".join(cur))
                    cur = []
                words.append(c)
            else:
                cur.append(c)
        if cur:
            words.append("".join(cur))
        return words

    def _word_ids(self, word: str) -> tuple[int, ...]:
        hit = self._word_cache.get(word)
        if hit is not None:
            return hit
        ids: list[int] = []
        if len(word) > self.max_chars:
            ids = [self.unk_id]
        else:
            start = 0
            while start < len(word):
                end, found = len(word), None
                while start < end:                      # longest vocab piece starting at `start`
                    piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                    found = self.vocab.get(piece)
                    if found is not None:
                        break
                    end -= 1
                if found is None:                       # one uncovered piece makes the word [UNK]
                    ids = [self.unk_id]
                    break
                ids.append(found)
                start = end
        out = tuple(ids)
        if len(self._word_cache) < 100_000:
            self._word_cache[word] = out
        return out

    def _encode_plain(self, text: str, ids: list[int]) -> None:
        for w in self.pre_tokenize(self.normalize(text)):
            ids.extend(self._word_ids(w))

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Ids of `text`; with add_special_tokens, [CLS] ... [SEP]. Truncated to max_length (default:
        the tokenizer's) tokens, specials included."""
        ids: list[int] = []
        for _, piece, special in split_special(text, self._special_re):   # [CLS], [MASK]... stay whole
            if special:
                ids.append(self.vocab[piece])
            else:
                self._encode_plain(piece, ids)
        limit = self.max_length if max_length is None else max_length
        if add_special_tokens:
            ids = [self.cls_id] + ids[:max(limit - 2, 0)] + [self.sep_id]
        else:
            ids = ids[:limit]
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True,
                     max_length: int | None = None) -> list[list[int]]:
        return [self.encode(t, add_special_tokens, max_length) for t in texts]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Like the `tokenizers` WordPiece decoder: "##" glues, other tokens get a space, and its
        `cleanup` rules apply to each token with its leading space (so "it ' s" stays apart)."""
        out: list[str] = []
        for i in ids:
            i = int(i)
            if skip_special_tokens and i in self.special_ids:
                continue
            tok = self.id_to_tok.get(i, self.unk_token)
            if out and tok.startswith(self.prefix):
                tok = tok[len(self.prefix):]
            elif out:
                tok = " " + tok
            for a, b in _CLEANUP:
                tok = tok.replace(a, b)
            out.append(tok)
        return "".join(out)

    def __repr__(self) -> str:
        return f"WordPieceTokenizer(vocab={self.vocab_size}, max_length={self.max_length})"
