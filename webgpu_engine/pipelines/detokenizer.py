"""Incremental detokenizer: token ids -> streamed text deltas that never split a UTF-8 character and
never show a stop string (held back while it may still be forming, cut when it completes).

    d = StreamDetokenizer(tokenizer.token_bytes, stop=["\\n\\n"])
    d.add(token_id)            # -> True once a stop string completed (the text ends before it)
    d.take_delta()             # new text that is safe to show
    d.finish()                 # end of generation: flush held bytes / held stop-string prefixes
                               # and return the last delta (`flush()` alone leaves it for take_delta)
    d.text                     # the whole answer (stop string removed)

Bytes of a character split across tokens (emoji, CJK in byte-level BPE) wait until the character is
complete; invalid sequences become U+FFFD exactly once, and at `finish` a truncated tail does too, so
no byte is lost. A SentencePiece reply ("▁Hello▁world") loses the space in front of its first word, as
the tokenizer's decode of the whole reply does (`strip_leading_space`; by default the tokenizer that
`token_bytes` belongs to says, by its `decode_strips_leading_space`), so the streamed text equals the
decoded one. Standard library only (runs in the page).
"""
from __future__ import annotations

import codecs
from typing import Callable, Iterable


def safe_token_bytes(token_bytes: Callable[[int], bytes]) -> Callable[[int], bytes]:
    """token_bytes that gives b"" for an id the tokenizer cannot decode (a padding row of the
    model's vocabulary) instead of raising: a reply never fails on one token's text."""
    def get(token_id: int) -> bytes:
        try:
            return token_bytes(int(token_id))
        except (ValueError, IndexError, KeyError, TypeError):
            return b""
    return get


class StreamDetokenizer:
    def __init__(self, token_bytes: Callable[[int], bytes], stop: Iterable[str] = (),
                 strip_leading_space: bool | None = None):
        if strip_leading_space is None:     # as the decode of the tokenizer this method belongs to
            owner = getattr(token_bytes, "__self__", None)
            strip_leading_space = bool(getattr(owner, "decode_strips_leading_space", False))
        self._strip_first = strip_leading_space     # until the first text arrives
        self._token_bytes = safe_token_bytes(token_bytes)
        self.stop = [s for s in dict.fromkeys(stop) if s]
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""            # decoded text so far (cut at a completed stop string)
        self._safe = 0            # text[:_safe] can be shown: it cannot be part of a stop string
        self._emitted = 0         # text[:_emitted] was returned by take_delta
        self.stopped = False      # a stop string completed
        self.stop_str: str | None = None
        self.n_tokens = 0

    def add(self, token_id: int) -> bool:
        """Append one token. Returns True when a stop string completed (then further adds are ignored)."""
        if self.stopped:
            return True
        self.n_tokens += 1
        self._append(self._dec.decode(self._token_bytes(int(token_id)), final=False))
        return self.stopped

    def add_many(self, ids: Iterable[int]) -> bool:
        for t in ids:
            if self.add(t):
                break
        return self.stopped

    def flush(self) -> None:
        """End of generation: decode any truncated tail (as U+FFFD) and release held text, which
        the next `take_delta` returns."""
        if not self.stopped:
            self._append(self._dec.decode(b"", final=True))
            if not self.stopped:
                self._safe = len(self.text)

    def finish(self) -> str:
        """`flush`, then the remaining delta."""
        self.flush()
        return self.take_delta()

    def take_delta(self) -> str:
        out = self.text[self._emitted:self._safe]
        self._emitted = max(self._emitted, self._safe)
        return out

    @property
    def emitted_text(self) -> str:
        return self.text[:self._emitted]

    def _append(self, piece: str) -> None:
        if not piece:
            return
        if self._strip_first:
            self._strip_first = False
            piece = piece[1:] if piece.startswith(" ") else piece
            if not piece:
                return
        start = len(self.text)
        self.text += piece
        if not self.stop:
            self._safe = len(self.text)
            return
        # a stop string that completes now must end inside `piece`: search from where it could start
        lo = max(0, start - self._max_stop + 1)
        hit = -1
        for s in self.stop:
            i = self.text.find(s, lo)
            if i >= 0 and (hit < 0 or i < hit):
                hit, self.stop_str = i, s
        if hit >= 0:
            self.text = self.text[:hit]
            self._safe = len(self.text)
            self.stopped = True
            return
        # hold back the longest suffix that is a prefix of some stop string
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        self._safe = max(self._safe, len(self.text) - hold)
