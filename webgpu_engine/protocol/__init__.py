"""OpenAI protocol: validation rules (stdlib, run everywhere), typed errors, and pydantic models
(native; imported lazily so the browser never needs pydantic)."""
from __future__ import annotations

from . import errors
from .objects import AttrDict, to_dict, to_object
from .rules import (check_chat_request, check_completion_request, check_embedding_request,
                    check_sampling)

_MODEL_NAMES = ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest", "ChatCompletion",
                "ChatCompletionChunk", "Completion", "CreateEmbeddingResponse", "CompletionUsage",
                "ErrorResponse", "ModelList", "ModelCard")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        from . import models
        return getattr(models, name)
    raise AttributeError(name)


__all__ = ["errors", "AttrDict", "to_dict", "to_object", "check_chat_request",
           "check_completion_request", "check_embedding_request", "check_sampling", *_MODEL_NAMES]
