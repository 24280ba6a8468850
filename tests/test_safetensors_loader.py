"""safetensors reader vs the `safetensors` package, sharded folders, HF configs and name tables,
and the tiny HF model writers read back exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest

from webgpu_engine.errors import ModelFormatError, UnsupportedModelError
from webgpu_engine.loaders.hf_config import load_bert_config, load_llama_config, map_hf_names
from webgpu_engine.loaders.safetensors import (SafetensorsFile, SafetensorsFolder, load_safetensors_folder,
                                               write_safetensors)

_NP = {"f32": np.float32, "f16": np.float16, "i64": np.int64}


def _as_numpy(t) -> np.ndarray:
    if t.qtype == "bf16":
        from tinymodels import bf16_bits_to_f32
        return bf16_bits_to_f32(np.frombuffer(t.data, np.uint16)).reshape(t.shape)
    return np.frombuffer(t.data, _NP[t.qtype]).reshape(t.shape)


def test_minilm_equals_safetensors_package(minilm_dir):
    from safetensors.numpy import load_file
    ref = load_file(str(minilm_dir / "model.safetensors"))
    f = SafetensorsFile(minilm_dir / "model.safetensors")
    assert set(f.tensors) == set(ref) and f.metadata == {"format": "pt"}
    for name, arr in ref.items():
        t = f.tensors[name]
        assert t.shape == arr.shape and t.qtype == {"float32": "f32", "int64": "i64"}[str(arr.dtype)], name
        assert isinstance(t.data, memoryview) and bytes(t.data) == arr.tobytes(), name


def test_minilm_config_and_names(minilm_dir):
    cfg = load_bert_config(minilm_dir)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads) == (30522, 384, 6, 12)
    assert (cfg.intermediate_size, cfg.max_position, cfg.head_dim, cfg.hidden_act) == (1536, 512, 32, "gelu")
    assert cfg.layer_norm_eps == 1e-12 and cfg.type_vocab_size == 2
    w = SafetensorsFolder(minilm_dir).weights("bert")
    assert w["embed"].shape == (30522, 384) and w["layers.5.up"].shape == (1536, 384)
    assert w["layers.0.q"].name == "encoder.layer.0.attention.self.query.weight"
    # position_ids is not a weight; the pooler's dense layer maps to head_dense (cross-encoders use it)
    assert len(w) == 5 + 16 * 6 + 2 and w["head_dense"].shape == (384, 384)
    with pytest.raises(UnsupportedModelError):
        load_llama_config(minilm_dir)


def test_writer_roundtrip_and_package_agrees(tmp_path):
    from safetensors.numpy import load_file
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float16)
    s = np.zeros((), np.float32)
    p = tmp_path / "x.safetensors"
    write_safetensors(p, {"a": ("f32", a.shape, a.tobytes()), "b": ("f16", b.shape, b.tobytes()),
                          "s": ("f32", (), s.tobytes())}, {"k": "v"})
    ref = load_file(str(p))
    np.testing.assert_array_equal(ref["a"], a)
    np.testing.assert_array_equal(ref["b"], b)
    f = SafetensorsFile(p.read_bytes())                   # parsing from a buffer
    assert f.metadata == {"k": "v"} and f.tensors["s"].shape == ()
    np.testing.assert_array_equal(_as_numpy(f.tensors["a"]), a)
    assert (8 + int.from_bytes(p.read_bytes()[:8], "little")) % 8 == 0      # data 8-byte aligned


def test_malformed(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFormatError, match="header length"):
        SafetensorsFile(p)
    p.write_bytes((4).to_bytes(8, "little") + b"nope")
    with pytest.raises(ModelFormatError, match="not JSON"):
        SafetensorsFile(p)
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    p.write_bytes(len(hdr).to_bytes(8, "little") + hdr + bytes(8))   # 8 of 16 data bytes
    with pytest.raises(ModelFormatError, match="truncated"):
        SafetensorsFile(p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="no .safetensors"):
        SafetensorsFolder(tmp_path / "empty")
    with pytest.raises(ModelFormatError, match="config.json"):
        load_llama_config(tmp_path / "empty")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype,sharded", [("f32", False), ("f16", True), ("bf16", False), ("bf16", True)])
def test_tiny_llama_safetensors_reads_back(tmp_path, arch, dtype, sharded):
    from tinymodels import write_tiny_llama_safetensors
    info = write_tiny_llama_safetensors(tmp_path / "m", arch=arch, dtype=dtype, sharded=sharded, seed=1)
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file() == sharded
    cfg = load_llama_config(info["folder"])
    assert cfg == info["config"] and cfg.rope_neox and cfg.qkv_bias == (arch == "qwen2")
    folder = SafetensorsFolder(info["folder"])
    assert len(folder.files) == (2 if sharded else 1)
    w = folder.weights("llama")
    assert set(w) == set(info["weights"])
    for name, t in w.items():
        assert t.qtype == dtype and t.name == info["hf_names"][name]
        np.testing.assert_array_equal(_as_numpy(t).astype(np.float32), info["weights"][name], err_msg=name)
    if dtype != "bf16":                                   # the package reads what we wrote
        from safetensors.numpy import load_file
        for fname in folder.files:
            for name, arr in load_file(str(info["folder"] / fname)).items():
                assert bytes(folder.tensors[name].data) == arr.tobytes()
    assert set(load_safetensors_folder(info["folder"])) == set(folder.tensors)


def test_bf16_rounding():
    from tinymodels import _to_bf16_bits, bf16_bits_to_f32
    # 1 + 2^-8 and 1 + 3*2^-8 are halfway between bf16 neighbours: ties go to the even mantissa
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 1.0 + 2 ** -7 + 2 ** -9], np.float32)
    assert bf16_bits_to_f32(_to_bf16_bits(x)).tolist() == [1.0, 1.0, 1.015625, -2.5, 1.0 + 2 ** -7]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_tiny_bert_reads_back(tmp_path, dtype):
    from tinymodels import write_tiny_bert
    info = write_tiny_bert(tmp_path / "b", pooling="cls", normalize=False, dtype=dtype, seed=2)
    assert load_bert_config(info["folder"]) == info["config"]
    tensors = load_safetensors_folder(info["folder"])
    for name, ref in info["weights"].items():
        np.testing.assert_array_equal(_as_numpy(tensors[name]).astype(np.float32), ref, err_msg=name)
    pool = json.loads((info["folder"] / "1_Pooling" / "config.json").read_text())
    assert pool["pooling_mode_cls_token"] and not pool["pooling_mode_mean_tokens"]
    modules = json.loads((info["folder"] / "modules.json").read_text())
    assert [m["type"].split(".")[-1] for m in modules] == ["Transformer", "Pooling"]
    assert len(map_hf_names(tensors, "bert")) == 5 + 16 * info["config"].n_layers


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_open_tiny(tmp_path, fmt):
    from tinymodels import open_tiny
    cfg, infos, close = open_tiny(tmp_path, arch="qwen2", fmt=fmt, n_layers=1)
    assert cfg.n_layers == 1 and cfg.qkv_bias and infos["layers.0.q_bias"].shape == (cfg.q_dim,)
    assert infos["layers.0.k"].shape == (cfg.kv_dim, cfg.hidden_size) and "layers.1.q" not in infos
    close()


def test_bert_names_prefixes_and_gamma_beta(tmp_path):
    """One name table serves plain BertModel names, "bert."/"model." prefixed ones and TF-era
    LayerNorm gamma / beta; a missing tensor is reported by its Hugging Face name."""
    from tinymodels import write_tiny_bert
    from webgpu_engine.loaders.hf_config import hf_name
    info = write_tiny_bert(tmp_path / "b", dtype="f32", seed=3)
    tensors = load_safetensors_folder(info["folder"])
    plain = map_hf_names(tensors, "bert")
    renamed = {}
    for i, (k, t) in enumerate(tensors.items()):
        k2 = ("bert.", "model.")[i % 2] + k
        if k2.endswith("LayerNorm.weight"):
            k2 = k2[:-len("weight")] + "gamma"
        elif k2.endswith("LayerNorm.bias"):
            k2 = k2[:-len("bias")] + "beta"
        renamed[k2] = t
    mapped = map_hf_names(renamed, "bert")
    assert mapped.keys() == plain.keys() and all(mapped[k] is plain[k] for k in plain)
    assert plain["layers.1.ffn_norm_bias"].name == "encoder.layer.1.output.LayerNorm.bias"
    assert hf_name("layers.1.ffn_norm_bias", "bert") == "encoder.layer.1.output.LayerNorm.bias"
    assert hf_name("embed", "bert") == "embeddings.word_embeddings.weight"
