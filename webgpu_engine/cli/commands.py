"""The command line: `python -m webgpu_engine info|chat|complete|embed|serve|download|cache|bench`.

Every subcommand imports what it needs lazily, so `--help` and `info` stay fast and work even when
a heavier layer (the engine, the server, the cache) is broken or missing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from .cli_structured import add_options as add_structured_options
from .cli_structured import run_turn
from .cli_tune import add_subcommand as add_tune_command
from .catalogue import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL

REF = "a model: an app-config id, a .gguf file, a model folder, a URL or a Hugging Face ORG/REPO[:QUANT]"


# --------------------------------------------------------------------------- info
def cmd_info(args) -> int:
    from . import gpu
    try:
        dev = gpu.request_device_sync(adapter_name=args.adapter)
    except Exception as e:  # noqa: BLE001 - shown to the user as is
        print(f"error: {e}", file=sys.stderr)
        return 1
    d = dev.describe()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    a = d["adapter"]
    print(f"adapter:   {dev.info.name}")
    print(f"vendor:    {a.get('vendor', '')}   type: {a.get('adapter_type', '')}   "
          f"backend: {a.get('backend', '')} ({d['backend']})")
    if a.get("description"):
        print(f"driver:    {a['description']}")
    print(f"features:  {', '.join(d['features']) or '(none)'}")
    print(f"shader-f16: {'yes' if dev.has_f16 else 'no (f32 kernels will be used)'}")
    keys = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
            "max-compute-invocations-per-workgroup", "max-storage-buffers-per-shader-stage",
            "max-compute-workgroups-per-dimension")
    print("limits:")
    for k in keys:
        if k in d["limits"]:
            v = d["limits"][k]
            extra = f"  ({v / (1 << 20):.0f} MiB)" if "size" in k and v >= 1 << 20 else ""
            print(f"  {k:40s} {v}{extra}")
    if args.all:
        for k, v in d["limits"].items():
            if k not in keys:
                print(f"  {k:40s} {v}")
    if args.model:
        _print_model(args, dev)
        dev.close()
        return 0
    try:
        from .engine.records import default_app_config
        print("models (built-in app config):")
        for r in default_app_config().model_list:
            print(f"  {r.model_id:32s} {r.model_type:9s} {r.model}")
    except Exception:  # noqa: BLE001 - info must work even when the engine layer is broken
        pass
    dev.close()
    return 0


def _print_model(args, dev) -> None:
    """What `--model` resolves to: its record, files and (for files on disk) the memory it would take."""
    from .config import ChatConfig
    from .engine import memory
    app, ids = _models(args, [args.model])
    rec = app.get(ids[0])
    print(f"model:     {rec.model_id}   type: {rec.model_type}")
    origin = rec.reference if rec.reference not in (None, rec.model) else None
    print(f"files:     {rec.model}" + (f"   (from {origin})" if origin else ""))
    if rec.overrides:
        print(f"overrides: {json.dumps(rec.overrides)}")
    print(f"needs:     {', '.join(rec.required_features) or 'no optional WebGPU feature'}")
    path = Path(rec.model) if rec.is_local else None
    if path is None:            # an app-config record: its files, once in the artifact cache
        from .cache import default_model_path
        path = default_model_path(rec.model_id)
        print(f"cached:    {path if path.exists() else 'no (python -m webgpu_engine download ' + rec.model_id + ')'}")
    if path.exists():
        cc = ChatConfig().updated(rec.overrides).updated((_chat_opts(args, 1) or [None])[0])
        est = memory.estimate_for(rec.model_type, path, cc, dev)
        budget, source = memory.memory_budget(dev)
        print(f"memory:    {est.total / (1 << 20):.1f} MiB on the GPU "
              f"(budget {budget / (1 << 20):.0f} MiB, {source})")


# --------------------------------------------------------------------------- engine helpers
def _engine_config(args):
    from .engine.records import EngineConfig

    def progress(report):
        if not getattr(args, "quiet", False):
            print(f"\r[{report['progress'] * 100:5.1f}%] {report['text'][:100]:100s}", end="",
                  file=sys.stderr, flush=True)
            if report["progress"] >= 1.0:
                print(file=sys.stderr)
    return EngineConfig(init_progress_callback=progress, log_level=args.log_level.upper())


def _models(args, refs: list[str]):
    """(app config, model ids) for the model references given on the command line: the records of
    --config (else the built-in ones), plus one record resolved per reference that is not an id there
    (a .gguf, a model folder, a URL, a Hugging Face ORG/REPO[:QUANT]), named by --model-id when given
    (in order). A bad reference fails here, before any engine or server starts."""
    from .engine.records import default_app_config, load_app_config
    from .engine.references import resolve_model_reference
    from .errors import InvalidRequestError
    app = load_app_config(args.config) if getattr(args, "config", None) else default_app_config()
    aliases = getattr(args, "model_id", None) or []
    aliases = [aliases] if isinstance(aliases, str) else list(aliases)
    if len(aliases) > len(refs):
        raise InvalidRequestError(f"{len(aliases)} --model-id given for {len(refs)} --model; give at "
                                  f"most one alias per model, in the same order.", param="model_id")
    aliases += [None] * (len(refs) - len(aliases))
    records = [resolve_model_reference(r, model_id=a, app_config=app) for r, a in zip(refs, aliases)]
    return app.with_records(*records), [r.model_id for r in records]


def _chat_opts(args, n: int) -> list[dict | None] | None:
    """Per-model chat_opts from --chat-opts and the load flags: a flag given once applies to all n
    models, given n times one value per model in order."""
    from .errors import InvalidRequestError
    flags = {"chat_opts": None, "context_window": "context_window_size",
             "prefill_chunk": "prefill_chunk_size", "dtype": "dtype",
             "max_num_sequences": "max_num_sequences"}
    opts: list[dict] = [{} for _ in range(n)]
    for flag, key in flags.items():
        values = getattr(args, flag, None) or []
        if not values:
            continue
        if len(values) not in (1, n):
            raise InvalidRequestError(f"--{flag.replace('_', '-')} is given {len(values)} times for {n} "
                                      f"models: give it once for all, or once per model.", param=flag)
        for k, o in enumerate(opts):
            v = values[0] if len(values) == 1 else values[k]
            if key is not None:
                o[key] = v
                continue
            try:
                d = json.loads(v)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"--chat-opts {v!r} is not JSON: {e}", param="chat_opts") from None
            if not isinstance(d, dict):
                raise InvalidRequestError(f"--chat-opts must be a JSON object, got {v!r}", param="chat_opts")
            o.update(d)
    return [o or None for o in opts] if any(opts) else None


def _create(args, refs: list[str]):
    from .engine import create_mlc_engine
    app, ids = _models(args, refs)
    cfg = _engine_config(args)
    cfg.app_config = app
    opts = _chat_opts(args, len(ids))
    return create_mlc_engine(ids if len(ids) > 1 else ids[0], engine_config=cfg,
                             chat_opts=opts if opts is None or len(ids) > 1 else opts[0])


# --------------------------------------------------------------------------- chat
async def _chat(args) -> int:
    engine = await _create(args, [args.model])
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    one_shot = bool(args.prompt)
    try:
        while True:
            if one_shot:
                text = " ".join(args.prompt)
            else:
                try:
                    text = input(">>> ")
                except EOFError:
                    print()
                    break
                if text.strip() in ("/exit", "/quit"):
                    break
                if text.strip() == "/reset":
                    messages = messages[:1] if args.system else []
                    await engine.reset_chat()
                    continue
                if text.strip() == "/stats":
                    print(await engine.runtime_stats_text())
                    continue
                if not text.strip():
                    continue
            messages.append({"role": "user", "content": text})
            await run_turn(engine, messages, args)      # streams; runs tool calls via stdin
            if one_shot:
                break
    finally:
        await engine.unload()
    return 0


def cmd_chat(args) -> int:
    return asyncio.run(_chat(args))


# --------------------------------------------------------------------------- complete
async def _complete(args) -> int:
    engine = await _create(args, [args.model])
    try:
        stream = await engine.completions.create(
            prompt=" ".join(args.prompt), stream=True, max_tokens=args.max_tokens,
            temperature=args.temperature, seed=args.seed, echo=args.echo)
        async for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].text, end="", flush=True)
        print()
    finally:
        await engine.unload()
    return 0


def cmd_complete(args) -> int:
    return asyncio.run(_complete(args))


# --------------------------------------------------------------------------- embed
async def _embed(args) -> int:
    engine = await _create(args, [args.model])
    try:
        res = await engine.embeddings.create(input=list(args.text))
    finally:
        await engine.unload()
    vecs = [d.embedding for d in res.data]
    if args.similarity:
        if len(vecs) < 2:
            print("error: --similarity needs at least two texts", file=sys.stderr)
            return 2
        sims = [[_cosine(a, b) for b in vecs] for a in vecs]
        width = max(len(t[:30]) for t in args.text)
        for t, row in zip(args.text, sims):
            print(f"{t[:30]:{width}s}  " + "  ".join(f"{s:6.3f}" for s in row))
    else:
        for t, v in zip(args.text, vecs):
            print(json.dumps({"text": t, "dim": len(v), "embedding": [round(x, 6) for x in v]}))
    return 0


def _cosine(a, b) -> float:
    num = sum(x * y for x, y in zip(a, b))
    den = (sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5)
    return num / den if den else 0.0


def cmd_embed(args) -> int:
    return asyncio.run(_embed(args))


# --------------------------------------------------------------------------- serve
SERVE_MAX_NUM_SEQUENCES = 0      # the server batches by default, as suits the device (ChatConfig)


def cmd_serve(args) -> int:
    from .engine.records import EngineConfig
    from .protocol.rules import RequestLimits
    from .server.app import ServerOptions, run_server
    # --config alone serves every record of the file; otherwise --model (default: the two defaults).
    refs = args.model or ([] if args.config else [DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL])
    app, models = _models(args, refs)
    models = models or app.ids()
    chat_opts = _chat_opts(args, len(models)) or [None] * len(models)
    # a server has several users: chat models batch up to SERVE_MAX_NUM_SEQUENCES requests unless
    # --max-num-sequences / --chat-opts say otherwise (embedders ignore it)
    chat_opts = [{"max_num_sequences": SERVE_MAX_NUM_SEQUENCES, **(o or {})} for o in chat_opts]
    given = {k: getattr(args, k) for k in ("max_n", "max_stop", "max_logit_bias",
                                           "max_embedding_inputs", "max_embedding_tokens")}
    limits = RequestLimits(**{k: v for k, v in given.items() if v is not None})
    cfg = EngineConfig(app_config=app, log_level=args.log_level.upper(), auto_recover=args.auto_recover,
                       limits=limits,
                       max_queue_length=args.max_queue,
                       request_timeout_s=args.request_timeout if args.request_timeout > 0 else None)
    opts = ServerOptions(models=models, host=args.host, port=args.port, api_key=args.api_key,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)),
                         cors_origins=args.cors_origin or [], log_level=args.log_level.upper(),
                         auto_recover=args.auto_recover, shutdown_grace_s=args.shutdown_grace,
                         engine_config=cfg, chat_opts=chat_opts, exit_on_load_error=True,
                         allow_model_management=args.allow_model_management)
    return run_server(opts)


# --------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    import runpy
    bench_dir = Path(args.dir)
    scripts = sorted(p for p in bench_dir.glob("*.py") if not p.name.startswith("_"))
    if args.list or not scripts:
        if not scripts:
            print(f"no benchmark scripts in {bench_dir}/", file=sys.stderr)
        for p in scripts:
            print(p.stem)
        return 0 if scripts else 1
    chosen = [p for p in scripts if not args.name or p.stem in args.name]
    if args.name and len(chosen) != len(set(args.name)):
        known = ", ".join(p.stem for p in scripts)
        print(f"error: unknown benchmark in {args.name}; known: {known}", file=sys.stderr)
        return 2
    for p in chosen:
        print(f"== {p.stem}", flush=True)
        old = sys.argv
        sys.argv = [str(p), *args.extra]
        try:
            runpy.run_path(str(p), run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                return int(e.code) if isinstance(e.code, int) else 1
        finally:
            sys.argv = old
    return 0


# --------------------------------------------------------------------------- parser
def _missing_cache_cli(name: str):
    def run(args) -> int:
        print(f"error: `{name}` needs the artifact cache layer (webgpu_engine.cache.cli), which is not "
              f"available in this installation.", file=sys.stderr)
        return 1
    return run


def _download_references(p) -> None:
    """`download` takes model references too: what the artifact cache does not know is resolved, which
    fetches it (a Hugging Face repo into the Hugging Face cache, a URL into the artifact cache)."""
    cache_download = p.get_default("func")
    p.description += (" A MODEL_ID may also be any model reference: a URL or a Hugging Face "
                      "ORG/REPO[:QUANT] (fetched into the Hugging Face cache).")

    def run(args) -> int:
        from .cache import known_models
        from .engine.references import resolve_model_reference
        known = known_models()
        refs = [m for m in args.model_id if m not in known]
        if len(refs) < len(args.model_id) or not refs:
            args.model_id = [m for m in args.model_id if m in known]
            rc = cache_download(args)
            if rc:
                return rc
        if args.root:           # URLs go to the artifact cache: the one --root names
            os.environ["WEBGPU_ENGINE_CACHE"] = args.root
        for ref in refs:
            rec = resolve_model_reference(ref, offline=args.offline or None)
            print(f"{ref}: {rec.model}")
        return 0
    p.set_defaults(func=run)


def _add_cache_commands(sub) -> None:
    """`download` and `cache` belong to the cache layer; it registers them when present."""
    try:
        from .cache import cli as cache_cli
        cache_cli.add_subcommands(sub)
        _download_references(sub.choices["download"])
        return
    except (ImportError, AttributeError):
        pass
    for name, text in (("download", "fetch a model's artifacts into the local cache"),
                       ("cache", "list or delete cached artifacts")):
        p = sub.add_parser(name, help=text + " (needs webgpu_engine.cache.cli)",
                           description=text + ".")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_missing_cache_cli(name))


def _model_options(p, many: bool = False):
    p.add_argument("--model-id", action="append" if many else "store", default=None, metavar="ALIAS",
                   help="the id the model is known by (default: the file, folder or repo name)"
                        + ("; repeatable, one per --model in order" if many else ""))
    p.add_argument("--config", default=None, metavar="APP_CONFIG_JSON",
                   help="WebLLM AppConfig JSON ({\"model_list\": [...]}): its records replace the "
                        "built-in ones" + (" and, without --model, are all served" if many else ""))
    each = "; once for every model, or once per --model in order" if many else ""
    g = p.add_argument_group("load options (WebLLM ChatConfig)")
    g.add_argument("--context-window", type=int, action="append", default=None, metavar="TOKENS",
                   help="KV cache length (default: the model's trained context, at most 4096)" + each)
    g.add_argument("--prefill-chunk", type=int, action="append", default=None, metavar="TOKENS",
                   help="prompt tokens per prefill step (default 256)" + each)
    g.add_argument("--dtype", choices=("auto", "f16", "f32"), action="append", default=None,
                   help="activation precision (auto: f16 where the adapter has shader-f16)" + each)
    g.add_argument("--max-num-sequences", type=int, action="append", default=None, metavar="N",
                   help="chat models: requests decoded together (continuous batching over a paged KV "
                        "cache; 0: as suits the device, 4 on a CPU adapter and 16 on a GPU; default: "
                        "serve 0, chat and complete 1)" + each)
    g.add_argument("--chat-opts", action="append", default=None, metavar="JSON",
                   help="WebLLM ChatOptions as JSON, e.g. '{\"temperature\": 0.2}'" + each)


def _queue_length(text: str) -> int | None:
    """--max-queue: a count >= 0 (0: a request is refused whenever the model is busy) or `none`
    (unbounded), the values EngineConfig.max_queue_length takes."""
    if text.strip().lower() in ("none", "unbounded"):
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 or 'none', got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 or 'none', got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m webgpu_engine",
        description="LLM and embedding engine on any WebGPU device, with WebLLM's MLCEngine API and "
                    "an OpenAI-compatible server.")
    ap.add_argument("--log-level", default=os.environ.get("WEBGPU_ENGINE_LOG_LEVEL", "WARNING"),
                    help="logging level: DEBUG, INFO, WARNING (default), ERROR")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="show the WebGPU adapter, its features and limits",
                       description="Show the WebGPU adapter this machine offers, its features "
                                   "(shader-f16 ...) and limits, and the built-in models.")
    p.add_argument("--json", action="store_true", help="print the full description as JSON")
    p.add_argument("--all", action="store_true", help="print every limit")
    p.add_argument("--adapter", default=None, help="pick an adapter by name substring")
    p.add_argument("--model", default=None, help=REF + ": show what it resolves to and its memory estimate")
    _model_options(p)
    p.set_defaults(func=cmd_info)

    def sampling(p, max_tokens):
        p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"default {max_tokens}")
        p.add_argument("--temperature", type=float, default=None,
                       help="sampling temperature (0 = greedy; default: the model's)")
        p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
        p.add_argument("--quiet", action="store_true", help="no load progress on stderr")

    p = sub.add_parser("chat", help="interactive streaming chat with an LLM",
                       description="Chat with an LLM, streaming its answers. Multi-turn; /reset starts "
                                   "over, /stats prints speed, /exit (or Ctrl-D) quits. With PROMPT, "
                                   "answers once and exits.")
    p.add_argument("--model", default=DEFAULT_CHAT_MODEL, help=f"{REF} (default {DEFAULT_CHAT_MODEL})")
    _model_options(p)
    p.add_argument("--system", default=None, help="system message")
    sampling(p, 256)
    add_structured_options(p)
    p.add_argument("prompt", nargs="*", default=None, help="one-shot prompt (optional)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("complete", help="raw text completion (no chat template)",
                       description="Continue PROMPT with the model (no chat template) and print it.")
    p.add_argument("--model", default=DEFAULT_CHAT_MODEL, help=f"{REF} (default {DEFAULT_CHAT_MODEL})")
    _model_options(p)
    p.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    sampling(p, 64)
    p.add_argument("prompt", nargs="+", help="text to continue")
    p.set_defaults(func=cmd_complete)

    p = sub.add_parser("embed", help="embed texts (vectors or cosine similarities)",
                       description="Embed each TEXT and print its vector as JSON lines, or with "
                                   "--similarity the matrix of cosine similarities.")
    p.add_argument("--model", default=DEFAULT_EMBED_MODEL, help=f"{REF} (default {DEFAULT_EMBED_MODEL})")
    _model_options(p)
    p.add_argument("--similarity", "-s", action="store_true", help="print cosine similarities")
    p.add_argument("--quiet", action="store_true", help="no load progress on stderr")
    p.add_argument("text", nargs="+", help="texts to embed")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/embeddings, "
                                   "/v1/models, /health and /metrics over HTTP.")
    p.add_argument("--model", action="append", default=None,
                   help=f"{REF} (repeatable; default {DEFAULT_CHAT_MODEL} and {DEFAULT_EMBED_MODEL})")
    _model_options(p, many=True)
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--api-key", default=os.environ.get("WEBGPU_ENGINE_API_KEY"),
                   help="require `Authorization: Bearer KEY` (env WEBGPU_ENGINE_API_KEY)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="request body size limit (MiB)")
    p.add_argument("--cors-origin", action="append", default=None,
                   help="a browser origin allowed to call the server, e.g. http://localhost:3000 "
                        "(repeatable; `*` allows any; default: none)")
    p.add_argument("--auto-recover", action="store_true",
                   help="after a device loss, reload the models on the next request")
    p.add_argument("--allow-model-management", action="store_true",
                   help="allow POST /v1/models/load and /v1/models/unload (guarded by --api-key)")
    p.add_argument("--max-queue", type=_queue_length, default=32, metavar="N|none",
                   help="requests that may wait for one model while it serves another; more get "
                        "HTTP 429 with Retry-After (default 32; 0: none may wait; none: unbounded), "
                        "as EngineConfig.max_queue_length")
    p.add_argument("--request-timeout", type=float, default=0.0,
                   help="seconds a request may take, queueing included; past it HTTP 504 "
                        "(default 0: no limit)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight may finish before the server exits "
                        "(default 30)")
    # Defaults live in protocol.rules.RequestLimits (not imported here: --help stays light).
    p.add_argument("--max-n", type=int, default=None, help="most choices (`n`) per request (default 16)")
    p.add_argument("--max-stop", type=int, default=None,
                   help="most stop strings per request (default 4, as OpenAI)")
    p.add_argument("--max-logit-bias", type=int, default=None,
                   help="most logit_bias entries per request (default 300, as OpenAI)")
    p.add_argument("--max-embedding-inputs", type=int, default=None,
                   help="most inputs per embeddings request (default 2048, as OpenAI)")
    p.add_argument("--max-embedding-tokens", type=int, default=None,
                   help="most tokens over all inputs of an embeddings request (default 300000, as OpenAI)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="run benchmark scripts from bench/",
                       description="Run the benchmark scripts in bench/ (each prints a table and "
                                   "writes JSON). Arguments after -- go to the scripts.")
    p.add_argument("name", nargs="*", help="benchmarks to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("--dir", default="bench", help="folder of the scripts (default bench/)")
    p.set_defaults(func=cmd_bench, extra=[])

    add_tune_command(sub, DEFAULT_CHAT_MODEL)
    _add_cache_commands(sub)
    return ap


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
        from .errors import WebGPUEngineError
        if isinstance(e, WebGPUEngineError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
