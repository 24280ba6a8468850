"""Turn the engine's plain response dicts into OpenAI objects: pydantic models natively, or a light
attribute-access dict where pydantic is missing (the browser). Standard library at module level."""
from __future__ import annotations

from typing import Any

try:  # pydantic is optional: absent in the page
    from . import models as _models
except ImportError:  # pragma: no cover - browser only
    _models = None


class AttrDict(dict):
    """A dict whose keys read as attributes, recursively (`resp.choices[0].message.content`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict:
        return _plain(self)

    def model_dump(self, **_: Any) -> dict:
        return _plain(self)


def _wrap(v: Any) -> Any:
    if isinstance(v, dict):
        return AttrDict({k: _wrap(x) for k, x in v.items()})
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def to_object(d: dict) -> Any:
    """The OpenAI object for response dict `d`, chosen by its `object` field."""
    if _models is not None:
        cls = _models.RESPONSE_TYPES.get(d.get("object", ""))
        if cls is not None:
            return cls.model_validate(d)
    return _wrap(d)


def to_dict(obj: Any) -> dict:
    """The JSON-ready dict of a response object (pydantic model, AttrDict or dict)."""
    if hasattr(obj, "model_dump") and not isinstance(obj, dict):
        return obj.model_dump(exclude_none=True)
    return _plain(obj)
