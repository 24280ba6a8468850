"""Special-token texts inside a string: one pattern and one splitter shared by the pure-Python
tokenizers (BPE, SentencePiece, WordPiece) and the chat template's encoder. Standard library only."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator


def special_pattern(texts: Iterable[str]) -> re.Pattern | None:
    """A regex matching any of `texts` (None for none), longest first, so that a special token that
    prefixes another does not win."""
    texts = sorted({t for t in texts if t}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


def split_special(text: str, pattern: re.Pattern | None) -> Iterator[tuple[int, str, bool]]:
    """(start, piece, is_special) for the pieces of `text` in order: the matches of `pattern` and the
    non-empty runs of ordinary text between them (all of `text` as one run when pattern is None)."""
    pos = 0
    if pattern is not None:
        for m in pattern.finditer(text):
            if m.start() > pos:
                yield pos, text[pos:m.start()], False
            yield m.start(), m.group(), True
            pos = m.end()
    if pos < len(text):
        yield pos, text[pos:], False
