"""Rules for structured output and function calling: `response_format`, `tools`, `tool_choice` and
assistant `tool_calls` in chat requests, with WebLLM's typed errors. Standard library only (they run
in the browser too, where the fields are then refused by the pipeline: no llguidance there).

`check_response_format(rf)` returns a normalised copy: {"type": "text"} or
{"type": "json_object" | "json_schema" | "grammar" | "regex", ...} where json_schema carries
`schema` (a dict; OpenAI's `json_schema.schema` and WebLLM's `json_object.schema` both land here).
"""
from __future__ import annotations

import json
import re
from typing import Any

from ..errors import InvalidRequestError
from .errors import FieldTypeError

MAX_GRAMMAR_CHARS = 100_000          # a schema or grammar text larger than this is refused
FORMATS = ("text", "json_object", "json_schema", "grammar", "regex")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class InvalidResponseFormatError(InvalidRequestError):
    """WebLLM: a response_format that is not one of the known shapes, or a schema that does not compile."""

    def __init__(self, detail: str):
        super().__init__(f"Invalid `response_format`: {detail}", param="response_format")


class InvalidResponseFormatGrammarError(InvalidRequestError):
    """WebLLM: `type: grammar` without a grammar, or a grammar that does not compile."""

    def __init__(self, detail: str = "When ResponseFormat.type is `grammar`, ResponseFormat.grammar "
                                     "needs to be specified."):
        super().__init__(f"Invalid `response_format.grammar`: {detail}", param="response_format")


class InvalidResponseFormatRegexError(InvalidRequestError):
    """Our extension `type: regex`: a missing or invalid pattern."""

    def __init__(self, detail: str):
        super().__init__(f"Invalid `response_format.regex`: {detail}", param="response_format")


class UnsupportedToolTypeError(InvalidRequestError):
    def __init__(self, got: object):
        super().__init__(f"Only 'function' tool type is supported, got {got!r}.", param="tools")


class UnsupportedToolChoiceTypeError(InvalidRequestError):
    def __init__(self, got: object):
        super().__init__("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {got!r}.",
                         param="tool_choice")


class FunctionNotFoundError(InvalidRequestError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(f"tool_choice names function {name!r}, which `tools` does not define "
                         f"(defined: {known}).", param="tool_choice")


def _schema(value: Any, where: str) -> dict:
    if isinstance(value, str):
        if len(value) > MAX_GRAMMAR_CHARS:
            raise InvalidResponseFormatError(f"{where} is longer than {MAX_GRAMMAR_CHARS} characters.")
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidResponseFormatError(f"{where} is not valid JSON ({e}).") from None
    if isinstance(value, bool):            # JSON Schema allows true/false; only objects are useful
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise InvalidResponseFormatError(f"{where} must be a JSON Schema object, got {type(value).__name__}.")
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise InvalidResponseFormatError(f"{where} is longer than {MAX_GRAMMAR_CHARS} characters.")
    return value


def check_response_format(rf: Any) -> dict | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in FORMATS:
        raise FieldTypeError("response_format", "an object with type one of " + ", ".join(FORMATS), rf)
    kind = rf["type"]
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        schema = rf.get("schema")
        if schema is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "schema": _schema(schema, "response_format.schema")}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if js is None and "schema" in rf:        # our normalised form (a request checked twice)
            js = rf
        if not isinstance(js, dict) or "schema" not in js:
            raise InvalidResponseFormatError("type `json_schema` needs `json_schema: {name, schema, "
                                             "strict}` with a `schema`.")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidResponseFormatError("`json_schema.name` must be a string.")
        return {"type": "json_schema", "schema": _schema(js["schema"], "response_format.json_schema.schema"),
                "name": name}
    if kind == "grammar":
        g = rf.get("grammar")
        if not isinstance(g, str) or not g.strip():
            raise InvalidResponseFormatGrammarError()
        if len(g) > MAX_GRAMMAR_CHARS:
            raise InvalidResponseFormatGrammarError(f"longer than {MAX_GRAMMAR_CHARS} characters.")
        return {"type": "grammar", "grammar": g}
    pattern = rf.get("regex", rf.get("pattern"))
    if not isinstance(pattern, str) or not pattern:
        raise InvalidResponseFormatRegexError("type `regex` needs a non-empty `regex` string.")
    if len(pattern) > MAX_GRAMMAR_CHARS:
        raise InvalidResponseFormatRegexError(f"longer than {MAX_GRAMMAR_CHARS} characters.")
    return {"type": "regex", "regex": pattern}


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict] | None, Any]:
    """Normalised (tools, tool_choice): tools as [{"type": "function", "function": {name,
    description?, parameters}}], tool_choice as "none" | "auto" | "required" | a function name
    (dict form)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise UnsupportedToolChoiceTypeError(tool_choice)
        return None, None
    if not isinstance(tools, list):
        raise FieldTypeError("tools", "a list of {type: function, function: {...}} objects", tools)
    out, names = [], []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise FieldTypeError(f"tools[{i}]", "an object", t)
        if t.get("type", "function") != "function":
            raise UnsupportedToolTypeError(t.get("type"))
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
            raise FieldTypeError(f"tools[{i}].function", "an object with a `name` of 1-64 letters, digits, "
                                 "_ or - (as OpenAI requires)", f)
        if f["name"] in names:
            raise FieldTypeError(f"tools[{i}].function.name", "unique among the tools", f["name"])
        params = f.get("parameters")
        try:
            params = {"type": "object", "properties": {}} if params is None else \
                _schema(params, f"tools[{i}].function.parameters")
        except InvalidResponseFormatError:
            raise FieldTypeError(f"tools[{i}].function.parameters", "a JSON Schema object", params) from None
        fn = {"name": f["name"], "parameters": params}
        if isinstance(f.get("description"), str):
            fn["description"] = f["description"]
        out.append({"type": "function", "function": fn})
        names.append(f["name"])
    tc = "auto" if tool_choice is None else tool_choice
    if isinstance(tc, dict):
        fn = tc.get("function") if tc.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise UnsupportedToolChoiceTypeError(tool_choice)
        if name not in names:
            raise FunctionNotFoundError(name, names)
        tc = {"type": "function", "function": {"name": name}}
    elif tc not in ("none", "auto", "required"):
        raise UnsupportedToolChoiceTypeError(tool_choice)
    return out, tc


def check_tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's `tool_calls`, normalised for the chat template: arguments as objects
    (templates print them as JSON) — OpenAI sends them as JSON strings."""
    if not isinstance(calls, list):
        raise FieldTypeError(f"messages[{i}].tool_calls", "a list", calls)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise FieldTypeError(f"messages[{i}].tool_calls[{j}]",
                                 "{id, type, function: {name, arguments}}", c)
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise FieldTypeError(f"messages[{i}].tool_calls[{j}].function.arguments",
                                     "a JSON object (as a string)", args) from None
        if args is None:
            args = {}
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else f"call_{j}",
                    "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out
