"""BERT encoder: numpy reference vs sentence-transformers golden data, sentence-transformers folder
parsing, and the GPU model vs the numpy reference on tiny random BERTs (real adapter)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import ref_bert as R
from tinymodels import write_tiny_bert
from webgpu_engine.errors import ModelFormatError, UnsupportedModelError
from webgpu_engine.loaders.hf_config import load_bert_config
from webgpu_engine.loaders.safetensors import load_safetensors_folder
from webgpu_engine.loaders.sentence_transformers import load_sentence_transformer_config
from webgpu_engine.models.bert import BertModel


# --------------------------------------------------------------------------- numpy reference
def test_numpy_reference_matches_sentence_transformers(minilm_dir, minilm_reference):
    W, cfg = R.load_weights(minilm_dir), R.load_config(minilm_dir)
    L = minilm_reference["max_seq_length"]
    for item in minilm_reference["items"]:
        v = R.embed(W, cfg, R.reference_ids(item, L), pooling="mean", normalize=True)
        assert R.cosine(v, item["embedding"]) > 0.999999, item["text"][:40]
        assert np.abs(v - np.asarray(item["embedding"])).max() < 1e-5


# --------------------------------------------------------------------------- folder config
def test_sentence_transformers_config_of_minilm(minilm_dir):
    st = load_sentence_transformer_config(minilm_dir)
    assert (st.pooling, st.normalize, st.max_seq_length) == ("mean", True, 256)
    assert st.is_sentence_transformers and st.model_folder == minilm_dir


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "lasttoken", "weightedmean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_config_of_tiny(tmp_path, pooling, normalize):
    write_tiny_bert(tmp_path, pooling=pooling, normalize=normalize, max_seq_length=40)
    st = load_sentence_transformer_config(tmp_path)
    assert (st.pooling, st.normalize, st.max_seq_length) == (pooling, normalize, 40)


def test_bare_hf_folder_defaults_to_mean_without_normalize(tmp_path):
    write_tiny_bert(tmp_path, pooling="cls", normalize=True)
    (tmp_path / "modules.json").unlink()
    st = load_sentence_transformer_config(tmp_path)
    assert (st.pooling, st.normalize, st.max_seq_length, st.is_sentence_transformers) == \
        ("mean", False, None, False)


def test_unsupported_module_stacks_raise_typed_errors(tmp_path):
    write_tiny_bert(tmp_path)
    mods = json.loads((tmp_path / "modules.json").read_text())
    (tmp_path / "modules.json").write_text(json.dumps(
        mods + [{"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(UnsupportedModelError, match="Dense"):
        load_sentence_transformer_config(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(mods))
    pool = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({**pool, "pooling_mode_cls_token": True}))
    with pytest.raises(UnsupportedModelError, match="exactly one pooling mode"):
        load_sentence_transformer_config(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_sqrt_len_tokens": True}))
    with pytest.raises(UnsupportedModelError, match="mean_sqrt_len"):
        load_sentence_transformer_config(tmp_path)
    (tmp_path / "modules.json").write_text("[{")
    with pytest.raises(ModelFormatError):
        load_sentence_transformer_config(tmp_path)


# --------------------------------------------------------------------------- GPU model vs numpy
def _embed_gpu(device, folder, seqs, B, S, *, act_dtype="f32", pooling, normalize) -> np.ndarray:
    cfg = load_bert_config(folder)
    owner = f"test:bert:{folder.name}:{act_dtype}"
    model = BertModel(device, cfg, load_safetensors_folder(folder), act_dtype=act_dtype, pooling=pooling,
                      normalize=normalize, owner=owner)
    try:
        assert device.allocated_bytes(owner) > 0
        dst = device.buffer(len(seqs) * cfg.hidden_size * 4, owner=owner, label="dst")
        model.run(seqs, B, S, dst)
        out = np.frombuffer(device.read_sync(dst), np.float32).reshape(len(seqs), cfg.hidden_size).copy()
    finally:
        model.dispose()
        device.release_owner(owner)
    assert device.allocated_bytes(owner) == 0
    return out


@pytest.mark.parametrize("wdtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False), ("max", True),
                                                ("lasttoken", True), ("weightedmean", False)])
def test_tiny_bert_matches_numpy(device, tmp_path, wdtype, pooling, normalize):
    info = write_tiny_bert(tmp_path, pooling=pooling, normalize=normalize, dtype=wdtype)
    V = info["config"].vocab_size
    rng = np.random.default_rng(1)
    # 3 sequences of different lengths in a bucket of 4 x 24: padded rows and a padding sequence
    seqs = [[2] + rng.integers(5, V, size=n - 2).tolist() + [3] for n in (21, 2, 9)]
    got = _embed_gpu(device, tmp_path, seqs, 4, 24, pooling=pooling, normalize=normalize)
    W, cfg = R.load_weights(tmp_path), R.load_config(tmp_path)
    for s, v in zip(seqs, got):
        ref = R.embed(W, cfg, s, pooling=pooling, normalize=normalize)
        assert np.all(np.isfinite(v))
        assert np.abs(v - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), (pooling, len(s))


@pytest.mark.parametrize("pooling", ["mean", "max"])
def test_tiny_bert_f16_activations(device, tmp_path, pooling):
    if not device.has_f16:
        pytest.fail("this adapter lacks shader-f16; the f16 variant cannot be tested here")
    write_tiny_bert(tmp_path, pooling=pooling, normalize=True, dtype="f16")
    rng = np.random.default_rng(2)
    seqs = [[2] + rng.integers(5, 100, size=n - 2).tolist() + [3] for n in (30, 5)]
    got = _embed_gpu(device, tmp_path, seqs, 2, 32, act_dtype="f16", pooling=pooling, normalize=True)
    W, cfg = R.load_weights(tmp_path), R.load_config(tmp_path)
    for s, v in zip(seqs, got):
        assert R.cosine(v, R.embed(W, cfg, s, pooling=pooling, normalize=True)) > 0.999


def test_missing_weight_and_bad_activation_are_typed_errors(device, tmp_path):
    write_tiny_bert(tmp_path)
    cfg = load_bert_config(tmp_path)
    tensors = load_safetensors_folder(tmp_path)
    del tensors["encoder.layer.1.output.dense.weight"]
    with pytest.raises(UnsupportedModelError, match="encoder.layer.1.output.dense.weight"):
        BertModel(device, cfg, tensors, owner="test:bert:missing")
    assert device.allocated_bytes("test:bert:missing") == 0
    cfg.hidden_act = "gelu_new"
    with pytest.raises(UnsupportedModelError, match="gelu_new"):
        BertModel(device, cfg, load_safetensors_folder(tmp_path), owner="test:bert:act")


def test_checkpoint_with_bert_prefix(device, tmp_path):
    """BertForMaskedLM-style checkpoints nest the encoder under `bert.`."""
    write_tiny_bert(tmp_path / "a", pooling="mean", normalize=True)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    tensors = load_safetensors_folder(tmp_path / "a")
    from webgpu_engine.loaders.safetensors import write_safetensors
    write_safetensors(tmp_path / "b" / "model.safetensors",
                      {"bert." + k: (t.qtype, t.shape, bytes(t.data)) for k, t in tensors.items()})
    seqs = [[2, 40, 41, 42, 3]]
    a = _embed_gpu(device, tmp_path / "a", seqs, 1, 16, pooling="mean", normalize=True)
    b = _embed_gpu(device, tmp_path / "b", seqs, 1, 16, pooling="mean", normalize=True)
    assert np.array_equal(a, b)


# --------------------------------------------------------------------------- pooling vs sentence-transformers
@pytest.mark.parametrize("pooling", ["lasttoken", "weightedmean"])
async def test_pooling_modes_equal_sentence_transformers(device, tmp_path, pooling):
    """tests/fixtures/make_pooling.py: SentenceTransformer.encode of the same tiny BERT, batches of 3."""
    from pathlib import Path

    from webgpu_engine.config import ChatConfig
    from webgpu_engine.pipelines.embedding import EmbeddingPipeline
    ref = json.loads((Path(__file__).parent / "fixtures" / "pooling_reference.json").read_text())
    mode = ref["modes"][pooling]
    write_tiny_bert(tmp_path, pooling=pooling, normalize=mode["normalize"], seed=ref["seed"],
                    max_seq_length=ref["max_seq_length"])
    pipe = await EmbeddingPipeline.load(device, tmp_path, ChatConfig(max_batch_size=2))
    try:
        assert pipe.tokenize(ref["texts"]) == mode["token_ids"]
        res = await pipe.embed_step(ref["texts"])
    finally:
        pipe.dispose()
    for got, want in zip(res.embeddings, mode["embeddings"]):
        assert R.cosine(got, want) > 0.9999 and np.abs(np.asarray(got) - want).max() < 1e-4


def test_f32_to_f16_without_numpy_gives_numpys_bits():
    """The browser page has no numpy: an f32 file's matrices under f16 activations go through struct
    there, with the bits numpy gives natively (ties to even, subnormals, signed zero, large values)."""
    from webgpu_engine.models.bert import f32_to_f16
    rng = np.random.default_rng(3)
    vals = np.concatenate([rng.standard_normal(300_000).astype(np.float32) * 0.05,
                           np.array([0.0, -0.0, 1e-7, -3e-6, 65504.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                                     6.1e-5, 2.0 ** -24, 2.0 ** -25], np.float32)])
    want = np.asarray(f32_to_f16(vals.tobytes())).view(np.uint16)
    got = np.frombuffer(f32_to_f16(vals.tobytes(), pure=True), np.uint16)
    assert want.dtype == np.uint16 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
