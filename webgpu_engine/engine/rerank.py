"""The engine's rerank path: validate → pick the reranker (a cross-encoder loaded as an embedding
model) → its FIFO lock → score every (query, document) pair → the top_n, highest first."""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from ..protocol.objects import to_object
from ..protocol.rerank import check_rerank_request, rerank_response
from .records import EMBEDDING


class Rerank:
    def __init__(self, engine):
        self.engine = engine

    async def create(self, request: Any = None, **fields):
        """`query`, `documents` (strings or {"text": ...}), optional `model`, `top_n`,
        `return_documents` (default true) → {"results": [{index, relevance_score, document}], ...}."""
        from .requests import request_fields
        engine = self.engine
        deadline = engine.deadline()
        req = check_rerank_request(request_fields(request, fields), engine.config.limits)
        lm = await engine.select(req.get("model"), EMBEDDING, "RerankRequest")
        lm = await engine.acquire(lm, "RerankRequest", deadline)
        try:
            engine.check_deadline(deadline, "rerank")
            caller = asyncio.current_task()
            res = await engine.guard(lm.pipeline.rerank_step(
                req["query"], req["documents"], deadline=deadline, timeout_s=engine.config.request_timeout_s,
                max_total_tokens=engine.config.limits.max_embedding_tokens,
                cancelled=lambda: caller is not None and caller.cancelling() > 0), lm, "rerank")
        finally:
            lm.lock.release()
        return to_object(rerank_response(lm.model_id, f"rerank-{uuid.uuid4().hex}", req["documents"],
                                         res.scores, req["top_n"], req["return_documents"], res.prompt_tokens))
