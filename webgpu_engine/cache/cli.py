"""Cache commands: `download MODEL_ID...`, `cache ls`, `cache rm MODEL_ID...`.

`add_subcommands(subparsers)` registers them in `python -m webgpu_engine`; `main()` is
`python -m webgpu_engine.cache download|ls|rm` (used by `make setup`).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import WebGPUEngineError


def _root_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default=None,
                   help="cache root (default: $WEBGPU_ENGINE_CACHE, else model_cache/ in the repository)")


def cmd_download(args) -> int:
    from . import cache_root, fetch_model_sync, known_models
    ids = args.model_id or sorted(known_models())
    for mid in ids:
        def progress(fraction: float, text: str) -> None:
            if args.quiet:
                return
            # The tqdm bar already draws on a terminal; text lines are for logs and pipes.
            if not sys.stderr.isatty():
                print(f"[{fraction * 100:5.1f}%] {text}", file=sys.stderr, flush=True)
        path = fetch_model_sync(mid, root=args.root, progress=progress, offline=args.offline or None,
                                verify=args.verify, bar=False if args.quiet else None)
        print(f"{mid}: {path}")
    if not args.quiet:
        print(f"cache root: {cache_root(args.root)}", file=sys.stderr)
    return 0


def cmd_ls(args) -> int:
    from . import cache_root, list_cache
    from .progress import human
    rows = list_cache(args.root)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"cache root: {cache_root(args.root)}")
    if not rows:
        print("(empty)")
    for r in rows:
        state = {True: "complete", False: "INCOMPLETE", None: ""}[r["complete"]]
        partial = f"  (+{human(r['partial_bytes'])} partial)" if r["partial_bytes"] else ""
        print(f"  {r['scope']:8s} {r['id']:36s} {r['files']:3d} files {human(r['bytes']):>10s}  "
              f"{state}{partial}")
    return 0


def cmd_rm(args) -> int:
    from . import delete_chat_config_in_cache, delete_model_all_info_in_cache, delete_model_in_cache
    fn = {"all": delete_model_all_info_in_cache, "model": delete_model_in_cache,
          "config": delete_chat_config_in_cache}[args.scope]
    from ..errors import CachePathError
    rc = 0
    for mid in args.model_id:
        try:
            hit = fn(mid, root=args.root)
        except CachePathError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 2
            continue
        if hit:
            print(f"deleted {mid} ({args.scope})")
        else:
            print(f"{mid}: nothing cached ({args.scope})", file=sys.stderr)
            rc = max(rc, 1)
    return rc


def _add_download(sub) -> None:
    p = sub.add_parser("download", help="fetch models' artifacts into the local cache",
                       description="Fetch the artifacts of each MODEL_ID (default: all known models) "
                                   "into the cache, verifying sizes and sha256.")
    p.add_argument("model_id", nargs="*", help="model ids (default: all known models)")
    p.add_argument("--offline", action="store_true", help="fail instead of touching the network")
    p.add_argument("--verify", action="store_true", help="re-hash files already in the cache")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    _root_arg(p)
    p.set_defaults(func=cmd_download)


def _add_ls_rm(sub, prefix: str = "") -> None:
    p = sub.add_parser("ls", help="list cached models", description="List what the cache holds.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _root_arg(p)
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("rm", help="delete cached models",
                       description="Delete the cached files of each MODEL_ID.")
    p.add_argument("model_id", nargs="+")
    p.add_argument("--scope", choices=("all", "model", "config"), default="all",
                   help="what to delete: weights (model), chat config (config) or both (all, default)")
    _root_arg(p)
    p.set_defaults(func=cmd_rm)


def add_subcommands(subparsers) -> None:
    """Register `download` and `cache {ls,rm}` in a parent parser's subparsers (func=handler(args))."""
    _add_download(subparsers)
    p = subparsers.add_parser("cache", help="list or delete cached artifacts",
                              description="List (ls) or delete (rm) cached artifacts.")
    inner = p.add_subparsers(dest="cache_command", metavar="ACTION")
    _add_ls_rm(inner)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m webgpu_engine.cache",
                                 description="The artifact cache of webgpu_engine.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    _add_download(sub)
    _add_ls_rm(sub)
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 0
    try:
        return args.func(args) or 0
    except WebGPUEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
