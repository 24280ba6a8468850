"""The commands' handlers: info, chat, complete, embed, serve and bench (tune is in tune.py; download
and cache belong to the cache layer, webgpu_engine.cache.cli). Each takes the parsed arguments and
returns the exit status; each imports what it needs lazily, so that `--help` and `info` stay fast
and work even when a heavier layer (the engine, the server, the cache) is broken or missing.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from ..catalogue import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL
from .models import chat_opts_for, resolve_models, with_model
from .structured import run_turn


# --------------------------------------------------------------------------- info
def cmd_info(args) -> int:
    from .. import gpu
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
        from ..engine.records import default_app_config
        print("models (built-in app config):")
        for r in default_app_config().model_list:
            print(f"  {r.model_id:32s} {r.model_type:9s} {r.model}")
    except Exception:  # noqa: BLE001 - info must work even when the engine layer is broken
        pass
    dev.close()
    return 0


def _print_model(args, dev) -> None:
    """What `--model` resolves to: its record, files and (for files on disk) the memory it would take."""
    from ..config import ChatConfig
    from ..engine import memory
    app, ids = resolve_models(args, [args.model])
    rec = app.get(ids[0])
    print(f"model:     {rec.model_id}   type: {rec.model_type}")
    origin = rec.reference if rec.reference not in (None, rec.model) else None
    print(f"files:     {rec.model}" + (f"   (from {origin})" if origin else ""))
    if rec.overrides:
        print(f"overrides: {json.dumps(rec.overrides)}")
    print(f"needs:     {', '.join(rec.required_features) or 'no optional WebGPU feature'}")
    path = Path(rec.model) if rec.is_local else None
    if path is None:            # an app-config record: its files, once in the artifact cache
        from ..cache import default_model_path
        path = default_model_path(rec.model_id)
        print(f"cached:    {path if path.exists() else 'no (python -m webgpu_engine download ' + rec.model_id + ')'}")
    if path.exists():
        cc = ChatConfig().updated(rec.overrides).updated((chat_opts_for(args, 1) or [None])[0])
        est = memory.estimate_for(rec.model_type, path, cc, dev)
        budget, source = memory.memory_budget(dev)
        print(f"memory:    {est.total / (1 << 20):.1f} MiB on the GPU "
              f"(budget {budget / (1 << 20):.0f} MiB, {source})")


# --------------------------------------------------------------------------- chat
async def _chat(engine, args) -> int:
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    one_shot = bool(args.prompt)
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
        messages.append({"role": "user", "content": _with_images(text, args)})
        await run_turn(engine, messages, args)      # streams; runs tool calls via stdin
        if one_shot:
            break
    return 0


def _with_images(text: str, args) -> str | list:
    """The first user message's content with the --image files (as data: URLs), then plain text."""
    paths, args.image = getattr(args, "image", None) or [], None
    if not paths:
        return text
    from ..vision.images import image_data_url
    return [*({"type": "image_url", "image_url": {"url": image_data_url(p)}} for p in paths),
            {"type": "text", "text": text}]


def cmd_chat(args) -> int:
    return asyncio.run(with_model(args, lambda engine: _chat(engine, args)))


# --------------------------------------------------------------------------- complete
async def _complete(engine, args) -> int:
    from .models import lora_request
    stream = await engine.completions.create(
        prompt=" ".join(args.prompt), stream=True, max_tokens=args.max_tokens,
        temperature=args.temperature, seed=args.seed, echo=args.echo, **lora_request(args))
    async for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
    print()
    return 0


def cmd_complete(args) -> int:
    return asyncio.run(with_model(args, lambda engine: _complete(engine, args)))


# --------------------------------------------------------------------------- embed
def cmd_embed(args) -> int:
    res = asyncio.run(with_model(args, lambda engine: engine.embeddings.create(input=list(args.text))))
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


# --------------------------------------------------------------------------- serve
SERVE_MAX_NUM_SEQUENCES = 0      # the server batches by default, as suits the device (ChatConfig)


def serve_chat_opts(opts: dict | None) -> dict:
    """A served chat model's options: it batches (SERVE_MAX_NUM_SEQUENCES) unless `opts` say otherwise."""
    return {"max_num_sequences": SERVE_MAX_NUM_SEQUENCES, **(opts or {})}


def cmd_serve(args) -> int:
    from ..engine.records import EngineConfig
    from ..protocol.rules import RequestLimits
    from ..server.app import ServerOptions, run_server
    # --config alone serves every record of the file; otherwise --model (default: the two defaults).
    refs = args.model or ([] if args.config else [DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL])
    app, models = resolve_models(args, refs)
    models = models or app.ids()
    chat_opts = chat_opts_for(args, len(models)) or [None] * len(models)
    # a server has several users: chat models batch up to SERVE_MAX_NUM_SEQUENCES requests unless
    # --max-num-sequences / --chat-opts say otherwise (embedders ignore it)
    # (speculation, by prompt lookup or a draft model, context shifts and a sliding window run per
    # sequence in the batch)
    chat_opts = [serve_chat_opts(o) for o in chat_opts]
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
                         allow_model_management=args.allow_model_management,
                         lora_adapters=_lora_adapters(args.lora), lora_max_rank=args.max_lora_rank,
                         max_loras=args.max_loras)
    if getattr(args, "ray_replicas", None):
        from .ray_cmds import serve_on_ray       # the same server on Ray Serve replicas
        return serve_on_ray(args, opts)
    return run_server(opts)


def _lora_adapters(specs: list[str] | None) -> dict | None:
    """serve's --lora NAME=PATH flags as {name: path}."""
    from ..errors import InvalidRequestError
    out = {}
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise InvalidRequestError(f"--lora {spec!r}: give NAME=PATH.", param="lora")
        out[name.strip()] = path.strip()
    return out or None


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
