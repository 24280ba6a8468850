"""The OpenAI request paths of the engine: chat.completions, completions and embeddings `create`.

Each request: validate (protocol rules) → pick the model → build the GenerationConfig → take the
model's FIFO lock → prefill + decode steps → release in `finally`. Streaming requests take the lock
and run the prefill inside `create` (so errors surface there, and arrival order is service order),
then return an `AsyncStream` of chunks that releases the lock when iteration ends, fails, is
cancelled or is closed early. Standard library only at module level.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import fields
from typing import Any, AsyncIterator

from ..config import SAMPLING_BY_NAME, GenerationConfig, SamplingParams
from ..protocol.errors import RangeError
from ..protocol.objects import to_object
from ..protocol.rules import check_chat_request, check_completion_request, check_embedding_request
from .lora import request_adapter
from .output import output_parser
from .records import EMBEDDING, LLM
from .tools import attach_grammar, prepare_chat


def request_fields(request: Any, fields: dict) -> dict:
    """A request (dict, pydantic model or object) merged with keyword fields, None values dropped."""
    if request is None:
        d = {}
    elif isinstance(request, dict):
        d = dict(request)
    elif hasattr(request, "model_dump"):
        d = request.model_dump(exclude_none=True)
    else:
        d = dict(vars(request))
    d.update({k: v for k, v in fields.items() if v is not None})
    return {k: v for k, v in d.items() if v is not None}


def gen_config(lm, req: dict) -> GenerationConfig:
    """Per-request sampling: the model's chat-config defaults, overridden by the request's fields."""
    cc = lm.chat_config

    def pick(name):          # the request's value, else the model's default (config.SAMPLING_FIELDS)
        v = req.get(name)
        return getattr(cc, SAMPLING_BY_NAME[name].chat_config) if v is None else v
    bias = {}                              # token id -> bias: what the sampler takes as it is
    lb = req.get("logit_bias") or {}
    if lb:
        vocab = lm.pipeline.vocab_size     # the ids the sampler may give (a padded vocabulary is cut)
        for k, v in lb.items():            # keys: digit strings (protocol.rules.check_sampling)
            tid = int(k)
            if tid >= vocab:
                raise RangeError("logit_bias", 0, vocab - 1, tid,
                                 extra=f"token ids of {lm.model_id} are below {vocab}")
            bias[tid] = float(v)
    return GenerationConfig(
        temperature=float(pick("temperature")), top_p=float(pick("top_p")),
        top_k=int(req.get("top_k") or 0), min_p=float(req.get("min_p") or 0.0),
        max_tokens=req.get("max_tokens"), stop=list(req.get("stop") or []),
        frequency_penalty=float(pick("frequency_penalty")),
        presence_penalty=float(pick("presence_penalty")),
        repetition_penalty=float(pick("repetition_penalty")),
        logit_bias=bias, logprobs=bool(req.get("logprobs")), top_logprobs=int(req.get("top_logprobs") or 0),
        seed=req.get("seed"), ignore_eos=bool(req.get("ignore_eos")), n=int(req.get("n") or 1),
        enable_thinking=req.get("enable_thinking"), reasoning_effort=req.get("reasoning_effort"),
        continue_final_message=bool(req.get("continue_final_message")),
        latency_breakdown=bool(req.get("enable_latency_breakdown")))


# WebLLM's `extra_body` (ChatCompletionRequest.extra_body) and fields the OpenAI client sends from
# its `extra_body` at the top level of the JSON body
EXTRA_FIELDS = {"enable_thinking": "chat", "enable_latency_breakdown": "any"}
# request fields that may also come inside extra_body (the OpenAI client merges them the same way):
# the sampler's (config.SamplingParams) and the others
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} | {
    "max_tokens", "max_completion_tokens", "stop", "n", "ignore_eos", "stream", "stream_options",
    "response_format", "tools", "tool_choice", "user", "echo", "suffix", "model", "lora"}


def _extra_body(req: dict, chat: bool) -> dict:
    """Fold `extra_body` into the request, as the OpenAI client does, and check the extra fields:
    each one works or is refused by name, never ignored."""
    from ..protocol.errors import FieldTypeError, UnsupportedFieldsError
    eb = req.pop("extra_body", None)
    if eb is not None:
        if not isinstance(eb, dict):
            raise FieldTypeError("extra_body", "an object", eb)
        unknown = sorted(k for k in eb if k not in EXTRA_FIELDS and k not in _SAMPLING_FIELDS)
        if unknown:
            raise UnsupportedFieldsError("extra_body", f"unknown keys {unknown}; supported: "
                                         f"{sorted(EXTRA_FIELDS)} and the request's own fields.")
        for k, v in eb.items():
            if k in req and req[k] != v:
                raise UnsupportedFieldsError("extra_body", f"{k} is given twice with different values "
                                             f"(in extra_body and in the request).")
            req[k] = v
    for k, where in EXTRA_FIELDS.items():
        v = req.get(k)
        if v is None:
            continue
        if not isinstance(v, bool):
            raise FieldTypeError(k, "true or false", v)
        if where == "chat" and not chat:
            raise UnsupportedFieldsError(k, f"{k} applies to the chat template; completions use none.")
    return req


def _choice_gen(gen: GenerationConfig, i: int) -> GenerationConfig:
    # One seed covers the whole request: choice i samples with seed + i, so the n choices differ
    # while the request stays reproducible; nothing of it outlives the request.
    if gen.seed is None or i == 0:
        return gen
    from dataclasses import replace
    return replace(gen, seed=gen.seed + i)


def _sequence(lm, req: dict):
    """The sequence a choice generates through, with the LoRA adapter the request's `lora` or
    `model` names (engine/lora.py)."""
    seq = lm.pipeline.sequence()
    adapter = request_adapter(lm, req)
    if adapter is not None:
        seq.adapter = adapter
    return seq


async def _steps(engine, lm, seq, gen: GenerationConfig, messages=None, prompt=None,
                 deadline: float | None = None) -> AsyncIterator[tuple[str, list]]:
    """One choice, generated through `seq` (lm.pipeline.sequence(): a sequence of the model's batch
    scheduler): prefill then decode until it stops. Yields (text delta, new
    logprob entries) after each step. Each step yields to the event loop (other requests,
    disconnects). Past `deadline` (loop time) the next step raises RequestTimeoutError instead."""
    try:
        # Before each step: was the model dropped meanwhile (unload, reload, a loss seen by another
        # request)? Then stop here instead of touching its freed buffers.
        engine.check_loaded(lm, "prefill")
        engine.check_deadline(deadline, "prefill")
        await engine.guard(seq.prefill_step(messages, gen, prompt=prompt), lm, "prefill")
        seen = 0
        while True:
            delta = seq.take_delta()
            entries = []
            if gen.logprobs:
                lps = seq.token_logprobs or []
                entries, seen = list(lps[seen:]), len(lps)
            if delta or entries:
                yield delta, entries
            if seq.stopped:
                break
            engine.check_loaded(lm, "decode")
            engine.check_deadline(deadline, "decode")
            await engine.guard(seq.decode_step(), lm, "decode")
            await asyncio.sleep(0)
        tail = seq.take_delta()   # held-back text (a partial stop string that was not one)
        if tail:
            yield tail, []
    finally:
        seq.close()


def _usage(usages: list[dict], t0: float) -> dict:
    if not usages:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    prompt = int(usages[0].get("prompt_tokens", 0))
    completion = sum(int(u.get("completion_tokens", 0)) for u in usages)
    extra = dict(usages[-1].get("extra") or {})
    extra["e2e_latency_s"] = time.perf_counter() - t0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "extra": extra}


class AsyncStream:
    """Async iterator of chunk objects. Holds the model's lock until iteration ends; `aclose()` (or
    leaving an `async with`) stops the generation and frees the lock at once. `usage` is filled when
    the stream ends (also when the client did not ask for a usage chunk)."""

    def __init__(self, lm, agen_factory, abandon=None):
        self._lm = lm
        self._abandon = abandon        # ends the generation when the stream is never iterated
        self._released = False
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None      # the stop string that ended the answer, if one did
        self.prompt_tokens: int | None = None
        self._agen = agen_factory(self)
        self._started = False

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._lm.lock.release()

    def __aiter__(self):
        return self

    async def __anext__(self):
        self._started = True
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        if self._started:
            await self._agen.aclose()
        elif self._abandon is not None:
            self._abandon()
        self._release()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __del__(self):
        if not self._released:
            # Dropped without being consumed: end the generation, hand the lock on (from the
            # loop's thread).
            if self._abandon is not None:
                self._abandon()
            try:
                loop = asyncio.get_running_loop()
                loop.call_soon(self._release)
            except RuntimeError:
                self._release()


class EventStream:
    """Another API's events made from a chat AsyncStream (the Responses and Messages APIs), with the
    AsyncStream surface the server and the sync facade use: iteration, aclose, usage. A subclass
    writes `_events()`, an async generator over `self._chat`."""

    def __init__(self, chat_stream, model: str):
        self._chat, self.model = chat_stream, model
        self._agen = self._events()

    async def _events(self):
        raise NotImplementedError
        yield

    @property
    def usage(self):
        return self._chat.usage

    @property
    def _released(self) -> bool:
        return self._chat._released

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()
        await self._chat.aclose()


# --------------------------------------------------------------------------- chat
class ChatCompletions:
    def __init__(self, engine):
        self.engine = engine

    async def create(self, request: Any = None, **fields):
        """OpenAI chat.completions.create: a ChatCompletion, or an AsyncStream of chunks when stream."""
        return await _create_text(self.engine, request_fields(request, fields), chat=True)


class Chat:
    def __init__(self, engine):
        self.completions = ChatCompletions(engine)


class Completions:
    def __init__(self, engine):
        self.engine = engine

    async def create(self, request: Any = None, **fields):
        """OpenAI completions.create (echo and suffix supported; no chat template)."""
        return await _create_text(self.engine, request_fields(request, fields), chat=False)


async def _create_text(engine, req: dict, chat: bool):
    name = "ChatCompletionRequest" if chat else "CompletionCreateParams"
    deadline = engine.deadline()
    limits = engine.config.limits
    req = _extra_body(req, chat)
    req = check_chat_request(req, limits) if chat else check_completion_request(req, limits)
    lm = await engine.select(req.get("model"), LLM, name)
    request_adapter(lm, req)             # a bad `lora` is refused before the lock
    gen = gen_config(lm, req)
    kind = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    messages, tools = (req["messages"], None) if chat else (None, None)
    if chat:      # tools offered to the template; the grammar compiled before the lock
        messages, gen, tools = await prepare_chat(lm, req, gen)
    else:
        gen = await attach_grammar(lm.pipeline, gen, req.get("response_format"))
    prompt = None if chat else req["prompt"]
    if req.get("stream"):
        return await _stream(engine, lm, req, gen, rid, created, kind, messages, prompt, deadline, tools)
    t0 = time.perf_counter()
    lm = await engine.acquire(lm, name, deadline)
    try:
        choices, usages = [], []
        interrupts = engine.interrupts
        for i in range(gen.n):
            g = _choice_gen(gen, i)
            parts, lps = [], []
            seq = None
            if engine.interrupts != interrupts:
                # as WebLLM: one interrupt_generate() stops the whole request; the choices after
                # the interrupted one are empty, with finish_reason "abort"
                finish = "abort"
            else:
                seq = _sequence(lm, req)
                async for delta, entries in _steps(engine, lm, seq, g, messages, prompt, deadline):
                    parts.append(delta)
                    lps.extend(entries)
                finish = seq.finish_reason or "stop"
                usages.append(seq.usage())
            text = "".join(parts)
            if chat:
                parser = output_parser(lm.pipeline, messages, g, tools)
                parser.feed(text)
                _, msg, finish = parser.finish(finish)
                c = {"index": i, "message": msg, "finish_reason": finish}
                if finish == "stop" and seq is not None and seq.stop_str is not None:
                    c["stop_reason"] = seq.stop_str       # the stop string that ended it (vLLM's field)
                if gen.logprobs:
                    c["logprobs"] = {"content": lps}
            else:
                if req.get("echo"):
                    text = prompt + text
                text += req.get("suffix") or ""
                c = {"index": i, "text": text, "finish_reason": finish}
                if finish == "stop" and seq is not None and seq.stop_str is not None:
                    c["stop_reason"] = seq.stop_str
                if gen.logprobs:
                    c["logprobs"] = _legacy_logprobs(lps, len(prompt) if req.get("echo") else 0)
            choices.append(c)
    finally:
        lm.lock.release()
    return to_object({"id": rid, "object": kind, "created": created, "model": lm.model_id,
                      "choices": choices, "usage": _usage(usages, t0)})


def _legacy_logprobs(entries: list[dict], offset0: int) -> dict:
    """OpenAI chat logprob entries → the legacy completions layout (parallel lists)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in e.get("top_logprobs", [])})
        out["text_offset"].append(off)
        off += len(e["token"])
    return out


async def _stream(engine, lm, req, gen, rid, created, kind, messages, prompt, deadline=None, tools=None):
    chat = kind == "chat.completion"
    name = "ChatCompletionRequest" if chat else "CompletionCreateParams"
    include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
    t0 = time.perf_counter()
    lm = await engine.acquire(lm, name, deadline)
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, usage=None):
        d = {"id": rid, "object": chunk_kind, "created": created, "model": lm.model_id, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return to_object(d)

    def piece(text, entries=None, finish=None, first=False, delta=None, stop_reason=None):
        if chat:
            if delta is None:
                delta = {"content": text} if text or first else {}
            if first:
                delta = {"role": "assistant", **delta}
            c = {"index": 0, "delta": delta, "finish_reason": finish}
            if entries:
                c["logprobs"] = {"content": entries}
        else:
            c = {"index": 0, "text": text, "finish_reason": finish}
            if entries:
                c["logprobs"] = _legacy_logprobs(entries, 0)
        if stop_reason is not None:
            c["stop_reason"] = stop_reason
        return chunk([c])

    def make(stream: AsyncStream):
        async def agen():
            try:
                first = True
                if not chat and req.get("echo"):
                    yield piece(prompt)
                    first = False
                # a chat answer goes through its parser: thinking to reasoning_content, tool calls
                # as they are written; text that may still turn into either is held back until known
                parser = output_parser(lm.pipeline, messages, gen, tools) if chat else None
                held_lps = []
                async for delta, entries in steps:
                    if parser is None:
                        yield piece(delta, entries)
                        continue
                    held_lps.extend(entries)
                    for d in parser.feed(delta):
                        yield piece("", held_lps, first=first, delta=d)
                        first, held_lps = False, []
                stream.finish_reason = seq.finish_reason or "stop"
                stream.stop_reason = seq.stop_str
                if parser is not None:
                    last, _, stream.finish_reason = parser.finish(stream.finish_reason)
                    for d in last:
                        yield piece("", held_lps, first=first, delta=d)
                        first, held_lps = False, []
                    if held_lps:          # entries of held text that turned out to be no delta
                        yield piece("", held_lps, first=first)
                        first = False
                if not chat and req.get("suffix"):
                    yield piece(req["suffix"])
                stream.usage = _usage([seq.usage()], t0)
                yield piece("", finish=stream.finish_reason, stop_reason=stream.stop_reason
                            if stream.finish_reason == "stop" else None)
                if include_usage:
                    yield chunk([], stream.usage)
            finally:
                await steps.aclose()
                stream._release()
        return agen()

    try:
        seq = _sequence(lm, req)
        steps = _steps(engine, lm, seq, gen, messages, prompt, deadline)
        # Run the prefill now, under the lock: its errors (context too long, device lost) raise
        # from create() and become proper HTTP errors instead of a broken stream.
        first_item = await steps.__anext__()
    except StopAsyncIteration:
        first_item = None
    except BaseException:
        lm.lock.release()
        raise
    steps = _prepend(first_item, steps)
    s = AsyncStream(lm, make, abandon=seq.close)
    s.prompt_tokens = seq.usage()["prompt_tokens"]      # known once the prefill ran
    return s


async def _prepend(first, rest):
    try:
        if first is not None:
            yield first
        async for x in rest:
            yield x
    finally:
        await rest.aclose()


# --------------------------------------------------------------------------- embeddings
class Embeddings:
    def __init__(self, engine):
        self.engine = engine

    async def create(self, request: Any = None, **fields):
        """OpenAI embeddings.create: input as str, list[str], list[int] or list[list[int]]."""
        engine = self.engine
        deadline = engine.deadline()
        req = check_embedding_request(request_fields(request, fields), engine.config.limits)
        lm = await engine.select(req.get("model"), EMBEDDING, "EmbeddingCreateParams")
        # Concurrent requests share forwards (coalesce.py: prepare_embed, then one embed_jobs).
        from .coalesce import embed_coalesced
        res, lm = await embed_coalesced(engine, lm, req, deadline)
        return _embedding_response(lm, res)


def _embedding_response(lm, res):
    data = [{"object": "embedding", "index": i, "embedding": list(v)} for i, v in enumerate(res.embeddings)]
    return to_object({"object": "list", "data": data, "model": lm.model_id,
                      "usage": {"prompt_tokens": res.prompt_tokens, "total_tokens": res.prompt_tokens,
                                "extra": {"prefill_tokens_per_s": res.prefill_tokens_per_s}}})
