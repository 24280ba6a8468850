"""The entry point the demo page calls: load models through the Cache API, chat (streamed), embed, search.

Runs inside Pyodide; standard library plus the project only (no numpy, pydantic or tokenizers).
Model files come from the page's own origin (`<base>/models/<model id>/<file>`), are kept in Cache
Storage (scope "model") so a reload of the page fetches nothing, and are staged into Pyodide's
in-memory file system, where the ordinary engine (`AsyncMLCEngine`) loads them as local records.
Values cross to JavaScript as JSON strings, so the page holds no Python proxies.

    app = pyodide.pyimport("webgpu_engine.browser.app")
    await app.start(location.href, progress)              // progress(fraction, text)
    const d = JSON.parse(app.default_models())            // {chat, embed}: catalogue.py's defaults
    await app.load(JSON.stringify([d.chat, d.embed]))
    await app.chat(JSON.stringify(messages), onDelta)    // onDelta(text) per streamed piece
    await app.load_url("https://huggingface.co/mlc-ai/<id>/resolve/main/")   // an MLC folder (WebLLM's)
    await app.load_folder(url, JSON.stringify(["config.json", ...]), id)     // a Hugging Face folder
    await app.load(JSON.stringify([d.chat]), "null", JSON.stringify({pirate: "<url>/pirate.gguf",
                   sql: {url: "<url>/sql-lora/"}}))     // LoRA adapters over the chat model (load_url,
                                                        // load_folder: the same last argument)

Images go in chat messages as OpenAI image_url parts whose URL holds the picture's pixels,
`data:image/x-rgba;width=W;height=H;base64,...` (the page decodes pictures in JavaScript: Python here
has no Pillow; vision/pure.py preprocesses them as Pillow and numpy do natively).
"""
from __future__ import annotations

import json
import math
import os
import time

from ..cache.defaults import model_artifacts
from ..catalogue import BUILTIN_MODELS, DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL
from ..engine.engine import AsyncMLCEngine
from ..engine.records import EMBEDDING, LLM, AppConfig, EngineConfig, ModelRecord
from ..errors import ArtifactFetchError, InvalidRequestError
from .artifact_cache import BrowserArtifactCache, stage_files

STAGE_ROOT = "/models"
_TYPES = {m.model_id: EMBEDDING if m.model_type == "embedding" else LLM for m in BUILTIN_MODELS}

_state: dict = {"engine": None, "base": "", "progress": None, "loaded": {}, "fetch_stats": {}}


def _progress(frac: float, text: str) -> None:
    cb = _state["progress"]
    if cb is not None:
        cb(float(frac), str(text))


def default_models() -> str:
    """The default chat model and embedder (catalogue.py), as JSON {"chat": id, "embed": id}."""
    return json.dumps({"chat": DEFAULT_CHAT_MODEL, "embed": DEFAULT_EMBED_MODEL})


async def start(base_url: str, progress=None) -> str:
    """Create the engine on this browser's WebGPU device; returns the device description (JSON)."""
    os.environ["WEBGPU_ENGINE_OFFLINE"] = "1"    # the page never lets Python reach the network itself
    _state["base"] = base_url.rsplit("/", 1)[0] + "/"
    _state["progress"] = progress
    engine = AsyncMLCEngine(EngineConfig(app_config=AppConfig([]),
                                         init_progress_callback=lambda r: _progress(r["progress"], r["text"])))
    dev = await engine.get_device()
    _state["engine"] = engine
    return json.dumps(dev.describe())


async def load(model_ids_json: str, chat_opts_json: str = "null", lora_json: str = "null") -> str:
    """Fetch (or find in Cache Storage) the files of each model, stage them, and load them all, with
    the LoRA adapters of `lora_json` over the chat model (_adapters)."""
    engine = _state["engine"]
    ids = json.loads(model_ids_json)
    opts = json.loads(chat_opts_json)
    cache = BrowserArtifactCache("model")
    records, stats = [], {}
    for k, mid in enumerate(ids):
        arts = [a for a in (model_artifacts(mid) or []) if a.scope == "model"]
        if not arts:
            raise ValueError(f"No file list known for model {mid!r}")
        urls = [f"{_state['base']}models/{mid}/{a.filename}" for a in arts]

        def prog(frac, text, k=k):
            _progress(0.5 * (k + frac) / len(ids), text)
        arrays, st = await cache.fetch_all(urls, prog)
        stage_files(f"{STAGE_ROOT}/{mid}", {a.filename: arr for a, arr in zip(arts, arrays)})
        stats[mid] = st.__dict__
        single = len(arts) == 1
        # A local record is used in place: the .gguf itself for one-file models, else the folder.
        where = f"{STAGE_ROOT}/{mid}" + (f"/{arts[0].filename}" if single else "")
        records.append(ModelRecord(model_id=mid, model=where, model_type=_TYPES.get(mid, LLM),
                                   overrides={"context_window_size": 2048} if single else {}))
    adapters = await _adapters(lora_json)
    engine.set_app_config(AppConfig(records))
    t0 = time.perf_counter()
    await engine.reload(ids, opts, lora_adapters=adapters)
    _state["loaded"] = {mid: _TYPES.get(mid, LLM) for mid in ids}
    _state["fetch_stats"] = stats
    return json.dumps({"fetch": stats, "load_seconds": time.perf_counter() - t0})


WEBLLM_MODEL_CACHE = "webllm/model"      # WebLLM's Cache Storage bucket of model files, keyed by URL


async def load_url(url: str, model_id: str = "", chat_opts_json: str = "null", lora_json: str = "null") -> str:
    """Load an MLC model folder as WebLLM publishes them (mlc-chat-config.json, tensor-cache.json or
    ndarray-cache.json with its shards, the tokenizer files) from `url` (any URL the page may fetch,
    e.g. a Hugging Face `resolve/main/` folder). Files already in WebLLM's own Cache Storage for the
    same URLs are read from there; others are fetched and kept in ours. Replaces the loaded models."""
    base = url.rstrip("/") + "/"
    # the id: given, else the repository's name of a hub URL (.../<repo>/resolve/<rev>/), else the folder's
    mid = model_id or (base.split("/resolve/")[0] if "/resolve/" in base else base.rstrip("/")).rsplit("/", 1)[-1]
    cache = BrowserArtifactCache("model", also=(WEBLLM_MODEL_CACHE,))
    [cfg_raw], st = await cache.fetch_all([base + "mlc-chat-config.json"])
    cfg = json.loads(bytes(cfg_raw.to_py()).decode())
    index_name, index = None, None
    for name in ("tensor-cache.json", "ndarray-cache.json"):
        try:
            [raw], st2 = await cache.fetch_all([base + name])
        except ArtifactFetchError:        # try the older name
            continue
        index_name, index = name, json.loads(bytes(raw.to_py()).decode())
        break
    if index is None:
        raise ArtifactFetchError(f"{base} has neither tensor-cache.json nor ndarray-cache.json: not an MLC "
                                 f"model folder")
    shards = sorted({r["dataPath"] for r in index.get("records", [])})
    names = shards + [f for f in cfg.get("tokenizer_files", []) if f not in shards]
    arrays, st3 = await cache.fetch_all([base + n for n in names],
                                        lambda frac, text: _progress(0.5 * frac, text))
    files = {"mlc-chat-config.json": cfg_raw, index_name: raw, **dict(zip(names, arrays))}
    stats = {k: getattr(st, k) + getattr(st2, k) + getattr(st3, k)
             for k in ("cached_files", "cached_bytes", "fetched_files", "fetched_bytes")}
    return await _load_files(mid, files, stats, chat_opts_json, lora_json)


async def load_folder(url: str, files_json: str, model_id: str = "", chat_opts_json: str = "null",
                      lora_json: str = "null") -> str:
    """Load a Hugging Face model folder (config.json, *.safetensors, the tokenizer files; a vision-
    language model's processor config too) from `url`: the files named in `files_json` are fetched
    (or found in Cache Storage) and loaded as a local folder. Replaces the loaded models."""
    base = url.rstrip("/") + "/"
    names = json.loads(files_json)
    if "config.json" not in names:
        raise ArtifactFetchError(f"{base}: a model folder's files must include config.json, not {names}")
    arrays, st = await BrowserArtifactCache("model").fetch_all([base + n for n in names],
                                                               lambda frac, text: _progress(0.5 * frac, text))
    mid = model_id or base.rstrip("/").rsplit("/", 1)[-1]
    return await _load_files(mid, dict(zip(names, arrays)), dict(st.__dict__), chat_opts_json, lora_json)


async def _load_files(mid: str, files: dict, stats: dict, chat_opts_json: str, lora_json: str = "null") -> str:
    """Stage a folder's fetched files and load it as the one model (with `lora_json`'s adapters)."""
    stats = {k: stats[k] for k in ("cached_files", "cached_bytes", "fetched_files", "fetched_bytes")}
    stage_files(f"{STAGE_ROOT}/{mid}", files)
    engine = _state["engine"]
    adapters = await _adapters(lora_json)
    engine.set_app_config(AppConfig([ModelRecord(model_id=mid, model=f"{STAGE_ROOT}/{mid}", model_type=LLM)]))
    t0 = time.perf_counter()
    await engine.reload(mid, json.loads(chat_opts_json), lora_adapters=adapters)
    _state["loaded"] = {mid: LLM}
    _state["fetch_stats"] = {mid: stats}
    return json.dumps({"model_id": mid, "files": sorted(files), "fetch": {mid: stats},
                       "load_seconds": time.perf_counter() - t0})


PEFT_FILES = ["adapter_config.json", "adapter_model.safetensors"]


async def _adapters(lora_json: str) -> dict | None:
    """The LoRA adapters a page loads over its chat model (MLCEngine.reload's lora_adapters), as JSON
    {name: a GGUF LoRA file's URL, or {"url": a PEFT folder's URL, "files": its files (default
    PEFT_FILES)}}: fetched (or found in Cache Storage), staged, {name: staged path}; None for none."""
    spec = json.loads(lora_json) if lora_json else None
    if not spec:
        return None
    if not isinstance(spec, dict):
        raise InvalidRequestError("The adapters must map names to a GGUF LoRA file's URL or to "
                                  '{"url": a PEFT folder\'s URL, "files": [...]}.', param="lora_adapters")
    staged = {}
    for name, where in spec.items():
        if not name or "/" in name or name in (".", ".."):
            raise InvalidRequestError(f"An adapter's name must be a non-empty name without '/', got {name!r}.",
                                      param="lora_adapters")
        one = isinstance(where, str)
        url = where if one else where.get("url") if isinstance(where, dict) else None
        files = [url.rsplit("/", 1)[1]] if one else (where.get("files") or PEFT_FILES) if url else None
        if not isinstance(url, str) or not url or not all(isinstance(f, str) and f and "/" not in f for f in files):
            raise InvalidRequestError(f"Adapter {name!r}: give a GGUF LoRA file's URL or {{\"url\": a PEFT "
                                      f"folder's URL, \"files\": [...]}}, got {where!r}.", param="lora_adapters")
        base = url.rsplit("/", 1)[0] + "/" if one else url.rstrip("/") + "/"
        arrays, _ = await BrowserArtifactCache("model").fetch_all([base + f for f in files],
                                                                  lambda frac, text: _progress(0.5 * frac, text))
        root = f"{STAGE_ROOT}/lora/{name}"
        stage_files(root, dict(zip(files, arrays)))
        staged[name] = f"{root}/{files[0]}" if one else root
    return staged


def _model(kind: str) -> str:
    for mid, t in _state["loaded"].items():
        if t == kind:
            return mid
    raise ValueError(f"no {kind} model loaded")


async def chat(messages_json: str, on_delta=None, request_json: str = "{}") -> str:
    """Stream a chat answer; `on_delta(text)` gets each piece; `request_json`'s `model` may name a LoRA
    adapter loaded with the chat model (lora_json). Returns text, usage and speeds (JSON)."""
    engine = _state["engine"]
    req = {"temperature": 0.0, "max_tokens": 64, **json.loads(request_json)}
    t0 = time.perf_counter()
    first = None
    parts, usage, finish = [], None, None
    model = req.pop("model", None) or _model(LLM)            # a LoRA adapter's name picks it
    stream = await engine.chat.completions.create(messages=json.loads(messages_json), model=model,
                                                  stream=True, stream_options={"include_usage": True}, **req)
    n_pieces = 0
    async for chunk in stream:
        for choice in chunk.choices or []:
            delta = choice.delta.content if choice.delta else None
            if delta:
                if first is None:
                    first = time.perf_counter()
                n_pieces += 1
                parts.append(delta)
                if on_delta is not None:
                    on_delta(delta)
            if choice.finish_reason:
                finish = choice.finish_reason
        if getattr(chunk, "usage", None):
            usage = _plain(chunk.usage)
    t1 = time.perf_counter()
    extra = (usage or {}).get("extra") or {}
    completion = (usage or {}).get("completion_tokens") or n_pieces
    decode_tps = extra.get("decode_tokens_per_s")
    if decode_tps is None and first is not None and completion > 1:
        decode_tps = (completion - 1) / max(t1 - first, 1e-9)
    return json.dumps({"text": "".join(parts), "finish_reason": finish, "usage": usage,
                       "decode_tokens_per_s": decode_tps, "seconds": t1 - t0,
                       "time_to_first_token_s": None if first is None else first - t0})


async def messages(request_json: str, on_event=None) -> str:
    """Anthropic's Messages API in the page (engine.messages, the chat path): the request as JSON
    (`model` defaults to the loaded chat model). With "stream": true each event goes to
    `on_event(json)` as it comes, and the Message they assemble is returned; else the Message."""
    req = json.loads(request_json)
    req.setdefault("model", _model(LLM))
    res = await _state["engine"].messages.create(req)
    if not req.get("stream"):
        return json.dumps(_plain(res))
    msg: dict = {}
    async for ev in res:
        ev = _plain(ev)
        if on_event is not None:
            on_event(json.dumps(ev))
        kind = ev["type"]
        if kind == "message_start":
            msg = ev["message"]
        elif kind == "content_block_start":
            msg["content"].append(ev["content_block"])
        elif kind == "content_block_delta":
            block, d = msg["content"][ev["index"]], ev["delta"]
            for key, field in (("text", "text"), ("thinking", "thinking"), ("partial_json", "partial_json")):
                if key in d:
                    block[field] = block.get(field, "") + d[key]
        elif kind == "content_block_stop":
            block = msg["content"][ev["index"]]
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("partial_json", "") or "{}")
        elif kind == "message_delta":
            msg.update(ev["delta"])
            msg["usage"]["output_tokens"] = ev["usage"]["output_tokens"]
        elif kind == "error":
            raise RuntimeError(ev["error"]["message"])
    return json.dumps(msg)


async def greedy_ids(prompt_ids_json: str, n: int) -> str:
    """`n` tokens after the given prompt ids, one forward step at a time (WebLLM's
    forwardTokensAndSample), not stopping at end-of-sequence tokens. Needs a greedy chat config."""
    engine = _state["engine"]
    ids = json.loads(prompt_ids_json)
    mid = _model(LLM)
    t0 = time.perf_counter()
    out = [await engine.forward_tokens_and_sample(ids, True, model=mid)]
    t1 = time.perf_counter()
    for _ in range(int(n) - 1):
        out.append(await engine.forward_tokens_and_sample([out[-1]], False, model=mid))
    t2 = time.perf_counter()
    return json.dumps({"ids": out, "prefill_seconds": t1 - t0,
                       "decode_tokens_per_s": (len(out) - 1) / max(t2 - t1, 1e-9)})


async def embed(texts_json: str) -> str:
    engine = _state["engine"]
    t0 = time.perf_counter()
    res = await engine.embeddings.create(input=json.loads(texts_json), model=_model(EMBEDDING))
    vecs = [list(d.embedding) for d in res.data]
    return json.dumps({"embeddings": vecs, "seconds": time.perf_counter() - t0})


async def search(query: str, docs_json: str) -> str:
    """Rank documents by cosine similarity to the query (vectors are L2-normalised by the model)."""
    docs = json.loads(docs_json)
    vecs = json.loads(await embed(json.dumps([query] + docs)))["embeddings"]
    q = vecs[0]
    scores = [sum(a * b for a, b in zip(q, v)) / (math.sqrt(sum(b * b for b in v)) or 1.0) for v in vecs[1:]]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    return json.dumps([{"doc": docs[i], "score": scores[i]} for i in order])


async def runtime_stats() -> str:
    return await _state["engine"].runtime_stats_text(model=_model(LLM))


def _plain(obj):
    """A response object (attribute dict or dataclass) as plain JSON-able values."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return {k: _plain(v) for k, v in vars(obj).items() if not k.startswith("_")}
    return obj
