"""A chat request's prompt ids (LLMChatPipeline, llm.py): a raw completion prompt as it is, or the
chat template over the messages (only the template inserts special tokens), checked against the
context window with typed errors; with context_overflow "truncate" (and "shift") the oldest turns are
dropped until it fits. Functions of what they read (the tokenizer, the template, the window), so the
pipeline's parts are explicit. Page code: standard library only.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from ..config import GenerationConfig
from ..errors import ContextWindowTooLargeError, InvalidRequestError, ModelFormatError
from ..gpu import IN_BROWSER
from .detokenizer import safe_token_bytes

INLINE_CHARS = 20_000                      # longer prompts are tokenised in a worker thread


def prompt_ids(tokenizer, template, system_message: str | None, messages, prompt,
               template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> list[int]:
    """Prompt token ids: a raw completion prompt as it is (special-token texts parsed), or the chat
    template over `messages` (a chat config's system message first where they have none).
    `template_kwargs` go to the template's render (e.g. enable_thinking)."""
    if prompt is not None:
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    if template is None:
        raise ModelFormatError("This model has no chat template; use a completion prompt instead.")
    msgs = list(messages or [])
    if system_message and not any(m.get("role") == "system" for m in msgs):
        msgs = [{"role": "system", "content": system_message}] + msgs
    return template.encode(tokenizer, msgs, add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))


def template_kwargs(gen: GenerationConfig) -> dict:
    """What a request passes to the chat template's render besides the messages."""
    kw = {} if gen.enable_thinking is None else {"enable_thinking": gen.enable_thinking}
    if gen.reasoning_effort:
        kw["reasoning_effort"] = gen.reasoning_effort
    if gen.tools:
        kw["tools"] = gen.tools
    if gen.continue_final_message:
        kw["continue_final_message"] = True
    return kw


def longest_token_bytes(tokenizer, vocab_size: int) -> int:
    """Bytes of the longest token (>= its characters): a text of n characters has at least n / this
    many tokens."""
    tb = safe_token_bytes(tokenizer.token_bytes)
    return max((len(tb(i)) for i in range(vocab_size)), default=1) or 1


def _text_chars(content) -> int:
    """The characters of a message's text (a list's text parts: an image's URL is no text)."""
    if isinstance(content, list):
        return sum(len(str(p.get("text") or "")) for p in content if isinstance(p, dict))
    return len(str(content or ""))


async def checked_ids(ids_of: Callable, messages, prompt, kw: dict, *, window: int, ctx: int, truncate: bool,
                      token_bytes: Callable[[], int]) -> tuple[list[int], int | None]:
    """(prompt ids, messages dropped or None): `ids_of(messages, prompt, kw)` checked against the
    `window` positions a prompt may fill (ContextWindowTooLargeError, InvalidRequestError for an
    empty one); with `truncate` the oldest turns go until it fits `ctx` rows. `token_bytes()`: the
    longest token's bytes (a text too long for the window is refused before it is tokenised)."""
    dropped = None
    if prompt is None and truncate:
        messages, dropped = await _fit_messages(ids_of, messages, kw, ctx)
    chars = len(prompt) if prompt is not None else \
        sum(_text_chars(m.get("content")) for m in messages or [] if isinstance(m, dict))
    if chars > window * token_bytes():
        # no token spans more characters than the longest one: too long without tokenising it
        raise ContextWindowTooLargeError(
            f"The prompt has {chars} characters, more than the {window} tokens the context window "
            f"holds. Shorten the conversation or load with a larger context_window_size.",
            param="prompt" if prompt is not None else "messages")
    if chars > INLINE_CHARS and not IN_BROWSER:    # Pyodide: no worker threads
        # a long prompt is tokenised in a worker thread: the event loop serves others meanwhile
        ids = await asyncio.to_thread(ids_of, messages, prompt, kw)
    else:
        ids = ids_of(messages, prompt, kw)
    if len(ids) >= window:
        raise ContextWindowTooLargeError(
            f"The prompt has {len(ids)} tokens; the context window holds {window} (one more is needed "
            f"to answer). Shorten the conversation or load with a larger context_window_size.",
            param="messages")
    if not ids:
        raise InvalidRequestError("The prompt is empty.", param="prompt")
    return ids, dropped


async def _fit_messages(ids_of: Callable, messages: list[dict], kw: dict, ctx: int) -> tuple[list[dict], int]:
    """context_overflow "truncate": the conversation less its oldest turns (each from a user message
    up to the next one) after the leading system messages, until its prompt fits `ctx` rows with
    room for one token; the latest turn is always kept (if it alone does not fit, the caller's error
    names the limit). Returns (messages, how many were dropped)."""
    msgs = list(messages or [])
    head = 0
    while head < len(msgs) and msgs[head].get("role") == "system":
        head += 1
    dropped = 0
    while True:
        ids = ids_of(msgs, None, kw) if IN_BROWSER else await asyncio.to_thread(ids_of, msgs, None, kw)
        later_user = [i for i in range(head + 1, len(msgs)) if msgs[i].get("role") == "user"]
        if len(ids) < ctx or not later_user:
            break
        cut = later_user[0]                 # drop msgs[head:cut]: the oldest turn
        dropped += cut - head
        msgs = msgs[:head] + msgs[cut:]
    return msgs, dropped
