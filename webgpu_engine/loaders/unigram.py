"""The vocabulary of a SentencePiece-Unigram tokenizer.json (XLM-RoBERTa: bge-m3, multilingual-e5):
ids, pieces, special tokens and the truncation length. Encoding runs in the `tokenizers` library
(loaders.tokenizer's NativeEncoder); there is no pure-Python Unigram encoder yet, so a page without
`tokenizers` cannot load these models (their Precompiled normaliser is a serialised trie too).
Plain Python: runs in the browser.
"""
from __future__ import annotations

from ..errors import UnsupportedModelError


class UnigramVocab:
    """Vocabulary facts of a Unigram tokenizer.json, what NativeEncoder asks of its `base`."""

    def __init__(self, pieces: list[str], *, unk_id: int | None, specials: dict[str, int], bos: str | None,
                 eos: str | None, max_length: int):
        self.pieces = pieces
        self.vocab = {p: i for i, p in enumerate(pieces)}
        self.vocab.update(specials)
        self.unk_id, self.max_length = unk_id, max_length
        self.special_ids = set(specials.values())
        self._bos, self._eos = bos, eos

    @classmethod
    def from_tokenizer_json(cls, spec: dict, tok_cfg: dict | None = None, *,
                            max_length: int | None = None) -> "UnigramVocab":
        model = spec.get("model") or {}
        if model.get("type") != "Unigram":
            raise UnsupportedModelError(f"tokenizer.json model {model.get('type')!r} is not Unigram")
        tok_cfg = tok_cfg or {}
        if max_length is None:
            max_length = int(tok_cfg.get("model_max_length", 512))
            max_length = max_length if 0 < max_length <= 1 << 20 else 512   # HF's "infinite" sentinel
        pieces = [p[0] for p in model.get("vocab") or []]
        specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens") or []}

        def name(key: str, default: str) -> str | None:
            v = tok_cfg.get(key, default)
            v = v.get("content") if isinstance(v, dict) else v
            return v if isinstance(v, str) else None
        return cls(pieces, unk_id=model.get("unk_id"), specials=specials, bos=name("bos_token", "<s>"),
                   eos=name("eos_token", "</s>"), max_length=max_length)

    @property
    def vocab_size(self) -> int:
        return max(self.vocab.values(), default=-1) + 1

    @property
    def bos_id(self) -> int | None:
        return self.vocab.get(self._bos) if self._bos else None

    @property
    def eos_ids(self) -> list[int]:
        return [self.vocab[self._eos]] if self._eos in self.vocab else []

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        return self.pieces[token_id] if token_id < len(self.pieces) else \
            next(t for t, i in self.vocab.items() if i == token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self.id_to_token(token_id).replace("\u2581", " ").encode("utf-8")

    def __repr__(self) -> str:
        return f"UnigramVocab(vocab={self.vocab_size}, max_length={self.max_length})"
