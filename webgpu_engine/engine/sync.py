"""MLCEngine: a synchronous facade over AsyncMLCEngine for scripts (MLC-LLM's MLCEngine/AsyncMLCEngine pair).

The async engine lives on an event loop in a background thread; each call is submitted there and
waited for. Streams come back as plain iterators that pull chunks across the thread boundary;
breaking out of one (or closing it) stops the generation and frees the model's lock.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

from .engine import AsyncMLCEngine
from .records import EngineConfig


class EngineLoop:
    """An asyncio loop on a thread of its own, where an engine runs (this module's MLCEngine, a Ray
    worker's: ray/host.py engine_loop); `loop`: the loop to run (default: a new event loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, name: str = "webgpu-engine", *,
                 running: bool = False):
        """`running`: `loop` already runs on another thread (a ServerThread's): calls go there and
        stop() leaves it."""
        self.loop = loop or asyncio.new_event_loop()
        self.thread = None
        if not running:
            self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
            self.thread.start()

    def run(self, coro):
        """Run `coro` on the engine's loop and wait for it (from a thread that is not a loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def call(self, coro):
        """Await `coro` running on the engine's loop, from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        if self.thread is None:
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


class SyncStream:
    """A blocking iterator over an AsyncStream living on the engine's loop."""

    def __init__(self, loop: EngineLoop, astream):
        self._loop, self._astream = loop, astream

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self):
        async def nxt():
            try:
                return True, await self._astream.__anext__()
            except StopAsyncIteration:
                return False, None
        ok, item = self._loop.run(nxt())
        if not ok:
            raise StopIteration
        return item

    def close(self) -> None:
        self._loop.run(self._astream.aclose())

    @property
    def usage(self):
        return self._astream.usage

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._astream._released:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Create:
    def __init__(self, engine: "MLCEngine", target):
        self._engine, self._target = engine, target

    def create(self, request: Any = None, **fields):
        res = self._engine._loop.run(self._target.create(request, **fields))
        if hasattr(res, "__anext__"):
            return SyncStream(self._engine._loop, res)
        return res


class _Chat:
    def __init__(self, engine: "MLCEngine"):
        self.completions = _Create(engine, engine.async_engine.chat.completions)


class _Responses(_Create):
    """engine.responses: create (a SyncStream of events when streaming), retrieve, delete."""

    def retrieve(self, response_id: str):
        return self._engine._loop.run(self._target.retrieve(response_id))

    def delete(self, response_id: str) -> dict:
        return self._engine._loop.run(self._target.delete(response_id))

    def input_items(self, response_id: str, **kw) -> dict:
        return self._engine._loop.run(self._target.input_items(response_id, **kw))


class _Messages(_Create):
    """engine.messages: create (a SyncStream of events when streaming), count_tokens."""

    def count_tokens(self, request: Any = None, **fields) -> dict:
        return self._engine._loop.run(self._target.count_tokens(request, **fields))


class MLCEngine:
    """Blocking engine: same methods as AsyncMLCEngine, without `await`."""

    def __init__(self, engine_config: EngineConfig | None = None, *, engine: AsyncMLCEngine | None = None,
                 loop: asyncio.AbstractEventLoop | None = None):
        """`engine` and `loop`: the facade over an engine that another thread's loop runs (a
        ServerThread's engine and loop: the script and the server share its models); close() then
        leaves the engine to its owner."""
        if engine is not None:
            self._loop, self.async_engine = EngineLoop(loop, running=True), engine
        else:
            self._loop = EngineLoop()
            self.async_engine = self._loop.run(_make(engine_config))
        self.chat = _Chat(self)
        self.completions = _Create(self, self.async_engine.completions)
        self.embeddings = _Create(self, self.async_engine.embeddings)
        self.responses = _Responses(self, self.async_engine.responses)
        self.messages = _Messages(self, self.async_engine.messages)

    def reload(self, model_id, chat_opts=None, *, lora_adapters: dict | None = None, lora_max_rank: int | None = None,
               max_loras: int | None = None) -> None:
        self._loop.run(self.async_engine.reload(model_id, chat_opts, lora_adapters=lora_adapters,
                                                lora_max_rank=lora_max_rank, max_loras=max_loras))

    def load_lora_adapter(self, lora_name: str, lora_path: str, model: str | None = None) -> None:
        self._loop.run(self.async_engine.load_lora_adapter(lora_name, lora_path, model))

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._loop.run(self.async_engine.unload_lora_adapter(lora_name))

    def rerank(self, request: Any = None, **fields):
        return self._loop.run(self.async_engine.rerank(request, **fields))

    def tokenize(self, request: Any = None, **fields) -> dict:
        return self._loop.run(self.async_engine.tokenize(request, **fields))

    def detokenize(self, request: Any = None, **fields) -> dict:
        return self._loop.run(self.async_engine.detokenize(request, **fields))

    def unload(self) -> None:
        self._loop.run(self.async_engine.unload())

    def interrupt_generate(self) -> None:
        self._loop.loop.call_soon_threadsafe(self.async_engine.interrupt_generate)

    def reset_chat(self, keep_stats: bool = False, model: str | None = None) -> None:
        self._loop.run(self.async_engine.reset_chat(keep_stats, model))

    def get_message(self, model: str | None = None) -> str:
        return self._loop.run(self.async_engine.get_message(model))

    def runtime_stats_text(self, model: str | None = None) -> str:
        return self._loop.run(self.async_engine.runtime_stats_text(model))

    def forward_tokens_and_sample(self, input_ids, is_prefill: bool, model: str | None = None) -> int:
        return self._loop.run(self.async_engine.forward_tokens_and_sample(input_ids, is_prefill, model))

    def get_max_storage_buffer_binding_size(self) -> int:
        return self._loop.run(self.async_engine.get_max_storage_buffer_binding_size())

    def get_gpu_vendor(self) -> str:
        return self._loop.run(self.async_engine.get_gpu_vendor())

    def set_app_config(self, app_config) -> None:
        self.async_engine.set_app_config(app_config)

    def set_init_progress_callback(self, cb) -> None:
        self.async_engine.set_init_progress_callback(cb)

    def set_log_level(self, level: str) -> None:
        self.async_engine.set_log_level(level)

    @property
    def models(self):
        return self.async_engine.models

    def close(self) -> None:
        """Unload every model, close the device the engine requested itself (AsyncMLCEngine.close)
        and stop the background loop (not another's engine: see __init__)."""
        if self._loop.thread is not None and self._loop.loop.is_running():
            self._loop.run(self.async_engine.close())
            self._loop.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def _make(cfg):
    return AsyncMLCEngine(cfg)


def create_mlc_engine_sync(model_id, engine_config: EngineConfig | None = None, chat_opts=None) -> MLCEngine:
    """The blocking CreateMLCEngine."""
    eng = MLCEngine(engine_config)
    try:
        eng.reload(model_id, chat_opts)
    except BaseException:
        eng.close()
        raise
    return eng
