"""An aiohttp server on 127.0.0.1 (a free port) in a thread of its own, for tests that need HTTP
while their own event loop (or none) runs: subclasses add their routes in `routes(app)`."""
from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ThreadedServer:
    name = "test-server"

    def __init__(self):
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def start(self):
        ready = threading.Event()

        async def boot():
            app = web.Application()
            self.routes(app)
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

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError(f"{self.name} did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
