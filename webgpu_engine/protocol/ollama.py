"""Ollama's API requests translated to the engine's OpenAI requests, and its answers back.

/api/chat and /api/generate become chat or completion requests (`options` mapped onto the OpenAI
sampling fields, `format` onto `response_format`, `tools` as they are); the engine's responses and
usage become Ollama's (`message` / `response`, `done_reason`, durations in nanoseconds). What has no
equivalent here is refused by name (a 400 naming the field), never ignored — except the runner's
hardware hints (HARDWARE_OPTIONS), which have no meaning on a WebGPU device. Standard library only.
"""
from __future__ import annotations

import json
import time
from typing import Any

from ..config import SAMPLING_FIELDS
from .errors import FieldTypeError, UnsupportedFieldsError

# option -> OpenAI request field, taken as they are (the protocol rules check their values);
# num_predict, Ollama's max_tokens, has rules of its own (options_fields)
OPTION_FIELDS = {f.ollama: f.openai for f in SAMPLING_FIELDS if f.ollama and f.openai and f.name != "max_tokens"}
# where Ollama's runner runs: accepted, no effect (one WebGPU device; weights are mapped as they are)
HARDWARE_OPTIONS = {"num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "numa",
                    "low_vram", "f16_kv", "num_keep"}
# samplers this engine's request path lacks: accepted only at the value that turns them off
OFF_VALUES = {"typical_p": 1, "tfs_z": 1, "mirostat": 0}
CHAT_FIELDS = {"model", "messages", "stream", "options", "format", "tools", "keep_alive", "think",
               "tool_choice", "logprobs", "top_logprobs", "lora"}
GENERATE_FIELDS = {"model", "prompt", "stream", "options", "format", "keep_alive", "think", "raw",
                   "system", "suffix", "template", "context", "images", "logprobs", "top_logprobs", "lora"}
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "stop"}
THINK_LEVELS = ("low", "medium", "high")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def check_fields(body: dict, allowed: set, route: str) -> None:
    """Fields a route does not take are refused by name."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise UnsupportedFieldsError(unknown[0], f"{route} does not take {unknown}; it takes {sorted(allowed)}.")


def options_fields(options: Any, context: int) -> dict:
    """Ollama `options` → OpenAI request fields. `context`: the loaded model's context window."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise FieldTypeError("options", "an object", options)
    out: dict = {}
    for k, v in options.items():
        if v is None or k in HARDWARE_OPTIONS:
            continue
        if k in OPTION_FIELDS:
            out[OPTION_FIELDS[k]] = v
        elif k == "num_predict":
            if not isinstance(v, int) or isinstance(v, bool):
                raise FieldTypeError("options.num_predict", "an integer", v)
            if v == 0 or v < -2:
                raise UnsupportedFieldsError("options.num_predict", f"num_predict {v} is not supported: give "
                                             f"a count >= 1, or -1 / -2 for no limit but the context.")
            if v > 0:
                out["max_tokens"] = v
        elif k == "num_ctx":
            if not isinstance(v, int) or isinstance(v, bool):
                raise FieldTypeError("options.num_ctx", "an integer", v)
            if v > context:
                raise UnsupportedFieldsError("options.num_ctx", f"the model is loaded with a context of "
                                             f"{context} tokens; num_ctx {v} would need a reload (load it with "
                                             f"a larger context_window_size), ask at most {context}.")
        elif k == "repeat_last_n":
            if options.get("repeat_penalty") not in (None, 1, 1.0) and v != -1:
                raise UnsupportedFieldsError("options.repeat_last_n", "the repetition penalty here covers "
                                             "every token of the context; send repeat_last_n -1 or omit it.")
        elif k in OFF_VALUES:
            if v != OFF_VALUES[k]:
                raise UnsupportedFieldsError(f"options.{k}", f"{k} is not supported by this engine (only "
                                             f"{OFF_VALUES[k]}, off); omit it.")
        else:
            raise UnsupportedFieldsError(f"options.{k}", f"unknown or unsupported option {k!r}.")
    return out


def response_format(fmt: Any) -> dict | None:
    """`format`: "json" → any JSON object; a JSON Schema object → that schema (the grammar path)."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise FieldTypeError("format", '"json" or a JSON Schema object', fmt)


def _message(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise FieldTypeError(f"messages[{i}]", "an object with role and content", m)
    out = {k: m[k] for k in ("role", "content") if k in m}
    if m.get("images"):
        out["content"] = _with_images(f"messages[{i}].images", m["images"], m.get("content"))
    if m.get("role") == "tool" and isinstance(m.get("tool_name"), str):
        out["name"] = m["tool_name"]
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise FieldTypeError(f"messages[{i}].tool_calls", "a list", calls)
        out["tool_calls"] = [{"type": "function", **c} if isinstance(c, dict) else c for c in calls]
    # an earlier answer's `thinking` (clients send the message back as they got it) is dropped, as
    # thinking templates drop earlier turns' reasoning
    if m.get("thinking") is not None and not isinstance(m["thinking"], str):
        raise FieldTypeError(f"messages[{i}].thinking", "a string", m["thinking"])
    return out


def _common(body: dict, route: str, allowed: set, context: int) -> dict:
    check_fields(body, allowed, route)
    req: dict = {"model": body.get("model")}
    if body.get("lora") is not None:
        # this server's extension (Ollama has no per-request adapter; `options` are the model's
        # parameters): the OpenAI routes' per-request LoRA scales, engine/lora.py
        req["lora"] = body["lora"]
    req.update(options_fields(body.get("options"), context))
    rf = response_format(body.get("format"))
    if rf is not None:
        req["response_format"] = rf
    think = body.get("think")
    if think is not None:
        # Ollama's levels (gpt-oss) turn thinking on; a template's thinking is on or off, not graded
        if not isinstance(think, bool) and think not in THINK_LEVELS:
            raise FieldTypeError("think", f"true, false or one of {list(THINK_LEVELS)}", think)
        req["enable_thinking"] = think is not False
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise FieldTypeError("logprobs", "true or false", lp)
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
        raise FieldTypeError("top_logprobs", "an integer", top)
    if lp or top:
        req["logprobs"], req["top_logprobs"] = True, top or 0
    return req


def chat_request(body: dict, context: int) -> dict:
    """An /api/chat body → a chat.completions request (no `stream`: the route streams by itself).
    `tool_choice` is this server's extension (Ollama has none: the model decides)."""
    req = _common(body, "/api/chat", CHAT_FIELDS, context)
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise FieldTypeError("messages", "a list of messages", msgs)
    req["messages"] = [_message(i, m) for i, m in enumerate(msgs)]
    if body.get("tools"):
        req["tools"] = body["tools"]
        if body.get("tool_choice") is not None:
            req["tool_choice"] = body["tool_choice"]
    return req


def generate_request(body: dict, context: int) -> tuple[dict, bool]:
    """An /api/generate body → (request, chat): a chat request over one user message (the model's
    own template; `system` as the system message), or with `raw` a completion of the prompt as it is."""
    req = _common(body, "/api/generate", GENERATE_FIELDS, context)
    for name, why in (("template", "prompts go through the model's own chat template (or `raw`)"),
                      ("context", "conversation state is not kept between requests; send the turns to "
                                  "/api/chat instead"),
                      ("suffix", "fill-in-the-middle is not supported")):
        if body.get(name):
            raise UnsupportedFieldsError(name, f"`{name}` is not supported: {why}.")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise FieldTypeError("prompt", "a string", prompt)
    if body.get("raw"):
        if body.get("images"):
            raise UnsupportedFieldsError("images", "a raw prompt takes no images (the chat template places "
                                         "them): leave out `raw`.")
        if body.get("system"):
            raise UnsupportedFieldsError("system", "a raw prompt takes no system message; write it into "
                                         "the prompt.")
        req["prompt"] = prompt
        if req.pop("logprobs", None):          # a completion's logprobs: the count of top entries
            req["logprobs"] = req.pop("top_logprobs")
        req.pop("enable_thinking", None)       # a raw prompt has no template to switch
        return req, False
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise FieldTypeError("system", "a string", system)
    content = _with_images("images", body["images"], prompt) if body.get("images") else prompt
    req["messages"] = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]
    return req, True


def _with_images(where: str, images: Any, text: Any) -> list:
    """Ollama's `images` (base64 strings) and the message's text as chat parts: the images first,
    then the text, as Ollama's templates place them."""
    if not isinstance(images, list) or not all(isinstance(b, str) and b for b in images):
        raise FieldTypeError(where, "a list of base64-encoded images", images)
    parts = [{"type": "image_url", "image_url": {"url": "data:;base64," + b}} for b in images]
    return parts + ([{"type": "text", "text": text}] if isinstance(text, str) and text else [])


def keep_alive_seconds(v: Any) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "90s", "-1"); a
    negative one keeps the model loaded (-1.0 here), None when absent. A bad value: FieldTypeError."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
        return -1.0 if v < 0 else float(v)
    if not isinstance(v, str) or not v.strip():
        raise FieldTypeError("keep_alive", 'a duration such as "5m" or "1h30m", or seconds', v)
    text = v.strip()
    sign, rest = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    if not rest:
        raise FieldTypeError("keep_alive", 'a duration such as "5m" or "1h30m", or seconds', v)
    try:
        return -1.0 if sign < 0 and float(rest) > 0 else float(rest)     # a bare number: seconds
    except ValueError:
        pass
    total, pos = 0.0, 0
    while pos < len(rest):
        j = pos
        while j < len(rest) and (rest[j].isdigit() or rest[j] == "."):
            j += 1
        k = j
        while k < len(rest) and not (rest[k].isdigit() or rest[k] == "."):
            k += 1
        unit = rest[j:k]
        try:
            total += float(rest[pos:j]) * _UNITS[unit]
        except (ValueError, KeyError):
            raise FieldTypeError("keep_alive", 'a duration such as "5m" or "1h30m", or seconds', v) from None
        pos = k
    return -1.0 if sign < 0 and total > 0 else total


def logprobs(choice: dict) -> list[dict] | None:
    """A chat or completion choice's logprobs in Ollama's shape: [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}] (None when the choice has none)."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    if "content" in lp:                                   # chat: OpenAI's entries are Ollama's
        return [{k: e[k] for k in ("token", "logprob", "bytes", "top_logprobs") if k in e}
                for e in lp["content"] or []]
    return [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8")),           # legacy completions
             "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode("utf-8"))}
                              for a, b in (top or {}).items()]}
            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


# --------------------------------------------------------------------------- answers
def now() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def durations(usage: dict | None, total_s: float) -> dict:
    """Ollama's counts and durations (ns) from the engine's usage (its extra: tokens per second)."""
    u = usage or {}
    extra = u.get("extra") or {}
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    pre, dec = extra.get("prefill_tokens_per_s") or 0, extra.get("decode_tokens_per_s") or 0
    ns = 1e9
    return {"total_duration": int(total_s * ns), "load_duration": 0,
            "prompt_eval_count": prompt,
            "prompt_eval_duration": int(prompt / pre * ns) if pre else 0,
            "eval_count": completion,
            "eval_duration": int(completion / dec * ns) if dec else 0}


def tool_calls(calls: list | None) -> list[dict]:
    """OpenAI tool calls (arguments as JSON text) → Ollama's (arguments as an object)."""
    out = []
    for c in calls or []:
        f = c["function"]
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = {"_raw": args}
        out.append({"function": {"name": f["name"], "arguments": args}})
    return out


__all__ = [
    "DONE_REASONS",
    "chat_request",
    "check_fields",
    "durations",
    "generate_request",
    "keep_alive_seconds",
    "logprobs",
    "now",
    "options_fields",
    "response_format",
    "tool_calls",
]
