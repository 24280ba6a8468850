"""A local aiohttp file server (127.0.0.1, its own thread and event loop) for the cache tests, with
injectable faults: HTTP status errors, connections dropped mid-body, slow bodies, Range ignored.
It serves in-memory files and records every request so tests can count downloads.

    with FileServer() as srv:
        srv.add("m/w.bin", data, drop_after=100_000, drops=2)
        url = srv.url("m/w.bin"); ...; srv.count("m/w.bin")
"""
from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass

from aiohttp import web

from threaded_server import ThreadedServer


@dataclass
class Fault:
    status: int | None = None        # answer this status instead of the file
    drop_after: int | None = None    # body bytes sent before the connection is cut ...
    drops: int = 1                   # ... in this many requests, then serve normally
    delay: float = 0.0               # seconds between body chunks (a slow server)
    chunk: int = 16 * 1024
    ignore_range: bool = False       # answer 200 with the whole file even to a Range request


class FileServer(ThreadedServer):
    name = "cache-test-server"

    def __init__(self):
        super().__init__()
        self.files: dict[str, bytes] = {}
        self.faults: dict[str, Fault] = {}
        self.requests: dict[str, list[dict]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup
    def add(self, path: str, data: bytes, **fault) -> str:
        self.files[path] = data
        self.faults[path] = Fault(**fault)
        return self.url(path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def count(self, path: str) -> int:
        with self._lock:
            return len(self.requests.get(path, []))

    def ranges(self, path: str) -> list[str | None]:
        with self._lock:
            return [h.get("Range") for h in self.requests.get(path, [])]

    def total_requests(self) -> int:
        with self._lock:
            return sum(len(v) for v in self.requests.values())

    # ------------------------------------------------------------------ serving
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        with self._lock:
            self.requests.setdefault(path, []).append(dict(request.headers))
        fault = self.faults.get(path, Fault())
        if fault.status:
            return web.Response(status=fault.status, text=f"injected {fault.status}")
        data = self.files.get(path)
        if data is None:
            return web.Response(status=404, text="not found")
        status, start = 200, 0
        headers = {"ETag": '"v1"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        m = re.fullmatch(r"bytes=(\d+)-", request.headers.get("Range", ""))
        if m and not fault.ignore_range:
            start = int(m.group(1))
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        headers["Content-Length"] = str(len(body))
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        drop_at = None
        if fault.drop_after is not None and fault.drops > 0:
            fault.drops -= 1
            drop_at = fault.drop_after
        sent = 0
        for i in range(0, len(body), fault.chunk):
            piece = body[i:i + fault.chunk]
            if drop_at is not None and sent + len(piece) > drop_at:
                await resp.write(piece[:drop_at - sent])
                # Cut the TCP connection mid-body: the client sees fewer bytes than Content-Length.
                request.transport.close()
                raise asyncio.CancelledError
            await resp.write(piece)
            sent += len(piece)
            if fault.delay:
                await asyncio.sleep(fault.delay)
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ routes
    def routes(self, app: web.Application) -> None:
        app.router.add_get("/{path:.*}", self._handle)
