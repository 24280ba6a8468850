"""Decoder embedders (Qwen3-Embedding style) on the real adapter against sentence-transformers
(tests/fixtures/make_qwen3_embedding.py): a tiny Qwen3Model in a sentence-transformers folder with
last-token pooling and Normalize, a tokenizer that appends <|endoftext|>, left padding in the
reference, an instruction prompt, and an input longer than max_seq_length."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.engine import MLCEngine
from webgpu_engine.models.registry import EMBEDDING, open_model

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODEL = FIXTURES / "tiny_qwen3_embedding"
REF = json.loads((FIXTURES / "qwen3_embedding_reference.json").read_text(encoding="utf-8"))


def _cos(g, w) -> float:
    g, w = np.asarray(g), np.asarray(w)
    return float(g @ w / np.linalg.norm(g) / np.linalg.norm(w))


def test_folder_opens_as_an_embedder():
    m = open_model(MODEL)
    m.close()
    assert (m.arch.name, m.kind, m.extra.pooling, m.extra.normalize) == ("qwen3", EMBEDDING, "lasttoken", True)
    assert m.config.qk_norm and m.config.embed_length == REF["max_length"] and m.config.num_labels == 0
    assert "embed_tokens.weight" in m.weights          # a bare Qwen3Model's names, mapped by the model
    # the engine's memory check: a cache of max_seq_length rows (40 -> 48), whatever the caller's length
    est = m.arch.estimate(m.config, m.weights, max_batch_size=32, max_seq_length=512, act_dtype="f32",
                          max_binding=1 << 30)
    c = m.config
    assert est.context_window == 0 and est.kv_cache == 2 * c.n_layers * c.n_kv_heads * 48 * c.head_dim * 4
    assert est.weights >= sum(t.nbytes for t in m.weights.values())


def test_same_decoder_without_modules_json_stays_an_llm(tmp_path):
    import shutil
    folder = shutil.copytree(MODEL, tmp_path / "m")
    (folder / "modules.json").unlink()
    m = open_model(folder)
    m.close()
    assert (m.arch.name, m.kind) == ("qwen3", "llm")         # only a sentence-transformers folder embeds


@pytest.fixture(scope="module")
def engine(device):
    eng = MLCEngine()
    eng.reload(str(MODEL), chat_opts={"max_batch_size": 4})
    yield eng
    eng.unload()


def test_token_ids_equal_sentence_transformers(engine):
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    tk = load_tokenizer(MODEL, max_length=REF["max_length"], encoder=True)
    got = [list(tk.encode(t, add_special_tokens=True, max_length=REF["max_length"])) for t in REF["texts"]]
    assert got == REF["token_ids"]
    assert all(ids[-1] == REF["eos_id"] for ids in got)                   # <|endoftext|> kept when truncated
    assert max(len(i) for i in got) == REF["max_length"]


def test_embeddings_equal_sentence_transformers(engine):
    res = engine.embeddings.create(input=REF["texts"])
    assert res.usage.prompt_tokens == sum(len(i) for i in REF["token_ids"])
    for text, item, want in zip(REF["texts"], res.data, REF["embeddings"]):
        assert _cos(item.embedding, want) >= 0.9999, text[:30]
        assert np.abs(np.asarray(item.embedding) - want).max() < 1e-4, text[:30]
        assert abs(np.linalg.norm(item.embedding) - 1.0) < 1e-5


def test_token_id_input_and_instruction_prompt(engine):
    # the prompt is prepended to the text as sentence-transformers does for prompt_name="query"
    res = engine.embeddings.create(input=[REF["prompt"] + t for t in REF["texts"][:2]])
    for item, want in zip(res.data, REF["query_embeddings"]):
        assert _cos(item.embedding, want) >= 0.9999
    by_ids = engine.embeddings.create(input=REF["query_token_ids"])
    for item, want in zip(by_ids.data, REF["query_embeddings"]):
        assert _cos(item.embedding, want) >= 0.9999
    assert _cos(res.data[0].embedding, REF["embeddings"][0]) < 0.9999          # the prompt changes it


def test_dimensions_truncate_and_renormalise(engine):
    # the card's table says "MRL Support: Yes" (as Qwen3-Embedding's does); sentence-transformers'
    # truncate_dim does not renormalise, OpenAI's `dimensions` does: compare directions
    n = REF["dimensions"]
    res = engine.embeddings.create(input=REF["texts"][:3], dimensions=n)
    for item, want in zip(res.data, REF["truncated_embeddings"]):
        assert len(item.embedding) == n and abs(np.linalg.norm(item.embedding) - 1.0) < 1e-5
        assert _cos(item.embedding, want) >= 0.9999
    from webgpu_engine.errors import EmbeddingDimensionsUnsupportedError
    with pytest.raises(EmbeddingDimensionsUnsupportedError):
        engine.embeddings.create(input="a", dimensions=65)


def test_card_table_mrl_column(tmp_path):
    from webgpu_engine.loaders.sentence_transformers import model_card_says_matryoshka
    head = "| Models | MRL Support |\n|---|---|\n"
    (tmp_path / "README.md").write_text(head + "| a | - |\n\nMRL Support: Yes, in prose\n")
    assert not model_card_says_matryoshka(tmp_path)
    (tmp_path / "README.md").write_text(head + "| a | - |\n| b | Yes |\n")
    assert model_card_says_matryoshka(tmp_path)


@pytest.mark.parametrize("dtype,min_cos", [("f32", 0.9999), ("f16", 0.999)])
def test_inputs_longer_than_a_prefill_chunk(device, monkeypatch, dtype, min_cos):
    # a 40-token input through 16-row chunks (KV cache carried across forwards) gives the same vector;
    # f16 activations (the pooled row normalised into f32) within f16's precision
    if dtype == "f16" and not device.has_f16:
        pytest.fail("this adapter lacks shader-f16; the f16 path cannot be checked here")
    from webgpu_engine.models import decoder_embedder
    monkeypatch.setattr(decoder_embedder, "PREFILL_CHUNK", 16)
    m = open_model(MODEL)
    try:
        model = decoder_embedder.DecoderEmbedder(device, m.config, m.weights, act_dtype=dtype, normalize=True,
                                                 owner="test:dec_emb")
    finally:
        m.close()
    try:
        assert model.llm.chunk == 16 and model.max_seq_length == REF["max_length"]
        seqs = [REF["token_ids"][2], REF["token_ids"][1]]            # 40 tokens (3 chunks), 2 tokens
        assert [len(c) for c in (model._chunks(40), model._chunks(2))] == [3, 1]
        dst = device.buffer(2 * 64 * 4, owner="test:dec_emb", label="dst")
        model.run(seqs, 2, 48, dst)
        import asyncio
        got = np.frombuffer(asyncio.run(device.read(dst, 0, 2 * 64 * 4)), np.float32).reshape(2, 64)
        for g, i in zip(got, (2, 1)):
            assert _cos(g, REF["embeddings"][i]) >= min_cos
    finally:
        model.dispose()


async def test_default_prompt_name_is_prepended(device, tmp_path):
    # sentence-transformers prepends prompts[default_prompt_name] to every text it is given alone
    import shutil
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.errors import UnsupportedModelError
    from webgpu_engine.loaders.sentence_transformers import load_sentence_transformer_config
    from webgpu_engine.pipelines.embedding import EmbeddingPipeline
    folder = shutil.copytree(MODEL, tmp_path / "m")
    cfg_file = folder / "config_sentence_transformers.json"
    conf = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg_file.write_text(json.dumps({**conf, "default_prompt_name": "query"}), encoding="utf-8")
    pipe = await EmbeddingPipeline.load(device, folder, ChatConfig(compile_at_load=False))
    try:
        assert pipe.tokenize(REF["texts"][:2]) == REF["query_token_ids"]
        res = await pipe.embed_step(REF["texts"][:2])
        for got, want in zip(res.embeddings, REF["query_embeddings"]):
            assert _cos(got, want) >= 0.9999
    finally:
        pipe.dispose()
    cfg_file.write_text(json.dumps({**conf, "default_prompt_name": "passage"}), encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match="default_prompt_name"):
        load_sentence_transformer_config(folder)
