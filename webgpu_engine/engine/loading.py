"""Loading and unloading models: ModelLoader, the engine part behind AsyncMLCEngine's reload() and
unload() (engine.py), and manage.py's one model beside the others. What a loaded model is, and what the
engine holds, live in residency.py.

reload() unloads everything, then loads each model in order. Before anything is allocated it fetches
every model and checks its memory estimate against the device (memory.py), so a model or context
window that cannot fit fails fast and allocates nothing; a failed or cancelled load frees what it
allocated. An intentional unload() (or reload()) is never a device loss (device_loss.py: a loss
during reload() drops every model, as one during a request does). manage.py loads and unloads one
model beside the others through the same steps.
Standard library only at module level (this runs in the browser too).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import ChatConfig
from ..errors import (ChatOptionTypeError, DeviceLostError, FeatureSupportError, InvalidRequestError,
                      ModelManagementConflictError, ReloadAbortedError, ReloadArgumentSizeUnmatchedError,
                      ReloadModelIdNotUniqueError, ShaderF16SupportError, UnsupportedChatOptionError)
from ..pipelines.protocol import ChatPipelineProtocol, EmbeddingPipelineProtocol, check_pipeline
from . import memory
from .lock import FIFOLock
from .records import LLM, AppConfig, EngineConfig, ModelRecord
from .residency import LoadedModel, Residency  # noqa: F401 - LoadedModel re-exported

log = logging.getLogger("webgpu_engine.engine")

# Owners of per-device kernel state (e.g. the 16-byte placeholder bound where an optional operand is
# absent): shared by every model, other engines and direct pipeline users on the same device, so a
# load never claims them and an unload never frees them (they live as long as the device).
SHARED_OWNERS = frozenset({"kernels"})


@dataclass
class _Plan:
    """One model of a reload, ready to load: nothing of it is on the GPU yet."""

    model_id: str
    record: ModelRecord
    chat_config: ChatConfig
    path: Path
    factory: Any
    estimate: memory.MemoryEstimate | None = None


def _places(pipe, model_type: str) -> int:
    """Requests a model serves at once: a chat model's batch (max_num_sequences), else one."""
    return max(1, int(pipe.chat_config.max_num_sequences)) if model_type == LLM else 1


def _protocol(model_type: str) -> type:
    """The pipeline contract of a model type (an unknown type loads as an embedder, see _factory)."""
    return ChatPipelineProtocol if model_type == LLM else EmbeddingPipelineProtocol


def _check_chat_options(cc: ChatConfig) -> None:
    """Settings of WebLLM's ChatConfig checked before anything loads (typed errors naming them)."""
    window, sinks = cc.sliding_window_size or -1, cc.attention_sink_size or 0
    if window > 0:
        if cc.context_window_size > 0:
            raise UnsupportedChatOptionError(
                "sliding_window_size", window, "only one of context_window_size and sliding_window_size "
                "may be positive (as in WebLLM): set context_window_size to -1 for a sliding window.")
        if not 0 <= sinks < window:
            raise ChatOptionTypeError("attention_sink_size", f"0 <= sinks < sliding_window_size ({window})", sinks)
        if cc.kv_cache_dtype in ("q8_0", "q4_0"):
            raise UnsupportedChatOptionError("kv_cache_dtype", cc.kv_cache_dtype, "a sliding window keeps its "
                                             "ring in an f16 or f32 KV pool: leave kv_cache_dtype auto with a "
                                             "sliding window, or leave sliding_window_size unset")
        if cc.speculation:
            raise UnsupportedChatOptionError("speculation", cc.speculation, "speculative decoding does not "
                                             "run with a sliding window; load without one of them")
        if cc.context_overflow == "shift":
            raise UnsupportedChatOptionError("context_overflow", "shift", "a sliding window never overflows "
                                             "(its ring drops one position per token): leave context_overflow")
    elif sinks not in (0, -1):
        raise UnsupportedChatOptionError(
            "attention_sink_size", sinks, "attention sinks only apply to a sliding window "
            "(sliding_window_size > 0 with context_window_size -1); leave it at 0.")
    # continuous batching: at most 256 sequences (0: as suits the device, at most the prefill chunk),
    # blocks of a power of two 1..256 tokens
    for name, ok, expected in (
            ("max_num_sequences", 0 <= cc.max_num_sequences <= 256,
             "an integer in 0..256 (0: as suits the device)"),
            ("kv_block_size", 1 <= cc.kv_block_size <= 256 and cc.kv_block_size & (cc.kv_block_size - 1) == 0,
             "a power of two in 1..256"),
            ("kv_pool_tokens", cc.kv_pool_tokens >= 0, "0 (automatic) or a positive number of tokens")):
        if not ok:
            raise ChatOptionTypeError(name, expected, getattr(cc, name))
    from ..models.plan import KV_CACHE_DTYPES
    from ..pipelines.llm import OVERFLOW_POLICIES
    from ..pipelines.speculation import Speculation
    Speculation.parse(cc.speculation)           # a bad speculation option fails before anything loads
    if cc.mmproj is not None and not Path(cc.mmproj).is_file():
        raise UnsupportedChatOptionError("mmproj", cc.mmproj, "there is no file there: give the path of the "
                                         "model's multimodal projector GGUF (llama.cpp's --mmproj)")
    if cc.context_overflow not in OVERFLOW_POLICIES:
        raise ChatOptionTypeError("context_overflow", f"one of {list(OVERFLOW_POLICIES)}", cc.context_overflow)
    if cc.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ChatOptionTypeError("kv_cache_dtype", f"one of {list(KV_CACHE_DTYPES)}", cc.kv_cache_dtype)
    if cc.n_keep < 0:
        raise ChatOptionTypeError("n_keep", "a number of tokens >= 0", cc.n_keep)
    if cc.max_num_sequences > cc.prefill_chunk_size > 0:
        raise ChatOptionTypeError("max_num_sequences", f"at most prefill_chunk_size ({cc.prefill_chunk_size})",
                                  cc.max_num_sequences)


class ModelLoader:
    """reload() / unload(), and one model loaded or unloaded beside the others (manage.py), over the
    engine's Residency. It owns the settings a load reads (WebLLM's setters write them): the app
    config, the progress callback and the logit processors."""

    def __init__(self, config: EngineConfig, held: Residency, get_device, lora, lost):
        self.config = config
        self.held = held
        self.get_device = get_device              # async: the engine's device (a new one after a loss)
        self.lora = lora                          # the engine's LoRA adapters (lora.py)
        self.lost = lost                          # the engine's DeviceLoss (a loss during a load)
        self.app_config: AppConfig = config.app_config
        self.init_progress_callback = config.init_progress_callback
        self.logit_processor_registry = dict(config.logit_processor_registry or {})
        self._progress_floor = 0.0                # a reload's progress reports never go back
        self._load_token: object | None = None    # the reload in progress; unload() clears it
        # one model-management call at a time (manage.py: two loads must not both pass the memory check)
        self.manage_lock = asyncio.Lock()

    async def reload(self, model_id: str | list[str], chat_opts: dict | list[dict | None] | None = None,
                     *, aliases: str | list[str | None] | None = None, lora_adapters: dict | None = None,
                     lora_max_rank: int | None = None, max_loras: int | None = None) -> None:
        """Unload everything, then load each model in order. Cancelling the task leaves nothing loaded
        and every GPU buffer of the partial load freed. `aliases` (one per model, None to keep the
        default) names the models in engine.models, /v1/models and responses (references only: an
        app-config record keeps its id). Downloads a reference needs report to the progress callback.
        `lora_adapters` {name: path}: LoRA adapters over the chat model, requested by name (lora.py),
        in a pool of rank `lora_max_rank` holding `max_loras` adapters (vLLM's --max-lora-rank,
        --max-loras: several adapters in one request need ranks adding up to at most the pool's)."""
        ids = [model_id] if isinstance(model_id, str) else list(model_id)
        names = [aliases] if isinstance(aliases, str) else list(aliases or [])
        if len(names) > len(ids):
            raise ReloadArgumentSizeUnmatchedError(len(ids), len(names))
        if chat_opts is None:
            opts: list[dict | None] = [None] * len(ids)
        else:
            opts = list(chat_opts) if isinstance(chat_opts, (list, tuple)) else [chat_opts]
            if len(opts) != len(ids):
                raise ReloadArgumentSizeUnmatchedError(len(ids), len(opts))
        if lora_adapters:           # adapters are served by the batch scheduler: batch as serve does
            opts = [{"max_num_sequences": 0, **(o or {})} for o in opts]
        if len(set(ids)) != len(ids):
            raise ReloadModelIdNotUniqueError(ids)
        # Ids the app config lacks are model references (a .gguf, a folder, a URL, a Hugging Face
        # repo): resolved into records, and registered, before anything unloads (references.py).
        from .references import records_for
        t0 = time.perf_counter()
        n = len(ids)
        self._progress_floor = 0.0
        loop = asyncio.get_running_loop()

        def fetched(k: int, frac: float, text: str) -> None:    # called from the resolving thread
            f = (k + max(0.0, min(1.0, frac))) / n
            loop.call_soon_threadsafe(self._report, 0.1 * f * 0.99, t0, f"[{ids[k]}] {text}")
        self.app_config, records = await records_for(self.app_config, ids, names, fetched)
        ids = [r.model_id for r in records]
        if len(set(ids)) != len(ids):
            raise ReloadModelIdNotUniqueError(ids)
        await self.unload()                 # also aborts a reload still in progress
        token = self._load_token = object()
        held = self.held
        held.last_reload = (ids, opts)
        held.state = "loading"
        dev, current, stage = None, None, "preparing the load"
        try:
            dev = await self.get_device()
            self._check_aborted(token)
            # Phase 1 (the first tenth of the progress): features, configs, files and memory, for
            # every model before anything is allocated, so a model that cannot fit fails fast.
            plans = []
            for k, (mid, rec, opt) in enumerate(zip(ids, records, opts)):
                current = mid
                plans.append(await self._prepare(dev, mid, rec, opt, k, n, t0, token))
                self._check_aborted(token)
            self._check_memory(dev, plans)
            stage = "loading (weight upload)"
            loaded: dict[str, LoadedModel] = {}
            try:
                for k, plan in enumerate(plans):
                    current = plan.model_id
                    loaded[plan.model_id] = await self._load_one(dev, plan, k, n, t0, token)
                    self._check_aborted(token)
            except BaseException:
                for lm in loaded.values():
                    held.dispose(lm)
                raise
        except BaseException as e:
            if self._load_token is token:
                self._load_token = None
            held.state = "idle" if held.state == "loading" else held.state
            if isinstance(e, Exception) and (isinstance(e, DeviceLostError) or (dev is not None and dev.lost)):
                # The same policy as a loss during a request: drop everything; auto_recover retries
                # this reload on the next request.
                raise self.lost.lose(e, dev, f"{stage} of model {current}") from e
            raise
        self._load_token = None
        held.install(loaded)
        await self.lora.load_adapters(lora_adapters, lora_max_rank, max_loras)
        self._report(1.0, t0, f"Finish loading on WebGPU - {dev.info.name}")

    def _check_aborted(self, token: object) -> None:
        """Raise ReloadAbortedError when unload() (or a newer reload()) ended the load `token`."""
        if self._load_token is not token:
            raise ReloadAbortedError()

    async def _prepare(self, dev, model_id: str, rec: ModelRecord, opts: dict | None, k: int, n: int,
                       t0: float, token: object = None) -> _Plan:
        """Check features, build the chat config, fetch the files (progress 0..0.1) and estimate memory."""
        rec = self._check_features(dev, rec, opts)
        from .references import hub_repo_record, is_hub_repo_record
        if is_hub_repo_record(rec):               # WebLLM's records: https://huggingface.co/mlc-ai/<id>
            rec = await asyncio.to_thread(hub_repo_record, rec)
        try:
            chat_config = ChatConfig().updated(rec.overrides).updated(opts)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e), param="chat_opts") from None
        builtin = (self.config.pipeline_factories or {}).get(rec.model_type) is None
        if builtin:
            _check_chat_options(chat_config)

        def progress(frac: float, text: str) -> None:
            if token is not None:
                self._check_aborted(token)        # an unload() stops the fetch at its next report
            f = (k + max(0.0, min(1.0, frac))) / n
            self._report(0.1 * f * 0.99, t0, f"[{model_id}] {text}")
        path = await self._model_path(rec, progress)
        if builtin:
            chat_config = await self._resolve_draft(chat_config, progress)
        factory = self._factory(rec.model_type)
        plan = _Plan(model_id, rec, chat_config, path, factory)
        plan.estimate = memory.estimate_model(factory, builtin, rec, path, chat_config, dev)
        return plan

    async def _resolve_draft(self, cc: ChatConfig, progress) -> ChatConfig:
        """speculation "draft": its model reference (an app-config id, a path, a URL, a Hub repo)
        resolved and fetched like a model's own, into a local path the pipeline loads."""
        spec = cc.speculation
        if not (isinstance(spec, dict) and spec.get("method") == "draft"):
            return cc
        from .references import records_for
        _, (rec,) = await records_for(self.app_config, [spec["model"]])
        if rec.model_type != LLM:
            raise UnsupportedChatOptionError("speculation", spec, f"the draft model {rec.model_id} is an "
                                             f"embedding model; a draft model must be a chat model")
        path = await self._model_path(rec, progress)
        return replace(cc, speculation={**spec, "model": str(path)})

    def memory_budget(self, dev=None) -> tuple[int, str]:
        """(bytes this engine may hold on the device, where the number comes from)."""
        return memory.memory_budget(dev or self.held.device, self.config.max_memory_bytes)

    def _check_memory(self, dev, plans: list[_Plan]) -> None:
        """Fail before any allocation when a model (after the ones before it in this reload) does not fit."""
        budget, source = self.memory_budget(dev)
        in_use = dev.allocated_bytes()
        for plan in plans:
            est = plan.estimate
            if est is None:
                continue
            cw = plan.chat_config.context_window_size
            if est.context_window and cw > est.context_window:
                log.warning("%s: context_window_size %d is above the model's trained context; using %d",
                            plan.model_id, cw, est.context_window)
            memory.check_fits(plan.model_id, est, dev, budget, source, in_use)
            in_use += est.total

    async def _load_one(self, dev, plan: _Plan, k: int, n: int, t0: float, token: object = None) -> LoadedModel:
        model_id, rec, chat_config, factory = plan.model_id, plan.record, plan.chat_config, plan.factory

        def progress(frac: float, text: str) -> None:
            # Loads fill 0.1..0.99 of the overall progress; it never goes backwards and 1.0 is left
            # for the final "Finish loading" report. An unload() stops the load at its next report
            # (a layer's upload, a shader module): the partial load is freed below.
            if token is not None:
                self._check_aborted(token)
            f = (k + max(0.0, min(1.0, frac))) / n
            self._report((0.1 + 0.9 * f) * 0.99, t0, f"[{model_id}] {text}")

        self._report((0.1 + 0.9 * k / n) * 0.99, t0, f"Loading model {model_id} ({k + 1}/{n})")
        before = set(dev.allocations())
        proc = self.logit_processor_registry.get(model_id)
        try:
            if proc is not None and rec.model_type != LLM:
                raise FeatureSupportError("logit processors", message=(
                    f"Model {model_id} is not a chat model: logit processors (logit_processor_registry) "
                    f"apply to chat models only."))
            pipe = await factory.load(dev, plan.path, chat_config, progress=progress, model_id=model_id)
            # the loaded object too: a custom class may set its attributes in __init__ only
            check_pipeline(pipe, _protocol(rec.model_type), f"The pipeline of model {model_id}")
            if proc is not None:
                pipe.set_logit_processor(proc)
            if rec.lora:              # an Ollama ADAPTER layer: its requests run with it (lora.py)
                from .lora import record_adapter
                default = await record_adapter(pipe, rec)
        except BaseException:
            # Cancelled or failed mid-load: free whatever this load allocated.
            # (only owners this load made: another engine on the device may hold "model:<id>" too)
            for owner in set(dev.allocations()) - before - SHARED_OWNERS:
                dev.release_owner(owner)
            raise
        owners = (set(dev.allocations()) - before - SHARED_OWNERS) | {pipe.owner}
        lm = LoadedModel(model_id, rec, pipe, pipe.chat_config,
                         rec.model_type, FIFOLock(model_id, _places(pipe, rec.model_type)), 0, owners,
                         plan.estimate)
        lm.default_adapter = default if rec.lora else None
        return lm

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
            # before anything loads: a class without the engine's members is refused by name
            check_pipeline(custom, _protocol(model_type), f"pipeline_factories[{model_type!r}] "
                           f"({getattr(custom, '__name__', custom)!r})", attributes=False)
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
        # Never backwards within a reload (a reference's download is reported before the fetches of
        # app-config models that come earlier in the list).
        progress = self._progress_floor = max(float(progress), self._progress_floor)
        cb = self.init_progress_callback
        if cb is not None:
            cb({"progress": progress, "time_elapsed": time.perf_counter() - t0, "text": text})

    async def unload(self) -> None:
        """Free every loaded model (an intentional unload is never reported as a device loss) and
        abort a reload() in progress: it stops at its next step, frees what it allocated and raises
        ReloadAbortedError (WebLLM's reload controller)."""
        self._load_token = None
        self.held.clear()

    async def load_beside(self, model: str, chat_opts: dict | None, alias: str | None) -> LoadedModel:
        """Load `model` next to the loaded models through reload()'s steps (manage.py checks first)."""
        from .references import records_for
        app_config, records = await records_for(self.app_config, [model], [alias] if alias else [])
        rec = records[0]
        mid = rec.model_id
        if mid in self.held.models:
            raise ModelManagementConflictError(f"Model {mid} is loaded already; unload it first to load "
                                               f"it with other options, or give another `model_id`.")
        self.app_config = app_config
        dev = await self.get_device()
        t0 = time.perf_counter()
        self._progress_floor = 0.0
        plan = await self._prepare(dev, mid, rec, chat_opts, 0, 1, t0)
        self._check_memory(dev, [plan])            # beside what the loaded models hold now
        lm = await self._load_one(dev, plan, 0, 1, t0)
        self.held.add(lm, chat_opts)
        self._report(1.0, t0, f"Finish loading {mid} on WebGPU - {dev.info.name}")
        return lm
