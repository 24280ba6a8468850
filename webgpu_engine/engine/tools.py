"""Function calling: how each model family writes tool calls, the prompt that offers the tools, the
grammar that forces a call (tool_choice "required" or a named function), and the parser that turns
the model's answer into OpenAI `tool_calls`. Standard library only.

Formats (picked from the chat template's text):
- hermes (Qwen2/2.5, Hermes, SmolLM, and any template that does not render tools itself):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- llama3 (Llama 3.1+ templates with `<|python_tag|>`/ipython): `{"name": ..., "parameters": {...}}`,
  calls separated by `;`;
- mistral (`[TOOL_CALLS]`): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- harmony (gpt-oss, `<|channel|>`): a commentary message to functions.NAME whose text is the
  arguments, ended by `<|call|>` (parsed by engine/harmony.py, which the family selects).
A template that does not mention `tools` gets the tools in a system message (Hermes' wording) and
earlier calls / results rewritten as text in the same format, so every model can take part.
"""
from __future__ import annotations

import json
import re
import uuid

from ..errors import InvalidRequestError


def held_tail(text: str, marks: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that could grow into one of `marks` (what a stream holds
    back: the output parsers', engine/output.py and engine/harmony.py)."""
    best = 0
    for mark in marks:
        for k in range(min(len(mark) - 1, len(text)), best, -1):
            if mark.startswith(text[-k:]):
                best = k
                break
    return best


HERMES, LLAMA3, MISTRAL, HARMONY = "hermes", "llama3", "mistral", "harmony"
_ARGS_KEY = {HERMES: "arguments", LLAMA3: "parameters", MISTRAL: "arguments"}


def tool_format(template) -> str:
    src = getattr(template, "source", "") or ""
    if "<|channel|>" in src:
        return HARMONY
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<|python_tag|>" in src or "ipython" in src:
        return LLAMA3
    return HERMES


def template_renders_tools(template) -> bool:
    return "tools" in (getattr(template, "source", "") or "")


def _call_json(fmt: str, name: str, args) -> str:
    return json.dumps({"name": name, _ARGS_KEY[fmt]: args}, ensure_ascii=False)


def _system_prompt(tools: list[dict]) -> str:
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You are provided with function signatures within "
            "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
            "Don't make assumptions about what values to plug into functions. Here are the available "
            f"tools: <tools>\n{sigs}\n</tools>\nFor each function call return a JSON object with the "
            "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def prepare_messages(messages: list[dict], tools: list[dict] | None, template) -> tuple[list[dict], dict]:
    """(messages, template kwargs) for a chat request with tools: templates that render tools get
    `tools=`; for the others the tools go into the system message and earlier tool calls and results
    become text in the Hermes format."""
    if template_renders_tools(template):
        return messages, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + _call_json(HERMES, c["function"]["name"],
                                                           c["function"]["arguments"]) + "\n</tool_call>"
                              for c in m["tool_calls"])
            text = (m.get("content") or "")
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls})
        elif m.get("role") == "tool":
            # consecutive results share one user turn (as Qwen's template does); models not
            # trained on tools need the last line to answer from them instead of echoing them
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool"):
                prev = out[-1]["content"][:-len(_USE_RESULTS)]
                out[-1]["content"] = prev + "\n" + block + _USE_RESULTS
            else:
                out.append({"role": "user", "content": block + _USE_RESULTS, "_tool": True})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    out = [{k: v for k, v in m.items() if k != "_tool"} for m in out]
    if tools:
        sys_text = _system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + sys_text}
        else:
            out.insert(0, {"role": "system", "content": sys_text})
    return out, {}


def tool_grammar(tools: list[dict], tool_choice, fmt: str, parallel: bool = True) -> dict | None:
    """A Lark grammar (llguidance's `%json` for the arguments) that forces the answer to be tool
    calls whose arguments follow the function's parameter schema: for tool_choice "required" or a
    named function; None for "auto"/"none" (the model chooses freely)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
    if fmt == HARMONY:          # one call (it ends the answer): a commentary message to the function
        return {"type": "lark", "grammar": _harmony_call_grammar(tools)}
    key = _ARGS_KEY[fmt]
    variants = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  key: t["function"]["parameters"]},
                 "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = dict(variants[0]) if len(variants) == 1 else {"anyOf": variants}
    # compact JSON as in response_format (pipelines.grammar.JSON_OPTIONS): no free whitespace
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    call = f"call: %json {json.dumps(schema)}\n"
    many = parallel and not isinstance(tool_choice, dict)
    if fmt == HERMES:
        one = '"<tool_call>\\n" call "\\n</tool_call>"'
        start = f"start: {one}" + (f' ("\\n" {one})*' if many else "")
    elif fmt == LLAMA3:
        start = "start: call" + (' ("; " call)*' if many else "")
    else:
        start = 'start: "[TOOL_CALLS][" call' + (' (", " call)*' if many else "") + ' "]"'
    return {"type": "lark", "grammar": start + "\n" + call}


def _harmony_call_grammar(tools: list[dict]) -> str:
    """Lark: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and arguments that
    follow NAME's parameter schema (compact JSON), for one of `tools`."""
    starts, rules = [], []
    for i, t in enumerate(tools):
        schema = {**t["function"]["parameters"],
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        head = json.dumps(f"commentary to=functions.{t['function']['name']} ")
        starts.append(f'<|channel|> {head} <|constrain|> "json" <|message|> args{i}')
        rules.append(f"args{i}: %json {json.dumps(schema)}")
    return "start: " + " | ".join(starts) + "\n" + "\n".join(rules) + "\n"


_USE_RESULTS = "\nAnswer the question with these results."
_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _objects(text: str) -> list:
    """JSON values written one after another (separated by whitespace, `,` or `;`)."""
    dec, i, out = json.JSONDecoder(), 0, []
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            break
        v, i = dec.raw_decode(text, i)
        out.append(v)
    return out


def _call_id(fmt: str) -> str:
    # Mistral's templates refuse tool-call ids that are not 9 letters or digits
    return uuid.uuid4().hex[:9] if fmt == MISTRAL else "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, fmt: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a model's answer: [] when it holds no well-formed call of a known
    function (then the whole text stays content)."""
    raw, content = [], text
    try:
        if fmt == HERMES and "<tool_call>" in text:
            content = text[:text.index("<tool_call>")].strip() or None
            blocks = _HERMES_RE.findall(text)
            if blocks and not text.rstrip().endswith("</tool_call>") and len(blocks) > 1:
                blocks = blocks[:-1]          # an answer cut short: the calls before the cut one
            for block in blocks:
                raw.extend(_objects(block))
        elif fmt == MISTRAL and "[TOOL_CALLS]" in text:
            content = text[:text.index("[TOOL_CALLS]")].strip() or None
            for v in _objects(text[text.index("[TOOL_CALLS]") + len("[TOOL_CALLS]"):]):
                raw.extend(v if isinstance(v, list) else [v])
        else:
            body = text.strip()
            body = body[len("<|python_tag|>"):] if body.startswith("<|python_tag|>") else body
            if body.startswith("{") or body.startswith("["):
                for v in _objects(body):
                    raw.extend(v if isinstance(v, list) else [v])
                content = None
    except ValueError:
        return text, []
    calls = []
    for v in raw:
        if not isinstance(v, dict) or v.get("name") not in names:
            return text, []
        args = v.get("arguments", v.get("parameters", {}))
        if isinstance(args, str):          # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return text, []
        calls.append({"id": _call_id(fmt), "type": "function",
                      "function": {"name": v["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return (content if calls else text), calls


class ToolContext:
    """What a chat request with tools needs after generation: the format and the known names."""

    def __init__(self, fmt: str, names: set[str], forced: bool):
        self.fmt, self.names, self.forced = fmt, names, forced

    def finish(self, message: dict, finish_reason: str) -> str:
        """Turn a finished answer's text into `tool_calls` when it holds calls (in place)."""
        content, calls = parse_tool_calls(message.get("content") or "", self.fmt, self.names)
        if not calls:
            return finish_reason
        message["content"], message["tool_calls"] = content, calls
        return "tool_calls" if finish_reason == "stop" else finish_reason

    def safe_prefix(self, text: str) -> int:
        """How much of a partial answer is content for sure (streaming sends that and holds back the
        rest, which may be or become a tool call): text before a call marker, less a tail that could
        begin one; Llama 3 calls are whole answers, so an answer that may start one is held."""
        if self.fmt == LLAMA3:
            t = text.lstrip()
            starts = ("{", "[", "<|python_tag|>")
            return 0 if any(m.startswith(t) or t.startswith(m) for m in starts) else len(text)
        mark = "[TOOL_CALLS]" if self.fmt == MISTRAL else "<tool_call>"
        i = text.find(mark)
        if i >= 0:
            return i
        for k in range(min(len(mark) - 1, len(text)), 0, -1):   # a tail that may grow into the mark
            if mark.startswith(text[-k:]):
                return len(text) - k
        return len(text)


async def prepare_chat(lm, req: dict, gen):
    """Before the lock: (messages, gen, ToolContext | None) of a chat request — the tools offered
    to the template, and the grammar (response_format, or the forced tool call) compiled and
    attached to the generation config. Image parts are decoded here (vision/requests.py: a model that
    takes no images, or fewer, is a 400 naming it)."""
    from ..vision.requests import resolve_images
    req = {**req, "messages": await resolve_images(lm.model_id, getattr(lm.pipeline, "vision", None),
                                                   req["messages"])}
    messages, gen, ctx, fmt = chat_prompt(lm, req, gen)
    return messages, await attach_grammar(lm.pipeline, gen, fmt, ctx), ctx


def chat_prompt(lm, req: dict, gen):
    """(messages, gen, ToolContext | None, format) of a chat request: the messages and the tools as
    the template renders them, and the format a grammar must force (None: nothing forced). What a
    prompt costs is counted from these (tokenize, count_tokens) without compiling the grammar."""
    from dataclasses import replace
    messages, pipe = req["messages"], lm.pipeline
    tools, tc = req.get("tools"), req.get("tool_choice")
    ctx, fmt = None, req.get("response_format")
    if tools and tc != "none":
        template = pipe.template
        style = tool_format(template)
        messages, kw = prepare_messages(messages, tools, template)
        gen = replace(gen, tools=kw.get("tools"))
        ctx = ToolContext(style, {t["function"]["name"] for t in tools}, tc != "auto")
        # A forced answer holds one call unless parallel calls are asked for explicitly: small models
        # repeat a finished call until max_tokens when the grammar lets them go on.
        fmt = tool_grammar(tools, tc, style, parallel=req.get("parallel_tool_calls") is True)
    elif any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        messages, _ = prepare_messages(messages, None, pipe.template)
    return messages, gen, ctx, fmt


async def attach_grammar(pipe, gen, fmt: dict | None, ctx: ToolContext | None = None):
    """`gen` with the grammar of `fmt` (a response_format, or a forced tool call's) compiled and
    attached; `gen` itself when there is none."""
    import asyncio
    import sys
    import time
    from dataclasses import replace
    if fmt is not None:
        t0 = time.perf_counter()
        compile_ = pipe.grammars.compile
        try:
            # compiling can take a while for a large schema: off the event loop where threads exist
            g = await asyncio.to_thread(compile_, fmt) if sys.platform != "emscripten" else compile_(fmt)
        except InvalidRequestError as e:
            if ctx is None:
                raise
            raise InvalidRequestError(f"A function's `parameters` cannot be used as a JSON Schema: {e}",
                                      param="tools") from None
        gen = replace(gen, grammar=g, grammar_init_s=time.perf_counter() - t0)
    return gen
