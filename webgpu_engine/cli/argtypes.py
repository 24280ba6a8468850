"""argparse value types shared by the parser (parser.py) and the command modules that add their own
options (ray_cmds.py), which parser.py imports: here, below both. Standard library only."""
from __future__ import annotations

import argparse


def count(text: str, lo: int = 0, none: bool = False) -> int | None:
    """An argparse type: an integer >= lo (or, with `none`, the word none / unbounded: None)."""
    want = f"a count >= {lo}" + (" or 'none'" if none else "")
    if none and text.strip().lower() in ("none", "unbounded"):
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if n < lo:
        raise argparse.ArgumentTypeError(f"expected {want}, got {n}")
    return n


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return count(text, 1)


__all__ = ["count", "positive"]
