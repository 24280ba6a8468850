"""Routes of OpenAI's Responses API over engine.responses (engine/responses.py):

POST   /v1/responses        a Response, or with "stream": true its typed server-sent events
                            (`event: <type>` then `data: {json}`, no [DONE], as OpenAI sends them)
GET    /v1/responses/{id}   a stored Response (404 for unknown, unstored or evicted ids)
GET    /v1/responses/{id}/input_items   the input items it answered (limit, order, after)
DELETE /v1/responses/{id}   forget a stored Response (404 as above)

They sit under /v1/, so the API key, body limits, error middleware and the model's queue apply
as on the chat route.
"""
from __future__ import annotations

from aiohttp import web

from ..protocol.objects import to_dict
from .common import ENGINE, METRICS, event_frame, json_body, ready_engine, sse


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete)


def _chat_usage(u: dict | None) -> dict | None:
    """Responses usage in the chat shape the metrics count."""
    return None if not u else {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"]}


async def create(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    res = await ready_engine(request).responses.create(body)
    if body.get("stream"):
        return await sse(request, res, res.model, frame=event_frame, done=None)
    d = to_dict(res)
    request.app[METRICS].observe_usage(d["model"], _chat_usage(d["usage"]))
    return web.json_response(d)


async def retrieve(request: web.Request) -> web.Response:
    res = await request.app[ENGINE].responses.retrieve(request.match_info["response_id"])
    return web.json_response(to_dict(res))


async def input_items(request: web.Request) -> web.Response:
    q = request.query
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = q.get("limit")
    res = await request.app[ENGINE].responses.input_items(
        request.match_info["response_id"], limit=limit, order=q.get("order", "desc"), after=q.get("after"))
    return web.json_response(res)


async def delete(request: web.Request) -> web.Response:
    return web.json_response(await request.app[ENGINE].responses.delete(request.match_info["response_id"]))
