"""MLC-LLM artifacts (WebLLM's models, loaders/mlc.py): a tiny model written in MLC's layout here
(numpy; MLC's group quantiser as its spec: groups of 32 along K, scale = max|w| / 7 in the model
dtype, q = clip(round(w / scale) + 7, 0, 14), 8 nibbles per u32 with element r at bits 4r) loads
and runs as the same model from safetensors (q0f32, q0f16, f32-to-bf16 records) or as a numpy
reference forward on the weights as the files encode them (q4f16_1, q4f32_1); broken artifacts
give typed errors; MLC's conv_template renders as WebLLM does."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cache_server import FileServer
from decoder_runner import DecoderRunner
from ref_llama import RefLlama
from test_references import _folder_files, fake_hf_repo
from tinyfamilies import (write_tiny_gemma_safetensors, write_tiny_olmo2_safetensors, write_tiny_phi3_safetensors,
                          write_tiny_gptneox_safetensors, write_tiny_phi_safetensors,
                          write_tiny_stablelm_safetensors)
from tinymodels import _to_bf16_bits, write_tiny_llama_safetensors
from webgpu_engine import errors as E
from webgpu_engine.cli import main
from webgpu_engine.engine import EngineConfig, create_mlc_engine
from webgpu_engine.engine.records import app_config_from_dict
from webgpu_engine.engine.references import resolve_model_reference
from webgpu_engine.errors import ModelFormatError, UnsupportedModelError
from webgpu_engine.kernels.quant_ref import dequantize
from webgpu_engine.loaders.mlc import (ConvTemplate, MLCArtifact, read_chat_config, repack_q4, repack_q4_numpy,
                                       repack_q4_stdlib)
from webgpu_engine.loaders.safetensors import SafetensorsFolder
from webgpu_engine.loaders.tensor_info import split_fused
from webgpu_engine.models.registry import open_model

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11, 128, 31, 200]

# (MLC name, our names fused in row order) of one layer, per family
_LAYER = {
    "llama": {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",), "mlp.gate_up_proj": ("gate", "up"),
              "mlp.down_proj": ("down",), "input_layernorm": ("attn_norm",), "post_attention_layernorm": ("ffn_norm",)},
}
_LAYER["qwen2"] = {**{k: v for k, v in _LAYER["llama"].items() if k != "self_attn.qkv_proj"},
                   "self_attn.c_attn": ("q", "k", "v")}


def mlc_quantize(w: np.ndarray, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """MLC's group quantisation of an (N, K) matrix: (q_weight (N, K/8) u32, q_scale (N, K/32))."""
    n, k = w.shape
    g = w.astype(scale_dtype).reshape(n, k // 32, 32)
    scale = (np.abs(g).max(axis=2) / scale_dtype(7)).astype(scale_dtype)
    q = np.clip(np.round(g.astype(np.float32) / scale[..., None].astype(np.float32) + 7), 0, 14).astype(np.uint32)
    q = q.reshape(n, k // 8, 8)
    return (q << (4 * np.arange(8, dtype=np.uint32))).sum(axis=2, dtype=np.uint32), scale


def mlc_dequantize(qw: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """(q - 7) * scale of MLC's q_weight / q_scale, in float64: the weights as the files encode them."""
    n = qw.shape[0]
    q = (qw[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    return ((q.reshape(n, -1, 32).astype(np.float64) - 7) * qs[..., None].astype(np.float64)).reshape(n, -1)


def mlc_param(params: dict, name: str, full: np.ndarray, quant: str, dtype, suffix: str = ".weight") -> np.ndarray:
    """Store one parameter as MLC's converter does: in a q4 quantisation a matrix as `name.q_weight` /
    `name.q_scale`, else `name + suffix` in the model's dtype; returns the float64 values the files encode."""
    if quant.startswith("q4") and full.ndim == 2:
        qw, qs = mlc_quantize(full, dtype)
        params[name + ".q_weight"], params[name + ".q_scale"] = qw, qs
        return mlc_dequantize(qw, qs)
    params[name + suffix] = full.astype(dtype)
    return np.asarray(params[name + suffix], np.float64)


def write_mlc(folder, info: dict, quant: str, *, bf16_records: bool = False, cache_name: str = "tensor-cache.json"):
    """An MLC folder of the tiny model `info` (write_tiny_llama_safetensors): returns {our name: float64
    values the files encode} (f32-to-bf16 records aside)."""
    folder.mkdir(parents=True)
    arch, w, cfg = info["arch"], info["weights"], info["config"]
    model_dtype = {"q0f32": np.float32, "q0f16": np.float16, "q4f16_1": np.float16, "q4f32_1": np.float32}[quant]
    params, encoded = {}, {}
    mats = {"model.embed_tokens": ("embed",), "lm_head": ("lm_head",)}
    for i in range(cfg.n_layers):
        for mlc, ours in _LAYER[arch].items():
            mats[f"model.layers.{i}.{mlc}"] = tuple(f"layers.{i}.{o}" for o in ours)
        if arch == "qwen2":
            params[f"model.layers.{i}.self_attn.c_attn.bias"] = np.concatenate(
                [w[f"layers.{i}.{b}_bias"] for b in "qkv"]).astype(model_dtype)
    mats["model.norm"] = ("norm",)
    for mlc, ours in mats.items():
        full = np.concatenate([w[o] for o in ours], axis=0) if len(w[ours[0]].shape) == 2 else w[ours[0]]
        if quant.startswith("q4") and full.ndim == 2:
            qw, qs = mlc_quantize(full, model_dtype)
            params[mlc + ".q_weight"], params[mlc + ".q_scale"] = qw, qs
            full = mlc_dequantize(qw, qs)
        else:
            params[mlc + ".weight"] = full.astype(model_dtype)
        rows = np.cumsum([0] + [w[o].shape[0] for o in ours]) if full.ndim == 2 else [0, len(full)]
        for o, a, b in zip(ours, rows[:-1], rows[1:]):
            encoded[o] = np.asarray(full[a:b], np.float64)
    for i in range(cfg.n_layers):
        if arch == "qwen2":
            bias = params[f"model.layers.{i}.self_attn.c_attn.bias"].astype(np.float64)
            q, kv = cfg.q_dim, cfg.kv_dim
            encoded.update({f"layers.{i}.q_bias": bias[:q], f"layers.{i}.k_bias": bias[q:q + kv],
                            f"layers.{i}.v_bias": bias[q + kv:]})
    # two shards, records in order
    names = list(params)
    shards = []
    for j, chunk in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        blob, recs = b"", []
        for name in chunk:
            a = params[name]
            fmt = "raw"
            if bf16_records and a.dtype == np.float32:
                raw, fmt = _to_bf16_bits(a).tobytes(), "f32-to-bf16"
            else:
                raw = a.tobytes()
            dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                     np.dtype(np.uint32): "uint32"}[a.dtype]
            recs.append({"name": name, "shape": list(a.shape), "dtype": dtype, "format": fmt,
                         "nbytes": len(raw), "byteOffset": len(blob)})
            blob += raw
        path = f"params_shard_{j}.bin"
        (folder / path).write_bytes(blob)
        shards.append({"dataPath": path, "format": "raw-shard", "nbytes": len(blob),
                       "md5sum": hashlib.md5(blob).hexdigest(), "records": recs})
    (folder / cache_name).write_text(json.dumps({"metadata": {"ParamSize": len(names)}, "records": shards}))
    d = info["config"]
    chat = {
        "model_type": arch, "quantization": quant,
        "model_config": {"hidden_size": d.hidden_size, "intermediate_size": d.ffn_size,
                         "num_attention_heads": d.n_heads, "num_hidden_layers": d.n_layers,
                         "rms_norm_eps": d.rms_eps, "vocab_size": d.vocab_size, "tie_word_embeddings": False,
                         "position_embedding_base": d.rope_base, "context_window_size": d.context_length,
                         "prefill_chunk_size": 128, "num_key_value_heads": d.n_kv_heads, "head_dim": d.head_dim},
        "context_window_size": d.context_length, "prefill_chunk_size": 128, "sliding_window_size": -1,
        "temperature": 0.7, "top_p": 0.9, "tokenizer_files": ["tokenizer.json"],
        "conv_template": {"name": "chatml", "system_template": "<|im_start|>system\n{system_message}<|im_end|>\n",
                          "system_message": "You are a helpful assistant.",
                          "roles": {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
                          "seps": ["<|im_end|>\n"], "role_content_sep": "\n", "role_empty_sep": "\n",
                          "stop_str": ["<|im_end|>"], "stop_token_ids": [2]},
    }
    (folder / "mlc-chat-config.json").write_text(json.dumps(chat))
    shutil.copy(info["folder"] / "tokenizer.json", folder / "tokenizer.json")
    return encoded


def _write_shards(folder, params: dict, *, bf16: bool = False, cache_name: str = "tensor-cache.json") -> None:
    """params {MLC name: array} as one raw shard and its tensor cache; bf16: as MLC's converter writes
    them (every record f32-to-bf16, float32 tensors stored as bf16)."""
    blob, recs = b"", []
    for name, a in params.items():
        raw = (_to_bf16_bits(a) if bf16 and a.dtype == np.float32 else np.ascontiguousarray(a)).tobytes()
        recs.append({"name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                     "format": "f32-to-bf16" if bf16 else "raw", "nbytes": len(raw), "byteOffset": len(blob)})
        blob += raw
    (folder / "params_shard_0.bin").write_bytes(blob)
    (folder / cache_name).write_text(json.dumps({"records": [{
        "dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": len(blob),
        "md5sum": hashlib.md5(blob).hexdigest(), "records": recs}]}))


_PHI_MLC = {"model.embed_tokens.": "transformer.embd.", "model.final_layernorm.": "lm_head.ln.",
            "lm_head.weight": "lm_head.linear.weight", "lm_head.bias": "lm_head.linear.bias",
            "input_layernorm.": "ln.", "self_attn.qkv_proj.": "mixer.Wqkv.", "self_attn.dense.": "mixer.out_proj.",
            "model.layers.": "transformer.h."}
# MLC's PhiConfig names of config.json's fields
_PHI_MLC_CONFIG = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                   "num_key_value_heads": "n_head_kv", "intermediate_size": "n_inner",
                   "layer_norm_eps": "layer_norm_epsilon"}
_PHI3_MLC = {"model.embed_tokens.": "transformer.embd.", "model.norm.": "transformer.norm.",
             "input_layernorm.": "ln.", "self_attn.qkv_proj.": "mixer.qkv_proj.", "self_attn.o_proj.": "mixer.out_proj.",
             "model.layers.": "transformer.h."}


def mlc_from_hf(hf_folder, folder, model_type: str) -> None:
    """A q0f32 MLC artifact of an HF folder, named and configured as MLC's converter does (fused
    q|k|v and gate|up, Qwen's c_attn, Phi-3's transformer.h / mixer, Gemma's 1 + w norms and Gemma 3's
    language_model. prefix; model_config in MLC's field names)."""
    folder.mkdir(parents=True)
    sf = SafetensorsFolder(hf_folder)
    t = {n: np.frombuffer(x.data, np.float32).reshape(x.shape) for n, x in sf.tensors.items()}
    sf.close()
    gemma, qwen = model_type.startswith("gemma"), model_type.startswith("qwen")
    c0 = json.loads((hf_folder / "config.json").read_text())
    params = {}
    for name in list(t):
        for group, fused, parts in (("self_attn", "c_attn" if qwen else "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                    ("mlp", "gate_up_proj", ("gate_proj", "up_proj"))):
            first = f".{group}.{parts[0]}."
            if first in name:
                names = [name.replace(first, f".{group}.{p}.") for p in parts]
                t[name.replace(first, f".{group}.{fused}.")] = np.concatenate([t.pop(n) for n in names])
    for name in [n for n in t if model_type == "gpt_neox" and ".query_key_value." in n]:
        heads = c0["num_attention_heads"]          # MLC's converter: per-head q|k|v rows -> q | k | v
        t[name] = np.concatenate(np.split(t[name].reshape(heads, -1, *t[name].shape[1:]), 3, axis=1)).reshape(
            t[name].shape)
    for name, a in t.items():
        mlc = name
        if model_type in ("phi3", "phi"):
            for a_, b_ in (_PHI3_MLC if model_type == "phi3" else _PHI_MLC).items():
                mlc = mlc.replace(a_, b_)
        if gemma and name.endswith("norm.weight"):
            a = (a + np.float32(1)).astype(np.float32)
        params[("language_model." if model_type == "gemma3" else "") + mlc] = a
    _write_shards(folder, params)
    c = json.loads((hf_folder / "config.json").read_text())
    c.pop("architectures", None)
    if "rope_theta" in c and not qwen and model_type != "stablelm":      # MLC's StableLmConfig keeps it
        c["position_embedding_base"] = c.pop("rope_theta")
    if model_type != "phi3" and "max_position_embeddings" in c:
        c["context_window_size"] = c.pop("max_position_embeddings")
    if model_type == "phi":                     # MLC's PhiConfig (from_phi1): its own field names
        c = {_PHI_MLC_CONFIG.get(k, k): v for k, v in c.items()}
        c["rotary_dim"] = int(c.pop("partial_rotary_factor") * c["n_embd"] // c["n_head"])
    if model_type == "gemma":                   # MLC's GemmaConfig field, from config.json's hidden_act
        c["hidden_activation"] = c.pop("hidden_act")
    if model_type not in ("gemma2", "phi3") and "sliding_window" in c:
        c["sliding_window_size"] = c.pop("sliding_window") or -1
    mc = {"text_config": c, "vocab_size": c["vocab_size"], "is_text_model": True} if model_type == "gemma3" else c
    (folder / "mlc-chat-config.json").write_text(json.dumps({"model_type": model_type, "quantization": "q0f32",
                                                             "model_config": mc, "sliding_window_size": -1}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_folder / f, folder / f)


def _values(m, cfg) -> dict:
    w = split_fused(m.weights, cfg.q_dim, cfg.kv_dim, cfg.ffn_size, cfg.head_dim)
    return {n: dequantize(x.data, x.qtype, x.n, x.k) for n, x in w.items()}


def _bf16(a: np.ndarray) -> np.ndarray:
    return (_to_bf16_bits(a).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlc")
    return {arch: write_tiny_llama_safetensors(root / f"hf-{arch}", arch=arch, seed=3) for arch in ("llama", "qwen2")} \
        | {"root": root}


def _run(device, path, owner: str) -> tuple[np.ndarray, list[int]]:
    m = open_model(path)
    try:
        r = DecoderRunner(device, m.config, m.weights, owner=owner, context_window=64, chunk=64)
    finally:
        m.close()
    try:
        logits = r.prefill(PROMPT, [len(PROMPT)])[len(PROMPT) - 1]
        return logits, r.greedy(logits, len(PROMPT), 6)
    finally:
        r.release()


@pytest.mark.parametrize("arch,quant", [("llama", "q0f32"), ("qwen2", "q0f16")])
def test_float_artifact_equals_safetensors(device, tiny, arch, quant):
    info = tiny[arch]
    write_mlc(tiny["root"] / f"{arch}-{quant}", info, quant)
    st = write_tiny_llama_safetensors(tiny["root"] / f"st-{arch}-{quant}", arch=arch, seed=3,
                                      dtype="f32" if quant == "q0f32" else "f16")
    got, got_tok = _run(device, tiny["root"] / f"{arch}-{quant}", "test:mlc")
    want, want_tok = _run(device, st["folder"], "test:st")
    assert got_tok == want_tok
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("arch,quant", [("llama", "q4f16_1"), ("qwen2", "q4f32_1")])
def test_q4_artifact_matches_reference(device, tiny, arch, quant):
    """Fused qkv_proj / c_attn (with its bias) and gate_up_proj split; logits and greedy tokens equal a
    numpy forward over (q - 7) * scale of the files."""
    info = tiny[arch]
    encoded = write_mlc(tiny["root"] / f"{arch}-{quant}", info, quant)
    m = open_model(tiny["root"] / f"{arch}-{quant}")
    try:
        assert m.arch.name == arch and m.config.vocab_size == info["config"].vocab_size
        w = m.weights
        assert w["layers.0.qkv"].qtype == ("q4_0" if quant == "q4f16_1" else "q4_0f32")
        # the repack is exact: our Q4_0 decode of it equals MLC's (q - 7) * scale, bit for bit
        t = w["layers.1.gate_up"]
        np.testing.assert_array_equal(dequantize(t.data, t.qtype, t.n, t.k),
                                      np.concatenate([encoded["layers.1.gate"], encoded["layers.1.up"]]))
        if arch == "qwen2":
            np.testing.assert_array_equal(np.frombuffer(w["layers.0.k_bias"].data, np.float32),
                                          encoded["layers.0.k_bias"])
    finally:
        m.close()
    got, got_tok = _run(device, tiny["root"] / f"{arch}-{quant}", "test:mlc")
    ref = RefLlama(info["config"], encoded)
    want = ref.forward(PROMPT, all_logits=False)[-1]
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
    assert got_tok[0] == int(np.argmax(want))


def test_bf16_records_widened(device, tiny):
    """MLC's converter stores float32 tensors as bf16 (format f32-to-bf16): they load as the bf16
    safetensors model does."""
    info = tiny["llama"]
    path = tiny["root"] / "llama-bf16rec"
    write_mlc(path, info, "q0f32", bf16_records=True)
    cache = json.loads((path / "tensor-cache.json").read_text())
    assert {r["format"] for s in cache["records"] for r in s["records"]} == {"f32-to-bf16"}
    art = MLCArtifact(path)
    try:
        t = art.tensors["model.layers.0.self_attn.o_proj.weight"]
        assert t.qtype == "bf16" and t.shape == info["weights"]["layers.0.o"].shape
        np.testing.assert_array_equal(dequantize(t.data, "bf16", *t.shape), _bf16(info["weights"]["layers.0.o"]))
    finally:
        art.close()
    st = write_tiny_llama_safetensors(tiny["root"] / "st-llama-bf16", arch="llama", seed=3, dtype="bf16")
    got, got_tok = _run(device, path, "test:mlc")
    want, want_tok = _run(device, st["folder"], "test:st")
    assert got_tok == want_tok
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


_FAMILY_WRITERS = {
    "qwen3": lambda p: write_tiny_llama_safetensors(p, arch="qwen3", seed=4),
    "mistral": lambda p: write_tiny_llama_safetensors(p, arch="mistral", seed=4, sliding_window=24),
    "phi3": lambda p: write_tiny_phi3_safetensors(p, seed=4),
    "gemma": lambda p: write_tiny_gemma_safetensors(p, arch="gemma", seed=4, n_kv_heads=1, head_dim=32),
    "gemma2": lambda p: write_tiny_gemma_safetensors(p, arch="gemma2", seed=4, sliding_window=24,
                                                     attn_softcap=50.0, final_softcap=30.0),
    "gemma3": lambda p: write_tiny_gemma_safetensors(p, arch="gemma3", seed=4, sliding_window=24),
    "olmo2": lambda p: write_tiny_olmo2_safetensors(p, seed=4),
    "stablelm": lambda p: write_tiny_stablelm_safetensors(p, seed=4),
    "phi": lambda p: write_tiny_phi_safetensors(p, seed=4),
    "gpt_neox": lambda p: write_tiny_gptneox_safetensors(p, seed=4),
}


@pytest.mark.parametrize("family", list(_FAMILY_WRITERS))
def test_family_names_and_config_as_hf(tiny, family):
    """Each family's MLC artifact opens as the same model as its HF folder: the same LlamaConfig (MLC's
    field names read) and the same weight values under our names (fusions split, Gemma's stored 1 + w)."""
    hf = tiny["root"] / f"hf-{family}"
    if not hf.exists():
        _FAMILY_WRITERS[family](hf)
    mlc_from_hf(hf, tiny["root"] / f"mlc-{family}", family)
    a, b = open_model(hf), open_model(tiny["root"] / f"mlc-{family}")
    try:
        assert a.arch.name == b.arch.name == {"phi": "phi2", "gpt_neox": "gptneox"}.get(family, family)
        ca, cb = dataclasses.asdict(a.config), dataclasses.asdict(b.config)
        plus_one = ca.pop("norm_plus_one")
        assert cb.pop("norm_plus_one") is False and plus_one == family.startswith("gemma")
        for d in (ca, cb):
            d.pop("name")
        assert ca == cb
        wa, wb = _values(a, a.config), _values(b, b.config)
        assert set(wa) == set(wb)
        for n in wa:
            want = wa[n] + 1 if plus_one and n.endswith("norm") else wa[n]
            np.testing.assert_allclose(wb[n], want, rtol=1e-7, err_msg=n)
    finally:
        a.close()
        b.close()


def test_gemma3_artifact_runs_as_hf(device, tiny):
    """Gemma 3's MLC artifact (language_model. names, 1 + w norms incl. q/k norms, nested text_config)
    gives the HF folder's logits and greedy tokens."""
    hf, mlc = tiny["root"] / "hf-gemma3", tiny["root"] / "mlc-gemma3"
    if not mlc.exists():
        if not hf.exists():
            _FAMILY_WRITERS["gemma3"](hf)
        mlc_from_hf(hf, mlc, "gemma3")
    got, got_tok = _run(device, mlc, "test:mlc")
    want, want_tok = _run(device, hf, "test:st")
    assert got_tok == want_tok
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_older_cache_name_chat_config_and_template(tiny):
    path = tiny["root"] / "llama-ndarray"
    write_mlc(path, tiny["llama"], "q0f32", cache_name="ndarray-cache.json")
    art = MLCArtifact(path, verify_md5=True)
    try:
        cfg = art.config()
        assert (cfg.rope_base, cfg.context_length, cfg.sliding_window) == (10000.0, 256, None)
        assert 2 in cfg.eos_ids
        assert read_chat_config(path) == {"context": 256, "overrides": {
            "temperature": 0.7, "top_p": 0.9, "stop_str": ["<|im_end|>"], "stop_token_ids": [2],
            "prefill_chunk_size": 128}}
        tpl = art.template()                 # no tokenizer_config.json: the conv_template
        assert isinstance(tpl, ConvTemplate)
    finally:
        art.close()
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]
    assert tpl.render(msgs) == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                                "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_llama3_conv_template_two_turns():
    """Llama-3's conv_template as WebLLM's prebuilt artifacts carry it (a request's system message
    replaces the default one; the system prompt takes no separator)."""
    conv = ConvTemplate({
        "name": "llama-3", "system_template": "<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>",
        "system_message": "You are a helpful, respectful and honest assistant.",
        "roles": {"user": "<|start_header_id|>user", "assistant": "<|start_header_id|>assistant"},
        "seps": ["<|eot_id|>"], "role_content_sep": "<|end_header_id|>\n\n", "role_empty_sep": "<|end_header_id|>\n\n",
        "stop_str": [], "stop_token_ids": [128001, 128009], "system_prefix_token_ids": [128000]})
    text = conv.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}])
    assert text == ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama2_conv_template_quirks():
    """WebLLM's llama-2 template: no role text before the first message after a system prompt,
    alternating seps, role_templates with their first placeholder filled, an empty role_empty_sep
    kept empty (absent separators default to ": "), a message's name as its role text."""
    conv = ConvTemplate({
        "system_template": "[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n", "system_message": "Be good.",
        "roles": {"user": "[INST]", "assistant": "[/INST]"}, "seps": [" ", " </s>"],
        "role_content_sep": " ", "role_empty_sep": "", "add_role_after_system_message": False,
        "role_templates": {"user": "<{user_message}>{function_string}", "assistant": "{assistant_message}"},
        "stop_token_ids": [2]})
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again {user_message}", "name": "Ann"}]
    assert conv.render(msgs) == ("[INST] <<SYS>>\nBe good.\n<</SYS>>\n\n<Hi> [/INST] Hello </s>"
                                 "Ann <Again {user_message}> [/INST]")
    bare = ConvTemplate({"system_template": "", "roles": {"user": "U", "assistant": "A"}, "seps": ["\n"]})
    assert bare.render([{"role": "user", "content": "x"}]) == "U: x\nA: "


def test_broken_artifacts_typed_errors(device, tiny, tmp_path):
    good = tiny["root"] / "llama-q0f32"
    if not good.exists():
        write_mlc(good, tiny["llama"], "q0f32")

    def copy(name):
        p = tmp_path / name
        shutil.copytree(good, p)
        return p
    short = copy("short")
    (short / "params_shard_1.bin").write_bytes((short / "params_shard_1.bin").read_bytes()[:-4])
    with pytest.raises(ModelFormatError, match="bytes, the tensor cache says"):
        MLCArtifact(short)
    flipped = copy("md5")
    raw = bytearray((flipped / "params_shard_0.bin").read_bytes())
    raw[100] ^= 1
    (flipped / "params_shard_0.bin").write_bytes(bytes(raw))
    MLCArtifact(flipped).close()                          # sizes agree: md5 only when asked
    with pytest.raises(ModelFormatError, match="md5"):
        MLCArtifact(flipped, verify_md5=True)
    missing = copy("missing")
    cache = json.loads((missing / "tensor-cache.json").read_text())
    cache["records"][0]["records"] = [r for r in cache["records"][0]["records"]
                                      if r["name"] != "model.layers.0.mlp.down_proj.weight"]
    (missing / "tensor-cache.json").write_text(json.dumps(cache))
    m = open_model(missing)
    try:
        with pytest.raises(UnsupportedModelError, match="layers.0.down"):
            DecoderRunner(device, m.config, m.weights, owner="test:missing", context_window=64, chunk=64)
    finally:
        m.close()
    kn = copy("kn")
    chat = json.loads((kn / "mlc-chat-config.json").read_text())
    (kn / "mlc-chat-config.json").write_text(json.dumps({**chat, "quantization": "q4f16_0"}))
    with pytest.raises(UnsupportedModelError, match="q4f16_0"):
        MLCArtifact(kn)
    mixtral = copy("mixtral")
    (mixtral / "mlc-chat-config.json").write_text(json.dumps({**chat, "model_type": "mixtral"}))
    with pytest.raises(UnsupportedModelError, match="mixtral"):
        open_model(mixtral)
    unpaired = copy("unpaired")
    q4 = tiny["root"] / "llama-q4f16_1"
    if not q4.exists():
        write_mlc(q4, tiny["llama"], "q4f16_1")
    shutil.rmtree(unpaired)
    shutil.copytree(q4, unpaired)
    cache = json.loads((unpaired / "tensor-cache.json").read_text())
    for shard in cache["records"]:
        shard["records"] = [r for r in shard["records"] if r["name"] != "model.layers.1.self_attn.o_proj.q_scale"]
    (unpaired / "tensor-cache.json").write_text(json.dumps(cache))
    with pytest.raises(ModelFormatError, match="o_proj.q_weight has no q_scale"):
        open_model(unpaired)


async def test_webllm_id_from_the_hf_cache_answers(device, tiny, tmp_path, monkeypatch):
    """`Tiny-Llama-q4f16_1-MLC` resolves to mlc-ai/<id> in a prepared offline HF cache, loads with its
    chat config's defaults and answers through the conv_template; unknown ids and broken caches are
    typed errors, and the engine stays usable."""
    art = tiny["root"] / "engine-q4f16_1"
    write_mlc(art, tiny["llama"], "q4f16_1")
    hub = tmp_path / "hub"
    fake_hf_repo(hub, "mlc-ai/Tiny-Llama-q4f16_1-MLC", _folder_files(art))
    broken = fake_hf_repo(hub, "mlc-ai/Broken-Llama-q4f16_1-MLC", _folder_files(art))
    (broken / "params_shard_1.bin").write_bytes(b"\0" * 8)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path / "artifacts"))
    fast = {"compile_at_load": False, "context_window_size": 64}
    engine = await create_mlc_engine("Tiny-Llama-q4f16_1-MLC", EngineConfig(device=device), fast)
    try:
        lm = engine.models["Tiny-Llama-q4f16_1-MLC"]
        cc = lm.chat_config
        assert (cc.temperature, cc.top_p, cc.stop_token_ids, cc.prefill_chunk_size) == (0.7, 0.9, [2], 128)
        assert engine.app_config.get("Tiny-Llama-q4f16_1-MLC").reference == "hf://mlc-ai/Tiny-Llama-q4f16_1-MLC"
        msgs = [{"role": "user", "content": "hello"}]
        r = await engine.chat.completions.create(messages=msgs, max_tokens=4, temperature=0, ignore_eos=True)
        pipe = lm.pipeline
        ids = pipe.template.encode(pipe.tokenizer, [{"role": "system", "content": "You are a helpful assistant."},
                                                    *msgs])
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4
        with pytest.raises(E.ModelReferenceError):
            await engine.reload("Missing-Llama-q4f16_1-MLC")
        with pytest.raises(ModelFormatError, match="tensor cache says"):
            await engine.reload("Broken-Llama-q4f16_1-MLC", fast)
        # WebLLM's own app-config record: the repo URL, a model_lib we do not need, its overrides on top
        engine.set_app_config(engine.app_config.with_records(*app_config_from_dict({"model_list": [{
            "model": "https://huggingface.co/mlc-ai/Tiny-Llama-q4f16_1-MLC", "model_id": "tiny-webllm",
            "model_lib": "https://example.org/Tiny-Llama-q4f16_1-webgpu.wasm",
            "overrides": {"temperature": 0.5, **fast}}]}).model_list))
        await engine.reload("tiny-webllm")
        assert (engine.models["tiny-webllm"].chat_config.temperature,
                engine.models["tiny-webllm"].chat_config.top_p) == (0.5, 0.9)
        r2 = await engine.chat.completions.create(messages=msgs, max_tokens=4, temperature=0, ignore_eos=True)
        assert r2.choices[0].message.content == r.choices[0].message.content
    finally:
        await engine.unload()


def test_complete_command_with_a_webllm_id_from_the_hf_cache(tiny, tmp_path, monkeypatch, capsys):
    """`complete --model Llama-3.2-1B-Instruct-q4f16_1-MLC` (WebLLM's prebuilt id) answers from a
    prepared offline HF cache holding a tiny model under that repo id; a missing id is a typed error."""
    art = tmp_path / "art"
    write_mlc(art, tiny["llama"], "q4f16_1")
    fake_hf_repo(tmp_path / "hub", "mlc-ai/Llama-3.2-1B-Instruct-q4f16_1-MLC", _folder_files(art))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path / "artifacts"))
    assert main(["complete", "--model", "Llama-3.2-1B-Instruct-q4f16_1-MLC", "--max-tokens", "5",
                 "--temperature", "0", "--context-window", "64", "--chat-opts", '{"compile_at_load": false}',
                 "hello"]) == 0
    out = capsys.readouterr().out
    assert out.strip(), out
    assert main(["complete", "--model", "Llama-3.2-3B-Instruct-q4f16_1-MLC", "--max-tokens", "2", "hi"]) != 0
    assert "Llama-3.2-3B-Instruct-q4f16_1-MLC" in capsys.readouterr().err


def test_webllm_catalogue_ids_resolve(tiny, tmp_path, monkeypatch, capsys):
    """A prebuilt id of WebLLM's list resolves to the repo its record names (the `-1k` variants share
    the plain repo) with its context window; `list --webllm` says which ids load and why not."""
    art = tmp_path / "art"
    write_mlc(art, tiny["llama"], "q4f16_1")
    snap = fake_hf_repo(tmp_path / "hub", "mlc-ai/Llama-3.1-8B-Instruct-q4f16_1-MLC", _folder_files(art))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rec = resolve_model_reference("Llama-3.1-8B-Instruct-q4f16_1-MLC-1k")
    assert (rec.model_id, rec.model, rec.reference) == ("Llama-3.1-8B-Instruct-q4f16_1-MLC-1k", str(snap),
                                                        "hf://mlc-ai/Llama-3.1-8B-Instruct-q4f16_1-MLC")
    assert rec.overrides["context_window_size"] == 1024 and rec.overrides["top_p"] == 0.9
    with pytest.raises(E.ModelReferenceError):            # listed, but not in the (offline) cache
        resolve_model_reference("Llama-3.2-1B-Instruct-q4f16_1-MLC")
    assert main(["list", "--webllm", "--json"]) == 0
    rows = {r["model_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["Llama-3.2-1B-Instruct-q4f16_1-MLC"]["loads"] and rows["Qwen3-0.6B-q4f32_1-MLC"]["loads"]
    # q3f16_1 (the two Llama-3 70B ids) is dequantised to f16 on load (tests/test_mlc_q3.py)
    assert rows["Llama-3-70B-Instruct-q3f16_1-MLC"]["loads"] and rows["Llama-3.1-70B-Instruct-q3f16_1-MLC"]["loads"]
    assert rows["phi-2-q4f16_1-MLC"]["loads"] and rows["gemma-2-2b-it-q4f16_1-MLC"]["family"] == "gemma2"
    assert rows["gemma-2b-it-q4f16_1-MLC"]["loads"] and rows["gemma-2b-it-q4f32_1-MLC-1k"]["family"] == "gemma"
    # Qwen3.5 (a hybrid of linear and full attention, not Qwen 3) loads as its own family, qwen35
    # (tests/test_qwen35.py test_qwen35_mlc_artifact)
    assert rows["Qwen3.5-0.8B-q4f16_1-MLC"]["loads"] and rows["Qwen3.5-0.8B-q4f16_1-MLC"]["family"] == "qwen3_5"
    # Gemma 4 (gemma-4-E2B-it) loads from MLC's gemma4 artifacts (tests/test_gemma4.py
    # test_gemma4_mlc_artifact: logits and tokens); here its id resolves to one and opens as Gemma 4
    assert all(rows[f"gemma-4-E2B-it-{q}-MLC"]["loads"] for q in ("q4f16_1", "q4f32_1"))
    from tinygemma4 import write_tiny_gemma4_mlc
    g4 = write_tiny_gemma4_mlc(tmp_path / "g4", "q4f16_1")["folder"]
    fake_hf_repo(tmp_path / "hub", "mlc-ai/gemma-4-E2B-it-q4f16_1-MLC", _folder_files(g4))
    opened = open_model(resolve_model_reference("gemma-4-E2B-it-q4f16_1-MLC").model)
    try:
        assert opened.arch.name == "gemma4" and opened.config.ple_dim and opened.config.kv_sources
    finally:
        opened.close()
    # WebLLM's own embedders (MLC's bert, tests/test_mlc_bert.py) and its vision model (phi3_v,
    # tests/test_phi3v.py: images and greedy tokens), whose id resolves to such an artifact and opens
    # as Phi-3 with its image side
    assert all(rows[f"snowflake-arctic-embed-{s}-q0f32-MLC-{b}"]["loads"] for s in "ms" for b in ("b4", "b32"))
    assert all(rows[f"Phi-3.5-vision-instruct-{q}-MLC"]["loads"] for q in ("q4f16_1", "q4f32_1"))
    from tinyphi3v import write_tiny_phi3v_mlc
    p3v = write_tiny_phi3v_mlc(tmp_path / "p3v", "q4f32_1")["folder"]
    fake_hf_repo(tmp_path / "hub", "mlc-ai/Phi-3.5-vision-instruct-q4f32_1-MLC", _folder_files(p3v))
    opened = open_model(resolve_model_reference("Phi-3.5-vision-instruct-q4f32_1-MLC").model)
    try:
        assert opened.arch.name == "phi3" and "embed" in opened.weights
    finally:
        opened.close()
    out = main(["list", "--webllm"]) == 0 and capsys.readouterr().out
    # Ministral 3's six ids load from MLC's ministral3 artifacts (YaRN, MLC's softmax scale;
    # tests/test_ministral3.py test_ministral3_mlc_artifact: logits and tokens); here one resolves to
    # such an artifact and opens as the family, with MLC's scale
    ministral = [m for m in rows if m.startswith("Ministral-3-")]
    assert len(ministral) == 6 and all(rows[m]["loads"] and rows[m]["family"] == "ministral3" for m in ministral)
    from tinyministral3 import write_tiny_ministral3_mlc
    m3 = write_tiny_ministral3_mlc(tmp_path / "m3", "q4f16_1")["folder"]
    fake_hf_repo(tmp_path / "hub", "mlc-ai/Ministral-3-3B-Instruct-2512-BF16-q4f16_1-MLC", _folder_files(m3))
    opened = open_model(resolve_model_reference("Ministral-3-3B-Instruct-2512-BF16-q4f16_1-MLC").model)
    try:
        assert opened.arch.name == "mistral3" and opened.config.rope_scaling == "yarn" and opened.config.attn_scale
    finally:
        opened.close()
    assert "web-llm 0.2.86" in out and "165 of 165" in out


@pytest.mark.parametrize("change", [
    {"model_config": "llama"}, {"model_config": {"hidden_size": "wide"}}, {"quantization": None},
    {"conv_template": {"roles": ["user"]}}, {"conv_template": {"seps": "</s>"}},
    {"conv_template": {"stop_token_ids": ["2"]}}, {"temperature": "hot", "conv_template": {"stop_str": "x"}},
])
def test_hostile_chat_configs_are_typed_errors(tiny, tmp_path, change):
    """A chat config with fields of the wrong type: ModelFormatError / UnsupportedModelError when the
    folder opens (model, template) and ModelReferenceError when it is resolved, never a TypeError."""
    good = tiny["root"] / "llama-q0f32"
    if not good.exists():
        write_mlc(good, tiny["llama"], "q0f32")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    chat = json.loads((bad / "mlc-chat-config.json").read_text())
    (bad / "mlc-chat-config.json").write_text(json.dumps({**chat, **change}))
    with pytest.raises((ModelFormatError, UnsupportedModelError)):
        m = open_model(bad)
        try:
            m.template()
        finally:
            m.close()
    if "temperature" in change or "stop_token_ids" in str(change):
        with pytest.raises(E.ModelReferenceError):
            resolve_model_reference(str(bad))


def test_mlc_folder_by_url(tiny, tmp_path, monkeypatch):
    """A folder URL of an MLC artifact fetches its chat config, tensor cache, tokenizer and the shards
    it lists into the artifact cache, and opens from there."""
    art = tmp_path / "Tiny-q4f32_1-MLC"
    write_mlc(art, tiny["llama"], "q4f32_1")
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path / "artifacts"))
    with FileServer() as srv:
        for name, p in _folder_files(art).items():
            srv.add(f"mlc/Tiny-q4f32_1-MLC/{name}", p.read_bytes())
        rec = resolve_model_reference(srv.url("mlc/Tiny-q4f32_1-MLC/"))
        assert srv.count("mlc/Tiny-q4f32_1-MLC/params_shard_1.bin") == 1
    assert rec.model_id == "Tiny-q4f32_1-MLC" and rec.overrides["top_p"] == 0.9
    got = _folder_files(Path(rec.model))
    assert {"mlc-chat-config.json", "tensor-cache.json", "tokenizer.json", "params_shard_0.bin",
            "params_shard_1.bin"} <= set(got)
    m = open_model(rec.model)
    try:
        assert m.weights["layers.0.o"].qtype == "q4_0f32"
    finally:
        m.close()


def test_repack_q4_every_nibble():
    """repack_q4 on every 4-bit value and random scales, f16 and f32: Q4_0's decode = (q - 7) * scale,
    and the numpy and standard-library repacks write the same bytes."""
    rng = np.random.default_rng(0)
    for sdt, qt in ((np.float16, "q4_0"), (np.float32, "q4_0f32")):
        q = rng.integers(0, 16, size=(6, 64)).astype(np.uint32)
        q[0, :16] = np.arange(16)
        qw = (q.reshape(6, 8, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(axis=2, dtype=np.uint32)
        qs = rng.uniform(-0.1, 0.1, (6, 2)).astype(sdt)
        args = (qw.tobytes(), qs.tobytes(), 6, 64, "f16" if sdt is np.float16 else "f32")
        data = repack_q4(*args)
        np.testing.assert_array_equal(dequantize(data, qt, 6, 64), mlc_dequantize(qw, qs))
        assert bytes(repack_q4_stdlib(*args)) == bytes(repack_q4_numpy(*args)) == bytes(data)   # the page's way
