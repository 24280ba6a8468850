"""What the server's route modules share: the application keys, OpenAI error JSON, the server's own
request errors, the JSON body reader, the readiness check and the Server-Sent Events writer.

A request body must be `application/json` in UTF-8 (415 otherwise), a JSON object nested at most
MAX_JSON_DEPTH deep (400 otherwise). A server still loading its models, shutting down, or whose
models failed to load answers 503 (with Retry-After where waiting helps).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from ..engine import AsyncMLCEngine
from ..errors import WebGPUEngineError
from ..protocol.objects import to_dict
from .metrics import ServerMetrics

log = logging.getLogger("webgpu_engine.server")

ENGINE = web.AppKey("engine", AsyncMLCEngine)
OPTS = web.AppKey("opts", object)
METRICS = web.AppKey("metrics", ServerMetrics)
STATE = web.AppKey("state", dict)

MAX_JSON_DEPTH = 64        # nesting of a request body; OpenAI's own schemas need fewer than 10
LOADING_RETRY_AFTER = 5    # seconds, sent with 503 while the models load or the server drains


# --------------------------------------------------------------------------- errors
MAX_ERROR_MESSAGE = 1000   # characters: messages quote client values, which may be huge


def error_response(status: int, message: str, etype: str, param: str | None = None,
                   code: str | None = None) -> web.Response:
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[:MAX_ERROR_MESSAGE - 3] + "..."
    body = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return web.json_response(body, status=status)


def error_code(e: WebGPUEngineError) -> str:
    """The `code` of an engine error in OpenAI error JSON: its class name, or the `json_code` a class
    names instead (the server's own request errors keep the codes they have always been sent with)."""
    return getattr(e, "json_code", None) or type(e).__name__


def engine_error_response(e: WebGPUEngineError) -> web.Response:
    resp = error_response(e.http_status, e.message, e.error_type, e.param, error_code(e))
    if e.retry_after is not None:
        resp.headers["Retry-After"] = str(int(e.retry_after))
    return resp


# Request data reaching library code it should not (validation is meant to stop it first) surfaces
# as one of these: the client's fault, so a 400, never a 500.
CLIENT_FAULTS = (ValueError, TypeError, LookupError, RecursionError, UnicodeError, OverflowError)


class BadRequestError(WebGPUEngineError):
    http_status = 400
    error_type = "invalid_request_error"
    json_code = "_BadRequest"


class UnsupportedMediaTypeError(WebGPUEngineError):
    http_status = 415
    error_type = "invalid_request_error"
    json_code = "_UnsupportedMediaType"


class UnavailableError(WebGPUEngineError):
    http_status = 503
    error_type = "service_unavailable"
    json_code = "_Unavailable"

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def error_rewriter(prefix: str, body):
    """A middleware giving the answers of paths under `prefix` another API's error JSON: OpenAI's
    `{"error": {...}}` becomes `body(status, message)` (status and headers kept)."""
    @web.middleware
    async def rewrite(request: web.Request, handler):
        resp = await handler(request)
        if (request.path.startswith(prefix) and resp.status >= 400 and isinstance(resp, web.Response)
                and resp.content_type == "application/json" and resp.body):
            try:
                err = json.loads(resp.body).get("error")
            except (ValueError, AttributeError):
                return resp
            if isinstance(err, dict):
                resp.text = json.dumps(body(resp.status, err.get("message")))
        return resp
    return rewrite


# --------------------------------------------------------------------------- requests
def allowed_origin(origins: list[str], origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin for a request from `origin`, None where none is allowed."""
    if "*" in origins:
        return "*"
    return origin if origin is not None and origin in origins else None


async def json_body(request: web.Request) -> dict:
    """The body as a JSON object: `application/json` (415 otherwise), UTF-8, nested at most
    MAX_JSON_DEPTH deep. NaN and Infinity parse (as Python's json does) and are refused by the
    protocol rules with the field named."""
    if request.content_type != "application/json":
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, got "
                                        f"{request.content_type[:60] or 'none'!r}. Send the body as JSON.")
    charset = request.charset
    if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        raise BadRequestError(f"Unsupported charset {charset[:40]!r}: JSON bodies must be UTF-8 "
                              f"(send `Content-Type: application/json`).", param="Content-Type")
    raw = await request.read()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequestError("The request body is not valid UTF-8.") from None
    except RecursionError:
        raise BadRequestError(f"The request body is nested too deeply; at most {MAX_JSON_DEPTH} levels "
                              f"are accepted.") from None
    except ValueError:
        raise BadRequestError("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    if depth_exceeds(body, MAX_JSON_DEPTH):
        raise BadRequestError(f"The request body is nested too deeply; at most {MAX_JSON_DEPTH} levels "
                              f"are accepted.")
    return body


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests deeper than `limit` (iterative: any depth is safe to check)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        items = v.values() if isinstance(v, dict) else v
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return False


def ready_engine(request: web.Request) -> AsyncMLCEngine:
    """The engine, once it can serve a request; else a 503 that says why."""
    engine = request.app[ENGINE]
    state = request.app[STATE]
    if state.get("error"):
        raise UnavailableError(f"Model loading failed: {state['error']}")
    if state.get("draining"):
        raise UnavailableError("The server is shutting down; send the request to another instance or "
                               "retry when it is back.", LOADING_RETRY_AFTER)
    if engine.state == "loading" or not state.get("loaded"):
        raise UnavailableError("Models are still loading; retry shortly (GET /health says when ready).",
                               LOADING_RETRY_AFTER)
    if engine.state == "device_lost" and not engine.config.auto_recover:
        raise UnavailableError("The GPU device was lost; restart the server or run it with --auto-recover.")
    return engine


# --------------------------------------------------------------------------- streaming
def openai_error_frame(status: int, message: str, etype: str, param: str | None, code: str | None) -> bytes:
    err = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


def data_frame(chunk) -> bytes:
    return b"data: " + json.dumps(to_dict(chunk), separators=(",", ":")).encode() + b"\n\n"


def event_frame(event) -> bytes:
    """A typed Server-Sent Event (`event: <type>` then `data: {json}`), as OpenAI's Responses and
    Anthropic's Messages streams send them."""
    d = to_dict(event)
    return (f"event: {d['type']}\n".encode() + b"data: "
            + json.dumps(d, separators=(",", ":")).encode() + b"\n\n")


async def sse(request: web.Request, stream, model_for_metrics: str, frame=data_frame,
              done: bytes | None = b"data: [DONE]\n\n", error_frame=None) -> web.StreamResponse:
    """Stream `stream`'s items, each written by `frame` (chat: `data:` lines ending with [DONE];
    the Responses and Messages APIs: typed `event:` frames and no [DONE]). An error after the
    headers is written by `error_frame(status, message, type, param, code)` (default: OpenAI's
    error JSON as a `data:` line)."""
    error_frame = error_frame or openai_error_frame
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await cors_headers(request, resp)
    await resp.prepare(request)
    try:
        async for chunk in stream:
            await resp.write(frame(chunk))
        if done is not None:
            await resp.write(done)
    except (ConnectionResetError, asyncio.CancelledError):
        # The client went away: stop generating now (frees the model's lock).
        await stream.aclose()
        raise
    except WebGPUEngineError as e:
        # Headers are gone already: report in-band as OpenAI-compatible servers do.
        await resp.write(error_frame(e.http_status, e.message, e.error_type, e.param, error_code(e)))
    except CLIENT_FAULTS as e:
        log.warning("request data failed past validation in a stream (%s)", type(e).__name__,
                    exc_info=True)
        await resp.write(error_frame(400, f"The request could not be processed ({type(e).__name__}).",
                                     "invalid_request_error", None, "invalid_request"))
    except Exception:  # noqa: BLE001
        log.exception("stream failed")
        await resp.write(error_frame(500, "Internal server error; see the server log.", "server_error",
                                     None, None))
    finally:
        await stream.aclose()
    request.app[METRICS].observe_usage(model_for_metrics, stream.usage)
    await resp.write_eof()
    return resp


async def cors_headers(request: web.Request, resp: web.StreamResponse) -> None:
    allow = allowed_origin(request.app[OPTS].cors_origins, request.headers.get("Origin"))
    if allow:
        resp.headers["Access-Control-Allow-Origin"] = allow
