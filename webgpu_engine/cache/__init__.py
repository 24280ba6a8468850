"""Artifact cache (placeholder resolver until the cache proper lands): where default models live."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_FILES = {
    "SmolLM2-135M-Instruct-Q4_1": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "all-MiniLM-L6-v2": "",
}


def cache_root() -> Path:
    env = os.environ.get("WEBGPU_ENGINE_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "model_cache"


def default_model_path(model_id: str) -> Path:
    base = cache_root() / "model" / model_id
    f = DEFAULT_FILES.get(model_id, "")
    return base / f if f else base
