"""Engine layer: AsyncMLCEngine / MLCEngine (WebLLM's MLCEngine API), model records and configs."""
from __future__ import annotations

from ..config import ChatConfig, GenerationConfig
from .engine import AsyncMLCEngine, create_mlc_engine
from .loading import LoadedModel
from .lock import FIFOLock
from .records import (DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL, EMBEDDING, LLM, AppConfig, EngineConfig,
                      ModelRecord, default_app_config)


def __getattr__(name: str):
    # The sync facade needs threads; keep it out of the browser's import path.
    if name in ("MLCEngine", "create_mlc_engine_sync"):
        from . import sync
        return getattr(sync, name)
    raise AttributeError(name)


__all__ = ["AsyncMLCEngine", "MLCEngine", "create_mlc_engine", "create_mlc_engine_sync", "EngineConfig",
           "AppConfig", "ModelRecord", "ChatConfig", "GenerationConfig", "FIFOLock", "LoadedModel",
           "default_app_config", "LLM", "EMBEDDING", "DEFAULT_CHAT_MODEL", "DEFAULT_EMBED_MODEL"]
