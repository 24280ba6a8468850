"""`tune` command: load a model, time the matmul kernel candidates on its weights (kernels/tune.py)
and store the winners in this adapter's profile, which loads with WEBGPU_ENGINE_KERNELS=tuned (and,
on GPU adapters, whenever a profile is stored) then use. Loads time the shapes a profile lacks by
themselves (tune.tune_at_load, shorter timings within a budget); this command times every shape of
the model again, with longer timings, and replaces their choices."""
from __future__ import annotations

import asyncio
import json
import os
import sys


def add_subcommand(sub, default_model: str) -> None:
    p = sub.add_parser("tune", help="time the matmul kernels on a model's shapes and store the fastest "
                                    "for this adapter",
                       description="Load a model, time each matmul kernel candidate on its weights (decode "
                                   "of 1..8 rows and prefill for chat models, batches for embedders) and "
                                   "store the winners per adapter in the artifact cache (profiles scope).")
    p.add_argument("--model", default=default_model, help="model reference (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop measuring after about this many "
                                                                 "seconds (default %(default)s)")
    p.add_argument("--adapter", default=None, help="pick an adapter by name substring")
    p.add_argument("--prefill-t", type=int, default=128, help="rows of a timed prefill matmul")
    p.add_argument("--dtype", choices=("auto", "f16", "f32"), default="auto", help="activation precision")
    p.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=cmd_tune)


async def _load(dev, path, dtype: str):
    """The model's pipeline (chat or embedding), loaded as the tuned family will run it."""
    from ..config import ChatConfig
    from ..models.registry import open_model
    m = open_model(path)
    kind = m.kind
    m.close()
    if kind == "llm":
        from ..pipelines.llm import LLMChatPipeline
        pipe = await LLMChatPipeline.load(dev, path, ChatConfig(dtype=dtype, context_window_size=256,
                                                                prefill_chunk_size=64, tune_kernels="off"))
    else:
        from ..pipelines.embedding import EmbeddingPipeline
        pipe = await EmbeddingPipeline.load(dev, path, ChatConfig(dtype=dtype, tune_kernels="off"))
    return kind, pipe


def cmd_tune(args) -> int:
    from .. import gpu
    from ..engine.references import resolve_model_reference
    from ..kernels import matmul as mm, profiles, tune
    # the weights are laid out as the tuned family loads them
    os.environ[mm.FAMILY_ENV] = "tuned"
    dev = gpu.request_device_sync(adapter_name=args.adapter)
    from ..cache import fetch_model_sync, known_models
    # a built-in id comes from the artifact cache; any other reference resolves as `chat --model` does
    path = fetch_model_sync(args.model) if args.model in known_models() else \
        resolve_model_reference(args.model).model
    kind, pipe = asyncio.run(_load(dev, path, args.dtype))
    try:
        dtype = getattr(pipe.model, "dtype", None) or getattr(pipe.model, "act_dtype", "f32")
        weights = tune.model_weights(pipe.model)
        cases = tune.cases_for(weights, tune.row_kind(pipe.model, kind), prefill_t=args.prefill_t)
        print(f"adapter: {dev.info.name} ({dev.info.backend}, {dev.info.description}); model {args.model}: "
              f"{len(weights)} weight shapes, {len(cases)} cases, budget {args.budget_s:g} s; "
              f"{'CPU' if mm.is_cpu_adapter(dev) else 'wall'} ms per matmul")

        def progress(done, total, r):
            base = r.times[profiles.BASE]
            best = min(r.times.values())
            print(f"[{done:>3}/{total}] {r.key:28} base {base:9.3f}  best {best:9.3f}  -> {r.choice}", flush=True)
        results = tune.tune(dev, cases, dtype, budget_s=args.budget_s, progress=progress, save=not args.dry_run)
    finally:
        pipe.dispose()
    picked = sum(r.choice != profiles.BASE for r in results)
    print(f"measured {len(results)}/{len(cases)} cases; {picked} use a GPU-family kernel, "
          f"{len(results) - picked} keep base")
    if not args.dry_run and results:
        print(f"profile: {profiles.path(dev)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"adapter": profiles.adapter_fields(dev), "model": args.model, "dtype": dtype,
                       "results": [r.__dict__ for r in results]}, f, indent=1)
    return 0 if results or not cases else 1


__all__ = ["add_subcommand", "cmd_tune"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run: python -m webgpu_engine tune")
