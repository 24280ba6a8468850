"""OpenAI's Responses API (`/v1/responses`) as a translation onto the chat path: the request rules
(what is refused by name), input items -> chat messages, flat function tools -> chat tools,
`text.format` -> `response_format`, and the builders of Response objects, output items and usage.

Standard library at module level (the rules and builders run in the browser too); the pydantic
request model `ResponseCreateRequest` exists where pydantic is installed.
"""
from __future__ import annotations

import uuid
from typing import Any

from ..errors import InvalidRequestError
from .errors import FieldTypeError, MinValueError, UnsupportedFieldsError, _show
from .objects import AttrDict, _wrap
from .rules import KNOWN_FIELDS, note_unknown_fields

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512     # OpenAI's limits
TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
# request fields kept as they are by the rules (the others below are refused or translated)
_PLAIN = ("model", "instructions", "temperature", "top_p", "seed", "user", "stream", "store",
          "parallel_tool_calls", "previous_response_id", "metadata", "max_output_tokens",
          "lora")         # llama.cpp's per-request LoRA scales, as on the chat route (engine/lora.py)


# the Responses request's fields: served, translated, accepted as hints, or refused by name; others
# are ignored and logged once (the chat route's policy, protocol/rules.py)
KNOWN_FIELDS["responses"] = frozenset(_PLAIN + (
    "input", "tools", "tool_choice", "text", "background", "reasoning", "include", "truncation",
    "conversation", "prompt", "max_tool_calls", "top_logprobs", "context_management", "service_tier",
    "stream_options", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"))


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- refusals
def _refuse(param: str, detail: str) -> InvalidRequestError:
    return UnsupportedFieldsError(param, detail)


def _check_refused(req: dict) -> None:
    """Fields of the Responses API this engine cannot honour: each refused by name, never ignored."""
    if req.get("background"):
        raise _refuse("background", "responses run in the request; send background=false or leave it out.")
    reasoning = req.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise FieldTypeError("reasoning", "an object", reasoning)
        if reasoning.get("effort") not in (None, "none") or any(
                reasoning.get(k) is not None for k in reasoning if k != "effort"):
            raise _refuse("reasoning", "reasoning effort and summaries are not supported; leave "
                                       "`reasoning` out or send {\"effort\": \"none\"}.")
    if req.get("include"):
        raise _refuse("include", f"no extra output data is available (got {_show(req['include'])}).")
    if req.get("truncation") not in (None, "disabled"):
        raise _refuse("truncation", "only \"disabled\" is supported: an input longer than the context "
                                    "is an error, not cut.")
    for name, what in (("conversation", "conversations are not stored; use previous_response_id"),
                       ("prompt", "stored prompt templates are not available; send `input`"),
                       ("max_tool_calls", "the number of tool calls cannot be capped; leave it out"),
                       ("context_management", "context management is not available")):
        if req.get(name) is not None:
            raise _refuse(name, what + ".")
    if req.get("top_logprobs"):
        raise _refuse("top_logprobs", "log probabilities are served by /v1/chat/completions.")
    if req.get("service_tier") not in (None, "auto", "default"):
        raise _refuse("service_tier", "one tier is served; send \"auto\" or \"default\".")


# --------------------------------------------------------------------------- input items
def _text_parts(where: str, content: Any, images: bool = False) -> str | list:
    """A message's content (a string, or a list of text parts) as one text; with `images` (a user
    message) its input_image parts make it a list of chat parts (text and image_url) in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldTypeError(where, "a string or a list of input_text parts", content)
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _refuse("input", f"{where}[{j}]: an input_image needs an image_url (a data: or http(s) "
                                       f"URL); file_id is not supported.")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail", "auto")}})
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise _refuse("input", f"{where}[{j}] is an {kind} part: this engine reads text and images "
                                   f"(input_image in user messages); send input_text parts.")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise FieldTypeError(where + f"[{j}]", "an input_text or output_text part "
                                 "{\"type\": \"input_text\", \"text\": ...}", part)
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _string(where: str, item: dict, key: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise FieldTypeError(f"{where}.{key}", "a non-empty string" if key != "arguments" else "a string", v)
    return v


def _check_item(i: int, item: Any) -> dict:
    """One input item, normalised: a message {type, role, content: str}, a function_call or a
    function_call_output; anything else is refused with its index."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise FieldTypeError(where, "an object (a message or a function_call / function_call_output item)", item)
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise FieldTypeError(f"{where}.role", f"one of {list(_ROLES)}", role)
        return {"type": "message", "role": role,
                "content": _text_parts(f"{where}.content", item.get("content"), images=role == "user")}
    if kind == "function_call":
        return {"type": "function_call", "call_id": _string(where, item, "call_id"),
                "name": _string(where, item, "name"), "arguments": _string(where, item, "arguments")}
    if kind == "function_call_output":
        out = item.get("output")
        return {"type": "function_call_output", "call_id": _string(where, item, "call_id"),
                "output": _text_parts(f"{where}.output", out)}
    if kind == "item_reference":
        raise _refuse("input", f"{where}: item references are not supported; pass previous_response_id "
                               f"or the items themselves.")
    if kind == "reasoning":
        return {"type": "reasoning"}         # earlier thinking is not fed back (templates drop it)
    raise _refuse("input", f"{where} has type {_show(kind)}: only messages, function_call and "
                           f"function_call_output items are (built-in tool calls are not supported).")


def _check_input(value: Any) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise FieldTypeError("input", "a non-empty string or list of items", value)
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise FieldTypeError("input", "a non-empty string or a non-empty list of items", value)
    return [_check_item(i, item) for i, item in enumerate(value)]


def to_chat_messages(items: list[dict], instructions: str | None = None) -> list[dict]:
    """Normalised items -> chat messages: consecutive function_call items become one assistant
    message's tool_calls (joined to the assistant text just before them), function_call_output
    items tool messages; `instructions` and the leading system/developer messages one system
    message (later ones stay where they are, as on the chat route); reasoning items are dropped."""
    system = [instructions] if instructions else []
    msgs: list[dict] = []
    for it in items:
        if it["type"] == "reasoning":
            continue
        if it["type"] == "message":
            if it["role"] in ("system", "developer") and not msgs:
                system.append(it["content"])
            elif it["role"] in ("system", "developer"):     # later ones: the chat template's to accept
                msgs.append({"role": "system", "content": it["content"]})
            else:
                msgs.append({"role": it["role"], "content": it["content"]})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    if system:
        msgs.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return msgs


# --------------------------------------------------------------------------- tools and text format
def _check_tools(tools: Any) -> list[dict] | None:
    """Responses' flat function tools, checked (chat's rules check the schemas later)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise FieldTypeError("tools", "a list of function tools", tools)
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise FieldTypeError(f"tools[{i}]", "a function tool object", t)
        if t.get("type") != "function":
            raise _refuse("tools", f"tools[{i}] has type {_show(t.get('type'))}: only function tools are "
                                   f"supported (no web_search, file_search, computer_use, code_interpreter, "
                                   f"image_generation, mcp or other built-in tools).")
        if not isinstance(t.get("name"), str):
            raise FieldTypeError(f"tools[{i}].name", "a string (Responses tools are flat: "
                                 "{\"type\": \"function\", \"name\": ..., \"parameters\": ...})", t.get("name"))
        out.append({k: t[k] for k in ("type", "name", "description", "parameters", "strict") if t.get(k) is not None})
    return out


def _check_tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("none", "auto", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "name": tc["name"]}
    raise _refuse("tool_choice", f"got {_show(tc)}; send \"none\", \"auto\", \"required\" or "
                                 f"{{\"type\": \"function\", \"name\": ...}}.")


def _check_text(text: Any) -> dict:
    """`text` -> {"format": {...}} with format text, json_object or json_schema."""
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise FieldTypeError("text", "an object like {\"format\": {\"type\": \"text\"}}", text)
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise _refuse("text", f"unknown keys {unknown}; `format` is supported.")
    if text.get("verbosity") not in (None, "medium"):
        raise _refuse("text.verbosity", "the model's verbosity cannot be set; leave it out.")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"format": {"type": kind}}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise FieldTypeError("text.format", "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", fmt)
        return {"format": {k: fmt[k] for k in ("type", "name", "schema", "description", "strict")
                           if fmt.get(k) is not None}}
    raise _refuse("text.format", f"got {_show(fmt)}; use type text, json_object or json_schema.")


def _check_metadata(md: Any) -> dict | None:
    if md is None:
        return None
    if not isinstance(md, dict) or len(md) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY
            and len(v) <= MAX_METADATA_VALUE for k, v in md.items()):
        raise FieldTypeError("metadata", f"an object of at most {MAX_METADATA_KEYS} string values (keys up "
                             f"to {MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})", md)
    return dict(md)


# --------------------------------------------------------------------------- the request
def check_responses_request(req: Any) -> dict:
    """Validate a Responses request: the refusals, the input items, tools, tool_choice, text and
    metadata; returns a normalised dict. Sampling fields are checked by the chat rules after
    `chat_request`."""
    if not isinstance(req, dict):
        raise FieldTypeError("body", "a JSON object", req)
    _check_refused(req)
    note_unknown_fields(req, "responses")
    out = {k: req[k] for k in _PLAIN if req.get(k) is not None}
    for name in ("instructions", "previous_response_id", "user", "safety_identifier", "prompt_cache_key"):
        if req.get(name) is not None and not isinstance(req[name], str):
            raise FieldTypeError(name, "a string", req[name])
    for name in ("store", "stream", "parallel_tool_calls"):
        if req.get(name) is not None and not isinstance(req[name], bool):
            raise FieldTypeError(name, "true or false", req[name])
    mot = req.get("max_output_tokens")
    if mot is not None:
        if isinstance(mot, bool) or not isinstance(mot, int):
            raise FieldTypeError("max_output_tokens", "an integer", mot)
        if mot < 1:
            raise MinValueError("max_output_tokens", 1, mot)
    if "input" not in req:
        raise FieldTypeError("input", "a non-empty string or list of items", None)
    out["input"] = _check_input(req["input"])
    out["tools"] = _check_tools(req.get("tools"))
    out["tool_choice"] = _check_tool_choice(req.get("tool_choice"))
    out["text"] = _check_text(req.get("text"))
    out["metadata"] = _check_metadata(req.get("metadata"))
    out.setdefault("store", True)
    if req.get("reasoning") is not None:
        out["reasoning"] = req["reasoning"]       # effort "none" at most (_check_refused)
    return out


def chat_request(req: dict, messages: list[dict]) -> dict:
    """The chat-completions request that serves a checked Responses request over `messages`."""
    chat = {"messages": messages}
    for ours, theirs in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("seed", "seed"), ("user", "user"), ("max_output_tokens", "max_tokens"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("lora", "lora")):
        if req.get(ours) is not None:
            chat[theirs] = req[ours]
    if req["tools"]:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in req["tools"]]
        tc = req.get("tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}} if isinstance(tc, dict) else tc
    if (req.get("reasoning") or {}).get("effort") == "none":
        chat["reasoning_effort"] = "none"         # a thinking template's thinking turned off
    fmt = req["text"]["format"]
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in fmt.items() if k != "type"}}
    return chat


# chat rules name the chat field; the Responses client sent another
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


# --------------------------------------------------------------------------- responses
def new_response(req: dict, rid: str, model: str, created: float, defaults: dict) -> dict:
    """A Response object in progress (no output yet); `defaults` holds the model's temperature and
    top_p for the fields the request left out."""
    tc = req.get("tool_choice")
    return {"id": rid, "object": "response", "created_at": created, "status": "in_progress",
            "error": None, "incomplete_details": None, "model": model, "output": [],
            "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
            "temperature": req.get("temperature", defaults.get("temperature")),
            "top_p": req.get("top_p", defaults.get("top_p")),
            "tools": req.get("tools") or [], "tool_choice": tc if tc is not None else "auto",
            "parallel_tool_calls": req.get("parallel_tool_calls", True), "text": req["text"],
            "previous_response_id": req.get("previous_response_id"), "store": req["store"],
            "metadata": req.get("metadata") or {}, "user": req.get("user"), "usage": None,
            "truncation": "disabled", "background": False,
            "reasoning": {"effort": (req.get("reasoning") or {}).get("effort"), "summary": None}}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict, finish_reason: str) -> list[dict]:
    """A chat answer (reasoning_content, content and tool_calls) as Response output items."""
    status = "incomplete" if finish_reason == "length" else "completed"
    items = [reasoning_item(message["reasoning_content"], status)] if message.get("reasoning_content") else []
    items += [message_item(message["content"], status)] if message.get("content") else []
    for c in message.get("tool_calls") or []:
        items.append(function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    return items


def usage(chat_usage: dict | None) -> dict:
    u = chat_usage or {}
    i, o = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    # cached_tokens: prefix reuse is not counted per request (reported as 0)
    return {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": o,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o}


def finish(response: dict, items: list[dict], chat_usage: dict | None, finish_reason: str) -> dict:
    """The in-progress `response` completed (or incomplete at max_output_tokens) with its output."""
    done = dict(response, output=items, usage=usage(chat_usage), status="completed")
    if finish_reason == "length":
        done.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    return done


class ResponseObject(AttrDict):
    """A Response as a dict with attribute access, plus the SDK's `output_text` (all output text)."""

    @property
    def output_text(self) -> str:
        return "".join(c["text"] for it in self["output"] if it["type"] == "message"
                       for c in it["content"] if c["type"] == "output_text")


def response_object(d: dict) -> ResponseObject:
    return ResponseObject(_wrap(d))


try:  # pydantic is optional: absent in the page
    from pydantic import BaseModel, ConfigDict, model_validator
except ImportError:  # pragma: no cover - browser only
    BaseModel = None

if BaseModel is not None:
    class ResponseCreateRequest(BaseModel):
        """The body of POST /v1/responses (the rules above run on the raw dict first)."""

        model_config = ConfigDict(extra="allow", protected_namespaces=())
        model: str | None = None
        input: str | list[dict]
        instructions: str | None = None
        max_output_tokens: int | None = None
        temperature: float | None = None
        top_p: float | None = None
        tools: list[dict] | None = None
        tool_choice: str | dict | None = None
        parallel_tool_calls: bool | None = None
        text: dict | None = None
        store: bool | None = None
        previous_response_id: str | None = None
        stream: bool | None = None
        metadata: dict[str, str] | None = None
        user: str | None = None
        seed: int | None = None

        @model_validator(mode="before")
        @classmethod
        def _rules(cls, data: Any) -> Any:
            check_responses_request(data)
            return data
