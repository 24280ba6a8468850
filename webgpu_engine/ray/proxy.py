"""The engine the HTTP front hands to the server's aiohttp app (server/app.py) instead of a local
AsyncMLCEngine: each engine call goes to a replica of the Ray Serve deployment through its
DeploymentHandle, so routes, validation, errors, SSE streaming and the API key stay the app's own.

The replica is chosen by the deployment's router (router.py) from the affinity key sent with the
call: a hash of the start of the prompt as the chat template lays it out (roles and contents in
order), PREFIX_CHARS characters, about four KV blocks. A call whose replica died before answering
(nothing streamed yet) is sent once more, which Ray routes to a live replica; a second failure, or
a failure after the first streamed chunk, is a typed 503.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
from typing import Any, Callable

from ..engine.records import EngineConfig
from ..engine.requests import request_fields
from ..errors import WebGPUEngineError
from ..protocol.objects import to_object
from ..server.common import UnavailableError

log = logging.getLogger("webgpu_engine.ray")

PREFIX_CHARS = 256      # ~64 tokens: the first four 16-token KV blocks of a typical English prompt
REPLICA_HEADER = "x-webgpu-engine-replica"

# The replica that answered the request being handled (read and cleared when its response is
# prepared: launch.add_replica_header).
answered_by: contextvars.ContextVar[str | None] = contextvars.ContextVar("answered_by", default=None)


def affinity(method: str, body: dict) -> str | None:
    """The routing key of a chat or completion request: a hash of its model and prompt start;
    None for the others (any replica serves them as well)."""
    if method == "chat":
        parts = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                c = m.get("content")
                parts.append(f"<{m.get('role')}>{c if isinstance(c, str) else json.dumps(c, sort_keys=True)}")
        text = "\n".join(parts)
    elif method == "completions":
        p = body.get("prompt")
        text = p if isinstance(p, str) else json.dumps(p)
    else:
        return None
    head = f"{body.get('model')}\n{text[:PREFIX_CHARS]}"
    return hashlib.blake2b(head.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


class RemoteEngineError(WebGPUEngineError):
    """An engine error raised on a replica, with the status, type, param, code and Retry-After it
    had there (the server answers it as it would have answered the original)."""

    def __init__(self, info: dict):
        super().__init__(info["message"], param=info.get("param"))
        self.http_status, self.error_type = info["status"], info["type"]
        self.json_code, self.retry_after = info.get("code"), info.get("retry_after")


def remote_error(info: dict) -> Exception:
    if "client_fault" in info:
        # the replica met request data past validation: the server's 400 for CLIENT_FAULTS
        return ValueError(f"request data failed on the replica ({info['client_fault']})")
    return RemoteEngineError(info)


def _replica_failures() -> tuple[type[BaseException], ...]:
    """Errors that mean the replica (not the request) failed: its process died or is unreachable."""
    import ray.exceptions as rex
    return (rex.RayActorError, rex.ActorUnavailableError, rex.ObjectLostError)


def _unavailable(e: BaseException) -> UnavailableError:
    return UnavailableError(f"The replica serving this request failed ({type(e).__name__}); retry the "
                            f"request: Ray is replacing it.", retry_after=1)


class RemoteModel:
    """What the app reads of a loaded model (id, type, describe()), from a replica's description."""

    def __init__(self, model_id: str, info: dict):
        self.model_id, self.model_type, self._info = model_id, info.get("model_type"), info

    def describe(self, device=None) -> dict:
        return dict(self._info)


class RemoteStream:
    """The app's view of a streamed completion: async iteration of chunk dicts, `usage` when it
    ends, aclose() cancels the replica's generation."""

    def __init__(self, gen, model_id: str | None):
        self._gen, self._done = gen, False
        self._lm = RemoteModel(model_id or "", {})
        self.usage: dict | None = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except _replica_failures() as e:
            self._done = True
            raise _unavailable(e) from None
        if "chunk" in item:
            return item["chunk"]
        self._done = True
        if "error" in item:
            raise remote_error(item["error"])
        self.usage = item.get("usage")
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._gen.cancel()


class _Endpoint:
    def __init__(self, proxy: "RayEngineProxy", method: str):
        self.proxy, self.method = proxy, method

    async def create(self, request: Any = None, **fields):
        return await self.proxy.request(self.method, request_fields(request, fields))


class _Chat:
    def __init__(self, proxy: "RayEngineProxy"):
        self.completions = _Endpoint(proxy, "chat")


class _NoResponses:
    """The Responses API keeps conversations in an engine's store, which replicas do not share."""

    async def _refuse(self, *a, **k):
        from ..errors import FeatureSupportError
        raise FeatureSupportError("responses", "The Responses API (/v1/responses) is not served by Ray "
                                  "replicas (stored responses are per engine); use /v1/chat/completions.")

    create = retrieve = delete = input_items = _refuse


class RayEngineProxy:
    """Engine-like object over a Ray Serve deployment. `deploy()` (blocking) deploys the replicas and
    returns the DeploymentHandle, `undeploy()` removes them; reload() / unload() run them off the loop."""

    def __init__(self, deploy: Callable[[], Any], undeploy: Callable[[], None],
                 config: EngineConfig | None = None):
        self._deploy, self._undeploy = deploy, undeploy
        self.config = config or EngineConfig()
        self.device = None
        self.state = "idle"
        self.models: dict[str, RemoteModel] = {}
        self.handle = None
        self.chat = _Chat(self)
        self.completions = _Endpoint(self, "completions")
        self.embeddings = _Endpoint(self, "embeddings")
        self.responses = _NoResponses()

    # ------------------------------------------------------------------ lifecycle
    async def reload(self, model_id=None, chat_opts=None) -> None:
        """Deploy the replicas (the models are the deployment's); ready when they all loaded."""
        self.state = "loading"
        try:
            self.handle = await asyncio.to_thread(self._deploy)
            info = await self.handle.describe.remote()
        except BaseException:
            self.state = "idle"
            raise
        self.models = {m: RemoteModel(m, d) for m, d in info["models"].items()}
        self.state = "ready"

    async def unload(self) -> None:
        self.models, self.state = {}, "idle"
        if self.handle is not None:
            self.handle = None
            await asyncio.to_thread(self._undeploy)

    async def close(self) -> None:
        """The server's shutdown (AsyncMLCEngine.close): the replicas hold the devices."""
        await self.unload()

    def queue_lengths(self) -> dict[str, int]:
        return {}       # the replicas' queues are theirs (Ray Serve's metrics report them)

    # ------------------------------------------------------------------ calls
    async def rerank(self, request: Any = None, **fields):
        return await self.request("rerank", request_fields(request, fields))

    async def tokenize(self, request: Any = None, **fields) -> dict:
        return await self.request("tokenize", request_fields(request, fields))

    async def detokenize(self, request: Any = None, **fields) -> dict:
        return await self.request("detokenize", request_fields(request, fields))

    async def request(self, method: str, body: dict):
        """One engine call on a replica: the result as the local engine returns it (a response
        object, a dict, or a RemoteStream when the body asks to stream)."""
        if self.handle is None:
            raise UnavailableError("The replicas are not deployed (starting or shutting down); retry shortly.",
                                   retry_after=5)
        key = affinity(method, body)
        stream = bool(body.get("stream")) and method in ("chat", "completions")
        failures = _replica_failures()
        for attempt in (1, 2):
            try:
                if stream:
                    gen = self.handle.options(stream=True).stream.remote(method, body, affinity=key)
                    first = await gen.__anext__()
                else:
                    first = await self.handle.call.remote(method, body, affinity=key)
                break
            except failures as e:
                if attempt == 2:
                    raise _unavailable(e) from None
                log.warning("replica failed before answering (%s); sending the request again", type(e).__name__)
        answered_by.set(first["replica"])
        if "error" in first:
            raise remote_error(first["error"])
        if stream:
            return RemoteStream(gen, body.get("model") or next(iter(self.models), None))
        res = first["result"]
        return to_object(res) if method in ("chat", "completions", "embeddings") else res
