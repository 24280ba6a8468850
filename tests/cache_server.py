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


@dataclass
class Fault:
    status: int | None = None        # answer this status instead of the file
    drop_after: int | None = None    # body bytes sent before the connection is cut ...
    drops: int = 1                   # ... in this many requests, then serve normally
    delay: float = 0.0               # seconds between body chunks (a slow server)
    chunk: int = 16 * 1024
    ignore_range: bool = False       # answer 200 with the whole file even to a Range request


class FileServer:
    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.faults: dict[str, Fault] = {}
        self.requests: dict[str, list[dict]] = {}
        self._lock = threading.Lock()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

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

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FileServer":
        ready = threading.Event()

        async def boot():
            app = web.Application()
            app.router.add_get("/{path:.*}", self._handle)
            self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        def run():
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(boot())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="cache-test-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("test file server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> "FileServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
