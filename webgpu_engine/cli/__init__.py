"""The command line: `python -m webgpu_engine info|chat|complete|embed|serve|list|download|cache|bench|tune`.

parser.py builds the argument parser, commands.py holds the handlers (models.py the model loading
they share), structured.py the chat options for structured output and tools, tune.py the `tune`
command; `download` and `cache` come from the cache layer (webgpu_engine.cache.cli). Every command
imports what it needs lazily, so `--help` and `info` stay fast and work even when a heavier layer
(the engine, the server, the cache) is broken or missing.
"""
from __future__ import annotations

import logging
import os
import sys

from .models import chat_opts_for, resolve_models
from .parser import build_parser

# The names these helpers had when the command line was one module (tests/test_references.py uses them).
_models = resolve_models
_chat_opts = chat_opts_for


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare `--` goes to the benchmark scripts untouched.
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if extra:
        args.extra = extra
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        ap.print_help()
        return 0
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - typed engine errors carry a message meant for users
        from ..errors import WebGPUEngineError
        if isinstance(e, WebGPUEngineError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


__all__ = ["build_parser", "main"]
