"""A chat answer's text as OpenAI's message fields, built as the text streams in: the thinking of
a reasoning model (`reasoning_content`), the answer (`content`) and tool calls (`tool_calls`, their
arguments streamed as the model writes them). The streamed deltas of `OutputParser` add up to the
message `finish()` returns for the same text. Standard library only (this runs in the page too).

Reasoning: templates that mention `<think>` (Qwen3, QwQ, DeepSeek-R1 and its distils) mark the
thinking as `<think> ... </think>`; a prompt whose generation prompt leaves a `<think>` open (R1's
templates do) starts the answer inside it. Whitespace next to the tags is dropped. Text before a
`<think>` that never closes stays reasoning (an answer cut short while thinking).
"""
from __future__ import annotations

import json
import re

from .tools import HERMES, LLAMA3, MISTRAL, ToolContext, _call_id, held_tail

THINK, END_THINK = "<think>", "</think>"


def has_reasoning(template) -> bool:
    """Whether a chat template writes thinking as <think> ... </think>."""
    return THINK in (getattr(template, "source", "") or "")


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a <think> open (the answer begins inside the thinking)."""
    return prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK)


class ReasoningSplitter:
    """Streams text into ("reasoning", s) and ("content", s) pieces."""

    def __init__(self, in_reasoning: bool):
        self.mode = "reasoning" if in_reasoning else "content"
        self.buf = ""
        self.seg_start = True        # at the start of a segment: leading whitespace is dropped
        self.seen_content = False    # content so far (a <think> after it is plain text)

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            mark = self._mark()
            i = self.buf.find(mark) if mark else -1
            if i < 0 or (mark == THINK and self.buf[:i].strip()):   # <think> only opens an answer
                break
            self._emit(out, self.buf[:i].rstrip())
            self.buf = self.buf[i + len(mark):]
            self.mode = "content" if self.mode == "reasoning" else "reasoning"
            self.seg_start = True
        if final:
            self._emit(out, self.buf.rstrip() if self.mode == "reasoning" else self.buf)
            self.buf = ""
            return out
        # hold back what may begin a tag, and trailing whitespace (dropped if a tag follows)
        mark = self._mark()
        if mark == THINK and self.buf.strip() and not THINK.startswith(self.buf.lstrip()):
            self.seen_content, mark = True, None        # text came first: no thinking follows
        keep = held_tail(self.buf, (mark,)) if mark else 0
        body = self.buf[:len(self.buf) - keep]
        stripped = body.rstrip()
        if mark is None:
            stripped = body
        self._emit(out, stripped)
        self.buf = self.buf[len(stripped):]
        return out

    def _mark(self) -> str | None:
        if self.mode == "reasoning":
            return END_THINK
        return None if self.seen_content else THINK

    def _emit(self, out: list, s: str) -> None:
        if self.seg_start:
            s = s.lstrip()
        if not s:
            return
        self.seg_start = False
        if self.mode == "content":
            self.seen_content = True
        if out and out[-1][0] == self.mode:
            out[-1] = (self.mode, out[-1][1] + s)
        else:
            out.append((self.mode, s))


_NAME_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
_STARTS = {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]", LLAMA3: ""}
_SEPARATORS = " \t\r\n,;[]"
_TAGS = ("<tool_call>", "</tool_call>")
_ARGS_KEY_RE = re.compile(r'"(arguments|parameters)"\s*:')


class _JsonEnd:
    """Finds where one JSON value ends in text that arrives in pieces (strings and nesting tracked)."""

    def __init__(self):
        self.depth, self.in_str, self.esc, self.started, self.done = 0, False, False, False, False

    def feed(self, s: str) -> int:
        """How many characters of `s` belong to the value (all of them while it is open)."""
        for i, ch in enumerate(s):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if not self.started and ch.isspace():
                continue
            self.started = True
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
            elif self.depth == 0 and ch in ",}] \n":
                self.done = True
                return i
        return len(s)


class ToolCallStreamer:
    """Streams tool calls as OpenAI does: per call a delta with index, id, type and name once the
    name is known, then the arguments in fragments as they are generated. Content before the first
    call marker streams as content. Calls not written as `{"name": ..., "arguments": {...}}` (in
    that order, arguments an object) are held and sent whole at the end, from the parsed answer."""

    def __init__(self, ctx: ToolContext):
        self.ctx, self.text, self.sent = ctx, "", 0     # sent: content characters sent
        self.calls: list[dict] = []                     # streamed calls: index, id, name, args text
        self.pos: int | None = None                     # where call parsing stands in text
        self.state = "header"                           # header | args | close
        self.json: _JsonEnd | None = None
        self.gave_up = False

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) after `delta`."""
        self.text += delta
        if self.pos is None:
            if self.gave_up:
                return "", []
            # content before a call marker, less trailing whitespace (held: it may precede a call)
            safe = len(self.text[:self.ctx.safe_prefix(self.text)].rstrip())
            content = self.text[self.sent:safe] if safe > self.sent else ""
            self.sent = max(self.sent, safe)
            start = self._call_start()
            if start is None:
                return content, []
            self.pos = start
            return content, self._advance()
        return "", self._advance()

    def _call_start(self) -> int | None:
        if self.ctx.fmt == LLAMA3:
            t = self.text.lstrip()
            if t.startswith("<|python_tag|>"):
                return len(self.text) - len(t) + len("<|python_tag|>")
            return len(self.text) - len(t) if t.startswith("{") else None
        i = self.text.find(_STARTS[self.ctx.fmt])
        return None if i < 0 else i + len(_STARTS[self.ctx.fmt])

    def _give_up(self) -> None:
        self.pos, self.gave_up = None, True      # the end decides (ToolContext.finish)

    def _advance(self) -> list[dict]:
        out: list[dict] = []
        while self.pos is not None:
            rest = self.text[self.pos:]
            if self.state == "header":
                skip = len(rest) - len(rest.lstrip(_SEPARATORS))
                body = rest[skip:]
                if self.ctx.fmt == HERMES and body.startswith(_TAGS):
                    self.pos += skip + body.index(">") + 1
                    continue
                m = _NAME_RE.match(body)
                if m is None:
                    partial_tag = self.ctx.fmt == HERMES and any(t.startswith(body) for t in _TAGS)
                    # not (yet) `{"name": "...", "arguments": `: wait while it may still become one
                    if body and not partial_tag and (body[0] != "{" or len(body) > 400
                                                     or _ARGS_KEY_RE.search(body)):
                        self._give_up()
                    return out
                if m.end() == len(body):
                    return out
                name = json.loads(f'"{m.group(1)}"')
                if name not in self.ctx.names or body[m.end()] != "{":
                    self._give_up()
                    return out
                call = {"index": len(self.calls), "id": _call_id(self.ctx.fmt), "name": name, "args": ""}
                self.calls.append(call)
                out.append({"tool_calls": [{"index": call["index"], "id": call["id"], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
                self.pos += skip + m.end()
                self.state, self.json = "args", _JsonEnd()
            elif self.state == "args":
                if not rest:
                    return out
                n = self.json.feed(rest)
                self.pos += n
                if n:
                    call = self.calls[-1]
                    call["args"] += rest[:n]
                    out.append({"tool_calls": [{"index": call["index"], "function": {"arguments": rest[:n]}}]})
                if not self.json.done:
                    return out
                self.state = "close"
            else:                       # the call object's closing brace
                j = rest.find("}")
                if j < 0:
                    return out
                self.pos += j + 1
                self.state = "header"
        return out

    def finish(self, finish_reason: str) -> tuple[str, list[dict], dict, str]:
        """At the end: (content still to send, tool-call deltas still to send, the message's
        `content` and `tool_calls`, finish_reason)."""
        msg = {"content": self.text}
        reason = self.ctx.finish(msg, finish_reason)
        parsed = msg.get("tool_calls") or []
        if not self.calls and not parsed:          # it was text after all
            return self.text[self.sent:], [], {"content": self.text}, reason
        deltas = []
        if not self.calls:                         # calls not streamed as they came: sent whole now
            for i, c in enumerate(parsed):
                f = c["function"]
                deltas.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                               "function": {"name": f["name"], "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": f["arguments"]}}]})
            calls = parsed
        else:                                      # the message holds what was streamed
            calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                     for c in self.calls]
            reason = "tool_calls" if finish_reason == "stop" else finish_reason
        content = self.text[:self.sent]
        return "", deltas, {"content": content if content.strip() else None, "tool_calls": calls}, reason


class OutputParser:
    """A chat answer's text → OpenAI deltas as it streams (`feed`), and the finished message
    (`finish`): reasoning split off when the template thinks, tool calls when tools were offered.
    With neither, every delta is plain content."""

    def __init__(self, reasoning: bool | None, tools: ToolContext | None):
        """reasoning: None (no thinking in this template), else whether the answer starts inside it."""
        self.split = None if reasoning is None else ReasoningSplitter(reasoning)
        self.tools = None if tools is None else ToolCallStreamer(tools)
        self.content, self.reasoning = [], []

    def feed(self, text: str, final: bool = False) -> list[dict]:
        pieces = self.split.feed(text, final) if self.split else ([("content", text)] if text else [])
        out: list[dict] = []
        for kind, s in pieces:
            if kind == "reasoning":
                self.reasoning.append(s)
                out.append({"reasoning_content": s})
            elif self.tools is None:
                self.content.append(s)
                out.append({"content": s})
            else:
                content, calls = self.tools.feed(s)
                if content:
                    out.append({"content": content})
                out.extend(calls)
        return out

    def finish(self, finish_reason: str) -> tuple[list[dict], dict, str]:
        """(the last deltas, the message: content, reasoning_content, tool_calls, finish_reason)."""
        out = self.feed("", final=True) if self.split else []
        msg: dict = {"role": "assistant"}
        if self.tools is not None:
            content, calls, fields, finish_reason = self.tools.finish(finish_reason)
            if content:
                out.append({"content": content})
            out.extend(calls)
            msg["content"] = fields.get("content")
            if fields.get("tool_calls"):
                msg["tool_calls"] = fields["tool_calls"]
        else:
            msg["content"] = "".join(self.content)
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        return out, msg, finish_reason


def output_parser(pipe, messages, gen, tools: ToolContext | None):
    """The parser of one chat answer: thinking split off when the model's template thinks (starting
    inside it when the rendered prompt leaves a <think> open), tool calls when tools were offered;
    the family's own when it has one (DecoderFamily.chat_format: gpt-oss's harmony)."""
    if chat_format(pipe) == "harmony" or (tools is not None and tools.fmt == "harmony"):
        from .harmony import HarmonyParser
        return HarmonyParser(tools)
    tpl = getattr(pipe, "template", None)
    reasoning = None
    if messages is not None and tpl is not None and has_reasoning(tpl):
        text = tpl.render(messages, add_generation_prompt=not gen.continue_final_message,
                          **pipe.template_kwargs(gen))
        reasoning = starts_in_reasoning(text)
    return OutputParser(reasoning, tools)


def chat_format(pipe) -> str:
    """The answer format of a pipeline's model family ("": the template's <think> and tool markers)."""
    from ..loaders.decoder_config import FAMILIES
    fam = FAMILIES.get(getattr(getattr(pipe, "model_config", None), "arch", ""))
    return fam.chat_format if fam is not None else ""
