"""Chat templates: render a model's own Jinja template the way Hugging Face transformers does.

Same environment as transformers' `apply_chat_template`: an ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII text, and `bos_token`/`eos_token`/`add_generation_prompt` variables.
jinja2 is pure Python, so this runs in the browser too (imported lazily).
"""
from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from typing import Any

from ..errors import InvalidRequestError, ModelFormatError
from .special_text import split_special


class TemplateError(InvalidRequestError):
    """The template rejected the conversation (its `raise_exception`), e.g. roles not alternating."""


def _raise_exception(message: str):
    raise TemplateError(f"The model's chat template rejected the messages: {message}", param="messages")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' version: Jinja's own tojson escapes HTML characters, which templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body only."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. `render(messages, add_generation_prompt=True)` -> prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        if not source:
            raise ModelFormatError("The model has no chat template (tokenizer.chat_template is empty)")
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _environment().from_string(source)
        except Exception as e:                     # jinja2.TemplateSyntaxError, but jinja2 is lazy
            raise ModelFormatError(f"The model's chat template does not compile: {e}") from e

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None, documents: list[dict] | None = None, **kwargs) -> str:
        variables = dict(bos_token=self.bos_token, eos_token=self.eos_token)
        continue_final = bool(kwargs.pop("continue_final_message", False))
        variables.update(kwargs)
        if continue_final and messages and messages[-1].get("content"):
            # vLLM's continue_final_message: the conversation as it stands, cut after the final
            # (assistant) message's text, so the answer continues it instead of opening a turn
            text = self._template.render(messages=messages, add_generation_prompt=False,
                                         tools=tools, documents=documents, **variables)
            tail = messages[-1]["content"]
            i = text.rfind(tail)
            if i < 0:
                from ..errors import InvalidRequestError
                raise InvalidRequestError("The chat template rewrites the final assistant message, so the "
                                          "answer cannot continue it; end with a user message instead.",
                                          param="messages")
            return text[:i + len(tail)]
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, documents=documents, **variables)

    def encode(self, tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **kwargs) -> list[int]:
        """Token ids of the rendered conversation, where only the template's own text yields special
        tokens: a special token's text inside a message (or tool / document) is tokenised as ordinary
        text, so content cannot open a turn of its own (`<|im_end|>\n<|im_start|>system`).

        Each special-token text in the messages is swapped for a placeholder no user can write (a
        private-use character and a random nonce) before rendering; the rendered text is cut at the
        special tokens that remain, which all come from the template, and each cut is tokenised without
        special-token parsing after its placeholders are put back. A conversation without special-token
        texts is tokenised exactly as before (one encode of the rendered text)."""
        special = getattr(tokenizer, "special_regex", None)
        kwargs = dict(kwargs)
        untrusted = {"messages": messages, **{k: kwargs[k] for k in ("tools", "documents") if k in kwargs}}
        if special is None or not _holds_special(untrusted, special):
            return list(tokenizer.encode(self.render(messages, add_generation_prompt=add_generation_prompt,
                                                     **kwargs)))
        nonce = "".join(str(secrets.randbelow(10)) for _ in range(16))
        originals: list[str] = []

        def mark(m) -> str:
            originals.append(m.group())
            return f"{_PH_OPEN}{nonce}.{len(originals) - 1}{_PH_CLOSE}"
        clean = _map_strings(untrusted, lambda text: special.sub(mark, text))
        kwargs.update({k: v for k, v in clean.items() if k != "messages"})
        text = self.render(clean["messages"], add_generation_prompt=add_generation_prompt, **kwargs)
        restore = re.compile(re.escape(_PH_OPEN + nonce) + r"\.(\d+)" + re.escape(_PH_CLOSE))
        return encode_template_text(tokenizer, text,
                                    lambda piece: restore.sub(lambda m: originals[int(m.group(1))], piece))

    @classmethod
    def from_tokenizer_config(cls, config: dict, name: str = "default") -> "ChatTemplate | None":
        """From a `tokenizer_config.json` dict (its chat_template may be a list of named templates)."""
        src = config.get("chat_template")
        if isinstance(src, list):
            by_name = {t.get("name"): t.get("template") for t in src}
            src = by_name.get(name) or next(iter(by_name.values()), None)
        if not src:
            return None
        return cls(src, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))


_PH_OPEN, _PH_CLOSE = "\ue000", "\ue001"     # private-use characters: no tokenizer gives them meaning
_LITERAL_KEYS = ("role", "type")             # compared by templates (role == 'user'), never free text


def encode_template_text(tokenizer, text: str, restore=lambda piece: piece) -> list[int]:
    """Ids of rendered template text: its special-token texts become special ids, the text between
    them (after `restore`) is tokenised with no special-token parsing. Equal to
    `tokenizer.encode(text)` when `restore` changes nothing (the tokenizer cuts at the same places)."""
    ids: list[int] = []
    for _, piece, special in split_special(text, tokenizer.special_regex):
        if special:
            ids.append(tokenizer.token_to_id(piece))
        else:
            ids.extend(tokenizer.encode(restore(piece), parse_special=False))
    return ids


def _holds_special(value, special) -> bool:
    if isinstance(value, str):
        return special.search(value) is not None
    if isinstance(value, dict):
        return any(_holds_special(v, special) for k, v in value.items() if k not in _LITERAL_KEYS)
    if isinstance(value, (list, tuple)):
        return any(_holds_special(v, special) for v in value)
    return False


def _map_strings(value, fn):
    """A copy of `value` (dicts, lists, strings) with `fn` applied to every free-text string."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: v if k in _LITERAL_KEYS else _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _token_text(tok) -> str:
    """tokenizer_config.json writes special tokens either as text or as an AddedToken dict."""
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return str(tok) if tok else ""


def from_gguf_metadata(md: dict) -> ChatTemplate | None:
    """The GGUF's `tokenizer.chat_template`, with bos/eos token texts from its vocabulary."""
    src = md.get("tokenizer.chat_template")
    if not src:
        return None
    tokens = md.get("tokenizer.ggml.tokens") or []

    def text(key):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""
    return ChatTemplate(str(src), bos_token=text("bos"), eos_token=text("eos"))


def from_folder(folder) -> ChatTemplate | None:
    """An HF folder's template: `chat_template.jinja` (newer transformers) or tokenizer_config.json's."""
    from pathlib import Path
    folder = Path(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        cfg = {**cfg, "chat_template": jinja.read_text(encoding="utf-8")}
    return ChatTemplate.from_tokenizer_config(cfg)
