"""`engine.messages`: Anthropic's Messages API served by the chat path (requests.py), no second
generation loop. A request is translated (protocol/anthropic.py), the chat completion runs, and its
answer becomes a Message; streamed, the chat chunks become the Messages stream's events
(message_start, content_block_start / _delta / _stop per block, message_delta, message_stop).
`count_tokens` counts the prompt as the chat path builds it (template, tools, thinking switch).
Standard library only at module level.
"""
from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError, WebGPUEngineError
from ..protocol import anthropic as ap
from ..protocol.objects import to_dict, to_object
from .records import LLM
from .requests import EventStream, request_fields


def _rename_param(e: InvalidRequestError) -> InvalidRequestError:
    """A chat rule's error names the chat field; name the Messages field the client sent."""
    if e.param in ap.CHAT_PARAMS:
        e.param = ap.CHAT_PARAMS[e.param]
    return e


class Messages:
    """engine.messages: create, count_tokens."""

    def __init__(self, engine):
        self.engine = engine

    async def create(self, request: Any = None, **fields):
        """A Message (a dict with attribute access), or with stream=true an async iterator of its
        events (the first ones after the prefill ran, so errors up to there raise here)."""
        req = request_fields(request, fields)
        chat = ap.chat_request(req)
        lm = await self.engine.select(chat.get("model"), LLM, "MessageCreateParams")
        if chat.get("model") not in lm.lora_adapters:     # a LoRA adapter's name stays: its rows use it
            chat["model"] = lm.model_id
        stream = bool(chat.pop("stream", False))
        try:
            res = await self.engine.chat.completions.create(chat, stream=stream)
        except InvalidRequestError as e:
            raise _rename_param(e) from None
        mid = ap.new_id("msg")
        if stream:
            return MessageEventStream(res, mid, lm.model_id, chat.get("stop") or [])
        d = to_dict(res)
        choice, u = d["choices"][0], d["usage"]
        reason, seq = ap.stop_reason(choice["finish_reason"], choice.get("stop_reason"), chat.get("stop") or [])
        return to_object(ap.message(mid, lm.model_id, ap.content_blocks(choice["message"]), reason, seq,
                                    ap.usage(u["prompt_tokens"], u["completion_tokens"])))

    async def count_tokens(self, request: Any = None, **fields) -> dict:
        """{"input_tokens": N}: what the same request's usage.input_tokens will be."""
        chat = ap.chat_request(request_fields(request, fields), count_only=True)
        try:
            got = await self.engine.tokenize(chat)
        except InvalidRequestError as e:
            raise _rename_param(e) from None
        return {"input_tokens": got["count"]}


class MessageEventStream(EventStream):
    """The Messages stream's events over a chat AsyncStream. A block opens at its first text
    (thinking, text, or a tool call, each with its index) and closes when the next one opens or
    the answer ends; a tool call's arguments arrive as input_json_delta fragments as they are
    generated. An engine error after the start ends it with an `error` event."""

    def __init__(self, chat_stream, mid: str, model: str, stops: list[str]):
        self._mid, self._stops = mid, stops
        super().__init__(chat_stream, model)

    @staticmethod
    def _event(kind: str, **fields) -> Any:
        return to_object({"type": kind, **fields})

    async def _events(self):
        ev = self._event
        prompt = self._chat.prompt_tokens or 0
        yield ev("message_start", message=ap.message(self._mid, self.model, [], None, None, ap.usage(prompt, 0)))
        yield ev("ping")
        index = -1
        open_kind: str | None = None          # "thinking" | "text" | "tool:<chat index>"
        finish = "stop"
        try:
            async for chunk in self._chat:
                for c in to_dict(chunk).get("choices", []):
                    delta = c.get("delta") or {}
                    pieces = []
                    if delta.get("reasoning_content"):
                        pieces.append(("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                       {"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
                    if delta.get("content"):
                        pieces.append(("text", {"type": "text", "text": ""},
                                       {"type": "text_delta", "text": delta["content"]}))
                    for tc in delta.get("tool_calls") or []:
                        f = tc.get("function") or {}
                        pieces.append((f"tool:{tc['index']}",
                                       {"type": "tool_use", "id": tc.get("id"), "name": f.get("name", ""),
                                        "input": {}},
                                       {"type": "input_json_delta", "partial_json": f.get("arguments") or ""}))
                    for kind, start, d in pieces:
                        if kind != open_kind:
                            if open_kind is not None:
                                for e in self._close(index, open_kind):
                                    yield e
                            index, open_kind = index + 1, kind
                            yield ev("content_block_start", index=index, content_block=start)
                        if d.get("partial_json") != "":          # a call's empty first fragment: none
                            yield ev("content_block_delta", index=index, delta=d)
                    finish = c.get("finish_reason") or finish
            if open_kind is not None:
                for e in self._close(index, open_kind):
                    yield e
            u = self._chat.usage or {}
            reason, seq = ap.stop_reason(finish, self._chat.stop_reason, self._stops)
            yield ev("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                     usage={"output_tokens": int(u.get("completion_tokens") or 0)})
            yield ev("message_stop")
        except WebGPUEngineError as e:
            yield ev("error", error={"type": ap.error_type(e.http_status), "message": e.message})

    def _close(self, index: int, kind: str):
        if kind == "thinking":
            yield self._event("content_block_delta", index=index,
                              delta={"type": "signature_delta", "signature": ""})
        yield self._event("content_block_stop", index=index)
