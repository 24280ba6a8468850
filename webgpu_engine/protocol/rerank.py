"""Rerank requests and responses in the shape Jina, Cohere and vLLM share (`/v1/rerank`).

    {"model": "...", "query": "...", "documents": ["...", {"text": "..."}], "top_n": 3,
     "return_documents": true}
    -> {"id": "rerank-...", "model": "...", "results": [{"index": 2, "relevance_score": 0.93,
        "document": {"text": "..."}}, ...], "usage": {"prompt_tokens": N, "total_tokens": N}}

Results are sorted by relevance, highest first; `index` is the document's place in the request.
Standard library only (runs in the browser).
"""
from __future__ import annotations

from typing import Any

from .errors import FieldTypeError, LimitExceededError
from .rules import DEFAULT_LIMITS, RequestLimits, _positive_int, _request_body, _text


def check_rerank_request(req: dict, limits: RequestLimits | None = None) -> dict:
    """Validate a rerank request; returns a copy with `documents` as plain strings and defaults set
    (top_n: every document; return_documents: true, as Jina and vLLM)."""
    lim = limits or DEFAULT_LIMITS
    out = _request_body(req)
    query = out.get("query")
    if not isinstance(query, str) or not query:
        raise FieldTypeError("query", "a non-empty string", query)
    out["query"] = _text("query", "query", query)
    docs = out.get("documents")
    if not isinstance(docs, list) or not docs:
        raise FieldTypeError("documents", "a non-empty list of strings or {\"text\": ...} objects", docs)
    if len(docs) > lim.max_embedding_inputs:
        raise LimitExceededError("documents", "documents", lim.max_embedding_inputs, len(docs),
                                 "Split them over several requests.")
    texts = []
    for j, d in enumerate(docs):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str) or not text:
            raise FieldTypeError(f"documents[{j}]", "a non-empty string or {\"text\": \"...\"}", d)
        texts.append(_text("documents", f"documents[{j}]", text))
    out["documents"] = texts
    top_n = _positive_int(out, "top_n")
    out["top_n"] = len(texts) if top_n is None else min(top_n, len(texts))
    rd = out.get("return_documents", True)
    if not isinstance(rd, bool):
        raise FieldTypeError("return_documents", "true or false", rd)
    out["return_documents"] = rd
    return out


def rerank_response(model: str, request_id: str, documents: list[str], scores: list[float], top_n: int,
                    return_documents: bool, prompt_tokens: int) -> dict[str, Any]:
    """The response body: the `top_n` most relevant documents, highest score first (ties: input order)."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    results = []
    for i in ranked:
        r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            r["document"] = {"text": documents[i]}
        results.append(r)
    return {"id": request_id, "model": model, "results": results,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


__all__ = ["check_rerank_request", "rerank_response"]
