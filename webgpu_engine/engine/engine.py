"""AsyncMLCEngine: WebLLM's MLCEngine in Python — several loaded models, a FIFO lock each, OpenAI API.

The engine holds no GPU math. Per loaded model id it keeps a pipeline, its chat config, its type and
a lock; every request goes validate → select model → lock → generate → release (requests.py).
One gpu Device is shared by all loaded models. Device loss: the request in flight fails with
DeviceLostError, every model is dropped, and later requests get ModelNotLoadedError — unless
`EngineConfig.auto_recover`, in which case the next request re-creates the device and reloads the
same models from the cache. Standard library only at module level (this runs in the browser too).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import gpu
from ..config import ChatConfig, GenerationConfig
from ..errors import (DeviceLostError, FeatureSupportError, IncorrectPipelineLoadedError,
                      InvalidRequestError, ModelNotLoadedError, ReloadArgumentSizeUnmatchedError,
                      ReloadModelIdNotUniqueError, ShaderF16SupportError, SpecifiedModelNotFoundError,
                      UnclearModelToUseError, EmbeddingUnsupportedModelError)
from .lock import FIFOLock
from .records import EMBEDDING, LLM, AppConfig, EngineConfig, ModelRecord

log = logging.getLogger("webgpu_engine.engine")


@dataclass
class LoadedModel:
    model_id: str
    record: ModelRecord
    pipeline: Any
    chat_config: ChatConfig
    model_type: str
    lock: FIFOLock
    epoch: int                     # which load generation; requests queued on a dropped one fail
    owners: set = field(default_factory=set)   # gpu buffer owners created by this model's load


class AsyncMLCEngine:
    """Async engine. `await engine.reload(ids)`, then `engine.chat.completions.create(...)` etc."""

    def __init__(self, engine_config: EngineConfig | None = None):
        from .requests import Chat, Completions, Embeddings
        self.config = engine_config or EngineConfig()
        self.app_config: AppConfig = self.config.app_config
        self.init_progress_callback = self.config.init_progress_callback
        self.logit_processor_registry = dict(self.config.logit_processor_registry or {})
        self.device = self.config.device
        self.models: dict[str, LoadedModel] = {}
        self.state = "idle"             # idle | loading | ready | device_lost
        self.device_lost_reason: str | None = None
        self._epoch = 0
        self._last_reload: tuple[list[str], list[dict | None]] | None = None
        self._recovering: asyncio.Future | None = None
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.embeddings = Embeddings(self)

    # ------------------------------------------------------------------ settings (WebLLM setters)
    def set_app_config(self, app_config: AppConfig) -> None:
        self.app_config = app_config

    def set_init_progress_callback(self, cb) -> None:
        self.init_progress_callback = cb

    def get_init_progress_callback(self):
        return self.init_progress_callback

    def set_log_level(self, level: str) -> None:
        logging.getLogger("webgpu_engine").setLevel(level.upper())

    def set_logit_processor_registry(self, registry: dict[str, Any] | None) -> None:
        self.logit_processor_registry = dict(registry or {})

    # ------------------------------------------------------------------ device
    async def get_device(self):
        """The engine's device, requested on first use (or again after a loss)."""
        if self.device is None or self.device.lost:
            self.device = await gpu.request_device(adapter_name=self.config.adapter_name)
        return self.device

    async def get_max_storage_buffer_binding_size(self) -> int:
        return (await self.get_device()).max_storage_binding

    async def get_gpu_vendor(self) -> str:
        return (await self.get_device()).info.vendor

    # ------------------------------------------------------------------ reload / unload
    async def reload(self, model_id: str | list[str], chat_opts: dict | list[dict | None] | None = None) -> None:
        """Unload everything, then load each model in order. Cancelling the task leaves nothing loaded
        and every GPU buffer of the partial load freed."""
        ids = [model_id] if isinstance(model_id, str) else list(model_id)
        if chat_opts is None:
            opts: list[dict | None] = [None] * len(ids)
        else:
            opts = list(chat_opts) if isinstance(chat_opts, (list, tuple)) else [chat_opts]
            if len(opts) != len(ids):
                raise ReloadArgumentSizeUnmatchedError(len(ids), len(opts))
        if len(set(ids)) != len(ids):
            raise ReloadModelIdNotUniqueError(ids)
        records = [self.app_config.get(i) for i in ids]   # unknown ids fail before anything unloads
        await self.unload()
        self._last_reload = (ids, opts)
        self.state = "loading"
        t0 = time.perf_counter()
        try:
            dev = await self.get_device()
            loaded: dict[str, LoadedModel] = {}
            try:
                for k, (mid, rec, opt) in enumerate(zip(ids, records, opts)):
                    loaded[mid] = await self._load_one(dev, mid, rec, opt, k, len(ids), t0)
            except BaseException:
                for lm in loaded.values():
                    self._dispose(lm)
                raise
        except BaseException:
            self.state = "idle" if self.state == "loading" else self.state
            raise
        self._epoch += 1
        for lm in loaded.values():
            lm.epoch = self._epoch
        self.models = loaded
        self.state = "ready"
        self.device_lost_reason = None
        self._report(1.0, t0, f"Finish loading on WebGPU - {dev.info.name}")

    async def _load_one(self, dev, model_id: str, rec: ModelRecord, opts: dict | None, k: int, n: int,
                        t0: float) -> LoadedModel:
        rec = self._check_features(dev, rec, opts)
        try:
            chat_config = ChatConfig().updated(rec.overrides).updated(opts)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e), param="chat_opts") from None

        def stage(lo: float, hi: float):
            # Fetching fills the first tenth of this model's share, loading the rest; the overall
            # fraction never goes backwards and 1.0 is left for the final "Finish loading" report.
            def progress(frac: float, text: str) -> None:
                f = lo + (hi - lo) * max(0.0, min(1.0, frac))
                self._report((k + f) / n * 0.99, t0, f"[{model_id}] {text}")
            return progress

        self._report(k / n * 0.99, t0, f"Loading model {model_id} ({k + 1}/{n})")
        before = set(dev.allocations())
        try:
            path = await self._model_path(rec, stage(0.0, 0.1))
            factory = self._factory(rec.model_type)
            kw = {}
            params = inspect.signature(factory.load).parameters
            if "model_id" in params:
                kw["model_id"] = model_id
            if "logit_processor" in params and model_id in self.logit_processor_registry:
                kw["logit_processor"] = self.logit_processor_registry[model_id]
            pipe = await factory.load(dev, path, chat_config, progress=stage(0.1, 1.0), **kw)
        except BaseException:
            # Cancelled or failed mid-load: free whatever this load allocated.
            for owner in set(dev.allocations()) - before:
                dev.release_owner(owner)
            dev.release_owner(f"model:{model_id}")
            raise
        proc = self.logit_processor_registry.get(model_id)
        if proc is not None and "logit_processor" not in params:
            setter = getattr(pipe, "set_logit_processor", None)
            if setter is None:
                pipe.dispose()
                raise FeatureSupportError(f"logit processors (model {model_id})")
            setter(proc)
        owners = (set(dev.allocations()) - before) | {f"model:{model_id}"}
        return LoadedModel(model_id, rec, pipe, getattr(pipe, "chat_config", chat_config),
                           rec.model_type, FIFOLock(model_id), 0, owners)

    def _check_features(self, dev, rec: ModelRecord, opts: dict | None) -> ModelRecord:
        if (opts or {}).get("dtype") == "f16" and not dev.has_f16:
            raise ShaderF16SupportError()
        for feat in rec.required_features:
            if feat in dev.features:
                continue
            if feat == "shader-f16":
                if rec.f32_variant:
                    log.warning("%s needs shader-f16, which %s lacks: loading its f32 variant %s",
                                rec.model_id, dev.info.name, rec.f32_variant)
                    return self._check_features(dev, self.app_config.get(rec.f32_variant), opts)
                raise ShaderF16SupportError()
            raise FeatureSupportError(feat)
        return rec

    def _factory(self, model_type: str):
        custom = (self.config.pipeline_factories or {}).get(model_type)
        if custom is not None:
            return custom
        if model_type == LLM:
            from ..pipelines.llm import LLMChatPipeline
            return LLMChatPipeline
        from ..pipelines.embedding import EmbeddingPipeline
        return EmbeddingPipeline

    async def _model_path(self, rec: ModelRecord, progress) -> Path:
        """Where the model's files are on disk: a local record is used in place; otherwise the artifact
        cache fetches (or finds) them. The one place that talks to the cache."""
        if rec.is_local:
            return Path(rec.model).expanduser()
        from .. import cache
        arts = None
        if cache.model_artifacts(rec.model_id) is None and rec.model_file:
            # A one-file record the cache does not know yet: its sources, then its home URL.
            bases = [b if b.endswith("/") else b + "/" for b in [*rec.sources, rec.model]]
            arts = cache.artifacts_from_bases(
                rec.model_id, {rec.model_file: (None, rec.integrity.get(rec.model_file))}, bases)
        path = Path(await cache.fetch_model(rec.model_id, arts, progress=progress))
        if rec.model_file and path.is_dir():
            path = path / rec.model_file
        return path

    def _report(self, progress: float, t0: float, text: str) -> None:
        log.info("%s", text)
        cb = self.init_progress_callback
        if cb is not None:
            cb({"progress": float(progress), "time_elapsed": time.perf_counter() - t0, "text": text})

    async def unload(self) -> None:
        """Free every loaded model (an intentional unload is never reported as a device loss)."""
        models, self.models = self.models, {}
        for lm in models.values():
            self._dispose(lm)
        if self.state != "device_lost":
            self.state = "idle"

    def _dispose(self, lm: LoadedModel) -> None:
        try:
            lm.pipeline.dispose()
        except Exception as e:  # noqa: BLE001 - a lost device has nothing left to free
            log.debug("dispose of %s: %s", lm.model_id, e)
        dev = self.device
        if dev is not None:
            for owner in lm.owners:
                dev.release_owner(owner)

    # ------------------------------------------------------------------ device loss
    def on_device_lost(self, err: BaseException) -> None:
        """Drop every model and all GPU state after a loss (called by the request that saw it)."""
        if self.state == "device_lost":
            return
        log.error("%s (dropping all loaded models%s)", err,
                  "; they reload on the next request" if self.config.auto_recover else "")
        self.device_lost_reason = str(err)
        models, self.models = self.models, {}
        for lm in models.values():
            self._dispose(lm)
        if self.device is not None and not self.device.lost:
            self.device.mark_lost(str(err))
        self.device = None           # dead; get_device() requests a fresh one on the next reload
        self.state = "device_lost"

    async def _maybe_recover(self) -> None:
        if self._recovering is not None:
            # Another request is already reloading: wait for it (its failure is reported to it;
            # here the model lookup that follows says what is loaded).
            await asyncio.wait([self._recovering])
            return
        if self.state != "device_lost" or not self.config.auto_recover or self._last_reload is None:
            return
        self._recovering = asyncio.get_running_loop().create_future()
        try:
            ids, opts = self._last_reload
            log.warning("recovering from device loss: new device, reloading %s", ids)
            await self.reload(ids, opts)
        finally:
            self._recovering.set_result(None)
            self._recovering = None

    # ------------------------------------------------------------------ model selection
    async def select(self, model: str | None, kind: str, request_name: str) -> LoadedModel:
        """WebLLM's getModelIdToUse + pipeline-type check."""
        await self._maybe_recover()
        loaded = list(self.models)
        if not loaded:
            raise ModelNotLoadedError(request_name)
        if model is None:
            if len(loaded) > 1:
                raise UnclearModelToUseError(loaded, request_name)
            lm = self.models[loaded[0]]
        else:
            lm = self.models.get(model)
            if lm is None:
                raise SpecifiedModelNotFoundError(loaded, model)
        if lm.model_type != kind:
            if kind == EMBEDDING:
                raise EmbeddingUnsupportedModelError(lm.model_id)
            raise IncorrectPipelineLoadedError(lm.model_id, kind, request_name)
        return lm

    async def acquire(self, lm: LoadedModel, request_name: str) -> None:
        """Take the model's lock; fail if the model was dropped (device loss, unload) while queued."""
        await lm.lock.acquire()
        if self.models.get(lm.model_id) is not lm:
            lm.lock.release()
            if self.state == "device_lost":
                raise DeviceLostError(self.device_lost_reason or "")
            raise ModelNotLoadedError(request_name)

    # ------------------------------------------------------------------ misc WebLLM methods
    def _llm(self, model: str | None) -> LoadedModel:
        loaded = list(self.models)
        if not loaded:
            raise ModelNotLoadedError("this call")
        if model is None:
            llms = [m for m in loaded if self.models[m].model_type == LLM]
            if len(loaded) > 1 and len(llms) != 1:
                raise UnclearModelToUseError(loaded, "this call")
            model = llms[0] if llms else loaded[0]
        lm = self.models.get(model)
        if lm is None:
            raise SpecifiedModelNotFoundError(loaded, model)
        return lm

    def interrupt_generate(self) -> None:
        """Stop every generation in flight after its current decode step (finish_reason "abort")."""
        for lm in self.models.values():
            f = getattr(lm.pipeline, "interrupt", None)
            if f is not None:
                f()

    async def reset_chat(self, keep_stats: bool = False, model: str | None = None) -> None:
        lm = self._llm(model)
        f = getattr(lm.pipeline, "reset_chat", None)
        if f is not None:
            async with lm.lock:
                f(keep_stats)

    async def get_message(self, model: str | None = None) -> str:
        lm = self._llm(model)
        if lm.model_type != LLM:
            raise IncorrectPipelineLoadedError(lm.model_id, LLM, "get_message")
        return lm.pipeline.get_message()

    async def runtime_stats_text(self, model: str | None = None) -> str:
        return self._llm(model).pipeline.runtime_stats_text()

    async def forward_tokens_and_sample(self, input_ids: list[int], is_prefill: bool,
                                        model: str | None = None) -> int:
        """One forward pass over `input_ids` and one sampled token (WebLLM's low-level hook)."""
        lm = await self.select(model, LLM, "forward_tokens_and_sample")
        cc = lm.chat_config
        gen = GenerationConfig(temperature=cc.temperature, top_p=cc.top_p)
        await self.acquire(lm, "forward_tokens_and_sample")
        try:
            return await self.guard(lm.pipeline.forward_tokens_and_sample(list(input_ids), is_prefill, gen))
        finally:
            lm.lock.release()

    async def guard(self, awaitable):
        """Await one pipeline step; on device loss drop all GPU state, then re-raise.

        A cancelled caller (client gone, consumer stopped) still lets the step in flight finish:
        abandoning a readback half-way would leave the pipeline's buffers in an unusable state, and
        one decode step is short."""
        task = asyncio.ensure_future(awaitable)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            if not task.cancelled() and isinstance(task.exception(), DeviceLostError):
                self.on_device_lost(task.exception())
            raise
        except DeviceLostError as e:
            self.on_device_lost(e)
            raise

    def queue_lengths(self) -> dict[str, int]:
        """Waiting requests per loaded model (+1 for the one running), for /metrics."""
        return {m: lm.lock.queue_length + (1 if lm.lock.locked else 0) for m, lm in self.models.items()}


async def create_mlc_engine(model_id: str | list[str], engine_config: EngineConfig | None = None,
                            chat_opts: dict | list[dict | None] | None = None) -> AsyncMLCEngine:
    """WebLLM's CreateMLCEngine: a new engine with `model_id` (one id or several) loaded."""
    engine = AsyncMLCEngine(engine_config)
    await engine.reload(model_id, chat_opts)
    return engine
