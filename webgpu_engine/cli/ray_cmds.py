"""The commands on Ray (the `[ray]` extra): `serve --ray-replicas N` (the server on Ray Serve
replicas, webgpu_engine.ray.launch) and `embed-corpus` (a parquet / JSON-lines corpus embedded
through Ray Data, webgpu_engine.ray.batch). Ray is imported only when one of them runs."""
from __future__ import annotations

import sys
from pathlib import Path

from ..catalogue import DEFAULT_EMBED_MODEL
from .argtypes import positive

ENGINE_FIELDS = ("log_level", "auto_recover", "limits", "max_queue_length", "request_timeout_s")


def add_serve_options(p) -> None:
    g = p.add_argument_group("scaling out on Ray Serve (needs the [ray] extra)")
    g.add_argument("--ray-replicas", type=positive, default=None, metavar="N",
                   help="serve from N Ray Serve replicas, one per WebGPU device (Ray resource `webgpu`), "
                        "behind this one endpoint")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join the Ray cluster at ADDR (default: start a local Ray instance, stopped on exit)")
    g.add_argument("--ray-min-replicas", type=int, default=None, metavar="N", help="autoscaling: fewest replicas")
    g.add_argument("--ray-max-replicas", type=positive, default=None, metavar="N",
                   help="autoscaling: most replicas")
    g.add_argument("--ray-target-ongoing-requests", type=float, default=None, metavar="N",
                   help="autoscaling: requests in flight per replica Ray scales towards")


def _need_ray() -> None:
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
        import ray.serve  # noqa: F401
    except ImportError:
        from ..errors import FeatureSupportError
        raise FeatureSupportError("ray", "This command needs Ray: pip install 'webgpu_engine[ray]'.") from None


def serve_on_ray(args, opts) -> int:
    """`serve` with --ray-replicas: `opts` (the single-process server's options) served from replicas."""
    _need_ray()
    if opts.allow_model_management:
        from ..errors import FeatureSupportError
        raise FeatureSupportError("allow_model_management", "--allow-model-management does not apply to "
                                  "--ray-replicas: the replicas' models are the deployment's; redeploy to "
                                  "change them.")
    from ..ray.host import EngineSpec
    from ..ray.launch import RayOptions, serve_on_ray as run
    cfg = opts.engine_config
    spec = EngineSpec(models=list(opts.models), chat_opts=opts.chat_opts, app_config=cfg.app_config,
                      engine_kwargs={k: getattr(cfg, k) for k in ENGINE_FIELDS})
    ray_opts = RayOptions(replicas=args.ray_replicas, address=args.ray_address,
                          min_replicas=args.ray_min_replicas, max_replicas=args.ray_max_replicas,
                          target_ongoing_requests=args.ray_target_ongoing_requests)
    return run(opts, spec, ray_opts)


# --------------------------------------------------------------------------- embed-corpus
def add_embed_corpus_command(sub) -> None:
    p = sub.add_parser("embed-corpus", help="embed a corpus file through Ray Data (needs the [ray] extra)",
                       description="Embed the text column of IN (.parquet, or .jsonl / .json lines) with "
                                   "one engine per WebGPU device of a Ray cluster, and write OUT.parquet: "
                                   "the rows with an `embedding` column (float32 lists).")
    p.add_argument("input", metavar="IN", help="a .parquet file or folder, or a .jsonl / .json file")
    p.add_argument("output", metavar="OUT", help="the .parquet file to write")
    p.add_argument("--model", default=DEFAULT_EMBED_MODEL, help=f"the embedding model (default {DEFAULT_EMBED_MODEL})")
    p.add_argument("--column", default="text", help="the text column (default text)")
    p.add_argument("--batch-size", type=positive, default=64, help="texts per engine call (default 64)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join the Ray cluster at ADDR (default: a local Ray instance for this run)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_embed_corpus)


def _read(path: str):
    import ray
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return ray.data.read_json(path, lines=True) if suffix != ".json" else ray.data.read_json(path)
    return ray.data.read_parquet(path)


def _table(batch: dict):
    import numpy as np
    import pyarrow as pa
    cols = {}
    for name, v in batch.items():
        v = np.asarray(v)
        if name == "embedding":
            cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1).astype(np.float32)), v.shape[1])
        else:
            cols[name] = pa.array(v.tolist())
    return pa.table(cols)


def cmd_embed_corpus(args) -> int:
    _need_ray()
    import ray
    import pyarrow.parquet as pq
    from tqdm import tqdm
    from ..ray.batch import embed_dataset
    from ..ray.host import connect
    if not Path(args.input).exists():
        print(f"error: no such file: {args.input}", file=sys.stderr)
        return 2
    started = connect(args.ray_address)
    writer = None
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False     # ours counts texts
        ds = _read(args.input)
        total = ds.count()
        out = embed_dataset(ds, model=args.model, column=args.column, batch_size=args.batch_size)
        with tqdm(total=total, unit="text", disable=args.quiet, file=sys.stderr) as bar:
            for batch in out.iter_batches(batch_format="numpy", batch_size=args.batch_size):
                table = _table(batch)
                if writer is None:
                    writer = pq.ParquetWriter(args.output, table.schema)
                writer.write_table(table)
                bar.update(table.num_rows)
        if writer is None:
            print("error: the corpus has no rows", file=sys.stderr)
            return 1
        print(f"wrote {total} embeddings to {args.output}", file=sys.stderr)
        return 0
    finally:
        if writer is not None:
            writer.close()
        if started:
            ray.shutdown()
