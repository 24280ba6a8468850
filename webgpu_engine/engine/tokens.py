"""Token counting for clients that split text to fit a model (RAG chunkers, context budgeting):
`engine.tokenize(...)` / `engine.detokenize(...)`, served as POST /tokenize and /detokenize in vLLM's
shapes (llama.cpp's field names accepted too).

    tokenize:   {model?, prompt | content, add_special_tokens?}                 -> a raw text's ids
                {model?, messages, tools?, tool_choice?, enable_thinking?,
                 add_generation_prompt?}                                        -> the chat template's
                -> {tokens, count, max_model_len}
    detokenize: {model?, tokens} -> {prompt, content}   (ids beyond the vocabulary: a 400)

A prompt is tokenised as a completion prompt is (`add_special_tokens`, default true: the model's BOS
where it has one); messages as a chat request's are (validated by the same rules, the chat config's
system message first, only the template inserting special tokens), so `count` is what a request with
that text would cost. Embedders take a prompt (as their inputs are tokenised) and no messages.
Tokenising runs in a worker thread (inline in the page, which has none). Standard library only.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable

from ..errors import InvalidRequestError
from ..protocol.errors import FieldTypeError, RangeError
from ..protocol.rules import check_chat_request
from .records import EMBEDDING
from .requests import gen_config, request_fields
from .tools import chat_prompt

# what a chat request's prompt depends on besides its messages
CHAT_PROMPT_FIELDS = ("messages", "tools", "tool_choice", "enable_thinking", "reasoning_effort")


_THREADS = sys.platform != "emscripten"     # Pyodide: no worker threads


async def _off_loop(fn, *args):
    """fn(*args) in a worker thread (tokenising long text must not hold the event loop), inline in
    the page."""
    return await asyncio.to_thread(fn, *args) if _THREADS else fn(*args)


def _flag(req: dict, name: str, default: bool) -> bool:
    v = req.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise FieldTypeError(name, "true or false", v)
    return v


class Tokenizing:
    """AsyncMLCEngine's tokenize / detokenize (engine.py delegates them here): `select` is the
    engine's model selection (AsyncMLCEngine.select), `config` its EngineConfig (the request limits)."""

    def __init__(self, select: Callable, config):
        self.select, self.config = select, config

    async def tokenize(self, request: Any = None, **fields) -> dict:
        req = request_fields(request, fields)
        lm = await self.select(req.get("model"), None, "tokenize")
        texts = [k for k in ("prompt", "content", "messages") if req.get(k) is not None]
        if len(texts) != 1:
            raise InvalidRequestError("tokenize takes exactly one of prompt (or content) and messages, "
                                      f"got {texts or 'none'}.", param="prompt")
        pipe, key = lm.pipeline, texts[0]
        if key == "messages":
            if lm.model_type == EMBEDDING:
                raise InvalidRequestError(f"{lm.model_id} is an embedding model: it has no chat template; "
                                          "tokenize a prompt instead.", param="messages")
            # the prompt as a chat request with these fields renders it: tools offered, thinking switch
            chat = check_chat_request({k: req[k] for k in CHAT_PROMPT_FIELDS if k in req}, self.config.limits)
            msgs, gen, _, _ = chat_prompt(lm, chat, gen_config(lm, chat))
            gen_prompt = _flag(req, "add_generation_prompt", True)
            ids = await _off_loop(pipe.prompt_ids, msgs, None, pipe.template_kwargs(gen), gen_prompt)
        else:
            text = req[key]
            if not isinstance(text, str):
                raise FieldTypeError(key, "a string", text)
            special = _flag(req, "add_special_tokens", True)
            kw = {"add_special_tokens": special}
            if lm.model_type == EMBEDDING:
                kw["max_length"] = 1 << 30                  # count all of it (inputs are cut later)
            ids = await _off_loop(lambda: pipe.tokenizer.encode(text, **kw))
        ctx = pipe.max_seq_length if lm.model_type == EMBEDDING else lm.describe()["context_window"]
        ids = [int(i) for i in ids]
        return {"tokens": ids, "count": len(ids), "max_model_len": int(ctx)}

    async def detokenize(self, request: Any = None, **fields) -> dict:
        req = request_fields(request, fields)
        lm = await self.select(req.get("model"), None, "detokenize")
        ids = req.get("tokens")
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise FieldTypeError("tokens", "a list of token ids (integers)", ids)
        tok = lm.pipeline.tokenizer
        vocab = int(getattr(lm.pipeline, "vocab_size", 0) or tok.vocab_size)
        for i in ids:
            if not 0 <= i < vocab:
                raise RangeError("tokens", 0, vocab - 1, i, extra=f"token ids of {lm.model_id} are below {vocab}")
        text = await _off_loop(lambda: tok.decode(ids, skip_special_tokens=False))
        return {"prompt": text, "content": text}
