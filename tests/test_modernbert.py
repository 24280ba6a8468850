"""ModernBERT on the real adapter against sentence-transformers (tests/fixtures/make_modernbert.py): a
tiny ModernBertModel made by transformers, with global and local (windowed) attention layers, a
byte-level BPE tokenizer, mean pooling, normalised."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import UnsupportedModelError
from webgpu_engine.loaders.hf_config import modernbert_config_from_dict
from webgpu_engine.loaders.tokenizer import load_tokenizer
from webgpu_engine.models.registry import open_model
from webgpu_engine.pipelines.embedding import EmbeddingPipeline

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODEL = FIXTURES / "tiny_modernbert"
REF = json.loads((FIXTURES / "modernbert_reference.json").read_text(encoding="utf-8"))


def test_config_both_transformers_formats():
    m = open_model(MODEL)
    m.close()
    cfg = m.config
    assert m.arch.name == "modernbert" and (cfg.ffn, cfg.rope_base, cfg.local_rope_base) == ("geglu", 160000.0, 10000.0)
    assert cfg.layer_windows == tuple(4 if t == "sliding_attention" else 0 for t in REF["layer_types"]) == (0, 4, 4, 0)
    old = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
           "intermediate_size": 8, "global_attn_every_n_layers": 2, "local_attention": 16,
           "global_rope_theta": 1e5, "local_rope_theta": 1e3}                # transformers 4's keys
    c = modernbert_config_from_dict(old)
    assert (c.layer_windows, c.rope_base, c.local_rope_base) == ((0, 8, 0, 8), 1e5, 1e3)
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        modernbert_config_from_dict({**old, "hidden_activation": "silu"})


def test_browser_path_refuses_bpe_encoders_by_name():
    with pytest.raises(UnsupportedModelError, match="BPE encoders"):
        load_tokenizer(MODEL, native=False, encoder=True)


@pytest.fixture(scope="module")
def pipe(device):
    import asyncio
    p = asyncio.run(EmbeddingPipeline.load(device, MODEL, ChatConfig(max_batch_size=4)))
    yield p
    p.dispose()


async def test_embeddings_equal_sentence_transformers(pipe):
    assert pipe.max_seq_length == REF["max_length"]
    assert pipe.tokenize(REF["texts"]) == REF["token_ids"]        # truncation and non-ASCII included
    assert max(len(i) for i in REF["token_ids"]) == REF["max_length"]
    res = await pipe.embed_step(REF["texts"])                     # two batches of mixed lengths
    for text, got, want in zip(REF["texts"], res.embeddings, REF["embeddings"]):
        g, w = np.asarray(got), np.asarray(want)
        assert g @ w / np.linalg.norm(g) / np.linalg.norm(w) > 0.9999, text[:30]
        assert np.abs(g - w).max() < 1e-4, text[:30]
