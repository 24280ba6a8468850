"""Speculative decoding by prompt lookup (n-gram): guess the next tokens by finding the last few
tokens earlier in the context (the prompt and the answer so far) and taking what followed them, then
check all the guesses in one forward pass. RAG answers and code edits copy long spans of their
prompt, so one pass often yields several tokens.

Exactness: the guesses are checked by a forward over rows [last token, guess 1 .. guess k] whose
kernels are row-invariant (the prefill's: a row's values do not depend on the other rows), with
each row's LM head computed as a one-row prefill computes it; row r's token is the one decoding
would give after the tokens before it. Every step of a request with speculation runs this way (with
no guess it is a one-row forward), so a greedy answer equals the answer of decoding one token per
forward with the prefill's kernels, whatever was guessed (tests/test_speculation.py). The default
decode path's fused one-row kernels sum in another order: an answer with speculation may differ
from an answer without it in the last bits of a logit, as two GPUs' answers may.

Which requests speculate: greedy ones without penalties, grammar or logit processor, on the
one-request path; the others decode as without speculation (named in `usage.extra`).
Standard library only (runs in the page).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ChatOptionTypeError

METHODS = ("ngram",)
MAX_K = 16


@dataclass(frozen=True)
class Speculation:
    """chat option `speculation`: {"method": "ngram", "k": guesses per step, "n": longest n-gram
    matched (down to `n_min`)}."""

    method: str = "ngram"
    k: int = 4
    n: int = 3
    n_min: int = 1

    @classmethod
    def parse(cls, opt) -> "Speculation | None":
        if opt is None or opt is False:
            return None
        if isinstance(opt, str):
            opt = {"method": opt}
        if not isinstance(opt, dict):
            raise ChatOptionTypeError("speculation", 'an object like {"method": "ngram", "k": 4}', opt)
        unknown = sorted(set(opt) - {"method", "k", "n", "n_min"})
        if unknown:
            raise ChatOptionTypeError("speculation", f"an object with method, k, n, n_min (not {unknown})", opt)
        method = opt.get("method", "ngram")
        if method not in METHODS:
            # a draft model is not written yet: refused by name rather than ignored
            raise ChatOptionTypeError("speculation", f"method one of {list(METHODS)} (a draft model is "
                                      f"not supported yet)", opt)
        vals = {}
        for name, lo, hi, default in (("k", 1, MAX_K, 4), ("n", 1, 8, 3), ("n_min", 1, 8, 1)):
            v = opt.get(name, default)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ChatOptionTypeError("speculation", f"{name} an integer in [{lo}, {hi}]", opt)
            vals[name] = v
        if vals["n_min"] > vals["n"]:
            raise ChatOptionTypeError("speculation", "n_min <= n", opt)
        return cls(method, **vals)

    def describe(self) -> dict:
        return {"method": self.method, "k": self.k, "n": self.n, "n_min": self.n_min}


def propose(context: list[int], k: int, n: int, n_min: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the context's last n
    tokens (n from `n` down to `n_min`: the longest match wins); [] when nothing matches."""
    L = len(context)
    if k <= 0:
        return []
    for size in range(min(n, L - 1), n_min - 1, -1):
        tail = context[L - size:]
        first = tail[0]
        # the latest start i < L - size with context[i:i + size] == tail
        for i in range(L - size - 1, -1, -1):
            if context[i] == first and context[i:i + size] == tail:
                return context[i + size:i + size + k]
    return []


@dataclass
class SpeculationStats:
    """What speculation did for one request (usage.extra) or a model since load."""

    steps: int = 0            # verify forwards
    proposed: int = 0         # tokens guessed
    accepted: int = 0         # guesses the model agreed with

    def add(self, other: "SpeculationStats") -> None:
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted

    def extra(self) -> dict:
        return {"speculation_steps": self.steps, "speculation_proposed_tokens": self.proposed,
                "speculation_accepted_tokens": self.accepted}
