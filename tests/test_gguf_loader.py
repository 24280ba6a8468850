"""GGUF reader: metadata, tensor infos and bytes equal the `gguf` package's reader; LlamaConfig; errors."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.errors import ModelFormatError, UnsupportedModelError
from webgpu_engine.loaders.gguf import GGML_TYPES, GGUFFile, our_name
from webgpu_engine.loaders.model_config import LlamaConfig


def _reference_metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):          # the reader's pseudo-fields (version, counts)
            continue
        out[key] = field.contents()
    return out


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return GGUFFile(smollm2_gguf)


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    from gguf import GGUFReader
    return GGUFReader(smollm2_gguf)             # slow (seconds): built once


def test_metadata_equals_gguf_package(smol, reader):
    ref = _reference_metadata(reader)
    assert set(smol.metadata) == set(ref)
    for key, value in ref.items():
        if isinstance(value, list):
            assert list(smol.metadata[key]) == list(value), key
        else:
            assert smol.metadata[key] == pytest.approx(value) if isinstance(value, float) \
                else smol.metadata[key] == value, key
    assert smol.version == 3 and smol.alignment == 32


def test_tensors_equal_gguf_package(smol, reader):
    assert [t.name for t in reader.tensors] == list(smol.tensors)
    for t in reader.tensors:
        ours = smol.tensors[t.name]
        assert ours.qtype == t.tensor_type.name.lower(), t.name
        assert ours.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        assert ours.nbytes == int(t.n_bytes) and ours.offset == int(t.data_offset), t.name
        assert bytes(ours.data) == np.ascontiguousarray(t.data).tobytes(), t.name


def test_data_is_zero_copy(smol):
    t = smol.tensors["token_embd.weight"]
    assert isinstance(t.data, memoryview) and t.data.obj is smol._buf.obj   # a view of the mmap
    assert t.qtype == "q8_0" and t.shape == (49152, 576) and t.nbytes == 49152 * 576 // 32 * 34


def test_parse_from_bytes_equals_path(smol, smollm2_gguf):
    g = GGUFFile(smollm2_gguf.read_bytes())
    assert g.metadata == smol.metadata
    assert {k: (t.qtype, t.shape, t.offset) for k, t in g.tensors.items()} == \
        {k: (t.qtype, t.shape, t.offset) for k, t in smol.tensors.items()}
    assert bytes(g.tensors["blk.3.attn_q.weight"].data) == bytes(smol.tensors["blk.3.attn_q.weight"].data)


def test_model_config(smol):
    cfg = smol.model_config()
    assert isinstance(cfg, LlamaConfig)
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.n_layers) == ("llama", 49152, 576, 30)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_size) == (9, 3, 64, 1536)
    assert cfg.rope_base == 100000.0 and cfg.rot_dim == 64 and cfg.rope_neox is False
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.context_length == 8192
    assert cfg.bos_id == 1 and cfg.eos_ids[0] == 2 and cfg.rms_eps == pytest.approx(1e-5)
    assert (cfg.q_dim, cfg.kv_dim, cfg.qkv_dim, cfg.n_rep) == (576, 192, 960, 3)


def test_name_table(smol):
    w = smol.weights()
    assert w["embed"].name == "token_embd.weight" and w["norm"].name == "output_norm.weight"
    assert "lm_head" not in w                                   # tied
    for i in (0, 29):
        for ours, theirs in [("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"),
                             ("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down"),
                             ("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm")]:
            assert w[f"layers.{i}.{ours}"].name == f"blk.{i}.{theirs}.weight"
    assert len(w) == 2 + 9 * 30
    assert our_name("blk.7.attn_q.bias") == "layers.7.q_bias" and our_name("blk.1.unknown") is None


def test_all_value_types_and_alignment(tmp_path):
    """Every metadata value type, arrays of each, a custom alignment, f16 and q8_0 tensors."""
    import gguf
    p = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint8("t.u8", 200); w.add_int8("t.i8", -100); w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000); w.add_uint32("t.u32", 4_000_000_000); w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.5); w.add_bool("t.bool", True); w.add_string("t.str", "héllo ✓")
    w.add_uint64("t.u64", 2**63 + 5); w.add_int64("t.i64", -(2**62)); w.add_float64("t.f64", 1 / 3)
    w.add_array("t.arr_i32", [1, -2, 3]); w.add_array("t.arr_str", ["a", "", "ü"])
    w.add_array("t.arr_f32", [0.25, -1.5]); w.add_array("t.arr_bool", [True, False])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 64)).astype(np.float16)
    w.add_tensor("a", a)
    q = gguf.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    g = GGUFFile(p)
    md = g.metadata
    assert (md["t.u8"], md["t.i8"], md["t.u16"], md["t.i16"]) == (200, -100, 60000, -30000)
    assert (md["t.u32"], md["t.i32"], md["t.u64"], md["t.i64"]) == (4_000_000_000, -2_000_000_000, 2**63 + 5, -(2**62))
    assert md["t.f32"] == 0.5 and md["t.bool"] is True and md["t.str"] == "héllo ✓" and md["t.f64"] == 1 / 3
    assert md["t.arr_i32"] == [1, -2, 3] and md["t.arr_str"] == ["a", "", "ü"]
    assert md["t.arr_f32"] == [0.25, -1.5] and md["t.arr_bool"] == [True, False]
    assert g.alignment == 64 and g.data_offset % 64 == 0
    assert g.tensors["a"].qtype == "f16" and g.tensors["a"].shape == (3, 64)
    assert bytes(g.tensors["a"].data) == a.tobytes() and g.tensors["a"].offset % 64 == 0
    assert g.tensors["q"].qtype == "q8_0" and g.tensors["q"].shape == (2, 64)
    assert bytes(g.tensors["q"].data) == q.tobytes()


def test_malformed_files(tmp_path, smollm2_gguf):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        GGUFFile(bad)
    head = smollm2_gguf.open("rb").read(4096)              # cut inside the metadata
    with pytest.raises(ModelFormatError, match="truncated|past the end"):
        GGUFFile(head)
    whole = smollm2_gguf.read_bytes()
    with pytest.raises(ModelFormatError, match="runs past the end"):   # cut inside the tensor data
        GGUFFile(whole[:len(whole) // 2])
    old = bytearray(whole[:64]); old[4:8] = (1).to_bytes(4, "little")
    with pytest.raises(ModelFormatError, match="version 1"):
        GGUFFile(bytes(old))
    with pytest.raises(ModelFormatError, match="Cannot open"):
        GGUFFile(tmp_path / "missing.gguf")


def test_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        GGUFFile(p).model_config()


def test_type_table_covers_supported_qtypes():
    from webgpu_engine.loaders.tensor_info import SUPPORTED_QTYPES
    # q4_0f32 is ours: MLC's q4f32_1 repacked (loaders/mlc.py), never in a GGUF file
    assert set(SUPPORTED_QTYPES) - {"q4_0f32"} <= set(GGML_TYPES.values())


# ------------------------------------------------------------------ tiny models written for other tests
def _dequant(t) -> np.ndarray:
    import gguf
    raw = np.frombuffer(t.data, dtype=np.uint8)
    if t.qtype == "f32":
        return raw.view(np.float32).reshape(t.shape)
    if t.qtype == "f16":
        return raw.view(np.float16).astype(np.float32).reshape(t.shape)
    gq = gguf.GGMLQuantizationType[t.qtype.upper()]
    return gguf.dequantize(raw.reshape(t.shape[0], -1), gq).reshape(t.shape).astype(np.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_0", "q4_1"])
def test_tiny_gguf_reads_back(tmp_path, arch, qtype):
    from tinymodels import unpermute_qk, write_tiny_llama_gguf
    info = write_tiny_llama_gguf(tmp_path / "m.gguf", arch=arch, qtype=qtype, seed=3)
    g = GGUFFile(info["path"])
    cfg = g.model_config()
    assert cfg == info["config"] and cfg.rope_neox == info["rope_neox"] == (arch == "qwen2")
    assert cfg.qkv_bias == (arch == "qwen2") and not cfg.tie_embeddings
    w = g.weights()
    assert set(w) == set(info["weights"])
    for name, t in w.items():
        assert t.qtype == info["qtypes"][name], name
        np.testing.assert_array_equal(_dequant(t), info["weights"][name], err_msg=name)
    for i in range(cfg.n_layers):                 # q/k stored permuted for llama only
        for part, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads)):
            name = f"layers.{i}.{part}"
            hf = unpermute_qk(info["weights"][name], heads) if arch == "llama" else info["weights"][name]
            np.testing.assert_array_equal(hf, info["hf_weights"][name])
    tok = g.tokenizer()
    assert tok.vocab_size == cfg.vocab_size == len(info["tokens"])
    text = g.template().render([{"role": "user", "content": "Hello world 42"}])
    assert tok.decode(tok.encode(text)) == text and tok.encode(text)[0] == cfg.bos_id


def test_tiny_gguf_same_model_as_safetensors(tmp_path):
    """Same seed, f32: the GGUF file is the safetensors model with q/k rows permuted."""
    from tinymodels import permute_qk, write_tiny_llama_gguf, write_tiny_llama_safetensors
    a = write_tiny_llama_gguf(tmp_path / "m.gguf", qtype="f32", seed=5, tie_embeddings=True)
    b = write_tiny_llama_safetensors(tmp_path / "hf", dtype="f32", seed=5, tie_embeddings=True)
    assert "lm_head" not in a["weights"] and GGUFFile(a["path"]).model_config().tie_embeddings
    for name, hf in b["weights"].items():
        heads = {"q": 4, "k": 2}.get(name.split(".")[-1])
        np.testing.assert_array_equal(a["weights"][name], permute_qk(hf, heads) if heads else hf, err_msg=name)


@pytest.mark.parametrize("qtype,tol", [("q4_k", 0.25), ("q6_k", 0.07), ("q5_k", 0.12), ("q3_k", 0.5),
                                      ("q2_k", 0.6), ("iq4_nl", 0.25), ("iq4_xs", 0.25)])
def test_tiny_gguf_k_quants(tmp_path, qtype, tol):
    """Our K-quant and IQ4 encoders write blocks that gguf dequantizes close to the weights they
    encode."""
    from tinymodels import write_tiny_llama_gguf
    info = write_tiny_llama_gguf(tmp_path / "k.gguf", qtype=qtype, embed_qtype="q8_0", seed=1,
                                 hidden_size=256, ffn_size=512, n_layers=1)
    g = GGUFFile(info["path"])
    w = g.weights()
    assert w["layers.0.down"].qtype == qtype and w["layers.0.down"].shape == (256, 512)
    assert w["embed"].qtype == "q8_0" and g.model_config() == info["config"]
    for name, t in w.items():
        np.testing.assert_array_equal(_dequant(t), info["weights"][name], err_msg=name)
    # the same seed and dims in f32: the quantized model is within one step of it
    exact = write_tiny_llama_gguf(tmp_path / "f.gguf", qtype="f32", seed=1, hidden_size=256, ffn_size=512,
                                  n_layers=1)["weights"]
    for name in ("layers.0.q", "layers.0.down", "layers.0.gate"):
        err = np.abs(info["weights"][name] - exact[name]).max() / np.abs(exact[name]).max()
        assert 0 < err < tol, (name, err)
    with pytest.raises(ValueError, match="multiple of the q4_k block"):
        write_tiny_llama_gguf(tmp_path / "bad.gguf", qtype="q4_k")


def test_tiny_gguf_k_quant_mix(tmp_path):
    """A Q4_K_M-style mix (v and down in Q6_K, the rest Q4_K): the loader reports each tensor's type
    and its bytes dequantize to the weights the writer encoded."""
    from tinymodels import write_tiny_llama_gguf
    info = write_tiny_llama_gguf(tmp_path / "mix.gguf", qtype="q4_k", embed_qtype="q6_k", seed=1,
                                 tensor_qtypes={"v": "q6_k", "down": "q6_k"}, hidden_size=256,
                                 ffn_size=512, n_layers=1)
    w = GGUFFile(info["path"]).weights()
    assert {n.split(".")[-1]: t.qtype for n, t in w.items() if n.startswith("layers.0.") and len(t.shape) == 2} \
        == {"q": "q4_k", "k": "q4_k", "v": "q6_k", "o": "q4_k", "gate": "q4_k", "up": "q4_k", "down": "q6_k"}
    assert w["embed"].qtype == "q6_k" and w["lm_head"].qtype == "q4_k"
    for name, t in w.items():
        np.testing.assert_array_equal(_dequant(t), info["weights"][name], err_msg=name)
