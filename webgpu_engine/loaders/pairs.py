"""Text pairs for cross-encoders: the special tokens and token types a tokenizer.json's post-processor
puts around two texts, and the `longest_first` truncation HF tokenizers apply to pairs.

    tpl = PairTemplate.from_tokenizer_json(spec)        # BERT: [CLS] A [SEP] B [SEP], types 0.. 1..
    ids, types = tpl.encode(a_ids, b_ids, max_length)   # a_ids, b_ids: each text without specials

Each text is tokenised alone (what `tokenizers` does for a pair too), so the pure-Python and native
tokenizers share this. Plain Python: runs in the browser.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class PairTemplate:
    # ("special", token id, type) or ("A" | "B", None, type), in order
    items: tuple[tuple[str, int | None, int], ...]

    @property
    def n_special(self) -> int:
        return sum(1 for kind, _, _ in self.items if kind == "special")

    @classmethod
    def from_tokenizer_json(cls, spec: dict, where: str = "tokenizer.json") -> "PairTemplate":
        pp = spec.get("post_processor") or {}
        kind = pp.get("type")
        if kind == "Sequence":          # e.g. ByteLevel then TemplateProcessing: the template decides
            found = [p for p in pp.get("processors", []) if p.get("type") in
                     ("TemplateProcessing", "BertProcessing", "RobertaProcessing")]
            pp, kind = (found[0], found[0]["type"]) if found else ({}, None)
        if kind == "TemplateProcessing":
            specials = {name: tok["ids"] for name, tok in pp.get("special_tokens", {}).items()}
            items = []
            for piece in pp.get("pair", []):
                if "SpecialToken" in piece:
                    t = piece["SpecialToken"]
                    items += [("special", i, int(t.get("type_id", 0))) for i in specials[t["id"]]]
                else:
                    t = piece["Sequence"]
                    items.append((t["id"], None, int(t.get("type_id", 0))))
            return cls(tuple(items))
        if kind == "BertProcessing":
            cls_id, sep_id = pp["cls"][1], pp["sep"][1]
            return cls((("special", cls_id, 0), ("A", None, 0), ("special", sep_id, 0), ("B", None, 1),
                        ("special", sep_id, 1)))
        if kind == "RobertaProcessing":
            # <s> A </s></s> B </s>; RoBERTa models have one token type, so every type is 0
            cls_id, sep_id = pp["cls"][1], pp["sep"][1]
            return cls((("special", cls_id, 0), ("A", None, 0), ("special", sep_id, 0), ("special", sep_id, 0),
                        ("B", None, 0), ("special", sep_id, 0)))
        raise UnsupportedModelError(f"{where}: post-processor {kind!r} does not say how to join a text pair "
                                    f"(TemplateProcessing, BertProcessing, RobertaProcessing do)")

    def encode(self, a: list[int], b: list[int], max_length: int) -> tuple[list[int], list[int]]:
        """(ids, token types) of the pair, truncated to `max_length` tokens in all."""
        n1, n2 = longest_first(len(a), len(b), max_length - self.n_special)
        ids: list[int] = []
        types: list[int] = []
        for kind, tok, typ in self.items:
            part = [tok] if kind == "special" else (a[:n1] if kind == "A" else b[:n2])
            ids += part
            types += [typ] * len(part)
        return ids, types


def longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """How many tokens of each text a pair keeps under `budget` (HF tokenizers' `longest_first`,
    tokenizers/src/utils/truncation.rs): the shorter text whole when the longer can take the rest,
    else half of the budget each (the odd token to the longer)."""
    if n1 + n2 <= budget:
        return n1, n2
    if budget < 0:
        raise ValueError(f"max_length leaves no room for the pair's special tokens ({budget})")
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return (n2, n1) if swap else (n1, n2)
