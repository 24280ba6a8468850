"""MLC's q3f16_1 (loaders/mlc_q3.py: WebLLM's two Llama-3-70B ids): 3-bit values, 10 to a u32 word, in
groups of 40 along K with f16 scales, rows padded to whole groups; dequantised to f16 on load. The
decode against a per-element reference of mlc-llm's layout, and a tiny Llama written as mlc-llm's
q3f16_1 converter writes it (hidden 64 and FFN 128: rows padded to 80 and 160) against an HF folder of
the values its files encode."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import tinymodels
from test_families import _ref, assert_runs_agree, run_golden
from test_mlc import _LAYER, _write_shards, write_mlc
from tinyministral3 import save_weights
from webgpu_engine.errors import ModelFormatError
from webgpu_engine.loaders.mlc_q3 import dequantize_q3
from webgpu_engine.models.registry import open_model


def q3_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mlc-llm's GroupQuantize of q3f16_1 (its _quantize / pack_weight) of an (N, K) matrix, in f16
    arithmetic: (q_weight (N, 4 G) u32, q_scale (N, G) f16), G = ceil(K / 40), padding bits zero."""
    n, k = w.shape
    g = -(-k // 40)
    x = np.zeros((n, g * 40), np.float16)
    x[:, :k] = w.astype(np.float16)
    pad = np.arange(g * 40) >= k
    scale = (np.where(pad, 0, np.abs(x)).reshape(n, g, 40).max(axis=2) / np.float16(3)).astype(np.float16)
    s = np.repeat(scale, 40, axis=1)
    q = np.clip(np.round((x / np.where(s == 0, np.float16(1), s)).astype(np.float16) + np.float16(3)), 0, 6)
    q = np.where(pad, 0, q).astype(np.uint32).reshape(n, g * 4, 10)
    return (q << (3 * np.arange(10, dtype=np.uint32))).sum(axis=2, dtype=np.uint32), scale


def q3_reference(qw: np.ndarray, qs: np.ndarray, k: int) -> np.ndarray:
    """Element by element: value j of a row is bits 3 (j % 10) of word j // 10, minus 3, times the
    scale of group j // 40, rounded to f16."""
    n = qw.shape[0]
    out = np.zeros((n, k), np.float16)
    for r in range(n):
        for j in range(k):
            q = (int(qw[r, j // 10]) >> (3 * (j % 10))) & 7
            out[r, j] = np.float16(np.float32(q - 3) * np.float32(qs[r, j // 40]))
    return out


@pytest.mark.parametrize("k", [40, 64, 130])
def test_q3_decode_matches_the_layout(k):
    """Rows of whole groups and padded ones: the decode equals the per-element reference exactly,
    and is within half a step of the weights quantised."""
    w = np.random.default_rng(k).standard_normal((5, k)).astype(np.float32)
    qw, qs = q3_quantize(w)
    got = dequantize_q3(qw.tobytes(), qs.tobytes(), 5, k)
    np.testing.assert_array_equal(got, q3_reference(qw, qs, k))
    step = np.repeat(qs.astype(np.float32), 40, axis=1)[:, :k]
    assert np.all(np.abs(got.astype(np.float32) - w) <= 0.5 * step + 1e-3)


def _write_q3(folder, info) -> dict:
    """An MLC q3f16_1 folder of tinymodels' Llama `info` (MLC's Llama names, every matrix quantised,
    the embedding and the head too); returns {our name: the values its files encode}."""
    write_mlc(folder, info, "q0f16")                 # chat config, tokenizer; the shards replaced below
    for f in folder.glob("params_shard_*.bin"):
        f.unlink()
    w, params, encoded = info["weights"], {}, {}
    mats = {"model.embed_tokens": ("embed",), "lm_head": ("lm_head",), "model.norm": ("norm",)}
    for i in range(info["config"].n_layers):
        mats.update({f"model.layers.{i}.{m}": tuple(f"layers.{i}.{o}" for o in ours) for m, ours in _LAYER["llama"].items()})
    for mlc, ours in mats.items():
        full = np.concatenate([w[o] for o in ours]) if w[ours[0]].ndim == 2 else w[ours[0]]
        if full.ndim == 2:
            params[mlc + ".q_weight"], params[mlc + ".q_scale"] = q3_quantize(full)
            full = q3_reference(params[mlc + ".q_weight"], params[mlc + ".q_scale"], full.shape[1])
        else:
            params[mlc + ".weight"] = full = full.astype(np.float16)
        rows = np.cumsum([0] + [w[o].shape[0] for o in ours])
        encoded.update({o: full[a:b].astype(np.float32) for o, a, b in zip(ours, rows[:-1], rows[1:])})
    _write_shards(folder, params)
    chat = json.loads((folder / "mlc-chat-config.json").read_text())
    (folder / "mlc-chat-config.json").write_text(json.dumps({**chat, "quantization": "q3f16_1"}))
    return encoded


def test_q3f16_1_llama_artifact(device, tmp_path):
    """The tiny Llama in q3f16_1 gives the logits (within 1e-4) and 16 greedy tokens of an HF folder
    holding the values its files encode; its weights are f16 (N, K) with the padding dropped."""
    ref = _ref("mistral")                            # its text and positions; the tokens are ours
    dims = dict(context_length=512, seed=13)
    info = tinymodels.write_tiny_llama_safetensors(tmp_path / "hf", arch="llama", **dims)
    encoded = _write_q3(tmp_path / "q3", info)
    save_weights(info["folder"], info, encoded)
    runs = []
    for path in (tmp_path / "q3", info["folder"]):
        opened = open_model(path)
        try:
            if path.name == "q3":
                w = opened.weights
                assert w["layers.0.down"].qtype == "f16" and tuple(w["layers.0.down"].shape) == (64, 128)
                np.testing.assert_array_equal(np.frombuffer(w["embed"].data, np.float16).reshape(-1, 64),
                                              encoded["embed"].astype(np.float16))
            runs.append(run_golden(device, opened.config, opened.weights, ref))
        finally:
            opened.close()
    assert_runs_agree(*runs, ref["rows"], tol=1e-4)


def test_q3f16_1_of_an_unknown_width_is_a_typed_error(tmp_path):
    """A q_weight whose groups match none of the model's row widths is a ModelFormatError."""
    info = tinymodels.write_tiny_llama_safetensors(tmp_path / "hf", arch="llama", seed=1)
    art = tmp_path / "q3"
    _write_q3(art, info)
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    chat = json.loads((bad / "mlc-chat-config.json").read_text())
    chat["model_config"].update(hidden_size=400, head_dim=100)      # 10 groups: no weight has them
    (bad / "mlc-chat-config.json").write_text(json.dumps(chat))
    with pytest.raises(ModelFormatError):
        open_model(bad).weights["embed"].data
