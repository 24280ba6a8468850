"""`python -m webgpu_engine list`: the model ids the engine loads by name (the app config: --config,
else the built-in records), or with --ollama the models of Ollama's store ($OLLAMA_MODELS, else
~/.ollama/models), each loadable as `ollama:NAME:TAG`. Reads manifests and records only: no GGUF is
opened and no blob hashed, so it is instant even for a large store."""
from __future__ import annotations

import json


def _size(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def cmd_list(args) -> int:
    if args.ollama:
        from ..engine.ollama_store import list_store, store_root
        rows = list_store()
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        if not rows:
            print(f"no models in the Ollama store at {store_root()} (set OLLAMA_MODELS to another store)")
            return 0
        print(f"{'NAME':40s} {'SIZE':>9s}  {'FAMILY':12s} {'PARAMETERS':10s} QUANT")
        for r in rows:
            if "error" in r:
                print(f"{r['name']:40s} {'':>9s}  error: {r['error']}")
                continue
            print(f"{r['name']:40s} {_size(r.get('size')):>9s}  {r.get('family') or '-':12s} "
                  f"{r.get('parameter_size') or '-':10s} {r.get('quantization_level') or '-'}")
        print(f"\nload one as ollama:NAME:TAG (e.g. serve --model ollama:{rows[0]['name']})")
        return 0
    if args.webllm:                           # WebLLM's prebuilt ids (cli/webllm.py)
        from .webllm import print_webllm
        return print_webllm(args.json)
    from ..engine.records import default_app_config, load_app_config
    app = load_app_config(args.config) if args.config else default_app_config()
    rows = [{"model_id": r.model_id, "model_type": r.model_type, "model": r.model} for r in app.model_list]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"{r['model_id']:40s} {r['model_type']:10s} {r['model']}")
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("list", help="list the model ids it loads by name, or Ollama's store (--ollama)",
                       description="List the model ids of the app config (--config, else the built-in "
                                   "ones), or with --ollama the models of Ollama's store ($OLLAMA_MODELS, "
                                   "else ~/.ollama/models), each loadable as ollama:NAME:TAG.")
    p.add_argument("--ollama", action="store_true", help="list Ollama's model store")
    p.add_argument("--webllm", action="store_true", help="list WebLLM's prebuilt model ids and which load")
    p.add_argument("--config", default=None, metavar="APP_CONFIG_JSON", help="WebLLM AppConfig JSON")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_list)
