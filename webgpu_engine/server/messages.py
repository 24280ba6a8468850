"""Routes of Anthropic's Messages API over engine.messages (engine/messages.py), so agent tools and
Claude-style clients (the `anthropic` package, anything that takes an Anthropic base URL) talk to
this server:

POST /v1/messages                a Message, or with "stream": true its typed server-sent events
                                 (`event: <type>` then `data: {json}`; `ping` every PING_S while
                                 the model has nothing new, an engine error after the start as an
                                 `error` event)
POST /v1/messages/count_tokens   {"input_tokens": N}

They sit under /v1/, so the API key (`x-api-key`, as Anthropic's clients send it, or `Authorization:
Bearer`), body limits and the model's queue apply as on the chat route. Every error on these paths
is Anthropic's JSON (`{"type": "error", "error": {"type": ..., "message": ...}}`) with the same HTTP
status; `anthropic-version` and `anthropic-beta` headers are accepted and not needed.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from ..protocol import anthropic as ap
from ..protocol.objects import to_dict
from .common import METRICS, error_rewriter, event_frame, json_body, ready_engine, sse

PREFIX = "/v1/messages"
PING_S = 10.0         # seconds without an event before a ping keeps proxies and clients from timing out


def add_routes(app: web.Application) -> None:
    # outermost: sees every answer of these paths
    app.middlewares.insert(0, error_rewriter(PREFIX, lambda status, msg: ap.error_body(status, str(msg))))
    app.router.add_post(PREFIX, create)
    app.router.add_post(PREFIX + "/count_tokens", count_tokens)


def _error_frame(status: int, message: str, etype: str, param, code) -> bytes:
    return event_frame(ap.error_body(status, message))          # Anthropic's `error` event


def _usage(u: dict | None) -> dict | None:
    """Messages usage in the chat shape the metrics count."""
    return None if not u else {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"]}


class _KeepAlive:
    """A stream's events with a `ping` event wherever PING_S pass without one (the AsyncStream
    surface `sse` uses: iteration, aclose, usage)."""

    def __init__(self, stream, every: float):
        self._s, self._every = stream, every
        self._next: asyncio.Task | None = None

    @property
    def usage(self):
        return self._s.usage

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._next is None:
            self._next = asyncio.ensure_future(self._s.__anext__())
        done, _ = await asyncio.wait({self._next}, timeout=self._every)
        if not done:
            return {"type": "ping"}
        task, self._next = self._next, None
        return task.result()

    async def aclose(self) -> None:
        if self._next is not None and not self._next.done():
            self._next.cancel()
            try:
                await self._next
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
        self._next = None
        await self._s.aclose()


async def create(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    res = await ready_engine(request).messages.create(body)
    if body.get("stream"):
        return await sse(request, _KeepAlive(res, PING_S), res.model, frame=event_frame, done=None,
                         error_frame=_error_frame)
    d = to_dict(res)
    request.app[METRICS].observe_usage(d["model"], _usage(d["usage"]))
    return web.json_response(d)


async def count_tokens(request: web.Request) -> web.Response:
    body = await json_body(request)
    return web.json_response(await ready_engine(request).messages.count_tokens(body))
