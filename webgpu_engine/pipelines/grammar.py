"""Constrained decoding with llguidance: a normalised `response_format` (or a tool-call grammar) →
a compiled grammar, cached by its source; one matcher per request, whose allowed-token bitmask
(ceil(V/32) u32 words, bit t of word t/32 = token t allowed) the pipeline uploads each step.

llguidance is a compiled wheel and is imported on first use only: in the browser it is missing, and a
constrained request fails with `FeatureSupportError` naming it instead of being silently ignored.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

from ..errors import FeatureSupportError
from ..protocol.structured import (InvalidResponseFormatError, InvalidResponseFormatGrammarError,
                                   InvalidResponseFormatRegexError)

# Compact JSON with json.dumps' separators: what models write, and no free whitespace, which a
# weak model could emit forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise FeatureSupportError(
            "llguidance", message="response_format (JSON mode, JSON Schema, grammar, regex) and "
            "constrained tool calls need the `llguidance` package, which is not available here "
            "(e.g. in the browser). Send response_format {\"type\": \"text\"} and no tool_choice "
            "\"required\".") from None
    return llguidance


def grammar_text(fmt: dict) -> tuple[str, str]:
    """(kind, source) of a normalised response_format (protocol.structured) or a tool grammar
    ({"type": "lark", "grammar": ...}): the cache key."""
    kind = fmt["type"]
    if kind == "json_object":
        return "json_schema", json.dumps({"type": "object"})
    if kind == "json_schema":
        # key order kept: properties are written in the schema's order (as OpenAI does)
        return "json_schema", json.dumps(fmt["schema"])
    if kind in ("grammar", "lark"):
        return kind, fmt["grammar"]
    if kind == "regex":
        return "regex", fmt["regex"]
    raise InvalidResponseFormatError(f"type {kind!r} has no grammar.")


def _to_llguidance(llg, kind: str, src: str) -> str:
    """The llguidance grammar definition (JSON text) of a source; typed errors for bad input."""
    M = llg.LLMatcher
    try:
        if kind == "json_schema":
            return M.grammar_from_json_schema(src, overrides=JSON_OPTIONS)
        if kind == "grammar":                         # GBNF (llama.cpp / WebLLM) or Lark
            return llg.grammar_from("gbnf", src)
        if kind == "lark":
            return M.grammar_from_lark(src)
        return M.grammar_from_regex(src)
    except ValueError as e:
        raise _error(kind, str(e)) from None


def _error(kind: str, msg: str):
    msg = msg.strip().splitlines()[0][:500] if msg.strip() else "it does not compile"
    if kind == "json_schema":
        return InvalidResponseFormatError(f"the JSON Schema cannot be used: {msg}")
    if kind == "regex":
        return InvalidResponseFormatRegexError(msg)
    return InvalidResponseFormatGrammarError(msg)


class Grammar:
    """A compiled grammar: a pristine matcher that requests copy (`matcher()`)."""

    def __init__(self, kind: str, source: str, proto, init_s: float):
        self.kind, self.source, self._proto, self.init_s = kind, source, proto, init_s

    def matcher(self) -> "Matcher":
        return Matcher(self._proto.deep_copy())


class Matcher:
    """One request's grammar state: `mask()` the allowed tokens for the next step, `consume(t)`
    the sampled token; `stopped` when the grammar allows nothing but the end."""

    def __init__(self, m):
        self._m = m
        self.mask_s = 0.0          # time spent computing masks (grammar_per_token_s)
        self.steps = 0

    def mask(self) -> bytes:
        t0 = time.perf_counter()
        out = self._m.compute_bitmask()
        self.mask_s += time.perf_counter() - t0
        self.steps += 1
        return out

    def consume(self, token: int) -> bool:
        return self._m.consume_token(int(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from here (nothing is consumed)."""
        return self._m.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""
        if n and not self._m.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self.error}")

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (its fast-forward tokens; may be empty)."""
        return list(self._m.compute_ff_tokens())

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class GrammarCompiler:
    """Per loaded model: the llguidance tokenizer (built on first use: ~1 s for a large vocabulary)
    and an LRU of compiled grammars keyed by (kind, source). Thread-safe: the engine compiles before
    the model's lock, possibly while another request of the model decodes."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self._eos = sorted(int(e) for e in eos_ids if 0 <= int(e) < self.vocab_size)
        self._llt = None
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _lltokenizer(self, llg):
        if self._llt is None:
            tk = self._tokenizer
            tokens = [bytes(tk.token_bytes(i)) for i in range(self.vocab_size)]
            specials = sorted(i for i in (getattr(tk, "special_ids", None) or ()) if i < self.vocab_size)

            class _Wrapped:      # the shape llguidance.TokenizerWrapper reads
                eos_token_id = self._eos[0] if self._eos else None
                bos_token_id = getattr(tk, "bos_id", None)
                special_token_ids = specials

                def __call__(_, s):
                    if isinstance(s, bytes):
                        s = s.decode("utf-8", "replace")
                    return list(tk.encode(s, parse_special=False))
            _Wrapped.tokens = tokens
            self._llt = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped()), n_vocab=self.vocab_size,
                                        eos_token=self._eos or None)
        return self._llt

    def compile(self, fmt: dict) -> Grammar:
        """The compiled grammar of a normalised response_format / tool grammar (cached)."""
        llg = _llguidance()
        key = grammar_text(fmt)
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                return g
            t0 = time.perf_counter()
            spec = _to_llguidance(llg, *key)
            m = llg.LLMatcher(self._lltokenizer(llg), spec, log_level=0)
            if m.is_error():
                raise _error(key[0], m.get_error())
            g = Grammar(key[0], key[1], m, time.perf_counter() - t0)
            self._cache[key] = g
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return g
