"""XLM-RoBERTa on the real adapter against sentence-transformers (tests/fixtures/make_xlmr.py): a tiny
bge-m3-style embedder (CLS pooling, normalised; SentencePiece-Unigram tokenizer) and a tiny
XLMRobertaForSequenceClassification reranker, both made by transformers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import UnsupportedModelError
from webgpu_engine.loaders.tokenizer import load_tokenizer
from webgpu_engine.models.registry import open_model
from webgpu_engine.pipelines.embedding import EmbeddingPipeline

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EMB, RERANK = FIXTURES / "tiny_xlmr", FIXTURES / "tiny_xlmr_reranker"
REF = json.loads((FIXTURES / "xlmr_reference.json").read_text(encoding="utf-8"))


def test_config_and_registry():
    m = open_model(EMB)
    try:
        assert m.arch.name == "xlm-roberta" and m.kind == "embedding"
        cfg = m.config
        assert (cfg.arch, cfg.pad_id, cfg.position_offset, cfg.num_labels) == ("xlm-roberta", 1, 2, 0)
        assert (m.extra.pooling, m.extra.normalize, m.extra.max_seq_length) == ("cls", True, REF["max_length"])
    finally:
        m.close()
    m = open_model(RERANK)
    try:
        assert (m.config.num_labels, m.config.classifier_activation) == (1, "sigmoid")
    finally:
        m.close()


def test_browser_path_refuses_unigram_by_name():
    with pytest.raises(UnsupportedModelError, match="Unigram"):
        load_tokenizer(EMB, native=False)


@pytest.fixture(scope="module")
def pipes(device):
    import asyncio

    async def load():
        return (await EmbeddingPipeline.load(device, EMB, ChatConfig(max_batch_size=4)),
                await EmbeddingPipeline.load(device, RERANK, ChatConfig(max_batch_size=4)))
    emb, rr = asyncio.run(load())
    yield emb, rr
    emb.dispose()
    rr.dispose()


async def test_embeddings_equal_sentence_transformers(pipes):
    emb, _ = pipes
    assert emb.max_seq_length == REF["max_length"]
    assert emb.tokenize(REF["texts"]) == REF["token_ids"]        # truncation and non-ASCII included
    assert max(len(i) for i in REF["token_ids"]) == REF["max_length"]
    res = await emb.embed_step(REF["texts"])                     # several batches of mixed lengths
    for text, got, want in zip(REF["texts"], res.embeddings, REF["embeddings"]):
        g, w = np.asarray(got), np.asarray(want)
        assert g @ w / np.linalg.norm(g) / np.linalg.norm(w) > 0.9999, text[:30]
        assert np.abs(g - w).max() < 1e-4
    assert res.prompt_tokens == sum(len(i) for i in REF["token_ids"])


async def test_reranker_scores_equal_cross_encoder(pipes):
    _, rr = pipes
    q = rr._plain_ids([REF["query"]])[0]
    assert [ids for ids, _ in rr._pairs(q, REF["documents"])] == REF["pair_token_ids"]
    res = await rr.rerank_step(REF["query"], REF["documents"])
    assert np.abs(np.asarray(res.scores) - np.asarray(REF["scores"])).max() < 1e-4
