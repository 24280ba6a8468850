"""Artifact cache of the page on the browser's Cache API, with WebLLM-like scopes.

One Cache Storage bucket per scope (`webgpu_engine/config`, `webgpu_engine/model`,
`webgpu_engine/shaders`, as WebLLM has `webllm/config`, `webllm/model`, `webllm/wasm`), keyed by URL.
A reload of the page finds the weights there and sends no request for them. Fetched files stay JS
ArrayBuffers (no copy into Python); `stage_files` puts them into Pyodide's in-memory file system in
the native cache's layout, so the engine and loaders open them as ordinary paths.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from js import Object, Response, Uint8Array, caches, fetch
from pyodide.ffi import to_js

from ..cache.artifact import SCOPES
from ..errors import ArtifactFetchError

PREFIX = "webgpu_engine"
_PROGRESS_EVERY_S = 0.25


def _js(d):
    return to_js(d, dict_converter=Object.fromEntries)


@dataclass
class FetchStats:
    """What one `fetch_all` did: files and bytes from the Cache API vs from the network."""

    cached_files: int = 0
    cached_bytes: int = 0
    fetched_files: int = 0
    fetched_bytes: int = 0
    seconds: float = 0.0


class BrowserArtifactCache:
    """Files of one scope in Cache Storage. `progress(fraction, text)` is called while fetching."""

    def __init__(self, scope: str = "model", prefix: str = PREFIX, also: tuple[str, ...] = ()):
        if scope not in SCOPES:
            raise ValueError(f"Unknown cache scope {scope!r}; expected one of {SCOPES}")
        self.scope, self.name = scope, f"{prefix}/{scope}"
        self.also = tuple(also)          # other Cache Storage buckets read (never written), e.g. WebLLM's
        self._cache = None

    async def _open(self):
        if self._cache is None:
            self._cache = await caches.open(self.name)
        return self._cache

    async def has(self, url: str) -> bool:
        return (await (await self._open()).match(url)) is not None

    async def delete(self, url: str) -> bool:
        return bool(await (await self._open()).delete(url))

    async def clear(self) -> bool:
        self._cache = None
        return bool(await caches.delete(self.name))

    async def fetch(self, url: str, on_bytes=None) -> tuple[object, bool]:
        """(Uint8Array of the file, came_from_cache). Network responses are stored before returning.
        `on_bytes(n_done, n_total)` follows a download."""
        cache = await self._open()
        hit = await cache.match(url)
        if hit is not None:
            return Uint8Array.new(await hit.arrayBuffer()), True
        for name in self.also:           # a file WebLLM already downloaded for the same URL
            if await caches.has(name):
                other = await (await caches.open(name)).match(url)
                if other is not None:
                    return Uint8Array.new(await other.arrayBuffer()), True
        try:
            resp = await fetch(url)
        except Exception as e:  # noqa: BLE001 - JS TypeError on network failure
            raise ArtifactFetchError(f"Cannot fetch {url}: {e}") from None
        if not resp.ok:
            raise ArtifactFetchError(f"Cannot fetch {url}: HTTP {resp.status} {resp.statusText}")
        data = await _read_body(resp, on_bytes)
        headers = {"Content-Type": str(resp.headers.get("Content-Type") or "application/octet-stream"),
                   "Content-Length": str(data.length)}
        await cache.put(url, Response.new(data, _js({"headers": headers})))
        return data, False

    async def fetch_all(self, urls: list[str], progress=None) -> tuple[list, FetchStats]:
        """Fetch several files (e.g. one model) with one overall progress report, WebLLM-style."""
        stats, t0 = FetchStats(), time.monotonic()
        out, last = [], [0.0]
        for k, url in enumerate(urls):
            def on_bytes(done, total, k=k):
                now = time.monotonic()
                if progress and total and now - last[0] > _PROGRESS_EVERY_S:
                    last[0] = now
                    frac = (k + done / total) / len(urls)
                    progress(frac, f"Fetching {self.scope} [{k + 1}/{len(urls)}]: {done / 2**20:.1f} of "
                                   f"{total / 2**20:.1f} MiB, {now - t0:.0f} s elapsed")
            data, cached = await self.fetch(url, on_bytes)
            if cached:
                stats.cached_files += 1
                stats.cached_bytes += int(data.length)
            else:
                stats.fetched_files += 1
                stats.fetched_bytes += int(data.length)
            out.append(data)
            if progress:
                where = "from cache" if cached else "fetched"
                progress((k + 1) / len(urls), f"{self.scope} [{k + 1}/{len(urls)}] {where}: {url.rsplit('/', 1)[-1]}")
        stats.seconds = time.monotonic() - t0
        return out, stats


async def _read_body(resp, on_bytes) -> object:
    """The whole body as one Uint8Array, read in chunks so a progress bar can follow it."""
    total = int(resp.headers.get("Content-Length") or 0)
    if not total or on_bytes is None:
        return Uint8Array.new(await resp.arrayBuffer())
    out = Uint8Array.new(total)
    reader = resp.body.getReader()
    done = 0
    while True:
        chunk = await reader.read()
        if chunk.done:
            break
        v = chunk.value
        if done + int(v.length) > total:
            await reader.cancel()
            raise ArtifactFetchError(f"{resp.url}: body longer than its Content-Length ({total} bytes)")
        out.set(v, done)
        done += int(v.length)
        on_bytes(done, total)
    if done != total:
        raise ArtifactFetchError(f"{resp.url}: got {done} of {total} bytes")
    return out


def stage_files(root: str, files: dict[str, object]) -> None:
    """Write {relative path: Uint8Array} under `root` in Pyodide's file system (MEMFS)."""
    import os  # noqa: PLC0415

    import pyodide_js  # noqa: PLC0415 - the Pyodide module object (its FS)
    for rel, data in files.items():
        path = f"{root.rstrip('/')}/{rel}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pyodide_js.FS.writeFile(path, data, _js({"canOwn": True}))
