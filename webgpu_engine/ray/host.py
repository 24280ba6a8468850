"""What every Ray worker of ours shares: the picklable description of the models to load
(EngineSpec), the engine it builds in the worker, and joining or starting the Ray instance.

A worker resolves the model references itself (a path must exist on the worker's node), so a spec
carries references and load options, never weights.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("webgpu_engine.ray")

# The custom Ray resource a worker holding a WebGPU device asks for: declare one per device with
# `ray start --resources '{"webgpu": 1}'` (a local instance we start declares what it needs).
RESOURCE = "webgpu"


@dataclass
class EngineSpec:
    """The models one engine loads: references (app-config ids, .gguf files, model folders, ...)
    with optional aliases and per-model chat options, and EngineConfig fields (limits, queue,
    timeout) as keyword arguments."""
    models: list[str]
    model_ids: list[str | None] = field(default_factory=list)
    chat_opts: list[dict | None] | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    app_config: Any = None     # an AppConfig (--config) the references resolve against; None: built-in

    def resolve(self):
        """(app config, model ids) as the command line resolves them."""
        from ..engine.records import default_app_config
        from ..engine.references import resolve_model_reference
        app = self.app_config or default_app_config()
        aliases = list(self.model_ids) + [None] * (len(self.models) - len(self.model_ids))
        records = [resolve_model_reference(r, model_id=a, app_config=app) for r, a in zip(self.models, aliases)]
        return app.with_records(*records), [r.model_id for r in records]

    def engine_config(self):
        from ..engine.records import EngineConfig
        app, _ = self.resolve()
        return EngineConfig(app_config=app, **self.engine_kwargs)

    def ids(self) -> list[str]:
        return self.resolve()[1]


def engine_loop():
    """A plain asyncio loop on a thread of its own, where our engine runs (engine/sync.py
    EngineLoop). Ray runs actors and Serve replicas on uvloop, which wgpu's awaitables do not
    recognise: the engine stays on this loop, and callers on Ray's loop await its work through `call`."""
    from ..engine.sync import EngineLoop
    return EngineLoop(asyncio.SelectorEventLoop(), name="webgpu-engine-ray")


async def open_engine(spec: EngineSpec):
    """An AsyncMLCEngine with the spec's models loaded (on this worker's WebGPU device)."""
    from ..engine import AsyncMLCEngine
    app, ids = spec.resolve()
    cfg = spec.engine_config()
    engine = AsyncMLCEngine(cfg)
    opts = spec.chat_opts if spec.chat_opts is None or len(ids) > 1 else spec.chat_opts[0]
    await engine.reload(ids if len(ids) > 1 else ids[0], opts)
    return engine


def connect(address: str | None, num_devices: int = 1, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at `address`, or (None) start a local instance declaring `num_devices`
    of our custom resource. Returns whether this process started the instance (then it must stop
    it: ray.shutdown()). A Ray instance already initialised in this process is used as it is."""
    import ray
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return False
    ray.init(num_cpus=num_cpus, resources={RESOURCE: num_devices}, include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)
    return True


def device_count() -> int:
    """How many WebGPU devices the connected cluster declares (its `webgpu` resource), at least 1."""
    import ray
    return max(1, int(ray.cluster_resources().get(RESOURCE, 0)))
