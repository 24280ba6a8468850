"""`chat` command options for structured output and function calling (--json, --json-schema,
--grammar, --regex, --tools, --tool-choice) and the turn loop that runs tool calls by asking the
user for each result on stdin (the CLI has no functions of its own to run)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def add_options(p) -> None:
    g = p.add_argument_group("structured output and tools")
    g.add_argument("--json", action="store_true", help="JSON mode: the answer is a JSON object")
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON", help="answer by this JSON Schema")
    g.add_argument("--grammar", default=None, metavar="FILE|TEXT", help="answer by this GBNF or Lark grammar")
    g.add_argument("--regex", default=None, help="answer matching this regular expression")
    g.add_argument("--tools", default=None, metavar="FILE|JSON",
                   help="OpenAI tools (a JSON list); results of calls are read from stdin")
    g.add_argument("--tool-choice", default=None, metavar="auto|none|required|NAME")


def _text_or_file(v: str) -> str:
    p = Path(v)
    try:
        if len(v) < 4096 and p.is_file():
            return p.read_text(encoding="utf-8")
    except OSError:
        pass
    return v


def request_fields(args) -> dict:
    """The chat request fields the options ask for (validated by the engine like any request)."""
    from .models import lora_request
    out: dict = lora_request(args)
    if args.json:
        out["response_format"] = {"type": "json_object"}
    if args.json_schema:
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "cli", "schema": json.loads(_text_or_file(args.json_schema))}}
    if args.grammar:
        out["response_format"] = {"type": "grammar", "grammar": _text_or_file(args.grammar)}
    if args.regex:
        out["response_format"] = {"type": "regex", "regex": args.regex}
    if args.tools:
        out["tools"] = json.loads(_text_or_file(args.tools))
    if args.tool_choice:
        tc = args.tool_choice
        out["tool_choice"] = tc if tc in ("auto", "none", "required") else \
            {"type": "function", "function": {"name": tc}}
    return out


async def run_turn(engine, messages: list[dict], args, read=input, write=print) -> None:
    """Stream one answer; while it is tool calls, ask for each call's result and answer again.
    Appends the assistant and tool messages to `messages`."""
    fields = request_fields(args)
    while True:
        stream = await engine.chat.completions.create(
            messages=messages, stream=True, max_tokens=args.max_tokens, temperature=args.temperature,
            seed=args.seed, **fields)
        text, calls = [], {}
        async for chunk in stream:
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta.to_dict() if hasattr(chunk.choices[0].delta, "to_dict") else \
                dict(chunk.choices[0].delta)
            if d.get("content"):
                text.append(d["content"])
                write(d["content"], end="", flush=True)
            for tc in d.get("tool_calls") or []:
                acc = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                acc["id"] = tc.get("id") or acc["id"]
                acc["name"] += (tc.get("function") or {}).get("name") or ""
                acc["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        if text:
            write()
        msg = {"role": "assistant", "content": "".join(text)}
        if not calls:
            messages.append(msg)
            return
        msg["content"] = msg["content"] or None
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in calls.values()]
        messages.append(msg)
        for c in calls.values():
            write(f"[tool call] {c['name']}({c['arguments']})")
            write(f"result of {c['name']}> ", end="", flush=True)
            try:
                result = read()
            except EOFError:
                write()
                return
            if not sys.stdin.isatty():
                write(result)
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        fields.pop("tool_choice", None)     # the answer after the results is the model's choice
