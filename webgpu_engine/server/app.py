"""OpenAI-compatible HTTP server on aiohttp over AsyncMLCEngine (native only).

Routes: POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/rerank, /tokenize, /detokenize;
GET /v1/models, /v1/models/{id}, /health, /metrics; POST /v1/models/load and /unload when model
management is allowed (admin.py); POST /v1/responses, GET and DELETE /v1/responses/{id}
(responses.py: OpenAI's Responses API, streamed as typed `event:` frames); POST /v1/messages and
/v1/messages/count_tokens (messages.py: Anthropic's Messages API, its errors in Anthropic's JSON).
Streaming is Server-Sent Events exactly as OpenAI sends them (`data: {json}\\n\\n`, then
`data: [DONE]\\n\\n`). Every error is OpenAI error JSON with its HTTP status; unexpected ones are
logged and answered 500 without internals. Handlers are cancelled when the client disconnects
(aiohttp handler_cancellation): the engine then stops after the decode step in flight and frees
the model's lock. GPU steps await their readbacks, so the loop keeps serving /health meanwhile.

Safe by default: POST bodies must be `application/json` in UTF-8 (415 otherwise), no CORS origin is
allowed unless configured, the API key (when set) guards /v1/*, /tokenize, /detokenize and /metrics
and is compared in constant time; /health stays open. A full model queue answers 429 with Retry-After, a request past
the engine's deadline 504, a server still loading (or shutting down) 503 with Retry-After. On
SIGTERM the server stops accepting, lets requests in flight finish for `shutdown_grace_s`, then
cancels what is left and exits. What the route modules share (application keys, error JSON, the
body reader, the readiness check) is in common.py.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..catalogue import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL
from ..engine import AsyncMLCEngine, EngineConfig
from ..errors import WebGPUEngineError
from ..protocol.objects import to_dict
from .common import (CLIENT_FAULTS, ENGINE, METRICS, OPTS, STATE, BadRequestError, allowed_origin,
                     engine_error_response, error_response, json_body, ready_engine, sse)
from .metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("webgpu_engine.server")


@dataclass
class ServerOptions:
    models: list[str] = field(default_factory=lambda: [DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL])
    chat_opts: list[dict | None] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    cors_origins: list[str] = field(default_factory=list)   # none: browsers on other origins are refused
    log_level: str = "INFO"
    auto_recover: bool = False
    shutdown_grace_s: float = 30.0                 # SIGTERM: how long requests in flight may finish
    engine_config: EngineConfig | None = None     # limits, queue, timeout; tests inject stubs here
    exit_on_load_error: bool = False   # `serve`: a model that fails to load stops the server (exit 1)
    allow_model_management: bool = False   # POST /v1/models/load and /unload (admin.py)
    lora_adapters: dict | None = None      # LoRA adapters {name: path} over the chat model (--lora)
    lora_max_rank: int | None = None       # their pool's rank and bound (--max-lora-rank, --max-loras)
    max_loras: int | None = None
    # builds the engine the app serves from (config, app) instead of AsyncMLCEngine(config): an
    # engine-like object (webgpu_engine.ray's proxy to Ray Serve replicas) that may add app signals
    engine_factory: Any = None


# --------------------------------------------------------------------------- middlewares
@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except WebGPUEngineError as e:
        return engine_error_response(e)
    except CLIENT_FAULTS as e:
        log.warning("request data failed past validation in %s %s (%s)", request.method,
                    request.path, type(e).__name__, exc_info=True)
        return error_response(400, f"The request could not be processed ({type(e).__name__}); check "
                              f"its fields against the API reference.", "invalid_request_error",
                              code="invalid_request")
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, f"Request body too large: {e.text or ''} Send at most "
                              f"{request.app[OPTS].max_body_bytes} bytes.".replace("  ", " "),
                              "invalid_request_error", code="request_too_large")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason if e.status != 404 else
                              f"Unknown route {request.method} {request.path}.",
                              "invalid_request_error" if e.status < 500 else "server_error")
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - logged here, never sent to the client
        log.exception("unexpected error in %s %s", request.method, request.path)
        return error_response(500, "Internal server error; see the server log.", "server_error")


@web.middleware
async def auth_and_limits_middleware(request: web.Request, handler):
    opts: ServerOptions = request.app[OPTS]
    guarded = request.path.startswith(("/v1/", "/api/")) or request.path in ("/metrics", "/tokenize", "/detokenize",
                                                                                "/lora-adapters")
    if opts.api_key and guarded and request.method != "OPTIONS":
        # OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`
        key = opts.api_key.encode("utf-8", "surrogateescape")
        auth = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        xkey = request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
        if not (hmac.compare_digest(auth, b"Bearer " + key) | hmac.compare_digest(xkey, key)):
            return error_response(401, "Incorrect or missing API key. Send `Authorization: Bearer "
                                  "<key>` (or `x-api-key: <key>`) with the key given to the server's "
                                  "--api-key.", "invalid_request_error", code="invalid_api_key")
    cl = request.content_length
    if cl is not None and cl > opts.max_body_bytes:
        return error_response(413, f"Request body too large ({cl} bytes); the limit is "
                              f"{opts.max_body_bytes} bytes.", "invalid_request_error",
                              code="request_too_large")
    return await handler(request)


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except asyncio.CancelledError:
        status = 499      # client closed the request (nginx's convention)
        raise
    finally:
        m = request.app[METRICS]
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unknown"
        m.requests.inc(endpoint=endpoint, status=status)
        m.latency.observe(time.perf_counter() - t0, endpoint=endpoint)


def cors_middleware_factory(origins: list[str]):
    @web.middleware
    async def cors(request: web.Request, handler):
        allow = allowed_origin(origins, request.headers.get("Origin"))
        if allow and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            resp = web.Response(status=204)
        else:
            resp = await handler(request)
        if allow and not resp.prepared:
            resp.headers["Access-Control-Allow-Origin"] = allow
            resp.headers["Access-Control-Allow-Headers"] = ("Authorization, Content-Type, x-api-key, "
                                                            "anthropic-version, anthropic-beta")
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
            if allow != "*":
                resp.headers["Vary"] = "Origin"
        return resp
    return cors


# --------------------------------------------------------------------------- handlers
async def _generate(request: web.Request, endpoint) -> web.StreamResponse:
    """A chat completion or a completion (`endpoint(engine)` is the one to create it): streamed as
    Server-Sent Events when the body asks, else one JSON response."""
    body = await json_body(request)
    engine = ready_engine(request)
    res = await endpoint(engine).create(body)
    if body.get("stream"):
        return await sse(request, res, res._lm.model_id)
    request.app[METRICS].observe_usage(res.model, to_dict(res).get("usage"))
    return web.json_response(to_dict(res))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, lambda engine: engine.chat.completions)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, lambda engine: engine.completions)


async def embeddings(request: web.Request) -> web.Response:
    body = await json_body(request)
    engine = ready_engine(request)
    # The engine speaks floats (as WebLLM); the official client asks for base64 by default.
    fmt = body.pop("encoding_format", None)
    if fmt not in (None, "float", "base64"):
        raise BadRequestError(f"encoding_format must be \"float\" or \"base64\", got {fmt!r}.",
                              param="encoding_format")
    res = to_dict(await engine.embeddings.create(body))
    if fmt == "base64":
        for d in res["data"]:
            v = d["embedding"]
            d["embedding"] = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
    request.app[METRICS].prompt_tokens.inc(res["usage"]["prompt_tokens"], model=res["model"])
    return web.json_response(res)


async def rerank(request: web.Request) -> web.Response:
    body = await json_body(request)
    res = to_dict(await ready_engine(request).rerank(body))
    request.app[METRICS].prompt_tokens.inc(res["usage"]["prompt_tokens"], model=res["model"])
    return web.json_response(res)


def _model_object(request: web.Request, model_id: str, lm) -> dict:
    """OpenAI's model object plus, from the engine, model_type, context_window (tokens) and memory (bytes)."""
    created = request.app[STATE].get("created", int(time.time()))
    # Anthropic's model object (type, display_name, created_at) beside OpenAI's: both clients list them
    return {"id": model_id, "object": "model", "created": created, "owned_by": "webgpu_engine",
            "type": "model", "display_name": model_id,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
            **lm.describe(request.app[ENGINE].device)}


def _adapter_object(request: web.Request, name: str, lm) -> dict:
    """A LoRA adapter as vLLM lists it: its own id, `parent` its base, `root` where it came from."""
    return {**_model_object(request, name, lm), "parent": lm.model_id, "root": lm.lora_adapters[name]}


async def list_models(request: web.Request) -> web.Response:
    models = request.app[ENGINE].models
    data = [_model_object(request, m, lm) for m, lm in models.items()]
    data += [_adapter_object(request, n, lm) for lm in models.values() for n in getattr(lm, "lora_adapters", ())]
    return web.json_response({"object": "list", "data": data, "has_more": False,      # Anthropic's paging
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the client's models.retrieve): 404 for an id that is not loaded."""
    model_id = request.match_info["model"]
    engine = request.app[ENGINE]
    lm = engine.models.get(model_id)
    base = None if lm is not None else next(
        (b for b in engine.models.values() if model_id in getattr(b, "lora_adapters", ())), None)
    if lm is None and base is None:
        return error_response(404, f"The model '{model_id}' does not exist or is not loaded.",
                              "invalid_request_error", param="model", code="model_not_found")
    return web.json_response(_model_object(request, model_id, lm) if lm is not None
                             else _adapter_object(request, model_id, base))


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (vLLM's shape; llama.cpp's `content` too): engine.tokenize."""
    body = await json_body(request)
    return web.json_response(await ready_engine(request).tokenize(body))


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: engine.detokenize."""
    body = await json_body(request)
    return web.json_response(await ready_engine(request).detokenize(body))


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    state = request.app[STATE]
    if state.get("error"):
        status = "error"
    elif state.get("draining"):
        status = "draining"
    elif engine.state == "device_lost":
        status = "device_lost"
    elif engine.state == "loading" or not state.get("loaded"):
        status = "loading"
    else:
        status = "ready"
    body: dict[str, Any] = {"status": status, "models": list(engine.models)}
    if state.get("error"):
        body["error"] = state["error"]
    if engine.device is not None:
        body["adapter"] = engine.device.info.name
    return web.json_response(body, status=200 if status == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render().encode(), headers={"Content-Type": CONTENT_TYPE})


# --------------------------------------------------------------------------- app
def create_app(opts: ServerOptions) -> web.Application:
    cfg = opts.engine_config or EngineConfig(log_level=opts.log_level, auto_recover=opts.auto_recover)
    if opts.auto_recover:
        cfg.auto_recover = True
    app = web.Application(client_max_size=opts.max_body_bytes, middlewares=[
        cors_middleware_factory(opts.cors_origins), metrics_middleware, errors_middleware,
        auth_and_limits_middleware])
    engine = opts.engine_factory(cfg, app) if opts.engine_factory is not None else AsyncMLCEngine(cfg)
    app[ENGINE], app[OPTS], app[STATE] = engine, opts, {"created": int(time.time())}

    def gpu_bytes() -> dict:
        dev = engine.device
        return dev.allocations() if dev is not None and not dev.lost else {}
    app[METRICS] = ServerMetrics(engine.queue_lengths, gpu_bytes)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/rerank", rerank)         # the Jina / Cohere / vLLM rerank shape
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)     # ids may hold slashes
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    from . import admin
    admin.add_routes(app)                             # answer 403 unless allow_model_management
    from . import ollama
    ollama.add_routes(app)                            # Ollama's API: /api/chat, /api/embed, /api/tags, ...
    from . import responses
    responses.add_routes(app)                         # /v1/responses (OpenAI's Responses API)
    from . import messages
    messages.add_routes(app)                          # /v1/messages (Anthropic's Messages API)
    app.on_startup.append(_start_loading)
    app.on_shutdown.append(_drain)
    app.on_cleanup.append(_shutdown)
    return app


async def _start_loading(app: web.Application) -> None:
    async def load():
        opts, state = app[OPTS], app[STATE]
        try:
            lora = {k: v for k, v in (("lora_adapters", opts.lora_adapters), ("lora_max_rank", opts.lora_max_rank),
                                      ("max_loras", opts.max_loras)) if v}
            await app[ENGINE].reload(opts.models, opts.chat_opts, **lora)
            state["loaded"] = True
            log.info("serving %s", ", ".join(opts.models))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported by /health
            state["error"] = str(e)
            if not opts.exit_on_load_error:
                log.exception("loading %s failed", opts.models)
                return
            # `serve` must not look like a running server without its models: say why and stop.
            log.debug("loading %s failed", opts.models, exc_info=True)
            print(f"error: cannot serve {', '.join(opts.models)}: {e}", file=sys.stderr, flush=True)
            state["exit_code"] = 1
            asyncio.get_running_loop().call_soon(_graceful_exit)
    app[STATE]["load_task"] = asyncio.create_task(load())


def _graceful_exit() -> None:
    raise web.GracefulExit()       # from a loop callback: run_app stops and cleans up (as on SIGINT)


async def _drain(app: web.Application) -> None:
    """Shutdown began (SIGTERM): refuse new work; requests in flight get the grace period."""
    app[STATE]["draining"] = True
    log.warning("shutting down: finishing requests in flight (grace %.0f s)", app[OPTS].shutdown_grace_s)


async def _shutdown(app: web.Application) -> None:
    t = app[STATE].get("load_task")
    if t is not None and not t.done():
        t.cancel()
    await app[ENGINE].close()


def run_server(opts: ServerOptions) -> int:
    """Serve until interrupted (the `serve` command); returns the exit status (1: the models failed
    to load and `exit_on_load_error` stopped the server)."""
    logging.getLogger("webgpu_engine").setLevel(opts.log_level)
    app = create_app(opts)
    web.run_app(app, host=opts.host, port=opts.port, handler_cancellation=True,
                shutdown_timeout=opts.shutdown_grace_s,
                print=lambda s: log.warning("%s", s), access_log=log if opts.log_level == "DEBUG" else None)
    return app[STATE].get("exit_code", 0)


class ServerThread:
    """The server on its own loop in a background thread (tests, notebooks, the demo).
    `port=0` picks a free port; `url` is the OpenAI base_url ("http://host:port/v1")."""

    def __init__(self, opts: ServerOptions, wait_ready: float | None = 300.0):
        self.opts = opts
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="webgpu-engine-server", daemon=True)
        self.thread.start()
        self._started.wait()
        if self.error:
            raise self.error
        if wait_ready:
            self.wait_ready(wait_ready)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.error = None
        try:
            self.app = create_app(self.opts)
            self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, self.opts.host, self.opts.port)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    @property
    def engine(self) -> AsyncMLCEngine:
        return self.app[ENGINE]

    @property
    def base(self) -> str:
        return f"http://{self.opts.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout: float = 300.0) -> None:
        async def wait():
            while self.app[STATE].get("load_task") is None:
                await asyncio.sleep(0.01)
            await asyncio.shield(self.app[STATE]["load_task"])
        self.call(wait(), timeout)
        if self.app[STATE].get("error"):
            raise RuntimeError(f"server failed to load models: {self.app[STATE]['error']}")

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
