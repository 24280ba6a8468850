"""Models on a running engine: load one more model beside those already loaded, or unload one, while
the others keep serving (the server's admin routes; reload() replaces every model at once instead).

A load goes through the same steps as reload(): the reference resolves into a record, the features
and the memory estimate are checked against what the loaded models already hold before anything is
allocated, and a failed or cancelled load frees what it allocated. An unloaded model's requests in
flight or queued fail with ModelUnloadedError, as after unload(). With auto_recover, the models a
device loss reloads are the ones loaded at that moment.
Standard library only (this runs in the browser too).
"""
from __future__ import annotations

import asyncio
import time

from ..errors import InvalidRequestError, ModelManagementConflictError, SpecifiedModelNotFoundError
from .engine import AsyncMLCEngine
from .loading import LoadedModel


def _lock(engine: AsyncMLCEngine) -> asyncio.Lock:
    """One model-management call at a time per engine (two loads must not both pass the memory check)."""
    lock = engine.__dict__.get("_manage_lock")
    if lock is None:
        lock = engine.__dict__["_manage_lock"] = asyncio.Lock()
    return lock


async def load_model(engine: AsyncMLCEngine, model: str, chat_opts: dict | None = None,
                     alias: str | None = None) -> LoadedModel:
    """Load `model` (an app-config id or a model reference, named `alias` when given) next to the
    loaded models; typed errors as reload()'s, and ModelManagementConflictError (409) when its id
    is loaded already or a reload() runs."""
    if chat_opts is not None and not isinstance(chat_opts, dict):
        raise InvalidRequestError("`chat_opts` must be an object of ChatOptions fields.", param="chat_opts")
    async with _lock(engine):
        if engine.state == "loading":
            raise ModelManagementConflictError("A reload of every model is in progress; load the model "
                                               "when it has finished.")
        from .references import records_for
        app_config, records = await records_for(engine.app_config, [model], [alias] if alias else [])
        rec = records[0]
        mid = rec.model_id
        if mid in engine.models:
            raise ModelManagementConflictError(f"Model {mid} is loaded already; unload it first to load "
                                               f"it with other options, or give another `model_id`.")
        engine.app_config = app_config
        dev = await engine.get_device()
        t0 = time.perf_counter()
        engine._progress_floor = 0.0
        plan = await engine._prepare(dev, mid, rec, chat_opts, 0, 1, t0)
        engine._check_memory(dev, [plan])            # beside what the loaded models hold now
        lm = await engine._load_one(dev, plan, 0, 1, t0)
        lm.epoch = engine._epoch
        engine.models[mid] = lm
        ids, opts = engine._last_reload or ([], [])
        engine._last_reload = ([*ids, mid], [*opts, chat_opts])
        if engine.state == "idle":
            engine.state = "ready"
        engine._report(1.0, t0, f"Finish loading {mid} on WebGPU - {dev.info.name}")
        return lm


async def unload_model(engine: AsyncMLCEngine, model_id: str) -> None:
    """Unload one model and free its GPU memory; the others keep serving."""
    async with _lock(engine):
        lm = engine.models.get(model_id)
        if lm is None:
            raise SpecifiedModelNotFoundError(list(engine.models), model_id)
        del engine.models[model_id]
        engine._dispose(lm)
        if engine._last_reload is not None:
            kept = [(m, o) for m, o in zip(*engine._last_reload) if m != model_id]
            engine._last_reload = ([m for m, _ in kept], [o for _, o in kept])
        if not engine.models and engine.state == "ready":
            engine.state = "idle"
