"""gpt-oss's answers in harmony, its chat format, as OpenAI's message fields while they stream: an
answer is messages in channels, each `<|channel|>NAME [to=RECIPIENT] [<|constrain|>json]<|message|>
TEXT` ended by `<|end|>` (the next one opened by `<|start|>assistant`), `<|call|>` or `<|return|>`:

    analysis                        -> reasoning_content
    final, or commentary to no one  -> content (commentary: the preambles it writes before calls)
    commentary to=functions.NAME    -> a tool call of NAME, its text the arguments (JSON)

The family selects this parser (DecoderFamily.chat_format "harmony"); it has the interface of
engine/output.py's OutputParser, and its streamed deltas add up to the message `finish` returns.
Standard library only (this runs in the page too).
"""
from __future__ import annotations

import re

from .tools import HERMES, ToolContext, _call_id, held_tail

START, END, MESSAGE, CHANNEL, RETURN, CALL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", \
    "<|call|>"
_ENDS = (END, RETURN, CALL, START)              # what ends a message's text
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """Streams a harmony answer into reasoning, content and tool-call deltas (see the module)."""

    def __init__(self, tools: ToolContext | None):
        self.tools = tools
        self.buf, self.in_body, self.kind = "", False, "content"
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict] = []              # index, id, name, args

    def feed(self, text: str, final: bool = False) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            if not self.in_body:                 # a header: wait for its <|message|>
                i = self.buf.find(MESSAGE)
                if i < 0:
                    if final:
                        self.buf = ""
                    return out
                self._open(self.buf[:i], out)
                self.buf, self.in_body = self.buf[i + len(MESSAGE):], True
                continue
            ends = [(j, m) for m in _ENDS if (j := self.buf.find(m)) >= 0]
            if ends:
                j, mark = min(ends)
                self._text(self.buf[:j], out)
                self.buf, self.in_body = self.buf[j + len(mark):], False
                continue
            keep = 0 if final else held_tail(self.buf, _ENDS)
            self._text(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def _open(self, header: str, out: list) -> None:
        """A message's header: its channel and recipient decide where its text goes."""
        channel = _CHANNEL.search(header)
        to = _RECIPIENT.search(header)
        name = to.group(1)[len("functions."):] if to and to.group(1).startswith("functions.") else None
        if name and self.tools is not None:
            call = {"index": len(self.calls), "id": _call_id(HERMES), "name": name, "args": ""}
            self.calls.append(call)
            out.append({"tool_calls": [{"index": call["index"], "id": call["id"], "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            self.kind = "call"
        else:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"

    def _text(self, s: str, out: list) -> None:
        if not s:
            return
        if self.kind == "call":
            call = self.calls[-1]
            call["args"] += s
            out.append({"tool_calls": [{"index": call["index"], "function": {"arguments": s}}]})
            return
        (self.reasoning if self.kind == "reasoning" else self.content).append(s)
        key = "reasoning_content" if self.kind == "reasoning" else "content"
        if out and list(out[-1]) == [key]:
            out[-1] = {key: out[-1][key] + s}
        else:
            out.append({key: s})

    def finish(self, finish_reason: str) -> tuple[list[dict], dict, str]:
        """(the last deltas, the message: content, reasoning_content, tool_calls, finish_reason)."""
        out = self.feed("", final=True)
        content = "".join(self.content)
        msg: dict = {"role": "assistant", "content": content}
        if self.calls:
            msg["content"] = content if content.strip() else None
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["args"]}}
                                 for c in self.calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        return out, msg, finish_reason
