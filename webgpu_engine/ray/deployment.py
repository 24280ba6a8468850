"""The Ray Serve replica: one engine on its node's WebGPU device, answering the HTTP front's engine
calls (proxy.py). Results and errors cross Ray as plain dicts: a typed engine error keeps its
status, type, param, code and Retry-After, so the front answers exactly as the single-process
server would.

Every answer names the replica (`replica`), which the front sends as `x-webgpu-engine-replica`.
Ray's health check calls check_health(): a lost device that the engine did not recover marks the
replica unhealthy and Ray replaces it.
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import WebGPUEngineError
from ..protocol.objects import to_dict
from .host import EngineSpec, engine_loop, open_engine

METHODS = ("chat", "completions", "embeddings", "rerank", "tokenize", "detokenize")


def error_info(e: BaseException) -> dict:
    """A raised error as data the front turns back into the same HTTP answer (proxy.remote_error)."""
    from ..server.common import CLIENT_FAULTS, error_code
    if isinstance(e, WebGPUEngineError):
        return {"status": e.http_status, "message": e.message, "type": e.error_type, "param": e.param,
                "code": error_code(e), "retry_after": e.retry_after}
    if isinstance(e, CLIENT_FAULTS):
        return {"client_fault": type(e).__name__}
    raise e


class EngineReplica:
    """Deployed with serve.deployment(...) by launch.py; `spec` names the models to load."""

    def __init__(self, spec: EngineSpec):
        from ray import serve
        self.name = serve.get_replica_context().replica_id.unique_id
        self.loop = engine_loop()
        self.engine = self.loop.run(open_engine(spec))

    def _target(self, method: str):
        e = self.engine
        return {"chat": e.chat.completions.create, "completions": e.completions.create,
                "embeddings": e.embeddings.create, "rerank": e.rerank, "tokenize": e.tokenize,
                "detokenize": e.detokenize}[method]

    async def call(self, method: str, body: dict, affinity: str | None = None) -> dict:
        """One engine call; `affinity` is read by the router (router.py), not here."""
        try:
            res = await self.loop.call(self._target(method)(body))
        except Exception as e:  # noqa: BLE001 - error_info re-raises what is not the client's
            return {"replica": self.name, "error": error_info(e)}
        return {"replica": self.name, "result": to_dict(res)}

    async def stream(self, method: str, body: dict, affinity: str | None = None):
        """A streamed chat completion or completion: first {replica} (or {replica, error} when the
        request is refused), then {chunk} items, then {usage}; an error mid-stream as {error}."""
        try:
            s = await self.loop.call(self._target(method)(body))
        except Exception as e:  # noqa: BLE001
            yield {"replica": self.name, "error": error_info(e)}
            return
        yield {"replica": self.name}

        async def nxt():
            try:
                return True, await s.__anext__()
            except StopAsyncIteration:
                return False, None
        try:
            while True:
                try:
                    more, chunk = await self.loop.call(nxt())
                except Exception as e:  # noqa: BLE001
                    yield {"error": error_info(e)}
                    return
                if not more:
                    break
                yield {"chunk": to_dict(chunk)}
            yield {"usage": s.usage}
        finally:
            # also when the front cancels (the client went away): stop decoding, free the lock
            await self.loop.call(s.aclose())

    def describe(self) -> dict[str, Any]:
        """The loaded models ({id: model object fields}), this replica's name and process id."""
        models = {m: lm.describe(self.engine.device) for m, lm in self.engine.models.items()}
        return {"replica": self.name, "pid": os.getpid(), "models": models}

    def check_health(self) -> None:
        """Ray Serve's health check: a device lost and not recovered is a dead replica."""
        e = self.engine
        if e.state == "device_lost" and not e.config.auto_recover:
            raise RuntimeError(f"the WebGPU device was lost: {e.device_lost_reason}")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            try:
                loop.run(self.engine.unload())
            finally:
                loop.stop()
