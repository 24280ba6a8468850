"""What an engine holds on its device (AsyncMLCEngine, engine.py): the loaded models, the engine's
state, the device, and what a device loss left behind.

The engine's parts share this one object instead of each other's attributes: loading.py (ModelLoader)
fills and empties it, device_loss.py (DeviceLoss) recovers it after a loss, the request paths read it
(engine.py's select / acquire). A model is dropped in one of two ways: an intentional unload (never a
loss: its requests fail with ModelUnloadedError) or a device loss (lose(): every model dropped, the
device forgotten, DeviceLostError for requests that used it).
Standard library only at module level (this runs in the browser too).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..config import ChatConfig
from ..errors import DeviceLostError, ModelUnloadedError
from ..pipelines.protocol import ChatPipelineProtocol, EmbeddingPipelineProtocol
from . import memory
from .lock import FIFOLock
from .records import EMBEDDING, ModelRecord

log = logging.getLogger("webgpu_engine.engine")


@dataclass
class LoadedModel:
    model_id: str
    record: ModelRecord
    pipeline: ChatPipelineProtocol | EmbeddingPipelineProtocol    # as model_type says
    chat_config: ChatConfig
    model_type: str
    lock: FIFOLock
    epoch: int                     # which load generation; requests queued on a dropped one fail
    owners: set = field(default_factory=set)   # gpu buffer owners created by this model's load
    estimate: memory.MemoryEstimate | None = None   # what the pre-load memory check assumed
    dropped_by_loss: bool = False  # dropped because the device was lost (not unloaded)
    coalescer: Any = None          # an embedder's group of concurrent requests (coalesce.py)
    lora_adapters: dict = field(default_factory=dict)   # LoRA adapters served over it: name -> path (lora.py)
    default_adapter: str | None = None   # the adapter its own requests run with (ModelRecord.lora)

    def describe(self, device=None) -> dict:
        """What /v1/models shows besides the id: the type, the context window in tokens (an
        embedder's longest input) and the memory in bytes (the pre-load estimate, and what the
        model's buffers hold on `device` now)."""
        plan = getattr(self.pipeline, "plan", None)       # a decoder's load plan: what was allocated
        ctx = (self.pipeline.max_seq_length if self.model_type == EMBEDDING
               else plan.context if plan is not None else self.chat_config.context_window_size)
        est = self.estimate
        mem = {"estimated_bytes": est.total if est else None, "weights_bytes": est.weights if est else None,
               "kv_cache_bytes": est.kv_cache if est else None, "allocated_bytes": None}
        if device is not None and not device.lost:
            held = device.allocations()
            mem["allocated_bytes"] = sum(held.get(o, 0) for o in self.owners)
        out = {"model_type": self.model_type, "context_window": ctx, "memory": mem}
        ring = getattr(plan, "ring", None)         # WebLLM's sliding window: the cache is a ring
        if ring is not None:
            out["sliding_window"] = {"sliding_window_size": ring.window, "attention_sink_size": ring.sinks}
        queued = getattr(self.pipeline, "queued_kernels", None)   # compiled in the background
        if queued:
            out["kernels"] = {"queued_at_load": len(queued), "compiling": sum(not p.ready for p in queued)}
        sched = getattr(self.pipeline, "scheduler", None)    # stub pipelines have none
        if sched is not None:
            out["batching"] = sched.describe()
        return out



class Residency:
    """The loaded models by id, the engine's state, the device and the last reload's arguments."""

    def __init__(self, device=None):
        self.models: dict[str, LoadedModel] = {}
        self.state = "idle"             # idle | loading | ready | device_lost
        self.device = device            # a gpu Device shared by every loaded model (None: not yet)
        self.lost_reason: str | None = None
        self.epoch = 0                  # which load generation the loaded models belong to
        # (ids, chat_opts) of what is loaded, as reload() was asked: what auto_recover reloads
        self.last_reload: tuple[list[str], list[dict | None]] | None = None

    # ------------------------------------------------------------------ loading and unloading
    def install(self, loaded: dict[str, LoadedModel]) -> None:
        """`loaded` (a finished reload) becomes what the engine serves."""
        self.epoch += 1
        for lm in loaded.values():
            lm.epoch = self.epoch
        self.models = loaded
        self.state = "ready"
        self.lost_reason = None

    def add(self, lm: LoadedModel, chat_opts: dict | None) -> None:
        """One more model beside those loaded (manage.py); a loss reloads it with the others."""
        lm.epoch = self.epoch
        self.models[lm.model_id] = lm
        ids, opts = self.last_reload or ([], [])
        self.last_reload = ([*ids, lm.model_id], [*opts, chat_opts])
        if self.state == "idle":
            self.state = "ready"

    def remove(self, model_id: str) -> LoadedModel | None:
        """Unload one model (manage.py); the others keep serving. None when it is not loaded."""
        lm = self.models.pop(model_id, None)
        if lm is None:
            return None
        self.dispose(lm)
        if self.last_reload is not None:
            kept = [(m, o) for m, o in zip(*self.last_reload) if m != model_id]
            self.last_reload = ([m for m, _ in kept], [o for _, o in kept])
        if not self.models and self.state == "ready":
            self.state = "idle"
        return lm

    def clear(self) -> None:
        """Free every loaded model (an intentional unload: never reported as a device loss)."""
        models, self.models = self.models, {}
        for lm in models.values():
            self.dispose(lm)
        if self.state != "device_lost":
            self.state = "idle"

    def dispose(self, lm: LoadedModel) -> None:
        try:
            lm.pipeline.dispose()
        except Exception as e:  # noqa: BLE001 - a lost device has nothing left to free
            log.debug("dispose of %s: %s", lm.model_id, e)
        if self.device is not None:
            for owner in lm.owners:
                self.device.release_owner(owner)

    # ------------------------------------------------------------------ a device loss
    def lose(self, err: BaseException, auto_recover: bool) -> None:
        """Drop every model and all GPU state after a loss (called by the request that saw it)."""
        if self.state == "device_lost":
            return
        log.error("%s (dropping all loaded models%s)", err,
                  "; they reload on the next request" if auto_recover else "")
        self.lost_reason = getattr(err, "detail", None) or str(err)
        models, self.models = self.models, {}
        for lm in models.values():
            lm.dropped_by_loss = True
            self.dispose(lm)
        if self.device is not None and not self.device.lost:
            self.device.mark_lost(str(err))
        self.device = None           # dead; the next reload requests a fresh one
        self.state = "device_lost"

    def lost_error(self, e: BaseException, dev: Any, what: str, auto_recover: bool) -> DeviceLostError:
        """A DeviceLostError saying what was lost and during what (the class adds what to try)."""
        reason = (dev.lost_reason if dev is not None else None) or self.lost_reason
        if not reason:
            reason = getattr(e, "detail", None) or str(e) or type(e).__name__
        detail = f"{reason}, during {what}"
        if auto_recover and self.last_reload:
            detail += (f" (auto_recover is on: the next request reloads "
                       f"{', '.join(self.last_reload[0])} on a new device)")
        err = DeviceLostError(detail)
        err.detail = detail
        return err

    def dropped_error(self, lm: LoadedModel, request_name: str) -> Exception:
        """Why a request's model is gone: a device loss, or an intentional unload/reload (never a loss)."""
        if self.state == "device_lost":
            err = DeviceLostError(self.lost_reason or "")
            err.detail = self.lost_reason
            return err
        return ModelUnloadedError(lm.model_id, request_name)

    def check_loaded(self, lm: LoadedModel, request_name: str) -> None:
        """Raise when `lm` was dropped (unload, reload, device loss) since the request picked it."""
        if self.models.get(lm.model_id) is not lm:
            raise self.dropped_error(lm, request_name)

    def holds(self, lm: LoadedModel) -> bool:
        return self.models.get(lm.model_id) is lm
