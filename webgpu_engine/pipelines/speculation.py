"""Speculative decoding: guess the next tokens, then check all the guesses in one forward pass.
Two ways to guess:

- prompt lookup ("ngram"): find the longest earlier match of the context's end (the prompt and the
  answer so far) and take what followed it, as far as every equally long match agrees (`propose`).
  RAG answers and code edits copy long spans of their prompt, so one pass often yields several
  tokens. Costs nothing on the GPU. Guessing only where the context is sure (a match of at least
  `n_min` = 2 tokens, up to where its occurrences part) matters where a verify row costs: on
  bench/speculative.py's tasks it kept 0.79-0.96 of the guesses against 0.37-0.88 for the latest
  match of at most 3 tokens (replayed on the answers, lavapipe's row costs).
- a draft model ("draft"): a second, smaller model with the same vocabulary decodes k tokens
  greedily for every sequence of a step at once (batch_draft.py: a paged cache of its own keeps the
  longest prefix it shares with each sequence's context, so rejected guesses are cut back). Works
  for any pair of families the registry loads.

Exactness: the guesses are checked as extra decode rows of the scheduler's step (batch_speculation.py):
rows [last token, guess 1 .. guess k] at consecutive positions through the decode kernels the batch's
plain rows go through, whose sums do not depend on the rows beside them, so row r's logits are, bit
for bit, those of a plain decode step at its position: a greedy answer with speculation equals the
answer without it, whatever was guessed (tests/test_speculation.py, tests/test_batch_speculation.py).

Sampled requests (speculative sampling): each verify row samples its token as a decode step would
(the request's temperature, top-k, top-p, min-p, logit_bias, with the next draws of its seed), and a
guess is kept when its row drew that very token. Both ways of guessing give one guess with
certainty (q(g) = 1), for which the accept rule min(1, p(g)/q(g)) = p(g) and the residual
distribution (p without g, renormalised) make exactly this: the token at each position is drawn
from the model's p, so the answers' distribution is that of decoding (tests/test_speculation.py
checks it with a chi-square test over many seeds). A seed gives the same answer on every run; it is
not the answer the same seed gives without speculation (rejected rows use up draws).

Grammars (JSON schema, tools, regex, lark): the grammar's forced tokens are the first guesses
(a JSON key the schema fixes is nearly always right), then the draft's or prompt lookup's; the
guesses the grammar refuses are dropped before the forward, and every verify row is masked with the
grammar's state after the guesses before it (the matcher steps through them and rolls back).

Which requests speculate: those without penalties (frequency, presence, repetition: their counts
would take in rejected rows) or logit processor (a host round trip per row); the others decode as
without speculation (named in `usage.extra`).

Turning itself off (`auto_off`, on by default, per sequence): a verify step of k + 1 rows costs more
than a plain decode step (on lavapipe about 2.1x for 4 rows through the fused kernels; on GPUs about
one step), so speculation only pays when enough guesses are right. Steps without guesses time the
yardstick; after `probe` verify steps, a sequence's tokens per second over its verify steps are
compared with the model's plain decode steps; when speculation is slower, the rest of the sequence
decodes in plain rows. (Judging every step, no-guess steps included, turned speculation off on
answers it made 1.4x faster: a slow early step decided it.) The answer is the same either way.
Standard library only (runs in the page).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ChatOptionTypeError

METHODS = ("ngram", "draft")
MAX_K = 16
_FIELDS = ("method", "k", "n", "n_min", "model", "auto_off", "probe")


@dataclass(frozen=True)
class Speculation:
    """chat option `speculation`: {"method": "ngram", "k": guesses per step, "n": longest n-gram
    matched (down to `n_min`)} or {"method": "draft", "model": a model reference, "k": ...}; both
    take "auto_off" (default true) and "probe" (verify steps before auto_off judges, default 4)."""

    method: str = "ngram"
    k: int | None = None           # None: auto_k (the rows one verify forward costs least for)
    n: int = 8
    n_min: int = 2
    model: str | None = None       # draft: the draft model (a reference; a local path once resolved)
    auto_off: bool = True
    probe: int = 4

    @classmethod
    def parse(cls, opt) -> "Speculation | None":
        if opt is None or opt is False:
            return None
        if isinstance(opt, str):
            opt = {"method": opt}
        if not isinstance(opt, dict):
            raise ChatOptionTypeError("speculation", 'an object like {"method": "ngram", "k": 4}', opt)
        unknown = sorted(set(opt) - set(_FIELDS))
        if unknown:
            raise ChatOptionTypeError("speculation", f"an object with {', '.join(_FIELDS)} (not {unknown})", opt)
        method = opt.get("method", "ngram")
        if method not in METHODS:
            raise ChatOptionTypeError("speculation", f"method one of {list(METHODS)}", opt)
        model = opt.get("model")
        if method == "draft" and (not isinstance(model, str) or not model.strip()):
            raise ChatOptionTypeError("speculation", 'a draft model reference: {"method": "draft", '
                                      '"model": "<id, path or URL>"}', opt)
        if method == "ngram" and model is not None:
            raise ChatOptionTypeError("speculation", '"model" only with method "draft"', opt)
        vals = {}
        for name, lo, hi, default in (("k", 1, MAX_K, None), ("n", 1, 8, 8), ("n_min", 1, 8, 2),
                                      ("probe", 1, 64, 4)):
            v = opt.get(name, default)
            if v is None and name == "k":
                vals[name] = None                  # auto_k at load
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ChatOptionTypeError("speculation", f"{name} an integer in [{lo}, {hi}]", opt)
            vals[name] = v
        if "n_min" not in opt:
            vals["n_min"] = min(vals["n_min"], vals["n"])
        if vals["n_min"] > vals["n"]:
            raise ChatOptionTypeError("speculation", "n_min <= n", opt)
        auto_off = opt.get("auto_off", True)
        if not isinstance(auto_off, bool):
            raise ChatOptionTypeError("speculation", "auto_off true or false", opt)
        return cls(method, model=model, auto_off=auto_off, **vals)

    def with_k(self, rows_per_pass: int | None) -> "Speculation":
        """This speculation with k set: as given, else auto: where verify rows go through the fused
        one-row kernels (LlamaModel.verify_rows_per_pass: the CPU family), which read each weight
        once per `rows_per_pass` rows, a verify forward of that many rows (on lavapipe 4 rows cost
        2.1x a decode step, 5 rows 2.8x, 8 rows 4.1x: bench/speculative.py); elsewhere (None) 4
        guesses."""
        if self.k is not None:
            return self
        return replace(self, k=max(1, rows_per_pass - 1) if rows_per_pass else 4)

    def describe(self) -> dict:
        d = {"method": self.method, "k": self.k, "auto_off": self.auto_off, "probe": self.probe}
        return {**d, "model": self.model} if self.method == "draft" else {**d, "n": self.n, "n_min": self.n_min}


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def propose(context: list[int], k: int, n: int, n_min: int = 1) -> list[int]:
    """Up to k tokens that followed the longest earlier match of the context's end (at most `n`,
    at least `n_min` tokens long; [] when there is none): what followed its latest occurrence, cut
    where another occurrence of that length went on otherwise (the context is unsure there: "from
    1 8" after "1887 to 1889" guesses "8", not "8 9"). The matches end at earlier copies of the last
    token, found by list.index (a scan in C)."""
    L = len(context)
    if k <= 0 or L < 2:
        return []
    last, ends, i = context[-1], [], -1
    try:
        while True:
            i = context.index(last, i + 1, L - 1)
            ends.append(i)
    except ValueError:
        pass
    best, at = 0, []
    for e in reversed(ends):                      # latest first
        m = 1
        while m < n and m <= e and context[e - m] == context[L - 1 - m]:
            m += 1
        if m > best:
            best, at = m, [e]
        elif m == best:
            at.append(e)
    if best < n_min:
        return []
    guess = context[at[0] + 1:at[0] + 1 + k]
    for e in at[1:]:
        guess = guess[:shared_prefix(guess, context[e + 1:e + 1 + len(guess)])]
        if not guess:
            break
    return guess


@dataclass
class SpeculationStats:
    """What speculation did for one request (usage.extra) or a model since load."""

    steps: int = 0            # verify forwards
    proposed: int = 0         # tokens guessed
    accepted: int = 0         # guesses the model agreed with
    tokens: int = 0           # tokens the verify forwards gave
    seconds: float = 0.0      # their time (draft guesses included)
    off: int = 0              # requests (or 1: this request) where auto_off turned speculation off
    plain: int = 0            # decode steps with nothing to guess (a token each, no verify)

    def add(self, other: "SpeculationStats") -> None:
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.off += other.off
        self.plain += other.plain

    def extra(self) -> dict:
        return {"speculation_steps": self.steps, "speculation_proposed_tokens": self.proposed,
                "speculation_accepted_tokens": self.accepted, "speculation_turned_off": bool(self.off)}


def penalty_free(gen) -> bool:
    """Whether a request may speculate: no frequency, presence or repetition penalty (their counts
    would take in the rejected rows' tokens)."""
    return gen.repetition_penalty == 1.0 and gen.frequency_penalty == 0.0 and gen.presence_penalty == 0.0


def grammar_row_masks(matcher, guess: list[int]) -> tuple[list[int], list[bytes]]:
    """Under a grammar: the leading guesses it allows from here, and each verify row's allowed-token
    mask (row r's after the guesses before it: the last token's row first); the matcher is left
    where it was."""
    guess = guess[:matcher.valid_prefix(guess)]
    masks = [matcher.mask()]
    for t in guess:
        matcher.consume(t)
        masks.append(matcher.mask())
    matcher.rollback(len(guess))
    return guess, masks


def slower_than_decode(stats: SpeculationStats, probe: int, decode_step_s: float | None) -> bool:
    """auto_off's rule: after `probe` verify steps, speculation is slower than one token per fused
    decode step of `decode_step_s` seconds."""
    if stats.steps < probe or decode_step_s is None or stats.tokens == 0:
        return False
    return stats.seconds / stats.tokens > decode_step_s


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map every id to the same bytes (a draft model's guesses are ids)."""
    n = a.vocab_size
    return n == b.vocab_size and all(a.token_bytes(i) == b.token_bytes(i) for i in range(n))
