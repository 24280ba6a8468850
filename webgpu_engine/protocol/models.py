"""OpenAI request/response objects as pydantic models (native only; the browser uses plain dicts).

Request models run the shared rules of `rules.py` on the raw dict before pydantic's own type checks,
so a bad request raises the same typed `InvalidRequestError` here as in the browser. Response models
mirror the OpenAI API (chat.completion, chat.completion.chunk, text_completion, embeddings list) with
WebLLM's `usage.extra` timing fields.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import rules


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def to_dict(self) -> dict:
        return self.model_dump(exclude_none=True)


# --------------------------------------------------------------------------- requests
class TextPart(_Model):
    type: Literal["text"] = "text"
    text: str


class ChatCompletionMessageParam(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict]] = None


class StreamOptions(_Model):
    include_usage: Optional[bool] = None


class _SamplingRequest(_Model):
    model: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_tokens: Optional[int] = None
    stop: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    ignore_eos: Optional[bool] = None
    user: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatCompletionMessageParam]
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    response_format: Optional[dict] = None

    @model_validator(mode="before")
    @classmethod
    def _rules(cls, data: Any) -> Any:
        return rules.check_chat_request(_raw(data))


class CompletionRequest(_SamplingRequest):
    prompt: str
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    best_of: Optional[int] = None

    @model_validator(mode="before")
    @classmethod
    def _rules(cls, data: Any) -> Any:
        return rules.check_completion_request(_raw(data))


class EmbeddingRequest(_Model):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Optional[Literal["float"]] = None
    dimensions: Optional[int] = None
    user: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _rules(cls, data: Any) -> Any:
        return rules.check_embedding_request(_raw(data))


def _raw(data: Any) -> Any:
    if isinstance(data, BaseModel):
        return data.model_dump(exclude_none=True)
    return data


# --------------------------------------------------------------------------- usage and logprobs
class UsageExtra(_Model):
    e2e_latency_s: Optional[float] = None
    prefill_tokens_per_s: Optional[float] = None
    decode_tokens_per_s: Optional[float] = None
    time_to_first_token_s: Optional[float] = None
    time_per_output_token_s: Optional[float] = None
    grammar_init_s: Optional[float] = None          # constrained requests (response_format, forced tools)
    grammar_per_token_s: Optional[float] = None


class CompletionUsage(_Model):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    extra: Optional[UsageExtra] = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatCompletionTokenLogprob(_Model):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Model):
    content: Optional[list[ChatCompletionTokenLogprob]] = None


class CompletionLogprobs(_Model):
    """The legacy completions layout (parallel lists), as OpenAI's /v1/completions returns it."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


# --------------------------------------------------------------------------- chat responses
class _Response(_Model):
    """The fields of every chat / completion response and chunk, in OpenAI's order; a subclass
    narrows `object` to its literal and `choices` to its choice type (pydantic keeps an overridden
    field where the base declares it)."""
    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Optional[CompletionUsage] = None
    system_fingerprint: Optional[str] = None


class ChatCompletionMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[dict]] = None


class ChatCompletionChoice(_Model):
    index: int
    message: ChatCompletionMessage
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[str] = None           # the stop string that ended it (vLLM's field)
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]


class ChoiceDelta(_Model):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict]] = None      # OpenAI's deltas: {index, id, type, function}


class ChatCompletionChunkChoice(_Model):
    index: int
    delta: ChoiceDelta
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[str] = None           # the stop string that ended it (vLLM's field)
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionChunkChoice]


# --------------------------------------------------------------------------- completions
class CompletionChoice(_Model):
    index: int
    text: str
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[str] = None           # the stop string that ended it (vLLM's field)
    logprobs: Optional[CompletionLogprobs] = None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# --------------------------------------------------------------------------- embeddings
class Embedding(_Model):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingUsage(_Model):
    prompt_tokens: int
    total_tokens: int
    extra: Optional[dict[str, float]] = None


class CreateEmbeddingResponse(_Model):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# --------------------------------------------------------------------------- models and errors
class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "webgpu_engine"


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(_Model):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Model):
    error: ErrorBody

    def to_dict(self) -> dict:
        # OpenAI always sends param and code, as null when unset.
        return self.model_dump()


RESPONSE_TYPES = {
    "chat.completion": ChatCompletion,
    "chat.completion.chunk": ChatCompletionChunk,
    "text_completion": Completion,
    "list": CreateEmbeddingResponse,
}
