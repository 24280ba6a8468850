"""EmbeddingPipeline on the real adapter: all-MiniLM-L6-v2 vs sentence-transformers golden vectors,
batching/order invariance, OpenAI input forms, truncation, errors, and freeing GPU memory."""
from __future__ import annotations

import random

import numpy as np
import pytest

import ref_bert as R
from tinymodels import write_tiny_bert
from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import InvalidRequestError
from webgpu_engine.pipelines.embedding import EmbeddingPipeline


@pytest.fixture(scope="module")
async def minilm(device, minilm_dir):
    pipe = await EmbeddingPipeline.load(device, minilm_dir, ChatConfig(dtype="f32", max_batch_size=8))
    yield pipe
    pipe.dispose()


def _cos(a, b) -> float:
    return R.cosine(a, b)


# --------------------------------------------------------------------------- golden data
async def test_minilm_matches_sentence_transformers(minilm, minilm_reference):
    items = minilm_reference["items"]
    L = minilm_reference["max_seq_length"]
    assert minilm.max_seq_length == L
    ids = minilm.tokenize([it["text"] for it in items])
    for got, it in zip(ids, items):
        assert got == R.reference_ids(it, L), it["text"][:40]
    res = await minilm.embed_step([it["text"] for it in items])
    assert res.prompt_tokens == sum(len(i) for i in ids)
    assert res.prefill_tokens_per_s > 0
    for v, it in zip(res.embeddings, items):
        assert len(v) == 384
        assert _cos(v, it["embedding"]) >= 0.9999, it["text"][:40]
        assert abs(np.linalg.norm(v) - 1.0) < 1e-4


async def test_minilm_f16_activations(device, minilm_dir, minilm_reference):
    if not device.has_f16:
        pytest.fail("this adapter lacks shader-f16; the f16 variant cannot be tested here")
    pipe = await EmbeddingPipeline.load(device, minilm_dir, ChatConfig(dtype="f16"))
    try:
        assert pipe.model.act_dtype == "f16"
        items = minilm_reference["items"]
        res = await pipe.embed_step([it["text"] for it in items])
        for v, it in zip(res.embeddings, items):
            assert _cos(v, it["embedding"]) >= 0.999, it["text"][:40]
    finally:
        pipe.dispose()
    assert device.allocated_bytes(pipe.owner) == 0


async def test_batch_size_and_order_do_not_change_vectors(device, minilm, minilm_dir):
    texts = ["a short one", "The quick brown fox jumps over the lazy dog near the river bank.", "",
             "GPUs", "Embeddings map text to vectors so that similar meanings end up close together.",
             "naïve café", "one two three four five six seven", "x"]
    ref = np.asarray((await minilm.embed_step(texts)).embeddings)
    single = await EmbeddingPipeline.load(device, minilm_dir, ChatConfig(dtype="f32", max_batch_size=1))
    try:
        perm = list(range(len(texts)))
        random.Random(0).shuffle(perm)
        one = np.asarray((await single.embed_step([texts[i] for i in perm])).embeddings)
    finally:
        single.dispose()
    assert np.abs(one - ref[perm]).max() <= 1e-5
    shuffled = np.asarray((await minilm.embed_step([texts[i] for i in perm])).embeddings)
    assert np.abs(shuffled - ref[perm]).max() <= 1e-5


# --------------------------------------------------------------------------- input forms
async def test_openai_input_forms(minilm):
    text = "Token ids and text give the same vector."
    ids = minilm.tokenize([text])[0]
    by_text = (await minilm.embed_step(text)).embeddings
    by_list = (await minilm.embed_step([text])).embeddings
    by_ids = await minilm.embed_step(ids)                    # list[int]: one sequence, taken as is
    by_id_lists = (await minilm.embed_step([ids, ids[:3]])).embeddings
    assert len(by_text) == len(by_list) == len(by_ids.embeddings) == 1 and len(by_id_lists) == 2
    assert by_ids.prompt_tokens == len(ids)
    for v in (by_list[0], by_ids.embeddings[0], by_id_lists[0]):
        assert np.abs(np.asarray(v) - by_text[0]).max() <= 1e-5
    assert _cos(by_id_lists[1], by_text[0]) < 0.999              # a different sequence, a different vector


async def test_empty_non_ascii_and_overlong_inputs(minilm):
    long_text = "lorem ipsum dolor " * 400
    res = await minilm.embed_step(["", "Ünïcödé ✓ 漢字 🙂", long_text])
    ids = minilm.tokenize(["", long_text])
    assert len(ids[0]) == 2 and len(ids[1]) == minilm.max_seq_length and ids[1][-1] == 102
    assert res.prompt_tokens == 2 + len(minilm.tokenize(["Ünïcödé ✓ 漢字 🙂"])[0]) + minilm.max_seq_length
    for v in res.embeddings:
        assert np.all(np.isfinite(v)) and abs(np.linalg.norm(v) - 1.0) < 1e-4


@pytest.mark.parametrize("bad", [[], [[]], ["a", 1], [1, "a"], [-1], [10 ** 9], [[1, 2], "x"], None, 5])
async def test_invalid_inputs_raise_invalid_request(minilm, bad):
    with pytest.raises(InvalidRequestError):
        await minilm.embed_step(bad)


# --------------------------------------------------------------------------- tiny models, config
@pytest.mark.parametrize("pooling,normalize,wdtype", [("mean", True, "f32"), ("cls", False, "f16"),
                                                      ("max", True, "f32")])
async def test_tiny_pipeline_matches_numpy(device, tmp_path, pooling, normalize, wdtype):
    write_tiny_bert(tmp_path, pooling=pooling, normalize=normalize, dtype=wdtype, max_seq_length=20)
    pipe = await EmbeddingPipeline.load(device, tmp_path, ChatConfig(dtype="f32", max_batch_size=4))
    try:
        texts = ["the cat sat on the mat", "hello world", "", "the quick brown fox is fast and the dog "
                 "was at the web gpu engine in paris france capital of it all"]
        res = await pipe.embed_step(texts)
        ids = pipe.tokenize(texts)
        assert len(ids[3]) == 20 and ids[3][-1] == 3           # truncated at max_seq_length, [SEP] kept
        W, cfg = R.load_weights(tmp_path), R.load_config(tmp_path)
        for s, v in zip(ids, res.embeddings):
            ref = R.embed(W, cfg, s, pooling=pooling, normalize=normalize)
            assert np.abs(np.asarray(v) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    finally:
        pipe.dispose()
    assert device.allocated_bytes(pipe.owner) == 0


async def test_bare_folder_and_chat_opts_max_seq_length(device, tmp_path):
    write_tiny_bert(tmp_path, pooling="cls", normalize=True, max_seq_length=20)
    (tmp_path / "modules.json").unlink()                       # plain HF folder: mean, no normalize
    pipe = await EmbeddingPipeline.load(device, tmp_path, ChatConfig(max_seq_length=8))
    try:
        assert pipe.max_seq_length == 8 and pipe.st_config.pooling == "mean" and not pipe.st_config.normalize
        res = await pipe.embed_step("the cat sat on the mat and the dog sat on the rug")
        ids = pipe.tokenize(["the cat sat on the mat and the dog sat on the rug"])[0]
        assert len(ids) == 8 and res.prompt_tokens == 8
        ref = R.embed(R.load_weights(tmp_path), R.load_config(tmp_path), ids, pooling="mean")
        assert np.abs(np.asarray(res.embeddings[0]) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
        assert abs(np.linalg.norm(ref) - 1.0) > 1e-2            # really not normalised
        over = await pipe.embed_step([list(range(5, 25))])       # token ids are truncated too
        assert over.prompt_tokens == 8
    finally:
        pipe.dispose()


async def test_dispose_frees_all_gpu_memory(device, tmp_path):
    write_tiny_bert(tmp_path)
    progress = []
    pipe = await EmbeddingPipeline.load(device, tmp_path, ChatConfig(), progress=lambda f, t: progress.append(f))
    assert progress and progress[-1] == 1.0 and progress == sorted(progress)
    await pipe.embed_step(["hello world"] * 5 + ["the cat"] * 40)          # several buckets
    assert device.allocated_bytes(pipe.owner) > 0
    pipe.dispose()
    assert device.allocated_bytes(pipe.owner) == 0


async def test_bad_chat_config_is_rejected_before_allocating(device, tmp_path):
    write_tiny_bert(tmp_path)
    before = device.allocated_bytes()
    for cc in (ChatConfig(max_batch_size=0), ChatConfig(max_seq_length=1), ChatConfig(dtype="int8")):
        with pytest.raises(InvalidRequestError):
            await EmbeddingPipeline.load(device, tmp_path, cc)
    assert device.allocated_bytes() == before
