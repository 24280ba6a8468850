"""Looking into and cleaning the cache, with WebLLM's helper names: has_model_in_cache,
delete_model_in_cache, delete_chat_config_in_cache, delete_model_all_info_in_cache; and list_cache
for `cache ls`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath

from ..errors import CachePathError, IntegrityError
from .artifact import SCOPES, Artifact, cache_root
from .defaults import model_artifacts


def has_model_in_cache(model_id: str, artifacts: list[Artifact] | None = None, *,
                       root: str | os.PathLike | None = None) -> bool:
    """True when loading `model_id` would need no network access (all files cached or local)."""
    from .fetch import present_path
    arts = artifacts or model_artifacts(model_id)
    if arts is None:                      # unknown record: anything cached under its id counts
        try:
            d = confined_dir(cache_root(root) / "model", model_id, root)
        except CachePathError:            # not an id of this cache (absolute, `..`): never looked at
            return False
        return d.is_dir() and any(p.is_file() for p in d.rglob("*"))
    try:
        return all(present_path(a, root, drop_corrupt=False) is not None for a in arts)
    except IntegrityError:                # a local source with the wrong content is not "in cache"
        return False


def confined_dir(parent: Path, model_id: str, root) -> Path:
    """`parent / model_id`, checked to lie strictly inside `parent` once links and `..` are resolved;
    raises CachePathError otherwise (before anything is deleted)."""
    if not isinstance(model_id, str) or not model_id or "\x00" in model_id:
        raise CachePathError(str(model_id), str(cache_root(root)))
    pure = PurePosixPath(model_id.replace("\\", "/"))
    if pure.is_absolute() or os.path.isabs(model_id) or ".." in pure.parts or pure.parts in ((), (".",)):
        raise CachePathError(model_id, str(cache_root(root)))
    d = parent / model_id
    inside, real = parent.resolve(), d.resolve()
    if real == inside or inside not in real.parents:
        raise CachePathError(model_id, str(cache_root(root)))
    return d


def _rm(scope: str, model_id: str, root) -> bool:
    """Delete one model's folder in `scope` and its unfinished downloads; True if anything was there.
    Both folders are checked to lie inside the cache before either is touched."""
    base = cache_root(root)
    dirs = [confined_dir(base / scope, model_id, root), confined_dir(base / ".partial" / scope, model_id, root)]
    hit = False
    for d in dirs:
        if d.exists():
            shutil.rmtree(d)
            hit = True
    return hit


def delete_model_in_cache(model_id: str, *, root: str | os.PathLike | None = None) -> bool:
    """Delete the weights (scope `model`) of `model_id`."""
    return _rm("model", model_id, root)


def delete_chat_config_in_cache(model_id: str, *, root: str | os.PathLike | None = None) -> bool:
    """Delete the chat config files (scope `config`) of `model_id`."""
    return _rm("config", model_id, root)


def delete_model_all_info_in_cache(model_id: str, *, root: str | os.PathLike | None = None) -> bool:
    """Delete everything cached under `model_id` (weights and chat config)."""
    a = delete_model_in_cache(model_id, root=root)
    b = delete_chat_config_in_cache(model_id, root=root)
    return a or b


def _tree_bytes(d: Path) -> tuple[int, int]:
    files = [p for p in d.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def list_cache(root: str | os.PathLike | None = None) -> list[dict]:
    """One entry per (scope, id): files, bytes, and bytes of unfinished downloads."""
    base = cache_root(root)
    out = []
    for scope in SCOPES:
        if not (base / scope).is_dir():
            continue
        for d in sorted(p for p in (base / scope).iterdir() if p.is_dir()):
            n, size = _tree_bytes(d)
            part = base / ".partial" / scope / d.name
            _, partial = _tree_bytes(part) if part.is_dir() else (0, 0)
            arts = model_artifacts(d.name) if scope == "model" else None
            complete = has_model_in_cache(d.name, root=root) if arts else None
            out.append({"scope": scope, "id": d.name, "path": str(d), "files": n, "bytes": size,
                        "partial_bytes": partial, "complete": complete})
    return out
