"""Typed request-validation errors (named after WebLLM's error.ts); each says what to change.

All are `InvalidRequestError`s (HTTP 400) with `param` set to the offending field, so the server can
turn them into OpenAI error JSON unchanged. Standard library only: they run in the browser too.
"""
from __future__ import annotations

import reprlib

from ..errors import InvalidRequestError


class FieldTypeError(InvalidRequestError):
    """A field has the wrong JSON type."""

    def __init__(self, param: str, expected: str, got: object):
        super().__init__(f"`{param}` must be {expected}, got {_show(got)}.", param=param)


class RangeError(InvalidRequestError):
    """A number outside its allowed interval; the interval is written like [lo, hi] or (lo, hi]."""

    def __init__(self, param: str, lo: float, hi: float, got: object, *, lo_open: bool = False,
                 extra: str = ""):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        super().__init__(f"`{param}` must be in {interval}, got {_show(got)}. Choose a value in "
                         f"{interval}{'; ' + extra if extra else ''}.", param=param)


class MinValueError(InvalidRequestError):
    def __init__(self, param: str, minimum: int, got: object):
        super().__init__(f"`{param}` must be at least {minimum}, got {_show(got)}.", param=param)


class InvalidNumberStringError(InvalidRequestError):
    """logit_bias keys must be token ids written as strings."""

    def __init__(self, param: str, got: object):
        super().__init__(f"`{param}` keys must be token ids written as strings of digits (e.g. "
                         f"{{\"50256\": -100}}), got key {_show(got)}.", param=param)


class LimitExceededError(InvalidRequestError):
    """A request asks for more work than the server's per-request limits allow (RequestLimits)."""

    def __init__(self, param: str, what: str, limit: int, got: int, hint: str = ""):
        super().__init__(f"Too many {what} in `{param}`: at most {limit} allowed, got {got}."
                         f"{' ' + hint if hint else ''}", param=param)


class InvalidTextError(InvalidRequestError):
    """Text that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800" from JSON escapes):
    no tokenizer can encode it."""

    def __init__(self, param: str, where: str, pos: int, char: str):
        super().__init__(f"`{where}` contains a lone UTF-16 surrogate U+{ord(char):04X} at character "
                         f"{pos}; send valid Unicode text (a surrogate must be paired, or replace it).",
                         param=param)


class DependencyError(InvalidRequestError):
    """A field that only makes sense together with another one."""

    def __init__(self, param: str, requires: str, value: object):
        super().__init__(f"`{param}` requires `{requires}` to be {_show(value)}. Set `{requires}` "
                         f"to {_show(value)} or remove `{param}`.", param=param)


class StreamingCountError(InvalidRequestError):
    def __init__(self, n: int):
        super().__init__(f"When streaming, `n` cannot be > 1 (got n={n}). Set stream=false to get "
                         f"several choices, or n=1 to stream.", param="n")


class SeedTypeError(InvalidRequestError):
    def __init__(self, got: object):
        super().__init__(f"`seed` must be an integer, got {_show(got)}. Pass a whole number such as 42.",
                         param="seed")


class InvalidStreamOptionsError(InvalidRequestError):
    def __init__(self):
        super().__init__("`stream_options` is only allowed when `stream` is true. Set stream=true or "
                         "remove stream_options.", param="stream_options")


class SystemMessageOrderError(InvalidRequestError):
    def __init__(self, index: int):
        super().__init__(f"The system message must be the first message; found one at messages[{index}]. "
                         f"Move it to messages[0] (only one system message is allowed).",
                         param="messages")


class MessageOrderError(InvalidRequestError):
    def __init__(self, role: object):
        super().__init__(f"The last message must come from `user` or `tool` (or `assistant`, whose text "
                         f"the answer continues), got {_show(role)}. End the conversation with the "
                         f"message the model should answer.",
                         param="messages")


class UnsupportedRoleError(InvalidRequestError):
    def __init__(self, index: int, role: object):
        super().__init__(f"messages[{index}].role must be one of system, user, assistant, tool; got "
                         f"{_show(role)}.", param="messages")


class ContentTypeError(InvalidRequestError):
    def __init__(self, index: int, detail: str):
        super().__init__(f"messages[{index}].content {detail}", param="messages")


class EmptyMessagesError(InvalidRequestError):
    def __init__(self):
        super().__init__("`messages` must be a non-empty list of {role, content} objects.",
                         param="messages")


class UnsupportedFieldsError(InvalidRequestError):
    def __init__(self, param: str, detail: str):
        super().__init__(f"`{param}` is not supported: {detail}", param=param)


class EmbeddingInputEmptyError(InvalidRequestError):
    def __init__(self, detail: str = "an empty list"):
        super().__init__(f"`input` must not be empty (got {detail}). Pass a string, a list of strings, "
                         f"a list of token ids or a list of token-id lists.", param="input")


class EmbeddingUnsupportedEncodingFormatError(InvalidRequestError):
    def __init__(self, got: object):
        super().__init__(f"`encoding_format` {_show(got)} is not supported by the engine; use \"float\" "
                         f"(the HTTP server converts to base64 itself).", param="encoding_format")


class PromptTypeError(InvalidRequestError):
    def __init__(self, got: object):
        super().__init__(f"`prompt` must be a string (or a list holding exactly one string), got "
                         f"{_show(got)}. Send one prompt per request, with n for several choices.",
                         param="prompt")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _show(v: object) -> str:
    """A short, bounded rendering of a client's value (never the whole of a huge or deep one)."""
    if isinstance(v, str):
        s = f'"{v[:60]}"'
    elif isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        s = f"an integer of {v.bit_length()} bits"
    else:
        try:
            s = _REPR.repr(v)
        except (ValueError, RecursionError):   # e.g. huge ints inside a list
            s = f"a {type(v).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."
