"""The models a command names and the engine it loads them into: model references resolved against
the app config (--config, else the built-in records), per-model load options from the flags, and
the engine's progress line on stderr. Shared by the commands that load models (chat, complete,
embed, serve, and info --model)."""
from __future__ import annotations

import json
import sys


def engine_config(args):
    from ..engine.records import EngineConfig

    def progress(report):
        if not getattr(args, "quiet", False):
            print(f"\r[{report['progress'] * 100:5.1f}%] {report['text'][:100]:100s}", end="",
                  file=sys.stderr, flush=True)
            if report["progress"] >= 1.0:
                print(file=sys.stderr)
    return EngineConfig(init_progress_callback=progress, log_level=args.log_level.upper())


def resolve_models(args, refs: list[str]):
    """(app config, model ids) for the model references given on the command line: the records of
    --config (else the built-in ones), plus one record resolved per reference that is not an id there
    (a .gguf, a model folder, a URL, a Hugging Face ORG/REPO[:QUANT]), named by --model-id when given
    (in order). A bad reference fails here, before any engine or server starts."""
    from ..engine.records import default_app_config, load_app_config
    from ..engine.references import resolve_model_reference
    from ..errors import InvalidRequestError
    app = load_app_config(args.config) if getattr(args, "config", None) else default_app_config()
    aliases = getattr(args, "model_id", None) or []
    aliases = [aliases] if isinstance(aliases, str) else list(aliases)
    if len(aliases) > len(refs):
        raise InvalidRequestError(f"{len(aliases)} --model-id given for {len(refs)} --model; give at "
                                  f"most one alias per model, in the same order.", param="model_id")
    aliases += [None] * (len(refs) - len(aliases))
    records = [resolve_model_reference(r, model_id=a, app_config=app) for r, a in zip(refs, aliases)]
    return app.with_records(*records), [r.model_id for r in records]


def chat_opts_for(args, n: int) -> list[dict | None] | None:
    """Per-model chat_opts from --chat-opts and the load flags: a flag given once applies to all n
    models, given n times one value per model in order."""
    from ..errors import InvalidRequestError
    flags = {"chat_opts": None, "context_window": "context_window_size",
             "prefill_chunk": "prefill_chunk_size", "dtype": "dtype",
             "max_num_sequences": "max_num_sequences", "speculation": "speculation",
             "context_overflow": "context_overflow", "draft_model": "speculation",
             "kv_cache_dtype": "kv_cache_dtype", "mmproj": "mmproj"}
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
            if flag == "draft_model":     # a draft model: speculation by it
                o[key] = {"method": "draft", "model": v}
                continue
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


def create_engine(args, refs: list[str]):
    from ..engine import create_mlc_engine
    app, ids = resolve_models(args, refs)
    cfg = engine_config(args)
    cfg.app_config = app
    opts = chat_opts_for(args, len(ids))
    if getattr(args, "lora", None) and len(ids) == 1:      # adapters are served by the batch scheduler
        opts = [{"max_num_sequences": 2, **((opts or [None])[0] or {})}]
    return create_mlc_engine(ids if len(ids) > 1 else ids[0], engine_config=cfg,
                             chat_opts=opts if opts is None or len(ids) > 1 else opts[0])


async def with_model(args, use):
    """Load --model, await `use(engine)` and close the engine whatever happens; returns what `use`
    returned. The one-model commands (chat, complete, embed) run through it."""
    engine = await create_engine(args, [args.model])
    try:
        if getattr(args, "lora", None):        # --lora PATH: requests name it (lora_request)
            await engine.load_lora_adapter(LORA_NAME, args.lora)
        return await use(engine)
    finally:
        await engine.close()


LORA_NAME = "lora"       # the name chat / complete --lora serve the adapter under


def lora_request(args) -> dict:
    """The request fields that pick chat / complete's --lora adapter (none without one)."""
    return {"model": LORA_NAME} if getattr(args, "lora", None) else {}
