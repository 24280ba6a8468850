"""Anthropic's Messages API (`/v1/messages`) as a translation onto the chat path: the request rules
(what is refused by name), content blocks -> chat messages, tools and tool_choice -> chat tools,
`thinking` -> the template's thinking switch, and the builders of Message objects, content blocks,
stop reasons, usage and errors in Anthropic's shapes.

    system            string, or text blocks              -> the system message
    messages          text / tool_use / tool_result blocks -> user, assistant (tool_calls), tool messages;
                      thinking blocks of earlier turns are dropped (templates drop them too);
                      a last assistant message is a prefill the answer continues
    max_tokens        required, as Anthropic requires it
    stop_sequences    -> stop; the one that ended the answer is `stop_sequence`
    tools             {name, description, input_schema} -> function tools
    tool_choice       auto / any / tool / none (disable_parallel_tool_use) -> auto / required / the
                      function / none (parallel_tool_calls)
    thinking          {"type": "enabled" | "adaptive" | "between_tools"} / {"type": "disabled"}
                      -> enable_thinking
    output_config     format {"type": "json_schema", "schema"} -> response_format (the grammar path);
                      effort accepted (thinking here is on or off, not graded)

Standard library only (the rules and builders run in the browser too).
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from ..errors import InvalidRequestError
from .errors import FieldTypeError, MinValueError, UnsupportedFieldsError, _show
from .rules import KNOWN_FIELDS

# the Messages request's fields: served, translated, accepted as hints, or refused by name; others
# are ignored and logged once (the chat route's policy, protocol/rules.py)
# (temperature, top_p and top_k: older clients send them, newer ones through extra_body)
HINTS = frozenset({"metadata", "service_tier", "cache_control", "diagnostics", "inference_geo", "speed",
                   "user_profile_id", "workspace_id"})           # accepted, nothing to do here
KNOWN_FIELDS["messages"] = frozenset({
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "tools", "tool_choice", "thinking", "output_config", "container", "mcp_servers",
    "context_management", "lora"}) | HINTS        # lora: the per-request LoRA scales of the chat route
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                          "cache_control", "context_management", "mcp_servers", "diagnostics", "lora"})
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn", "abort": "end_turn"}
# HTTP status -> Anthropic's error type (its documented set; 503 is its "overloaded")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(status: int, message: str) -> dict:
    """Anthropic's error JSON: {"type": "error", "error": {"type": ..., "message": ...}}."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- content blocks
def _text(where: str, v: Any) -> str:
    if not isinstance(v, str):
        raise FieldTypeError(where, "a string", v)
    return v


def _blocks(where: str, content: Any) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise FieldTypeError(where, "a string or a list of content blocks", content)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise FieldTypeError(f"{where}[{j}]", "a content block object with a `type`", b)
    return content


def _refuse_block(where: str, kind: str, model: str | None) -> InvalidRequestError:
    if kind == "image":              # a user message's image blocks go to the model (vision models)
        return UnsupportedFieldsError(where, f"{where} is an image block: images go in user messages' "
                                             f"content (not in tool results or assistant turns).")
    return UnsupportedFieldsError(where, f"{where} has type {_show(kind)}: content blocks of type text, "
                                         f"tool_use, tool_result and thinking are supported.")


def _tool_result_text(where: str, content: Any, model: str | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, b in enumerate(_blocks(where, content)):
        if b["type"] != "text":
            raise _refuse_block(f"{where}[{j}]", b["type"], model)
        texts.append(_text(f"{where}[{j}].text", b.get("text")))
    return "\n".join(texts)


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for j, b in enumerate(_blocks("system", system)):
        if b["type"] != "text":
            raise UnsupportedFieldsError(f"system[{j}]", "system blocks must be text blocks.")
        texts.append(_text(f"system[{j}].text", b.get("text")))
    return "\n\n".join(texts) or None


def to_chat_messages(req: dict) -> list[dict]:
    """`system` and `messages` -> chat messages. A user message's tool_result blocks become tool
    messages (in their order, before its text); an assistant message's tool_use blocks its tool_calls."""
    msgs = req.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise FieldTypeError("messages", "a non-empty list of messages", msgs)
    model = req.get("model") if isinstance(req.get("model"), str) else None
    out: list[dict] = []
    system = _system(req.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}                     # tool_use id -> tool name (tool messages name it)
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise FieldTypeError(f"messages[{i}]", "an object with role and content", m)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise FieldTypeError(f"messages[{i}].role", '"user" or "assistant" (the system prompt is the '
                                 'top-level `system`)', role)
        where = f"messages[{i}].content"
        texts: list[str] = []
        parts: list[dict] = []                       # a user message's text and image parts, in order
        calls: list[dict] = []
        for j, b in enumerate(_blocks(where, m.get("content"))):
            kind, at = b["type"], f"{where}[{j}]"
            if kind == "text":
                texts.append(_text(f"{at}.text", b.get("text")))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(at, b.get("source"))}})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                cid, name = _text(f"{at}.id", b.get("id")), _text(f"{at}.name", b.get("name"))
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise FieldTypeError(f"{at}.input", "an object", args)
                names[cid] = name
                calls.append({"id": cid, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                cid = _text(f"{at}.tool_use_id", b.get("tool_use_id"))
                text = _tool_result_text(f"{at}.content", b.get("content"), model)
                if b.get("is_error"):
                    text = f"Error: {text}"
                tm = {"role": "tool", "tool_call_id": cid, "content": text}
                if cid in names:
                    tm["name"] = names[cid]
                out.append(tm)
            else:
                raise _refuse_block(at, kind, model)
        if role == "assistant":
            am: dict = {"role": "assistant", "content": "".join(texts)}
            if calls:
                am["tool_calls"] = calls
            out.append(am)
        elif len(parts) > len(texts):            # images: the engine decodes them (a 400 for a text model)
            out.append({"role": "user", "content": parts})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _image_url(where: str, source: Any) -> str:
    """An image block's source ({"type": "base64", "media_type", "data"} or {"type": "url", "url"}) as
    the URL of a chat image_url part."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise FieldTypeError(f"{where}.source", 'a {"type": "base64", "media_type", "data"} or {"type": "url", '
                         '"url"} image source', source)


# --------------------------------------------------------------------------- tools
def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise FieldTypeError("tools", "a list of tools", tools)
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise FieldTypeError(f"tools[{i}]", "a tool object", t)
        if t.get("type") not in (None, "custom"):
            raise UnsupportedFieldsError(f"tools[{i}].type", f"tool type {_show(t.get('type'))} is a server or "
                                         f"client tool of Anthropic's; only custom tools (name, description, "
                                         f"input_schema) are supported.")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise FieldTypeError(f"tools[{i}].input_schema", "a JSON Schema object", schema)
        f = {"name": _text(f"tools[{i}].name", t.get("name")), "parameters": schema}
        if t.get("description") is not None:
            f["description"] = _text(f"tools[{i}].description", t["description"])
        out.append({"type": "function", "function": f})
    return out


def _tool_choice(tc: Any) -> dict:
    """tool_choice -> the chat request's tool_choice and parallel_tool_calls ({} when absent)."""
    if tc is None:
        return {}
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise FieldTypeError("tool_choice", '{"type": "auto" | "any" | "tool" | "none"}', tc)
    kind = tc["type"]
    if kind == "tool":
        out = {"tool_choice": {"type": "function", "function": {"name": _text("tool_choice.name", tc.get("name"))}}}
    else:
        out = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[kind]}
    dp = tc.get("disable_parallel_tool_use")
    if dp is not None:
        if not isinstance(dp, bool):
            raise FieldTypeError("tool_choice.disable_parallel_tool_use", "true or false", dp)
        out["parallel_tool_calls"] = not dp
    return out


def _thinking(th: Any) -> bool | None:
    if th is None:
        return None
    if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise FieldTypeError("thinking", '{"type": "enabled", "budget_tokens": N} or {"type": "disabled"}', th)
    if th["type"] == "disabled":
        return False
    budget = th.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise FieldTypeError("thinking.budget_tokens", "a positive integer", budget)
    return True


# --------------------------------------------------------------------------- the request
def chat_request(req: Any, count_only: bool = False) -> dict:
    """A Messages request (or a count_tokens one with `count_only`) -> the chat request it runs as.
    The chat rules check the sampling fields' values afterwards (with the chat names mapped back
    by CHAT_PARAMS)."""
    if not isinstance(req, dict):
        raise FieldTypeError("body", "a JSON object", req)
    if count_only:
        odd = sorted(k for k in req if k not in COUNT_FIELDS)
        if odd:
            raise UnsupportedFieldsError(odd[0], f"count_tokens takes {sorted(COUNT_FIELDS)}, not {odd}.")
    chat: dict = {"model": req.get("model"), "messages": to_chat_messages(req)}
    if not count_only:
        mt = req.get("max_tokens")
        if mt is None:
            raise FieldTypeError("max_tokens", "an integer (the Messages API requires it)", mt)
        if not isinstance(mt, int) or isinstance(mt, bool):
            raise FieldTypeError("max_tokens", "an integer", mt)
        if mt < 1:       # Anthropic's 0 warms its prompt cache; prefix reuse here is automatic
            raise MinValueError("max_tokens", 1, mt)
        chat["max_tokens"] = mt
        for k in ("temperature", "top_p", "top_k", "stream", "lora"):
            if req.get(k) is not None:
                chat[k] = req[k]
        stops = req.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise FieldTypeError("stop_sequences", "a list of strings", stops)
            if stops:
                chat["stop"] = list(stops)
        md = req.get("metadata")
        if md is not None and not isinstance(md, dict):
            raise FieldTypeError("metadata", "an object", md)
        if isinstance(md, dict) and isinstance(md.get("user_id"), str):
            chat["user"] = md["user_id"]
        for name in ("container", "mcp_servers", "context_management"):
            if req.get(name):
                raise UnsupportedFieldsError(name, f"`{name}` needs Anthropic's hosted tools; leave it out.")
    tools, choice = _tools(req.get("tools")), _tool_choice(req.get("tool_choice"))
    if tools:
        chat["tools"] = tools
        chat.update(choice)
    elif choice.get("tool_choice") not in (None, "auto", "none"):   # without tools only these mean anything
        raise UnsupportedFieldsError("tool_choice", "tool_choice any / tool needs `tools`.")
    think = _thinking(req.get("thinking"))
    if think is not None:
        chat["enable_thinking"] = think
    fmt = _output_format(req.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def _output_format(oc: Any) -> dict | None:
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise FieldTypeError("output_config", "an object", oc)
    if oc.get("effort") not in (None, "low", "medium", "high", "xhigh", "max"):
        raise FieldTypeError("output_config.effort", '"low", "medium", "high", "xhigh" or "max"', oc["effort"])
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise FieldTypeError("output_config.format", '{"type": "json_schema", "schema": {...}}', fmt)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


# chat field -> the Messages field a client sent (errors of the chat rules name the latter)
CHAT_PARAMS = {"stop": "stop_sequences", "max_tokens": "max_tokens", "tools": "tools",
               "tool_choice": "tool_choice", "enable_thinking": "thinking", "user": "metadata.user_id",
               "response_format": "output_config.format"}


# --------------------------------------------------------------------------- answers
def stop_reason(finish: str, matched: str | None, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason and the stop string that ended it (the
    model's own stop strings end a turn: end_turn)."""
    if finish == "stop" and matched is not None and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """Anthropic's usage. Prefix reuse is not counted per request: no cache fields are reported
    as read or written (0), so input_tokens is the whole prompt, as count_tokens counts it."""
    return {"input_tokens": int(prompt_tokens), "output_tokens": int(completion_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def tool_input(arguments: str) -> dict:
    """A tool call's JSON arguments as the tool_use block's `input` (an object)."""
    try:
        v = json.loads(arguments) if arguments and arguments.strip() else {}
    except ValueError:
        return {"_raw": arguments}
    return v if isinstance(v, dict) else {"_value": v}


def content_blocks(message: dict) -> list[dict]:
    """A chat answer (reasoning_content, content, tool_calls) as Messages content blocks."""
    out: list[dict] = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": tool_input(c["function"].get("arguments") or "")})
    return out


def message(mid: str, model: str, content: list[dict], reason: str | None, sequence: str | None,
            use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": use}


__all__ = ["CHAT_PARAMS", "chat_request", "content_blocks", "error_body", "error_type", "message", "new_id",
           "stop_reason", "to_chat_messages", "tool_input", "usage"]
