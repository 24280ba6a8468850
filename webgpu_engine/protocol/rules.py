"""The OpenAI request validation rules, written once over plain dicts (WebLLM's checks + OpenAI ranges).

Both the pydantic models (native) and the engine (also in the browser, where pydantic is missing)
call these functions, so a request is judged the same everywhere. Each `check_*` raises a typed
`InvalidRequestError` naming the field, or returns a normalised copy of the request: stop as a list,
message content as plain strings, `max_completion_tokens` folded into `max_tokens`, temperatures
below GREEDY_TEMPERATURE set to 0.

Validation is total: every number that reaches the GPU is finite and inside its documented range,
every text is valid Unicode, and the amount of work one request may ask for is bounded by
`RequestLimits` (the engine passes its own; the defaults follow OpenAI's limits). Standard library only.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from ..config import SAMPLING_FIELDS
from .structured import check_response_format, check_tool_calls, check_tools
from .errors import (ContentTypeError, DependencyError, EmbeddingInputEmptyError,
                     EmbeddingUnsupportedEncodingFormatError, EmptyMessagesError, FieldTypeError,
                     InvalidNumberStringError, InvalidStreamOptionsError, InvalidTextError,
                     LimitExceededError, MessageOrderError, MinValueError, PromptTypeError,
                     RangeError, SeedTypeError, StreamingCountError,
                     UnsupportedFieldsError, UnsupportedRoleError)

ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20             # chat's top_logprobs (OpenAI's limit); also the GPU sampler's (TOPN
                                  # in kernels/sampling.py and sampling.wgsl)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")   # on or off, graded where the template reads it
# Unknown top-level fields are ignored (clients send fields of newer API versions and of other
# servers), each name logged once per request kind at debug level; a known field with a value this
# engine cannot honour is refused by name instead.
_SAMPLING_FIELDS = frozenset({f.openai for f in SAMPLING_FIELDS if f.openai}) | {
    "model", "stream", "stream_options", "max_completion_tokens", "user", "extra_body", "enable_latency_breakdown",
    "lora"}                  # llama.cpp's per-request LoRA adapter scales (engine/lora.py request_adapter)
KNOWN_FIELDS = {
    "chat": _SAMPLING_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                                "enable_thinking", "reasoning_effort"},
    "completion": _SAMPLING_FIELDS | {"prompt", "echo", "suffix", "best_of", "response_format"},
    "embedding": frozenset({"model", "input", "encoding_format", "dimensions", "user"}),
}
_logged_unknown: set[tuple[str, str]] = set()
_log = logging.getLogger("webgpu_engine.protocol")


def note_unknown_fields(req: dict, kind: str) -> None:
    """Log (debug, once per name and request kind) the top-level fields this engine ignores."""
    known = KNOWN_FIELDS[kind]
    for k in req:
        if k not in known and (kind, k) not in _logged_unknown and len(_logged_unknown) < 1024:
            _logged_unknown.add((kind, k))
            _log.debug("ignoring the unknown %s request field %r (logged once)", kind, str(k)[:64])


MAX_LEGACY_LOGPROBS = 5           # /v1/completions' integer `logprobs` (OpenAI's limit)
# Temperatures in (0, 1e-5) mean greedy decoding (as vLLM treats them): the sampler divides logits
# by the temperature in float32, where 1/1e-39 overflows, and such a temperature is greedy anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 10.0
MIN_REPETITION_PENALTY = 0.01
MAX_TOKEN_ID_DIGITS = 10          # logit_bias keys: token ids below 10^10 (every vocabulary fits)


@dataclass(frozen=True)
class RequestLimits:
    """How much work one request may ask for. Defaults follow OpenAI's API limits where it has one.

    max_n: choices per request (`n`).
    max_stop / max_stop_chars: stop strings per request (OpenAI: 4) and characters in each.
    max_logit_bias: logit_bias entries (OpenAI: 300).
    max_embedding_inputs: inputs of one embeddings request (OpenAI: 2048).
    max_embedding_tokens: tokens summed over one embeddings request's inputs (OpenAI: 300 000);
        token-id inputs are counted here, text inputs where the embedding pipeline tokenises them.
    """

    max_n: int = 16
    max_stop: int = 4
    max_stop_chars: int = 256
    max_logit_bias: int = 300
    max_embedding_inputs: int = 2048
    max_embedding_tokens: int = 300_000


DEFAULT_LIMITS = RequestLimits()


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(param: str, where: str, s: str) -> str:
    """`s` unchanged when it is valid Unicode; a lone surrogate (from a JSON \\ud800 escape) raises."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidTextError(param, where, e.start, s[e.start]) from None
    return s


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field(req: dict, name: str, ok, what: str) -> Any:
    """req[name] (None when absent or null), which must pass `ok` (else a FieldTypeError: `what`)."""
    v = req.get(name)
    if v is not None and not ok(v):
        raise FieldTypeError(name, what, v)
    return v


def _positive_int(req: dict, name: str) -> int | None:
    """req[name]: None when absent or null, else an integer >= 1."""
    v = _field(req, name, _is_int, "a positive integer")
    if v is not None and v < 1:
        raise MinValueError(name, 1, v)
    return v


def _num(req: dict, name: str) -> float | None:
    v = _field(req, name, _is_num, "a number")
    if isinstance(v, float) and not math.isfinite(v):
        raise FieldTypeError(name, "a finite number", v)
    return v


def _int(req: dict, name: str) -> int | None:
    return _field(req, name, _is_int, "an integer")


def _bool(req: dict, name: str) -> bool | None:
    return _field(req, name, lambda v: isinstance(v, bool), "true or false")


# --------------------------------------------------------------------------- sampling fields
def check_sampling(req: dict, limits: RequestLimits | None = None) -> dict:
    """Rules shared by chat and text completions. Returns a normalised copy."""
    lim = limits or DEFAULT_LIMITS
    out = dict(req)
    if out.get("max_completion_tokens") is not None:
        if out.get("max_tokens") is None:
            out["max_tokens"] = out["max_completion_tokens"]
        out.pop("max_completion_tokens")
    _model_field(out)

    stream = _bool(out, "stream")
    n = _int(out, "n")
    if n is not None and n < 1:
        raise MinValueError("n", 1, n)
    if n is not None and n > lim.max_n:
        raise RangeError("n", 1, lim.max_n, n, extra="the server's limit on choices per request")
    if stream and n is not None and n > 1:
        raise StreamingCountError(n)
    if out.get("stream_options") is not None:
        if not stream:
            raise InvalidStreamOptionsError()
        so = out["stream_options"]
        if not isinstance(so, dict):
            raise FieldTypeError("stream_options", "an object like {\"include_usage\": true}", so)
        unknown = set(so) - {"include_usage"}
        if unknown:
            raise UnsupportedFieldsError("stream_options", f"unknown keys {sorted(unknown)}; only "
                                         f"include_usage is supported.")
        _bool(so, "include_usage")

    seed = out.get("seed")
    if seed is not None and not _is_int(seed):
        # JSON has one number type; 42.0 is still a whole number.
        if isinstance(seed, float) and seed.is_integer():
            out["seed"] = int(seed)
        else:
            raise SeedTypeError(seed)

    t = _num(out, "temperature")
    if t is not None and not 0 <= t <= 2:
        raise RangeError("temperature", 0, 2, t, extra="0 means greedy decoding")
    if t is not None and t < GREEDY_TEMPERATURE:
        out["temperature"] = 0.0
    p = _num(out, "top_p")
    if p is not None and not 0 < p <= 1:
        raise RangeError("top_p", 0, 1, p, lo_open=True)
    k = _int(out, "top_k")          # not OpenAI's; vLLM's and llama.cpp's (-1 or 0: off)
    if k is not None:
        if k < -1:
            raise MinValueError("top_k", -1, k)
        out["top_k"] = max(k, 0)
    mp = _num(out, "min_p")         # vLLM's and llama.cpp's: keep p >= min_p * the best token's p
    if mp is not None and not 0 <= mp <= 1:
        raise RangeError("min_p", 0, 1, mp)
    mt = _int(out, "max_tokens")
    if mt is not None and mt < 1:
        raise MinValueError("max_tokens", 1, mt)

    for name in ("frequency_penalty", "presence_penalty"):
        v = _num(out, name)
        if v is not None and not -2 <= v <= 2:
            raise RangeError(name, -2, 2, v)
    # WebLLM: when one penalty is set the other defaults to 0 (not to the model's default).
    if (out.get("frequency_penalty") is None) != (out.get("presence_penalty") is None):
        for name in ("frequency_penalty", "presence_penalty"):
            if out.get(name) is None:
                out[name] = 0.0
    rp = _num(out, "repetition_penalty")
    if rp is not None and not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
        raise RangeError("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, rp,
                         extra="1.0 means no penalty")

    lb = out.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise FieldTypeError("logit_bias", "an object mapping token-id strings to numbers", lb)
        if len(lb) > lim.max_logit_bias:
            raise LimitExceededError("logit_bias", "entries", lim.max_logit_bias, len(lb))
        norm = {}
        for k, v in lb.items():
            if _is_int(k):
                ks = str(k) if 0 <= k < 10 ** MAX_TOKEN_ID_DIGITS else None
            else:
                ks = k
            # Only plain ASCII digits: str.isdigit() also accepts "²" and other digits int() rejects.
            if (not isinstance(ks, str) or not ks.isascii() or not ks.isdigit()
                    or len(ks) > MAX_TOKEN_ID_DIGITS):
                raise InvalidNumberStringError("logit_bias", k)
            if not _is_num(v):
                raise FieldTypeError(f"logit_bias[\"{ks}\"]", "a number", v)
            if not -100 <= v <= 100:
                raise RangeError("logit_bias", -100, 100, v, extra=f"value of token {ks}")
            norm[ks] = float(v)
        out["logit_bias"] = norm

    logprobs = out.get("logprobs")
    top = out.get("top_logprobs")
    if top is not None:
        if not _is_int(top):
            raise FieldTypeError("top_logprobs", "an integer", top)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RangeError("top_logprobs", 0, MAX_TOP_LOGPROBS, top)
        if logprobs is not True:
            raise DependencyError("top_logprobs", "logprobs", True)

    stop = out.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise FieldTypeError("stop", "a string or a list of strings", stop)
        if any(s == "" for s in stop):
            raise FieldTypeError("stop", "non-empty strings", stop)
        if len(stop) > lim.max_stop:
            raise LimitExceededError("stop", "stop strings", lim.max_stop, len(stop))
        longest = max(len(s) for s in stop)
        if longest > lim.max_stop_chars:
            raise LimitExceededError("stop", "characters in one stop string", lim.max_stop_chars,
                                     longest)
        for j, s in enumerate(stop):
            _text("stop", f"stop[{j}]", s)
        out["stop"] = stop
    _bool(out, "ignore_eos")
    return out


# --------------------------------------------------------------------------- chat
def _content_text(i: int, role: str, content: Any) -> str | list | None:
    """A message's content as one text; a user message with image parts keeps its parts in order
    (text parts {"type": "text", "text"} and image parts {"type": "image", "url", "detail"}: the
    engine decodes the images and the model's chat template places them)."""
    if content is None:
        if role == "assistant":
            return None
        raise ContentTypeError(i, f"is missing; a {role} message needs text content.")
    if isinstance(content, str):
        return _text("messages", f"messages[{i}].content", content)
    if isinstance(content, list):
        texts, parts = [], []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "image_url" and role == "user":
                parts.append(_image_part(i, j, part))
                continue
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                raise ContentTypeError(i, f"[{j}] must be a text part {{\"type\": \"text\", \"text\": "
                                          f"\"...\"}}{' or an image_url part' if role == 'user' else ''}, "
                                          f"got type {kind!r}.")
            texts.append(_text("messages", f"messages[{i}].content[{j}].text", part["text"]))
            parts.append({"type": "text", "text": texts[-1]})
        if len(parts) > len(texts):
            return parts
        return "\n".join(texts)
    raise ContentTypeError(i, f"must be a string or a list of text parts, got {type(content).__name__}.")


IMAGE_DETAILS = ("auto", "low", "high")


def _image_part(i: int, j: int, part: dict) -> dict:
    """OpenAI's {"type": "image_url", "image_url": {"url", "detail"}} (or the url as a string) as
    {"type": "image", "url", "detail", "where"}; `detail` is accepted (each model has one resolution)."""
    where = f"messages[{i}].content[{j}]"
    spec = part.get("image_url")
    url, detail = (spec.get("url"), spec.get("detail", "auto")) if isinstance(spec, dict) else (spec, "auto")
    if not isinstance(url, str) or not url:
        raise FieldTypeError(f"{where}.image_url.url", "a data: or http(s) URL string", url)
    if detail not in IMAGE_DETAILS:
        raise FieldTypeError(f"{where}.image_url.detail", f"one of {list(IMAGE_DETAILS)}", detail)
    return {"type": "image", "url": url, "detail": detail, "where": where}


def _request_body(req: dict) -> dict:
    """A copy of a request body, which must be a JSON object, with its `model` checked."""
    if not isinstance(req, dict):
        raise FieldTypeError("body", "a JSON object", req)
    out = dict(req)
    _model_field(out)
    return out


def _model_field(out: dict) -> None:
    """`model`, when given: a string, checked as request text (the same for every route)."""
    model = out.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldTypeError("model", "a model id string", model)
    if model is not None:
        _text("model", "model", model)


def _sampled_request(req: dict, kind: str, limits: RequestLimits | None) -> dict:
    """A `kind` ("chat" or "completion") request body, which must be a JSON object, its unknown
    fields noted and its sampling fields checked: a normalised copy."""
    if not isinstance(req, dict):
        raise FieldTypeError("body", "a JSON object", req)
    note_unknown_fields(req, kind)
    return check_sampling(req, limits)


def check_chat_request(req: dict, limits: RequestLimits | None = None) -> dict:
    """Validate a chat completion request; returns a normalised copy (messages with string content)."""
    out = _sampled_request(req, "chat", limits)
    msgs = out.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise EmptyMessagesError()
    norm = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise FieldTypeError(f"messages[{i}]", "an object with role and content", m)
        role = m.get("role")
        if role == "developer":          # OpenAI's newer name for the system message
            role = "system"
        if role not in ROLES:
            raise UnsupportedRoleError(i, role)
        # a system message past the first is the chat template's to accept (ChatML and Llama 3
        # render it) or refuse (a TemplateError, 400), not WebLLM's SystemMessageOrderError
        nm = {"role": role, "content": _content_text(i, role, m.get("content"))}
        for key in ("name", "tool_call_id"):
            v = m.get(key)
            if v is not None:
                if not isinstance(v, str):
                    raise FieldTypeError(f"messages[{i}].{key}", "a string", v)
                nm[key] = _text("messages", f"messages[{i}].{key}", v)
        if m.get("tool_calls"):
            if role != "assistant":
                raise UnsupportedFieldsError("messages", f"messages[{i}].tool_calls: only assistant "
                                             f"messages carry tool calls.")
            nm["tool_calls"] = check_tool_calls(i, m["tool_calls"])
            if nm["content"] is None:
                nm["content"] = ""       # templates concatenate content: a call without text is ""
        if role == "assistant" and nm["content"] is None:
            raise ContentTypeError(i, "is missing; an assistant message needs text content.")
        norm.append(nm)
    last = norm[-1]
    # vLLM's continue_final_message, implied by the order: the answer continues the assistant's
    # text (a prefill) instead of opening a turn
    out["continue_final_message"] = last["role"] == "assistant" and not last.get("tool_calls")
    if last["role"] not in ("user", "tool") and not out["continue_final_message"]:
        raise MessageOrderError(last["role"])
    out["messages"] = norm
    # OpenAI's; "none" turns a template's thinking off, a grade goes to templates that read one
    # (gpt-oss's harmony: "Reasoning: low | medium | high")
    effort = out.pop("reasoning_effort", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise FieldTypeError("reasoning_effort", f"one of {list(REASONING_EFFORTS)}", effort)
        if effort == "none" and out.get("enable_thinking") is None:
            out["enable_thinking"] = False
        elif effort != "none":
            out["reasoning_effort"] = effort

    rf = check_response_format(out.get("response_format"))
    if rf is None or rf["type"] == "text":
        out.pop("response_format", None)
    else:
        out["response_format"] = rf
    _bool(out, "parallel_tool_calls")
    tools, tool_choice = check_tools(out.pop("tools", None), out.pop("tool_choice", None))
    if tools:
        out["tools"], out["tool_choice"] = tools, tool_choice
    if tools and rf is not None and rf["type"] != "text" and tool_choice != "none":
        raise UnsupportedFieldsError("response_format", "a response_format cannot be combined with "
                                     "`tools` (tool calls have their own format); use one or the other.")
    return out


# --------------------------------------------------------------------------- completions
def check_completion_request(req: dict, limits: RequestLimits | None = None) -> dict:
    """Validate a text completion request (prompt, echo, suffix + sampling fields)."""
    out = _sampled_request(req, "completion", limits)
    prompt = out.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise PromptTypeError(prompt)
    out["prompt"] = _text("prompt", "prompt", prompt)
    _bool(out, "echo")
    sfx = out.get("suffix")
    if sfx is not None and not isinstance(sfx, str):
        raise FieldTypeError("suffix", "a string", sfx)
    if sfx is not None:
        _text("suffix", "suffix", sfx)
    bo = out.get("best_of")
    if bo is not None and bo != 1:
        raise UnsupportedFieldsError("best_of", "ask for n choices instead (best_of must be 1).")
    lp = out.get("logprobs")
    # Legacy completions take logprobs as an integer count of top entries (OpenAI: 0..5).
    if lp is not None and not isinstance(lp, bool):
        if not _is_int(lp) or not 0 <= lp <= MAX_LEGACY_LOGPROBS:
            raise RangeError("logprobs", 0, MAX_LEGACY_LOGPROBS, lp,
                             extra="completions take the number of top logprobs per token")
        out["logprobs"] = True
        out["top_logprobs"] = lp
    rf = check_response_format(out.get("response_format"))    # vLLM and llama.cpp take it here too
    if rf is None or rf["type"] == "text":
        out.pop("response_format", None)
    else:
        out["response_format"] = rf
    return out


# --------------------------------------------------------------------------- embeddings
def check_embedding_request(req: dict, limits: RequestLimits | None = None) -> dict:
    """Validate an embedding request: input as str / list[str] / list[int] / list[list[int]]."""
    lim = limits or DEFAULT_LIMITS
    out = _request_body(req)
    note_unknown_fields(out, "embedding")
    inp = out.get("input")
    if inp is None:
        raise EmbeddingInputEmptyError("no `input` field")
    if isinstance(inp, str):
        if inp == "":
            raise EmbeddingInputEmptyError("an empty string")
        _text("input", "input", inp)
    elif isinstance(inp, list):
        if not inp:
            raise EmbeddingInputEmptyError()
        if all(isinstance(x, str) for x in inp):
            if len(inp) > lim.max_embedding_inputs:
                raise LimitExceededError("input", "inputs", lim.max_embedding_inputs, len(inp),
                                         "Split the inputs over several requests.")
            for j, x in enumerate(inp):
                if x == "":
                    raise EmbeddingInputEmptyError("an empty string in the list")
                _text("input", f"input[{j}]", x)
        elif all(_is_int(x) for x in inp):
            if any(x < 0 for x in inp):
                raise FieldTypeError("input", "non-negative token ids", inp)
            _token_budget(len(inp), lim)
        elif all(isinstance(x, list) for x in inp):
            if len(inp) > lim.max_embedding_inputs:
                raise LimitExceededError("input", "inputs", lim.max_embedding_inputs, len(inp),
                                         "Split the inputs over several requests.")
            for x in inp:
                if not x:
                    raise EmbeddingInputEmptyError("an empty token-id list")
                if not all(_is_int(t) and t >= 0 for t in x):
                    raise FieldTypeError("input", "lists of non-negative integer token ids", x)
            _token_budget(sum(len(x) for x in inp), lim)
        else:
            raise FieldTypeError("input", "a string, a list of strings, a list of token ids or a "
                                 "list of token-id lists (not a mix)", inp)
    else:
        raise FieldTypeError("input", "a string, a list of strings, a list of token ids or a list "
                             "of token-id lists", inp)
    # whether the model may be truncated, and to how many, is the pipeline's to say
    _positive_int(out, "dimensions")
    ef = out.get("encoding_format")
    if ef is not None and ef != "float":
        raise EmbeddingUnsupportedEncodingFormatError(ef)
    return out


def _token_budget(n_tokens: int, lim: RequestLimits) -> None:
    if n_tokens > lim.max_embedding_tokens:
        raise LimitExceededError("input", "tokens", lim.max_embedding_tokens, n_tokens,
                                 "Split the inputs over several requests.")


__all__ = ["RequestLimits", "DEFAULT_LIMITS", "GREEDY_TEMPERATURE", "check_sampling",
           "check_chat_request", "check_completion_request", "check_embedding_request", "ROLES",
           "MAX_TOP_LOGPROBS", "MAX_LEGACY_LOGPROBS"]
