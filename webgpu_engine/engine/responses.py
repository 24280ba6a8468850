"""`engine.responses`: OpenAI's Responses API served by the chat path (requests.py), no second
generation loop. A request is checked (protocol/responses.py), its input items (after those of
`previous_response_id`, from the store) become chat messages, the chat completion runs, and its
answer becomes output items; streamed, the chat chunks become the Responses' typed events.

Stored responses (store=true, the default) live in a bounded in-memory LRU (EngineConfig.
responses_store_size): a response holds its whole conversation as items, so a continuation needs
only its own id. Unknown and evicted ids raise ResponseNotFoundError (HTTP 404).
Standard library only at module level.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ..errors import InvalidRequestError, WebGPUEngineError
from ..protocol import responses as rp
from ..protocol.objects import to_dict, to_object
from .records import LLM
from .requests import EventStream, request_fields


class ResponseNotFoundError(WebGPUEngineError):
    http_status = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(f"No stored response with id {response_id[:80]!r}: it was never stored "
                         f"(store=false), was deleted, or was evicted from the server's store of the "
                         f"most recent responses.", param=param)


class ResponseStore:
    """The most recent stored responses, least recently used evicted first. An entry: the
    response dict and the conversation items it continues (its input history and its output)."""

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._inputs: dict[str, list[dict]] = {}

    def put(self, response: dict, items: list[dict], inputs: list[dict] | None = None) -> None:
        """`inputs`: the input items as GET .../input_items lists them (ids given here, once)."""
        self._entries[response["id"]] = (response, items)
        self._inputs[response["id"]] = [_listed_item(it) for it in (inputs or [])]
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            gone, _ = self._entries.popitem(last=False)
            self._inputs.pop(gone, None)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        entry = self._entries.get(response_id) if isinstance(response_id, str) else None
        if entry is None:
            raise ResponseNotFoundError(str(response_id), param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]
        self._inputs.pop(response_id, None)

    def inputs(self, response_id: str) -> list[dict]:
        self.get(response_id)
        return self._inputs.get(response_id, [])

    def __len__(self) -> int:
        return len(self._entries)


def _rename_param(e: InvalidRequestError) -> InvalidRequestError:
    """A chat rule's error names the chat field; name the Responses field the client sent."""
    if e.param in rp.CHAT_PARAMS:
        e.param = rp.CHAT_PARAMS[e.param]
    return e


def _listed_item(it: dict) -> dict:
    """An input item as OpenAI lists it (input_items): an id, a status, text as content parts."""
    kind = it["type"]
    if kind == "message":
        part = "output_text" if it["role"] == "assistant" else "input_text"
        content = it["content"] if isinstance(it["content"], list) else [{"type": "text", "text": it["content"]}]
        return {"id": rp.new_id("msg"), "type": "message", "role": it["role"], "status": "completed",
                "content": [{"type": part, "text": p["text"]} if p["type"] == "text" else
                            {"type": "input_image", "image_url": p["image_url"]["url"],
                             "detail": p["image_url"].get("detail", "auto")} for p in content]}
    prefix = {"function_call": "fc", "function_call_output": "fco"}.get(kind, "rs")
    return {"id": rp.new_id(prefix), **it, "status": "completed"}


def _conversation_items(output: list[dict]) -> list[dict]:
    """Output items as input items of the next turn (what a continuation sends back)."""
    out = []
    for it in output:
        if it["type"] == "reasoning":
            continue
        if it["type"] == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": "".join(c["text"] for c in it["content"])})
        else:
            out.append({k: it[k] for k in ("type", "call_id", "name", "arguments")})
    return out


class Responses:
    """engine.responses: create, retrieve, delete."""

    def __init__(self, engine):
        self.engine = engine
        self.store = ResponseStore(engine.config.responses_store_size)

    async def create(self, request: Any = None, **fields):
        """A Response object, or with stream=true an async iterator of its events (the first ones
        after the prefill ran, so errors up to there raise here)."""
        req = rp.check_responses_request(request_fields(request, fields))
        history: list[dict] = []
        if req.get("previous_response_id"):
            _, history = self.store.get(req["previous_response_id"], "previous_response_id")
        items = history + req["input"]
        chat = rp.chat_request(req, rp.to_chat_messages(items, req.get("instructions")))
        lm = await self.engine.select(req.get("model"), LLM, "ResponseCreateParams")
        cc = lm.chat_config
        base = rp.new_response(req, rp.new_id("resp"), lm.model_id, int(time.time()),
                               {"temperature": cc.temperature, "top_p": cc.top_p})
        try:
            res = await self.engine.chat.completions.create(chat, stream=bool(req.get("stream")))
        except InvalidRequestError as e:
            raise _rename_param(e) from None
        if req.get("stream"):
            return ResponseEventStream(res, base, lambda done: self._keep(req, items, done))
        d = to_dict(res)
        choice = d["choices"][0]
        done = rp.finish(base, rp.output_items(choice["message"], choice["finish_reason"]), d["usage"],
                         choice["finish_reason"])
        self._keep(req, items, done)
        return rp.response_object(done)

    def _keep(self, req: dict, items: list[dict], response: dict) -> None:
        if req["store"]:
            self.store.put(response, items + _conversation_items(response["output"]), items)

    async def retrieve(self, response_id: str):
        """A stored Response (ResponseNotFoundError for unknown, unstored or evicted ids)."""
        return rp.response_object(self.store.get(response_id)[0])

    async def input_items(self, response_id: str, *, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> dict:
        """The input items a stored response answered (the earlier turns of a previous_response_id
        chain included), as OpenAI's input_items list: newest first by default, `limit` 1..100, a
        cursor `after` (an item id)."""
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 100:
            raise InvalidRequestError(f"`limit` must be an integer in [1, 100], got {limit!r}.", param="limit")
        if order not in ("asc", "desc"):
            raise InvalidRequestError(f"`order` must be asc or desc, got {order!r}.", param="order")
        items = self.store.inputs(response_id)
        items = items[::-1] if order == "desc" else list(items)
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise InvalidRequestError(f"`after` {after[:80]!r} is no input item of {response_id}.",
                                          param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def delete(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class ResponseEventStream(EventStream):
    """The typed events of a streamed Response over a chat AsyncStream: response.created and
    .in_progress, per output item .output_item.added / .done (a reasoning item's text deltas, a
    message's content part and text deltas, a function call's argument deltas), then response.completed (or .incomplete at
    max_output_tokens). An engine error after the start ends it with response.failed."""

    def __init__(self, chat_stream, base: dict, keep):
        self._base, self._keep = base, keep
        self._seq = 0
        super().__init__(chat_stream, base["model"])

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return to_object(ev)        # an attribute-access dict (events have no `object` field)

    async def _events(self):
        base = self._base
        yield self._event("response.created", response=base)
        yield self._event("response.in_progress", response=base)
        items: list[dict] = []
        message: dict | None = None        # the open message item
        thought: dict | None = None        # the open reasoning item (a thinking template's text)
        calls: dict[int, dict] = {}        # chat tool-call index -> its function_call item
        finish = "stop"
        try:
            async for chunk in self._chat:
                for c in to_dict(chunk).get("choices", []):
                    delta = c.get("delta") or {}
                    if delta.get("reasoning_content"):
                        if thought is None:
                            thought = rp.reasoning_item("", "in_progress")
                            items.append(thought)
                            yield self._event("response.output_item.added", output_index=len(items) - 1,
                                              item=dict(thought, content=[]))
                        thought["content"][0]["text"] += delta["reasoning_content"]
                        yield self._event("response.reasoning_text.delta", item_id=thought["id"],
                                          output_index=items.index(thought), content_index=0,
                                          delta=delta["reasoning_content"])
                    if delta.get("content"):
                        if message is None:
                            message = rp.message_item("", "in_progress")
                            items.append(message)
                            for ev in self._open_message(message, len(items) - 1):
                                yield ev
                        message["content"][0]["text"] += delta["content"]
                        yield self._event("response.output_text.delta", item_id=message["id"],
                                          output_index=items.index(message), content_index=0,
                                          delta=delta["content"], logprobs=[])
                    for tc in delta.get("tool_calls") or []:
                        f = tc.get("function") or {}
                        item = calls.get(tc["index"])
                        if item is None:
                            item = rp.function_call_item(tc["id"], f.get("name", ""), "", "in_progress")
                            calls[tc["index"]] = item
                            items.append(item)
                            yield self._event("response.output_item.added", output_index=len(items) - 1,
                                              item=dict(item))
                        if f.get("arguments"):
                            item["arguments"] += f["arguments"]
                            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                              output_index=items.index(item), delta=f["arguments"])
                    finish = c.get("finish_reason") or finish
            status = "incomplete" if finish == "length" else "completed"
            for i, item in enumerate(items):
                item["status"] = status if item["type"] != "function_call" else "completed"
                for ev in self._close(item, i):
                    yield ev
            done = rp.finish(base, items, self._chat.usage, finish)
            self._keep(done)
            yield self._event("response." + done["status"], response=done)
        except WebGPUEngineError as e:
            failed = dict(base, status="failed", output=items,
                          error={"code": "rate_limit_exceeded" if e.http_status == 429 else "server_error",
                                 "message": e.message})
            yield self._event("response.failed", response=failed)

    def _open_message(self, item: dict, index: int):
        yield self._event("response.output_item.added", output_index=index, item=dict(item, content=[]))
        yield self._event("response.content_part.added", item_id=item["id"], output_index=index,
                          content_index=0, part=rp.output_text(""))

    def _close(self, item: dict, index: int):
        if item["type"] == "reasoning":
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=item["content"][0]["text"])
        elif item["type"] == "message":
            part = item["content"][0]
            yield self._event("response.output_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"], logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=dict(part))
        else:
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"], arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=index, item=_copy(item))


def _copy(item: dict) -> dict:
    return {k: ([dict(p) for p in v] if k == "content" else v) for k, v in item.items()}
