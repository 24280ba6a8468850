"""Shader bundles through the cache: a model record may name a versioned zip of `shaders/*.wgsl`
(URL, pypi:// member or local path); it is fetched into the `shaders` scope, unpacked once, and the
gpu layer is pointed at it. Without one, the installed package's own `shaders/` are used.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from ..errors import ArtifactError
from .artifact import Artifact, cache_root, local_source_path, lock_path, model_dir, source_kind
from .fetch import _threadsafe, fetch_artifacts_sync

WGSL_DIR = "wgsl"
MAX_WGSL_BYTES = 1 << 20       # one WGSL file of a bundle (ours are at most tens of KB)
MAX_WGSL_FILES = 1000


def bundle_name(url: str) -> str:
    """`.../webgpu_engine-shaders-0.2.0.zip` -> `webgpu_engine-shaders-0.2.0` (the version is in the name)."""
    path = url.split("/", 3)[-1] if url.startswith("pypi://") else urlparse(url).path or url
    name = PurePosixPath(path).name
    return name[:-4] if name.lower().endswith(".zip") else name


def _unpack(zip_path: Path, out: Path, tmp_parent: Path) -> Path:
    tmp_parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="wgsl-", dir=tmp_parent))
    try:
        n = 0
        with zipfile.ZipFile(zip_path) as z:
            for info in z.infolist():
                name = PurePosixPath(info.filename).name      # flatten: no path from the zip is trusted
                if info.is_dir() or not name.endswith(".wgsl"):
                    continue
                # A member's declared size is checked before anything is inflated, and the read is
                # bounded too: a zip bomb cannot fill memory or the disk.
                if info.file_size > MAX_WGSL_BYTES:
                    raise ArtifactError(f"Shader bundle {zip_path.name}: {info.filename} declares "
                                        f"{info.file_size} bytes, over the {MAX_WGSL_BYTES}-byte limit "
                                        f"for one WGSL file")
                n += 1
                if n > MAX_WGSL_FILES:
                    raise ArtifactError(f"Shader bundle {zip_path.name} holds more than {MAX_WGSL_FILES} "
                                        f"WGSL files")
                with z.open(info) as src:
                    data = src.read(MAX_WGSL_BYTES + 1)
                if len(data) > MAX_WGSL_BYTES:
                    raise ArtifactError(f"Shader bundle {zip_path.name}: {info.filename} is over the "
                                        f"{MAX_WGSL_BYTES}-byte limit for one WGSL file")
                (tmp / name).write_bytes(data)
        if n == 0:
            raise ArtifactError(f"Shader bundle {zip_path.name} holds no .wgsl files")
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)             # atomic: the folder appears complete or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fetch_shader_bundle_sync(url: str, *, sha256: str | None = None, size: int | None = None,
                             root: str | os.PathLike | None = None, **kwargs) -> Path:
    """The folder of WGSL files of bundle `url` (a local folder is used in place)."""
    if source_kind(url) == "local" and local_source_path(url).is_dir():
        return local_source_path(url)
    name = bundle_name(url)
    a = Artifact("shaders", name, PurePosixPath(name).name + ".zip", (url,), sha256=sha256, size=size)
    out = model_dir("shaders", name, root) / WGSL_DIR
    if out.is_dir() and any(out.glob("*.wgsl")):
        return out
    zip_path = fetch_artifacts_sync([a], root=root, **kwargs)[0]
    from filelock import FileLock
    lock_path(a, root).parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path(a, root)) + ".unpack"):
        if not (out.is_dir() and any(out.glob("*.wgsl"))):
            _unpack(zip_path, out, cache_root(root) / ".partial" / "shaders")
    return out


async def fetch_shader_bundle(url: str, *, progress=None, **kwargs) -> Path:
    return await asyncio.to_thread(fetch_shader_bundle_sync, url, progress=_threadsafe(progress), **kwargs)


async def use_shader_bundle(url: str | None, **kwargs) -> Path:
    """Point the gpu layer at bundle `url` (None: the package's own shaders); returns the folder used."""
    from ..gpu import shaders
    if not url:
        shaders.set_shader_dir(None)
        return shaders.shader_dir()
    d = await fetch_shader_bundle(url, **kwargs)
    shaders.set_shader_dir(d)
    return d
