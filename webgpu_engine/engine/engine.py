"""AsyncMLCEngine: WebLLM's MLCEngine in Python — several loaded models, a FIFO lock each, OpenAI API.

The engine holds no GPU math. Per loaded model id it keeps a pipeline, its chat config, its type and
a lock; every request goes validate → select model → lock → generate → release (requests.py).
One gpu Device is shared by all loaded models. This module serves requests (model selection,
admission, the WebLLM methods). Everything else is a part the engine holds and delegates to, each
with its own state: what is loaded on which device (residency.py), loading and unloading (loading.py),
what a device loss does (device_loss.py), tokenize / detokenize (tokens.py), the LoRA adapters (lora.py).
Standard library only at module level (this runs in the browser too).
"""
from __future__ import annotations

import asyncio
from typing import Any

from .. import gpu
from ..config import GenerationConfig
from ..errors import (IncorrectPipelineLoadedError, InvalidRequestError, ModelBusyError, ModelNotLoadedError,
                      RequestTimeoutError, SpecifiedModelNotFoundError, UnclearModelToUseError)
from .device_loss import DeviceLoss
from .loading import SHARED_OWNERS, LoadedModel, ModelLoader  # noqa: F401 - SHARED_OWNERS re-exported
from .lora import LoraAdapters
from .records import LLM, AppConfig, EngineConfig
from .residency import Residency
from .tokens import Tokenizing


class AsyncMLCEngine:
    """Async engine. `await engine.reload(ids)`, then `engine.chat.completions.create(...)` etc."""

    def __init__(self, engine_config: EngineConfig | None = None):
        from .requests import Chat, Completions, Embeddings
        self.config = engine_config or EngineConfig()
        self.held = Residency(self.config.device)
        self.lora = LoraAdapters(lambda: self.held.models)
        self.loss = DeviceLoss(self.config, self.held, self.lora)
        self.loader = ModelLoader(self.config, self.held, self.get_device, self.lora, self.loss)
        self.loss.reload = self.loader.reload
        self.interrupts = 0             # interrupt_generate() calls: a request stops all its choices
        self.chat = Chat(self)
        self.completions = Completions(self)
        self.embeddings = Embeddings(self)
        from .responses import Responses
        self.responses = Responses(self)      # OpenAI's Responses API over the chat path
        from .messages import Messages
        self.messages = Messages(self)        # Anthropic's Messages API over the chat path
        from .rerank import Rerank
        self._rerank = Rerank(self)
        self._tokens = Tokenizing(self.select, self.config)

    # ------------------------------------------------------------------ what is loaded (residency.py)
    @property
    def models(self) -> dict[str, LoadedModel]:
        return self.held.models

    @property
    def state(self) -> str:
        """idle | loading | ready | device_lost"""
        return self.held.state

    @property
    def device(self):
        return self.held.device

    @property
    def device_lost_reason(self) -> str | None:
        return self.held.lost_reason

    # ------------------------------------------------------------------ loading (loading.py)
    async def reload(self, model_id: str | list[str], chat_opts: dict | list[dict | None] | None = None,
                     *, aliases: str | list[str | None] | None = None, lora_adapters: dict | None = None,
                     lora_max_rank: int | None = None, max_loras: int | None = None) -> None:
        """Unload everything, then load each model in order (ModelLoader.reload: aborting, aliases,
        progress, adapters and their pool's rank and bound)."""
        await self.loader.reload(model_id, chat_opts, aliases=aliases, lora_adapters=lora_adapters,
                                 lora_max_rank=lora_max_rank, max_loras=max_loras)

    async def unload(self) -> None:
        """Free every loaded model and abort a reload() in progress (ModelLoader.unload)."""
        await self.loader.unload()

    async def close(self) -> None:
        """unload(), then close the device this engine requested itself (one given in EngineConfig
        stays its owner's): its compiled pipelines and worker threads go now, not at exit. A later
        reload() requests a new device."""
        await self.unload()
        dev, self.held.device = self.held.device, self.config.device
        if dev is not None and dev is not self.config.device and not dev.lost:
            dev.close()

    def memory_budget(self, dev=None) -> tuple[int, str]:
        """(bytes this engine may hold on the device, where the number comes from)."""
        return self.loader.memory_budget(dev)

    # ------------------------------------------------------------------ device loss (device_loss.py)
    async def guard(self, awaitable, lm: LoadedModel | None = None, what: str = "a GPU step"):
        """Await one pipeline step; a device loss drops every model (DeviceLoss.guard)."""
        return await self.loss.guard(awaitable, lm, what)

    def check_loaded(self, lm: LoadedModel, request_name: str) -> None:
        """Raise when `lm` was dropped (unload, reload, device loss) since the request picked it."""
        self.held.check_loaded(lm, request_name)

    # ------------------------------------------------------------------ tokens, adapters (their parts)
    async def tokenize(self, request: Any = None, **fields) -> dict:
        """Token ids of a prompt (or a chat request's rendered messages), their count and the
        model's context window (vLLM's /tokenize)."""
        return await self._tokens.tokenize(request, **fields)

    async def detokenize(self, request: Any = None, **fields) -> dict:
        """The text of token ids (vLLM's /detokenize)."""
        return await self._tokens.detokenize(request, **fields)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, model: str | None = None,
                                max_rank: int | None = None) -> None:
        """Serve adapter `lora_name` (a PEFT folder or GGUF LoRA file at `lora_path`) over a loaded chat
        model (lora.py)."""
        await self.lora.load_lora_adapter(lora_name, lora_path, model, max_rank)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self.lora.unload_lora_adapter(lora_name)

    def lora_names(self) -> list[str]:
        return self.lora.lora_names()

    async def rerank(self, request: Any = None, **fields):
        """Rerank `documents` by relevance to `query` with a cross-encoder (the shape of Jina's,
        Cohere's and vLLM's rerank APIs): `top_n`, `return_documents`, `model` optional."""
        return await self._rerank.create(request, **fields)

    # ------------------------------------------------------------------ settings (WebLLM setters)
    @property
    def app_config(self) -> AppConfig:
        return self.loader.app_config

    def set_app_config(self, app_config: AppConfig) -> None:
        self.loader.app_config = app_config

    def set_init_progress_callback(self, cb) -> None:
        self.loader.init_progress_callback = cb

    def get_init_progress_callback(self):
        return self.loader.init_progress_callback

    def set_log_level(self, level: str) -> None:
        """WebLLM's levels: TRACE, DEBUG, INFO, WARN, ERROR, SILENT (and Python's WARNING, CRITICAL)."""
        from ..logs import set_log_level
        try:
            set_log_level(level)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="log_level") from None

    def set_logit_processor_registry(self, registry: dict[str, Any] | None) -> None:
        self.loader.logit_processor_registry = dict(registry or {})

    # ------------------------------------------------------------------ device
    async def get_device(self):
        """The engine's device, requested on first use (or again after a loss)."""
        held = self.held
        if held.device is None or held.device.lost:
            held.device = await gpu.request_device(adapter_name=self.config.adapter_name)
        return held.device

    async def get_max_storage_buffer_binding_size(self) -> int:
        return (await self.get_device()).max_storage_binding

    async def get_gpu_vendor(self) -> str:
        return (await self.get_device()).info.vendor

    # ------------------------------------------------------------------ model selection
    async def select(self, model: str | None, kind: str | None, request_name: str) -> LoadedModel:
        """WebLLM's getModelIdToUse + pipeline-type check."""
        await self.loss.maybe_recover()
        loaded = list(self.models)
        if not loaded:
            raise ModelNotLoadedError(request_name)
        if model is None:
            if len(loaded) > 1:
                raise UnclearModelToUseError(loaded, request_name)
            lm = self.models[loaded[0]]
        else:
            lm = self.models.get(model) or self.lora.lora_base(model)     # a LoRA adapter: its base
            if lm is None:
                raise SpecifiedModelNotFoundError(loaded + self.lora.lora_names(), model)
        if kind is not None and lm.model_type != kind:       # None: either pipeline type
            # WebLLM's getLLMStates / getEmbeddingStates: the other pipeline type loaded
            raise IncorrectPipelineLoadedError(lm.model_id, kind, request_name)
        return lm

    def deadline(self) -> float | None:
        """The loop time by which a request arriving now must be done (request_timeout_s), or None."""
        t = self.config.request_timeout_s
        return None if t is None else asyncio.get_running_loop().time() + t

    def check_deadline(self, deadline: float | None, during: str) -> None:
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise RequestTimeoutError(self.config.request_timeout_s, during)

    async def _enter(self, lm: LoadedModel, deadline: float | None) -> None:
        """Queue for `lm`'s lock: refused at once when the queue is full (ModelBusyError), given up
        at the deadline (RequestTimeoutError)."""
        limit = self.config.max_queue_length
        if limit is not None and lm.lock.locked and lm.lock.queue_length >= limit:
            raise ModelBusyError(lm.model_id, lm.lock.queue_length, lm.lock.retry_after())
        if deadline is None:
            await lm.lock.acquire()
            return
        try:
            await asyncio.wait_for(lm.lock.acquire(), deadline - asyncio.get_running_loop().time())
        except asyncio.TimeoutError:
            raise RequestTimeoutError(self.config.request_timeout_s, f"the wait for {lm.model_id}") from None

    async def acquire(self, lm: LoadedModel, request_name: str, deadline: float | None = None) -> LoadedModel:
        """Take the model's lock and return the model to use. A request that was still queued when
        the device was lost started no GPU work, so with auto_recover it waits for the reload and
        queues on the reloaded model; otherwise (or after an unload) it fails with the reason.
        Admission: see _enter (bounded queue, deadline)."""
        await self._enter(lm, deadline)
        if self.models.get(lm.model_id) is lm:
            return lm
        lm.lock.release()
        if not (self.config.auto_recover and lm.dropped_by_loss):
            raise self.held.dropped_error(lm, request_name)
        new = await self.select(lm.model_id, lm.model_type, request_name)   # recovers first
        await self._enter(new, deadline)
        if self.models.get(new.model_id) is not new:
            new.lock.release()
            raise self.held.dropped_error(new, request_name)
        return new

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
        """Stop every generation in flight after its current decode step (finish_reason "abort");
        a request with n > 1 generates none of its remaining choices (WebLLM)."""
        self.interrupts += 1
        for lm in self.models.values():
            if lm.model_type == LLM:
                lm.pipeline.interrupt()

    async def reset_chat(self, keep_stats: bool = False, model: str | None = None) -> None:
        lm = self._llm(model)
        if lm.model_type == LLM:            # an embedder holds no conversation
            async with lm.lock:
                lm.pipeline.reset_chat(keep_stats)

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
        lm = await self.acquire(lm, "forward_tokens_and_sample")
        try:
            return await self.guard(lm.pipeline.forward_tokens_and_sample(list(input_ids), is_prefill, gen),
                                    lm, "forward_tokens_and_sample")
        finally:
            lm.lock.release()

    def queue_lengths(self) -> dict[str, int]:
        """Waiting requests per loaded model (+1 for the one running), for /metrics; an embedder's
        coalesced requests count one by one, not as the one group queued on the lock."""
        return {m: lm.lock.queue_length + lm.lock.held
                + (lm.coalescer.queued_past_lock() if lm.coalescer is not None else 0)
                for m, lm in self.models.items()}


async def create_mlc_engine(model_id: str | list[str], engine_config: EngineConfig | None = None,
                            chat_opts: dict | list[dict | None] | None = None, *,
                            aliases: str | list[str | None] | None = None) -> AsyncMLCEngine:
    """WebLLM's CreateMLCEngine: a new engine with `model_id` (one id or several) loaded (named by
    `aliases`, see reload)."""
    engine = AsyncMLCEngine(engine_config)
    await engine.reload(model_id, chat_opts, aliases=aliases)
    return engine
