"""The pipeline contract: what the engine calls on, and reads from, a loaded chat or embedding model.

The engine (engine/engine.py, requests.py, coalesce.py, rerank.py, tools.py) is written against
these two `typing.Protocol`s and calls their members directly, without probing: a class given in
`EngineConfig.pipeline_factories` is checked against its model type's protocol before it loads
(`check_pipeline`), so a missing member fails at once with PipelineContractError naming it, not
as an AttributeError in the middle of a request. LLMChatPipeline and EmbeddingPipeline declare the
attributes below in their class bodies, so the check needs no loaded model.

Parameters before `/` are passed by position (their names are the implementation's choice); the
others by keyword, so an implementation must spell them as here (or take **kwargs).
Standard library only (this runs in the browser too).
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from ..config import ChatConfig, GenerationConfig
    from .grammar import Grammar

Progress = Callable[[float, str], None]      # (fraction 0..1, text), called during a load
Cancelled = Callable[[], bool]               # polled between batches; True stops the step


# --------------------------------------------------------------------------- a pipeline's parts
class ChatTokenizerProtocol(Protocol):
    """A chat model's tokenizer (loaders: BPETokenizer, SPMTokenizer, NativeTokenizer): prompt ids,
    and each token's bytes (streamed text, logprobs, grammar masks)."""

    def encode(self, text: str, /, *, add_special_tokens: bool = False) -> list[int]: ...

    def token_bytes(self, token_id: int, /) -> bytes: ...


class EmbeddingTokenizerProtocol(Protocol):
    """An embedder's tokenizer (WordPieceTokenizer, NativeWordPiece): ids with the model's special
    tokens, truncated to max_length."""

    def encode(self, text: str, /, *, add_special_tokens: bool = True,
               max_length: int | None = None) -> list[int]: ...


class ChatTemplateProtocol(Protocol):
    """A chat template (loaders.chat_template.ChatTemplate). The engine reads `source` to pick the
    tool-call format; the pipeline encodes conversations, passing template variables (tools=,
    enable_thinking=, ...) as keywords."""

    source: str

    def render(self, messages: list[dict], /, *, add_generation_prompt: bool = True, **variables: Any) -> str: ...

    def encode(self, tokenizer: ChatTokenizerProtocol, messages: list[dict], /, *,
               add_generation_prompt: bool = True, **variables: Any) -> list[int]: ...


class GrammarCompilerProtocol(Protocol):
    """Compiles a response_format (or a forced tool call's grammar) for one model's vocabulary
    (pipelines.grammar.GrammarCompiler); the engine calls it before taking the model's lock."""

    def compile(self, fmt: dict, /) -> Grammar: ...


# A pipeline attribute annotated with one of these is checked on the loaded object too.
_PARTS = {p.__name__: p for p in (ChatTokenizerProtocol, EmbeddingTokenizerProtocol, ChatTemplateProtocol,
                                  GrammarCompilerProtocol)}


class GenerationProtocol(Protocol):
    """One choice being generated: prefill_step, then decode_step until `stopped` (each step samples
    as prefill_step's GenerationConfig asked); the engine reads the text, logprobs and usage between
    steps and calls close() when it is done with it (finished, failed or its caller gone).
    `sequence()` gives one: a sequence of the model's scheduler (pipelines/batch_sequence.py:
    BatchSequence); LLMChatPipeline's own request-level methods drive one such sequence."""

    stopped: bool                   # the answer is finished
    finish_reason: str | None       # "stop" | "length" | "abort" | None
    stop_str: str | None            # the stop string that ended it, if one did
    token_logprobs: list            # OpenAI logprobs entries of the answer

    async def prefill_step(self, messages: list[dict] | None, gen: GenerationConfig, /, *,
                           prompt: str | None = None) -> None: ...

    async def decode_step(self) -> None: ...

    def take_delta(self) -> str: ...

    def get_message(self) -> str: ...

    def usage(self) -> dict: ...

    def interrupt(self) -> None: ...

    def close(self) -> None: ...


class ChatPipelineProtocol(GenerationProtocol, Protocol):
    """A loaded chat LLM (LLMChatPipeline). Each choice of a request generates through
    `sequence()`; interrupt() stops every generation of the model."""

    dev: Any                        # the gpu Device the model lives on (device-loss checks)
    owner: str                      # gpu buffer owner of the model's buffers (freed on unload)
    chat_config: ChatConfig         # the per-load config, defaults of each request's sampling
    tokenizer: ChatTokenizerProtocol
    template: ChatTemplateProtocol | None   # None: no template (tools go into the system message)
    vocab_size: int                 # ids the sampler may give (logit_bias ids are checked against it)
    grammars: GrammarCompilerProtocol

    def sequence(self) -> GenerationProtocol:
        """What one choice generates through: a new sequence of the model's scheduler."""

    @classmethod
    async def load(cls, dev: Any, path: Path, chat_config: ChatConfig, /, *,
                   progress: Progress | None = None, model_id: str | None = None) -> ChatPipelineProtocol:
        """Load the model; its GPU buffers are owned by `owner` (`model:<model_id>` when given)."""

    def set_logit_processor(self, proc: Any, /) -> None:
        """WebLLM's LogitProcessor for this model (EngineConfig.logit_processor_registry)."""

    def reset_chat(self, keep_stats: bool = False, /) -> None: ...

    def runtime_stats_text(self) -> str: ...

    async def forward_tokens_and_sample(self, ids: list[int], is_prefill: bool, gen: GenerationConfig,
                                        /) -> int: ...

    def dispose(self) -> None:
        """Free every GPU buffer of the model."""


class EmbeddingPipelineProtocol(Protocol):
    """A loaded embedder or cross-encoder (EmbeddingPipeline). The engine coalesces concurrent
    requests: prepare_embed per request (checks and tokens, no GPU work), then one embed_jobs for
    the group. The job only needs `seqs` (token ids per input: the group's size) and goes back to
    the same pipeline's embed_jobs; results have `embeddings`, `prompt_tokens` and
    `prefill_tokens_per_s` (rerank results: `scores`, `prompt_tokens`)."""

    dev: Any
    owner: str
    chat_config: ChatConfig
    tokenizer: EmbeddingTokenizerProtocol
    max_seq_length: int             # the longest input in tokens (/v1/models' context_window)
    is_reranker: bool               # a cross-encoder answers rerank_step only, an embedder embed_*

    @classmethod
    async def load(cls, dev: Any, path: Path, chat_config: ChatConfig, /, *,
                   progress: Progress | None = None, model_id: str | None = None
                   ) -> EmbeddingPipelineProtocol: ...

    async def embed_step(self, input: Any, /, *, deadline: float | None = None,  # noqa: A002
                         cancelled: Cancelled | None = None, max_total_tokens: int | None = None,
                         timeout_s: float | None = None, dimensions: int | None = None) -> Any:
        """prepare_embed then embed_jobs of one request."""

    async def prepare_embed(self, input: Any, /, *, deadline: float | None = None,  # noqa: A002
                            cancelled: Cancelled | None = None, max_total_tokens: int | None = None,
                            timeout_s: float | None = None, dimensions: int | None = None) -> Any: ...

    async def embed_jobs(self, jobs: list, /, *, deadline: float | None = None,
                         cancelled: Cancelled | None = None, timeout_s: float | None = None) -> list:
        """One result per job, in the order of `jobs`."""

    async def rerank_step(self, query: str, documents: list[str], /, *, deadline: float | None = None,
                          cancelled: Cancelled | None = None, max_total_tokens: int | None = None,
                          timeout_s: float | None = None) -> Any: ...

    def runtime_stats_text(self) -> str: ...

    def dispose(self) -> None: ...


# --------------------------------------------------------------------------- checking
class PipelineContractError(TypeError):
    """A pipeline class or object lacks a member of its protocol, or takes other arguments."""

    def __init__(self, what: str, protocol: type, problems: list[str]):
        self.problems = problems
        super().__init__(f"{what} does not implement {protocol.__name__}: " + "; ".join(problems) +
                         ". See webgpu_engine/pipelines/protocol.py.")


def _members(protocol: type) -> tuple[dict[str, str], list[str]]:
    """({data attribute name: its annotation}, method names) the protocol declares, its bases' included."""
    data, methods = {}, []
    for base in reversed(protocol.__mro__):
        if base in (object, Protocol) or not getattr(base, "_is_protocol", False):
            continue
        for name, annotation in base.__dict__.get("__annotations__", {}).items():
            data.setdefault(name, str(annotation))
        for name, v in base.__dict__.items():
            if name.startswith("_") or name in methods:
                continue
            if isinstance(v, (classmethod, staticmethod)) or inspect.isfunction(v):
                methods.append(name)
    return data, methods


def _has_data(obj: Any, name: str) -> bool:
    if not isinstance(obj, type):
        return hasattr(obj, name)
    # a class declares an instance attribute by annotating it in its body (or gives it a value)
    return hasattr(obj, name) or any(name in getattr(k, "__annotations__", {}) for k in obj.__mro__)


def _signature_problems(name: str, want: inspect.Signature, have: inspect.Signature) -> list[str]:
    """Can every call the protocol allows be made to `have`? (positional by position, keywords by name)"""
    wp = list(want.parameters.values())
    hp = list(have.parameters.values())
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in hp)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in hp)
    positional = [p for p in hp if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    used, out = set(), []
    for i, w in enumerate(wp):
        if w.kind == w.VAR_KEYWORD:               # callers pass further keywords of their choice
            if not var_kw:
                out.append(f"{name}() takes no **keyword arguments (**{w.name})")
            continue
        if w.kind == w.POSITIONAL_ONLY:
            h = positional[i] if i < len(positional) else None
            if h is None and not var_pos:
                out.append(f"{name}() takes no positional argument {i + 1} ({w.name})")
                continue
        else:
            h = have.parameters.get(w.name)
            if h is not None and h.kind == h.POSITIONAL_ONLY:
                h = None
            if h is None and not var_kw:
                out.append(f"{name}() has no parameter {w.name!r}")
                continue
        if h is not None:
            used.add(h.name)
            if w.default is not w.empty and h.default is h.empty:
                out.append(f"{name}() requires {h.name!r}, which callers may leave out")
    for h in hp:
        if h.name not in used and h.default is h.empty and h.kind not in (h.VAR_POSITIONAL, h.VAR_KEYWORD):
            out.append(f"{name}() requires {h.name!r}, which the engine never passes")
    return out


def conformance_problems(obj: Any, protocol: type, *, attributes: bool = True) -> list[str]:
    """What `obj` (a pipeline class, or a loaded pipeline) lacks of `protocol`; [] when it conforms.
    attributes=False checks the methods only (a class that sets its attributes in __init__ without
    declaring them: its loaded object is checked for them)."""
    cls = obj if isinstance(obj, type) else type(obj)
    data, methods = _members(protocol)
    out = [f"no attribute {n!r}" for n in data if attributes and not _has_data(obj, n)]
    for name in methods:
        want_raw = inspect.getattr_static(protocol, name)
        forwarded = False
        try:
            have_raw = inspect.getattr_static(cls, name)
        except AttributeError:
            # an object may forward members (__getattr__: NativeTokenizer gives its base's token_bytes)
            have_raw = getattr(obj, name, None) if not isinstance(obj, type) else None
            forwarded = True
            if have_raw is None:
                out.append(f"no method {name}()")
                continue
        if isinstance(want_raw, classmethod) and not isinstance(have_raw, classmethod):
            out.append(f"{name}() must be a classmethod")
            continue
        want, have = getattr(protocol, name), have_raw if forwarded else getattr(cls, name)
        if not callable(have):
            out.append(f"{name} is not callable")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
            out.append(f"{name}() must {'' if inspect.iscoroutinefunction(want) else 'not '}be async")
        ws, hs = inspect.signature(want), inspect.signature(have)
        if not isinstance(want_raw, classmethod):           # drop `self` of plain methods
            ws = ws.replace(parameters=list(ws.parameters.values())[1:])
            if not inspect.ismethod(have):                  # a forwarded member comes bound already
                hs = hs.replace(parameters=list(hs.parameters.values())[1:])
        out += _signature_problems(name, ws, hs)
    if attributes and not isinstance(obj, type):            # a loaded object's parts: theirs too
        for name, annotation in data.items():
            kinds = [k.strip() for k in annotation.split("|")]
            part = next((_PARTS[k] for k in kinds if k in _PARTS), None)
            if part is None or not hasattr(obj, name):
                continue
            value = getattr(obj, name)
            if value is None and "None" in kinds:
                continue
            if value is None:
                out.append(f"{name} is None")
                continue
            out += [f"{name}: {p}" for p in conformance_problems(value, part)]
    return out


def check_pipeline(obj: Any, protocol: type, what: str | None = None, *, attributes: bool = True) -> None:
    """Raise PipelineContractError unless `obj` (class or object) conforms to `protocol`."""
    problems = conformance_problems(obj, protocol, attributes=attributes)
    if problems:
        name = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise PipelineContractError(what or name, protocol, problems)
