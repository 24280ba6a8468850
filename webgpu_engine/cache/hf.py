"""Hugging Face hub files through `huggingface_hub`: the user's HF cache, HF_TOKEN, HF_ENDPOINT, offline mode.

Models named by a Hugging Face repo id live in the Hugging Face cache (`HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `~/.cache/huggingface/hub`), shared with transformers, llama.cpp and
huggingface-cli, so a model any of them fetched loads without network access. The settings are read
from the environment on every call (not when huggingface_hub is first imported), so a process can
change them. Offline (`HF_HUB_OFFLINE=1` or `WEBGPU_ENGINE_OFFLINE=1`, or `offline=True`) lists and
opens only what the HF cache holds; online, a hub that cannot be reached falls back to the cache too.
A download that fails or is interrupted leaves no partial file in the HF cache (see _Partials).
huggingface_hub is imported lazily: module level is the standard library only.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ArtifactFetchError, ModelAccessError, ModelReferenceError, NetworkForbiddenError
from .artifact import OFFLINE_ENV

_TRUE = ("1", "true", "yes", "on")
LIST_TIMEOUT_S = 10.0


def hf_offline(offline: bool | None = None) -> bool:
    if offline is not None:
        return offline
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", OFFLINE_ENV))


def _sync_offline(offline: bool | None) -> bool:
    """Whether this call is offline. huggingface_hub reads HF_HUB_OFFLINE only once, at import, so it
    is given the environment's current value (a process may change it, as tests do); an explicit
    `offline` applies to this call alone (local_files_only)."""
    from huggingface_hub import constants
    constants.HF_HUB_OFFLINE = hf_offline(None)
    return hf_offline(offline)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub resolves it, read from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def hf_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` (a branch, tag or commit; default main) in the
    HF cache, or None when the cache does not hold it."""
    repo_dir = hf_cache_dir() / _repo_folder(repo_id)
    rev = revision or "main"
    ref = repo_dir / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snap = repo_dir / "snapshots" / commit
    return snap if snap.is_dir() else None


def _cached_files(snapshot: Path) -> list[str]:
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _translate(e: Exception, reference: str, what: str) -> Exception:
    """huggingface_hub's exceptions as our typed errors (the message names the reference)."""
    from huggingface_hub import errors as hf
    endpoint = hf_endpoint() or "https://huggingface.co"
    if isinstance(e, hf.GatedRepoError):
        return ModelAccessError(reference, f"{what}: the repo is gated ({endpoint})")
    if isinstance(e, hf.RepositoryNotFoundError):
        # The hub answers 401/404 alike for a private repo without a token and a missing one.
        return ModelReferenceError(
            reference, [f"{what}: no such Hugging Face repo at {endpoint} (or it is private: set HF_TOKEN)"])
    if isinstance(e, hf.RevisionNotFoundError):
        return ModelReferenceError(reference, [f"{what}: the repo has no such revision"])
    if isinstance(e, hf.LocalEntryNotFoundError):
        return NetworkForbiddenError(
            f"{reference}: {what} is not in the Hugging Face cache ({hf_cache_dir()}) and the hub is "
            f"offline or unreachable. Fetch it once online (`python -m webgpu_engine download "
            f"{reference}`), or unset HF_HUB_OFFLINE / WEBGPU_ENGINE_OFFLINE.")
    if isinstance(e, hf.EntryNotFoundError):
        return ModelReferenceError(reference, [f"{what}: the repo has no such file"])
    return ArtifactFetchError(f"{reference}: {what} failed: {type(e).__name__}: {e}")


def repo_files(repo_id: str, revision: str | None = None, *, offline: bool | None = None,
               reference: str | None = None) -> tuple[list[str], str]:
    """(every file path in the repo, where the list came from: "hub" or "cache")."""
    reference = reference or repo_id
    snap = cached_snapshot(repo_id, revision)
    if hf_offline(offline):
        if snap is None:
            raise NetworkForbiddenError(
                f"the Hugging Face cache ({hf_cache_dir()}) holds no snapshot of {repo_id} and offline "
                f"mode (HF_HUB_OFFLINE / WEBGPU_ENGINE_OFFLINE) forbids asking the hub")
        return _cached_files(snap), "cache"
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf
    _sync_offline(offline)
    try:
        # model_info, not list_repo_files: it fails at once when the hub is unreachable (the tree
        # listing retries with backoff for ~20 s), and the cache can then answer.
        info = HfApi(endpoint=hf_endpoint()).model_info(repo_id, revision=revision, timeout=LIST_TIMEOUT_S)
        return sorted(s.rfilename for s in info.siblings or []), "hub"
    except (hf.RepositoryNotFoundError, hf.RevisionNotFoundError) as e:
        raise _translate(e, reference, f"listing {repo_id}") from None
    except Exception as e:  # noqa: BLE001 - unreachable hub (connection, timeout, 5xx): use the cache
        if snap is not None:
            return _cached_files(snap), "cache"
        raise _translate(e, reference, f"listing {repo_id}") from None


class _Partials:
    """The `*.incomplete` files of one download, removed when it fails.

    huggingface_hub writes a blob to `blobs/<etag>[.<nonce>].incomplete` under the lock
    `.locks/models--ORG--REPO/<etag>.lock` and renames it when complete. Releases before 1.x keep the
    part on failure (to resume it later); we leave nothing half-written in any cache, so after a
    failed or interrupted download the parts it wrote are deleted: those that appeared or changed
    since it started and whose lock no other download (another thread or process) holds now."""

    def __init__(self, repo_id: str):
        self.blobs = hf_cache_dir() / _repo_folder(repo_id) / "blobs"
        self.locks = hf_cache_dir() / ".locks" / _repo_folder(repo_id)
        self.before = self._scan()

    def _scan(self) -> dict[Path, tuple[int, int]]:
        out = {}
        for p in self.blobs.glob("*.incomplete") if self.blobs.is_dir() else ():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out[p] = (st.st_mtime_ns, st.st_size)
        return out

    def remove(self) -> list[Path]:
        """Delete this download's parts; the paths deleted."""
        from filelock import FileLock, SoftFileLock, Timeout
        removed = []
        for p, sig in self._scan().items():
            if self.before.get(p) == sig:           # untouched by this download: not ours
                continue
            lock_path = self.locks / f"{p.name.split('.', 1)[0]}.lock"
            try:
                lock = FileLock(str(lock_path), timeout=0) if lock_path.is_file() else None
                try:
                    if lock is not None:
                        lock.acquire()
                except NotImplementedError:         # no flock on this file system: a soft lock
                    lock = SoftFileLock(str(lock_path), timeout=0)
                    lock.acquire()
            except Timeout:                         # another download is writing it now
                continue
            try:
                p.unlink(missing_ok=True)
                removed.append(p)
            finally:
                if lock is not None:
                    lock.release()
        return removed


def _bars(progress, what: str):
    """A tqdm class for huggingface_hub's bars that also reports each update as
    progress(fraction, text) (byte bars for a file, file-count bars for a folder); None without one."""
    if progress is None:
        return None
    from tqdm.auto import tqdm

    class Bar(tqdm):
        def update(self, n=1):
            out = super().update(n)
            if self.total:
                done = (f"{self.n / 2 ** 20:.1f} of {self.total / 2 ** 20:.1f} MiB" if self.unit == "B"
                        else f"{self.n} of {self.total} files")
                progress(min(1.0, self.n / self.total), f"fetching {what}: {done}")
            return out
    return Bar


def download_file(repo_id: str, filename: str, revision: str | None = None, *, offline: bool | None = None,
                  reference: str | None = None, progress=None) -> Path:
    """The local path of one repo file (from the HF cache, else downloaded into it, reported to
    `progress(fraction, text)` when given)."""
    from huggingface_hub import hf_hub_download
    partials = _Partials(repo_id)
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=hf_cache_dir(),
                                    local_files_only=_sync_offline(offline), endpoint=hf_endpoint(),
                                    tqdm_class=_bars(progress, filename)))
    except BaseException as e:  # noqa: BLE001 - translated into typed errors (an interrupt: re-raised)
        partials.remove()
        if not isinstance(e, Exception):
            raise
        raise _translate(e, reference or repo_id, f"fetching {filename}") from None


def download_folder(repo_id: str, allow_patterns: list[str], revision: str | None = None, *,
                    offline: bool | None = None, reference: str | None = None, progress=None) -> Path:
    """The local snapshot folder holding the repo files that match `allow_patterns` (downloads
    reported to `progress(fraction, text)` when given)."""
    from huggingface_hub import snapshot_download
    partials = _Partials(repo_id)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=hf_cache_dir(),
                                      allow_patterns=allow_patterns, local_files_only=_sync_offline(offline),
                                      endpoint=hf_endpoint(), tqdm_class=_bars(progress, repo_id)))
    except BaseException as e:  # noqa: BLE001 - translated into typed errors (an interrupt: re-raised)
        partials.remove()
        if not isinstance(e, Exception):
            raise
        raise _translate(e, reference or repo_id, f"fetching the files of {repo_id}") from None
