"""Admin routes: load and unload models on a running server (off unless --allow-model-management).

POST /v1/models/load   {"model": REF, "model_id": ALIAS?, "chat_opts": {...}?}  -> the model, as /v1/models
POST /v1/models/unload {"model": ID}                                           -> {"id", "object", "deleted"}
POST /v1/load_lora_adapter   {"lora_name": NAME, "lora_path": PATH}   (vLLM's shapes) -> a line of text
POST /v1/unload_lora_adapter {"lora_name": NAME, "lora_int_id": N?}                 -> a line of text
GET  /lora-adapters     (llama.cpp's) -> [{"id", "name", "path", "model"}]: each chat model's adapters, id
                       its place in load order over its model, as a request's `lora` entries name it
REF is what `serve --model` takes (an app-config id or a model reference). Both sit under /v1/, so
the API key guards them when one is set. A load passes the start-up memory check against what the
loaded models hold; every failure is a typed 4xx/5xx JSON error and the loaded models keep serving.
"""
from __future__ import annotations

import time

from aiohttp import web

from ..engine.manage import load_model, unload_model
from ..errors import WebGPUEngineError
from .common import ENGINE, OPTS, STATE, BadRequestError, json_body, ready_engine


class ModelManagementDisabledError(WebGPUEngineError):
    http_status = 403
    error_type = "invalid_request_error"

    def __init__(self):
        super().__init__("Loading and unloading models at run time is off on this server; start it "
                         "with --allow-model-management (and --api-key) to allow it.")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/models/load", load)
    app.router.add_post("/v1/models/unload", unload)
    app.router.add_post("/v1/load_lora_adapter", load_lora)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora)
    app.router.add_get("/lora-adapters", list_lora)


def _fields(body: dict, allowed: dict[str, type], required: str) -> dict:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequestError(f"Unknown field(s) {unknown}; this route takes {sorted(allowed)}.",
                              param=unknown[0])
    for name, kind in allowed.items():
        v = body.get(name)
        if v is None and name != required:
            continue
        if not isinstance(v, kind) or (kind is str and not v.strip()):
            what = "a non-empty string" if kind is str else "an object"
            raise BadRequestError(f"`{name}` must be {what}.", param=name)
    return body


async def load(request: web.Request) -> web.Response:
    if not request.app[OPTS].allow_model_management:
        raise ModelManagementDisabledError()
    body = _fields(await json_body(request), {"model": str, "model_id": str, "chat_opts": dict}, "model")
    engine = ready_engine(request)
    lm = await load_model(engine, body["model"], body.get("chat_opts"), body.get("model_id"))
    created = request.app[STATE].get("created", int(time.time()))
    return web.json_response({"id": lm.model_id, "object": "model", "created": created,
                              "owned_by": "webgpu_engine", **lm.describe(engine.device)})


async def unload(request: web.Request) -> web.Response:
    if not request.app[OPTS].allow_model_management:
        raise ModelManagementDisabledError()
    body = _fields(await json_body(request), {"model": str}, "model")
    await unload_model(request.app[ENGINE], body["model"])
    return web.json_response({"id": body["model"], "object": "model", "deleted": True})


async def load_lora(request: web.Request) -> web.Response:
    """A LoRA adapter over the loaded chat model, served as `lora_name` (engine/lora.py)."""
    if not request.app[OPTS].allow_model_management:
        raise ModelManagementDisabledError()
    body = _fields(await json_body(request), {"lora_name": str, "lora_path": str, "load_inplace": bool}, "lora_name")
    if not body.get("lora_path"):
        raise BadRequestError("`lora_path` must be a non-empty string.", param="lora_path")
    await ready_engine(request).load_lora_adapter(body["lora_name"], body["lora_path"])
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def unload_lora(request: web.Request) -> web.Response:
    if not request.app[OPTS].allow_model_management:
        raise ModelManagementDisabledError()
    body = _fields(await json_body(request), {"lora_name": str, "lora_int_id": int}, "lora_name")
    await ready_engine(request).unload_lora_adapter(body["lora_name"])
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


async def list_lora(request: web.Request) -> web.Response:
    """The served adapters (llama.cpp's list has a global `scale` too; here a request's adapter is at
    1 when its `model` names it, else at the scale its `lora` gives, so there is none)."""
    models = ready_engine(request).models.values()
    return web.json_response([{"id": i, "name": n, "path": p, "model": lm.model_id}
                              for lm in models for i, (n, p) in enumerate(getattr(lm, "lora_adapters", {}).items())])
