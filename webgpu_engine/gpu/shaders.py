"""Where WGSL sources come from: the installed package's `shaders/` (or a source checkout's), or a
directory set by WEBGPU_ENGINE_SHADERS / `set_shader_dir` (e.g. a shader bundle from the cache)."""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

_override: Path | None = None


def default_shader_dir() -> Path:
    env = os.environ.get("WEBGPU_ENGINE_SHADERS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent
    installed = here / "shaders"            # wheel: webgpu_engine/shaders/*.wgsl
    if installed.is_dir() and any(installed.glob("*.wgsl")):
        return installed
    return here.parent / "shaders"          # source checkout: <repo>/shaders


def shader_dir() -> Path:
    return _override or default_shader_dir()


def set_shader_dir(path: str | os.PathLike | None) -> None:
    """Use WGSL files from `path` (None: back to the default). Clears the source cache."""
    global _override
    _override = Path(path) if path else None
    load_shader_source.cache_clear()


@lru_cache(maxsize=None)
def load_shader_source(file: str) -> str:
    path = shader_dir() / file
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"WGSL file {file!r} not found in {shader_dir()}") from None
