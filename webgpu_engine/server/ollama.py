"""Ollama's HTTP API beside the OpenAI routes, so Ollama clients (the `ollama` package, LangChain's
ChatOllama / OllamaEmbeddings, LlamaIndex, Open WebUI) talk to this server.

POST /api/chat, /api/generate (NDJSON streaming, `stream` true by default), /api/embed, /api/embeddings,
/api/show, /api/pull; GET /api/tags, /api/ps, /api/version; DELETE /api/delete. Requests go through
the engine's chat, completion and embedding paths (protocol/ollama.py translates them), so limits,
queueing, the API key and the error rules are the OpenAI routes'. Errors are Ollama's `{"error": msg}`
with the same 4xx/5xx status (a middleware rewrites the OpenAI error JSON of every /api/ path).
/api/tags and /api/ps list the loaded models (this server serves what it loaded, not the whole
store; `expires_at` is when keep_alive unloads the model, far in the future while none will). Model
management (`--allow-model-management`) lets `keep_alive` unload a model (0: after the request; a
duration such as "5m": once idle that long; negative: never), /api/delete unload one (the store's
files are never deleted) and /api/pull download a Hugging Face GGUF (`hf.co/ORG/REPO:QUANT`);
otherwise keep_alive is checked and ignored (models stay loaded). `think` (true, false or Ollama's
levels) switches a template's thinking, answered as `thinking`; `logprobs` / `top_logprobs` answer
with Ollama's `logprobs` entries; /api/embed takes `dimensions`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from aiohttp import web

from .. import __version__
from ..config import SAMPLING_FIELDS
from ..engine.manage import unload_model
from ..engine.records import EMBEDDING, LLM
from ..errors import ModelNotFoundError, WebGPUEngineError
from ..protocol import ollama as proto
from ..protocol.errors import FieldTypeError, UnsupportedFieldsError
from ..protocol.objects import to_dict
from .admin import ModelManagementDisabledError
from .common import (
    CLIENT_FAULTS,
    ENGINE,
    METRICS,
    OPTS,
    STATE,
    allowed_origin,
    error_rewriter,
    json_body,
    ready_engine,
)

log = logging.getLogger("webgpu_engine.server")
NDJSON = "application/x-ndjson"
FAR_FUTURE = "2318-01-01T00:00:00Z"      # expires_at of a model kept loaded (Ollama's keep_alive -1)


def add_routes(app: web.Application) -> None:
    # outermost: sees every /api/ answer, CORS headers kept
    app.middlewares.insert(0, error_rewriter("/api/", lambda status, message: {"error": message}))
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_post("/api/embed", embed)
    app.router.add_post("/api/embeddings", embeddings)
    app.router.add_post("/api/show", show)
    app.router.add_post("/api/pull", pull)
    app.router.add_delete("/api/delete", delete)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", version)


# --------------------------------------------------------------------------- helpers
class OllamaModelNotFoundError(ModelNotFoundError):
    def __init__(self, model: str, loaded: list[str]):
        super().__init__(f"model {model!r} not found; this server serves {loaded} (load others with "
                         f"`serve --model ollama:NAME:TAG`).", param="model")


def _model(request: web.Request, body: dict, kind: str | None):
    """The loaded model a body names (`model`, or the older `name`); NAME alone also finds NAME:latest.
    `keep_alive` is checked here too, before any work, and the model's idle timer stops (it is in use)."""
    engine = ready_engine(request)
    proto.keep_alive_seconds(body.get("keep_alive"))
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise FieldTypeError("model", "a model name", name)
    lm = engine.models.get(name) or (engine.models.get(name + ":latest") if ":" not in name else None) \
        or engine.lora.lora_base(name)           # a LoRA adapter's name: its base, with the adapter
    if lm is None:
        raise OllamaModelNotFoundError(name, list(engine.models))
    if kind is not None and lm.model_type != kind:
        what = "an embedding model: use /api/embed" if lm.model_type == EMBEDDING else "a chat model"
        raise UnsupportedFieldsError("model", f"{lm.model_id} is {what}.")
    timer = _timers(request).pop(lm.model_id, None)
    if timer is not None:
        timer[1].cancel()
    return engine, lm


def _served(req: dict, lm) -> str:
    """The `model` a chat request over `lm` runs as: a LoRA adapter's name as given, else the base's id."""
    return req["model"] if req["model"] in lm.lora_adapters else lm.model_id


def _context(lm) -> int:
    return int(lm.describe()["context_window"])


def _timers(request: web.Request) -> dict:
    """model id -> (the epoch second it unloads at, its idle timer): keep_alive's pending unloads."""
    return request.app[STATE].setdefault("keep_alive", {})


async def _after(request: web.Request, body: dict, lm) -> str | None:
    """keep_alive where model management is on: 0 unloads the model now ("unload"), a duration once
    it has been idle that long (a request for it meanwhile starts the wait again), a negative one
    keeps it loaded. Without management keep_alive is checked and has no effect."""
    keep = proto.keep_alive_seconds(body.get("keep_alive"))
    if keep is None or not request.app[OPTS].allow_model_management:
        return None
    engine, timers = request.app[ENGINE], _timers(request)
    old = timers.pop(lm.model_id, None)
    if old is not None:
        old[1].cancel()
    if keep == 0:
        await unload_model(engine, lm.model_id)
        return "unload"
    if keep > 0:
        loop, epoch = asyncio.get_running_loop(), lm.epoch

        def arm(delay: float):
            timers[lm.model_id] = (time.time() + delay, loop.call_later(delay, expire))

        def expire():
            now = engine.models.get(lm.model_id)
            if now is None or now.epoch != epoch:          # unloaded or reloaded meanwhile
                timers.pop(lm.model_id, None)
            elif now.lock.locked or now.lock.queue_length:
                arm(1.0)                                   # in use through another route: wait
            else:
                timers.pop(lm.model_id, None)
                asyncio.ensure_future(_unload_quietly(engine, lm.model_id))
        arm(keep)
    return None


async def _unload_quietly(engine, model_id: str) -> None:
    try:
        await unload_model(engine, model_id)
        log.info("unloaded %s: idle past its keep_alive", model_id)
    except WebGPUEngineError:          # unloaded meanwhile
        pass


def _head(lm) -> dict:
    return {"model": lm.model_id, "created_at": proto.now()}


async def _ndjson(request: web.Request, lines, close) -> web.StreamResponse:
    """Stream the dicts of `lines` as NDJSON; an error after the headers goes in-band as {"error"}."""
    resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
    allow = allowed_origin(request.app[OPTS].cors_origins, request.headers.get("Origin"))
    if allow:
        resp.headers["Access-Control-Allow-Origin"] = allow
    await resp.prepare(request)
    try:
        async for obj in lines:
            await resp.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    except (ConnectionResetError, asyncio.CancelledError):
        await close()
        raise
    except WebGPUEngineError as e:
        await resp.write(json.dumps({"error": e.message}).encode() + b"\n")
    except CLIENT_FAULTS as e:
        log.warning("request data failed past validation in a stream (%s)", type(e).__name__, exc_info=True)
        await resp.write(json.dumps({"error": f"The request could not be processed ({type(e).__name__})."})
                         .encode() + b"\n")
    except Exception:  # noqa: BLE001
        log.exception("stream failed")
        await resp.write(b'{"error":"Internal server error; see the server log."}\n')
    finally:
        await close()
    await resp.write_eof()
    return resp


# --------------------------------------------------------------------------- chat and generate
async def chat(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    engine, lm = _model(request, body, LLM)
    req = proto.chat_request(body, _context(lm))
    req["model"] = _served(req, lm)
    if not req["messages"]:                   # Ollama's idiom: load (or unload) the model, answer nothing
        return await _load_answer(request, body, lm, {"message": {"role": "assistant", "content": ""}})
    return await _run(request, body, lm, engine.chat.completions, req, chat=True)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    engine, lm = _model(request, body, LLM)
    if not body.get("prompt") and not body.get("images"):
        proto.generate_request({**body, "prompt": ""}, _context(lm))      # the other fields still checked
        return await _load_answer(request, body, lm, {"response": ""})
    req, is_chat = proto.generate_request(body, _context(lm))
    req["model"] = _served(req, lm)
    return await _run(request, body, lm, engine.chat.completions if is_chat else engine.completions, req,
                      chat=False)


async def _load_answer(request, body, lm, empty: dict) -> web.Response:
    reason = await _after(request, body, lm) or "load"
    return web.json_response({**_head(lm), **empty, "done": True, "done_reason": reason})


def _piece(lm, chat: bool, text: str, calls: list | None = None, thinking: str | None = None,
           logprobs: list | None = None) -> dict:
    if chat:
        msg = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = calls
        out = {**_head(lm), "message": msg}
    else:
        out = {**_head(lm), "response": text}
        if thinking:
            out["thinking"] = thinking
    if logprobs:
        out["logprobs"] = logprobs
    return out


async def _run(request, body, lm, endpoint, req: dict, chat: bool) -> web.StreamResponse:
    t0 = time.perf_counter()
    metrics = request.app[METRICS]
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise FieldTypeError("stream", "true or false", stream)
    if not stream:
        res = to_dict(await endpoint.create(req))
        ch = res["choices"][0]
        msg = ch.get("message") or {}
        text = msg.get("content") if "message" in ch else ch["text"]
        calls = proto.tool_calls(msg.get("tool_calls"))
        metrics.observe_usage(res["model"], res.get("usage"))
        out = {**_piece(lm, chat, text or "", calls, msg.get("reasoning_content"), proto.logprobs(ch)),
               "done": True,
               "done_reason": proto.DONE_REASONS.get(ch["finish_reason"], ch["finish_reason"]),
               **proto.durations(res.get("usage"), time.perf_counter() - t0)}
        await _after(request, body, lm)
        return web.json_response(out)
    s = await endpoint.create({**req, "stream": True})

    async def lines():
        calls: dict[int, dict] = {}          # streamed OpenAI tool-call deltas, gathered per index
        async for c in s:
            d = to_dict(c)
            if not d["choices"]:
                continue
            ch = d["choices"][0]
            delta = ch.get("delta") or {}           # a chat chunk (also /api/generate's templated path)
            text = delta.get("content") if "delta" in ch else ch.get("text")
            for tc in delta.get("tool_calls") or []:
                got = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                f = tc.get("function") or {}
                got["name"] += f.get("name") or ""
                got["arguments"] += f.get("arguments") or ""
            thinking, lps = delta.get("reasoning_content"), proto.logprobs(ch)
            if text or thinking or lps:
                yield {**_piece(lm, chat, text or "", None, thinking, lps), "done": False}
        if calls:
            yield {**_piece(lm, chat, "", proto.tool_calls([{"function": calls[i]} for i in sorted(calls)])),
                   "done": False}
        metrics.observe_usage(lm.model_id, s.usage)
        await s.aclose()
        done = {**_piece(lm, chat, ""), "done": True,
                "done_reason": proto.DONE_REASONS.get(s.finish_reason, s.finish_reason),
                **proto.durations(s.usage, time.perf_counter() - t0)}
        await _after(request, body, lm)
        yield done
    return await _ndjson(request, lines(), s.aclose)


# --------------------------------------------------------------------------- embeddings
def _embed_fields(body: dict, allowed: set, route: str) -> None:
    proto.check_fields(body, allowed, route)
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise FieldTypeError("options", "an object", opts)
    odd = sorted(k for k in opts if k not in proto.HARDWARE_OPTIONS)
    if odd:
        raise UnsupportedFieldsError(f"options.{odd[0]}", f"{odd} do not apply to embeddings.")


async def embed(request: web.Request) -> web.Response:
    body = await json_body(request)
    _embed_fields(body, {"model", "input", "truncate", "options", "keep_alive", "dimensions"}, "/api/embed")
    engine, lm = _model(request, body, EMBEDDING)
    inp = body.get("input")
    if not (isinstance(inp, str) or (isinstance(inp, list) and all(isinstance(x, str) for x in inp))):
        raise FieldTypeError("input", "a string or a list of strings", inp)
    if body.get("truncate") is False:
        raise UnsupportedFieldsError("truncate", "inputs longer than the model's window are always "
                                     "truncated here; omit truncate or send true.")
    t0 = time.perf_counter()
    req = {"model": lm.model_id, "input": inp}
    if body.get("dimensions") is not None:
        req["dimensions"] = body["dimensions"]
    res = to_dict(await engine.embeddings.create(req))
    request.app[METRICS].prompt_tokens.inc(res["usage"]["prompt_tokens"], model=res["model"])
    await _after(request, body, lm)
    return web.json_response({"model": lm.model_id, "embeddings": [d["embedding"] for d in res["data"]],
                              "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                              "prompt_eval_count": res["usage"]["prompt_tokens"]})


async def embeddings(request: web.Request) -> web.Response:
    """The older route: one `prompt`, one `embedding`."""
    body = await json_body(request)
    _embed_fields(body, {"model", "prompt", "options", "keep_alive"}, "/api/embeddings")
    engine, lm = _model(request, body, EMBEDDING)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise FieldTypeError("prompt", "a string", prompt)
    if not prompt:                             # Ollama answers an empty prompt with an empty vector
        return web.json_response({"embedding": []})
    res = to_dict(await engine.embeddings.create({"model": lm.model_id, "input": prompt}))
    request.app[METRICS].prompt_tokens.inc(res["usage"]["prompt_tokens"], model=res["model"])
    await _after(request, body, lm)
    return web.json_response({"embedding": res["data"][0]["embedding"]})


# --------------------------------------------------------------------------- models
async def _facts(request: web.Request, lm) -> dict:
    """What /api/tags, /api/ps and /api/show say about a loaded model (read once per load, in a worker
    thread: it parses the GGUF's header)."""
    cache = request.app[STATE].setdefault("ollama_facts", {})
    key = (lm.model_id, lm.record.model, lm.epoch)
    if key not in cache:
        cache[key] = await asyncio.to_thread(_read_facts, lm)
    return cache[key]


def _read_facts(lm) -> dict:
    path = Path(lm.record.model).expanduser()
    ref = lm.record.reference or ""
    facts = {"digest": "", "template": "", "size": 0, "modified_at": proto.now(), "arch": None,
             "details": {"parent_model": "", "format": "gguf" if path.is_file() else "safetensors",
                         "family": "", "families": None, "parameter_size": "", "quantization_level": ""}}
    try:
        st = path.stat()
        facts["modified_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime))
        facts["size"] = st.st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*.safetensors"))
    except OSError:
        pass
    if path.is_file():
        from ..loaders.gguf import GGUFFile
        with GGUFFile(path) as g:
            facts["arch"] = g.architecture
            facts["template"] = g.chat_template or ""
    elif (path / "config.json").is_file():
        try:
            facts["arch"] = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError):
            pass
    facts["details"]["family"] = facts["arch"] or ""
    facts["details"]["families"] = [facts["arch"]] if facts["arch"] else None
    if ref.startswith("ollama:"):
        from ..engine.ollama_store import open_store_model
        try:
            m = open_store_model(ref)
            facts["digest"] = m.manifest_digest
            facts["details"].update(family=m.config.get("model_family") or facts["arch"] or "",
                                    parameter_size=m.config.get("model_type") or "",
                                    quantization_level=m.config.get("file_type") or "")
            facts["template"] = facts["template"] or (m.template or "")
        except WebGPUEngineError:       # the store changed since the load: show what the file says
            pass
    return facts


async def _entry(request, lm) -> dict:
    f = await _facts(request, lm)
    return {"name": lm.model_id, "model": lm.model_id, "modified_at": f["modified_at"], "size": f["size"],
            "digest": f["digest"], "details": f["details"]}


async def tags(request: web.Request) -> web.Response:
    models = request.app[ENGINE].models.values()
    return web.json_response({"models": [await _entry(request, lm) for lm in models]})


async def ps(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    out = []
    for lm in engine.models.values():
        d = lm.describe(engine.device)
        mem = d["memory"]
        vram = mem.get("allocated_bytes") or 0
        timer = _timers(request).get(lm.model_id)
        expires = FAR_FUTURE if timer is None else \
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timer[0]))
        out.append({**await _entry(request, lm), "size": mem.get("estimated_bytes") or vram, "size_vram": vram,
                    "expires_at": expires, "context_length": d["context_window"]})
    return web.json_response({"models": out})


async def show(request: web.Request) -> web.Response:
    body = await json_body(request)
    _, lm = _model(request, body, None)
    f = await _facts(request, lm)
    cc = lm.chat_config
    params = [f"stop {json.dumps(s)}" for s in cc.stop_str]
    if lm.model_type == LLM:              # the model's sampling defaults, as Ollama names them
        params += [f"{f.ollama} {getattr(cc, f.chat_config):g}" for f in SAMPLING_FIELDS
                   if f.ollama and f.chat_config and f.name != "stop"]
    ref = lm.record.reference or lm.record.model
    modelfile = f"# Modelfile of {lm.model_id}\nFROM {ref}\n" + "".join(f"PARAMETER {p}\n" for p in params)
    if cc.system_message:
        modelfile += f'SYSTEM """{cc.system_message}"""\n'
    info = {"general.architecture": f["arch"] or ""}
    if f["arch"]:
        info[f"{f['arch']}.context_length"] = _context(lm)
    caps = ["embedding"] if lm.model_type == EMBEDDING else ["completion"] + (["tools"] if f["template"] and
                                                                              "tools" in f["template"] else [])
    vision = getattr(lm.pipeline, "vision", None)
    if vision is not None:                                 # images are taken (Ollama's "vision")
        caps.append("vision")
    out = {"modelfile": modelfile, "parameters": "\n".join(params), "template": f["template"],
           "details": f["details"], "model_info": info, "capabilities": caps, "modified_at": f["modified_at"]}
    if cc.system_message:
        out["system"] = cc.system_message
    return web.json_response(out)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def pull(request: web.Request) -> web.StreamResponse:
    """An Ollama name already in the local store is checked (digests) and reported present; a Hugging
    Face GGUF (`hf.co/ORG/REPO:QUANT`) is downloaded where model management is on. Ollama's registry
    itself is never contacted."""
    body = await json_body(request)
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise FieldTypeError("model", "a model name", name)
    from ..engine.ollama_store import PREFIX, open_store_model, store_root
    from ..engine.references import resolve_model_reference
    if name.lower().startswith(("hf.co/", "huggingface.co/")):
        if not request.app[OPTS].allow_model_management:
            raise ModelManagementDisabledError()
        ref = name
    else:
        ref = name if name.lower().startswith(PREFIX) else PREFIX + name
        try:
            open_store_model(ref)
        except ModelNotFoundError:
            raise OllamaPullError(name, store_root()) from None
    await asyncio.to_thread(resolve_model_reference, ref)
    if body.get("stream", True):
        async def lines():
            yield {"status": "pulling manifest"}
            yield {"status": "verifying sha256 digest"}
            yield {"status": "success"}

        async def nothing():
            return None
        return await _ndjson(request, lines(), nothing)
    return web.json_response({"status": "success"})


class OllamaPullError(ModelNotFoundError):
    def __init__(self, name: str, root: Path):
        super().__init__(f"pull model {name!r}: this server does not download from Ollama's registry and "
                         f"the Ollama store ({os.fspath(root)}) does not hold it. Run `ollama pull {name}`, "
                         f"or pull a Hugging Face GGUF as hf.co/ORG/REPO:QUANT.", param="model")


async def delete(request: web.Request) -> web.Response:
    """Unloads the model where model management is on; the files of the store are kept."""
    if not request.app[OPTS].allow_model_management:
        raise ModelManagementDisabledError()
    body = await json_body(request)
    _, lm = _model(request, body, None)
    await unload_model(request.app[ENGINE], lm.model_id)
    return web.json_response({})
