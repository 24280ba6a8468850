"""A tiny Phi-3.5-vision MLC artifact (model_type phi3_v) written the way MLC's converter writes one
(mlc-llm model/phi3v/phi3v_loader.py names; group quantisation of every nn.Linear and the embedding
outside the CLIP tower, which MLC marks no_quantization and keeps in the model's dtype).

The text model: tinyfamilies' Phi-3 (2 layers, width 64, no longrope, full rotary) with one more
token, `<|image|>` (an added special token of tokenizer.json), whose id stands for image rows; the
tower: tests/fixtures/phi3v_tower.npz (transformers' CLIPVisionModel, 6 x 6 patches of 56); the
separators and the projector (4 * 32 -> 64, GELU, 64 -> 64): seeded random."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from test_mlc import _write_shards, mlc_dequantize, mlc_quantize
from tinyfamilies import _phi3

import tinymodels as tm

TOWER = Path(__file__).parent / "fixtures" / "phi3v_tower.npz"
DTYPES = {"q0f32": np.float32, "q0f16": np.float16, "q4f16_1": np.float16, "q4f32_1": np.float32}
CONV = {"name": "phi-3-vision", "system_template": "{system_message}", "system_message": "",
        "roles": {"user": "<|user|>", "assistant": "<|assistant|>"}, "seps": ["<|end|>\n"],
        "role_content_sep": "\n", "role_empty_sep": "\n", "system_prefix_token_ids": [1],
        "stop_str": ["<|endoftext|>"], "stop_token_ids": [2]}


def tower_fixture() -> tuple[dict, dict, np.ndarray]:
    """(config, {name: f32 weights}, transformers' features (2, 36, 32)) of the fixture tower."""
    z = np.load(TOWER)
    return json.loads(str(z["config"])), {n[2:]: z[n].astype(np.float32) for n in z.files if n.startswith("w:")}, z["features"]


def write_tiny_phi3v_mlc(folder, quant: str, seed: int = 5) -> dict:
    """Write the artifact; returns {"folder", "tower" (config, float64 weights as the files encode
    them), "proj" (glb_GN, sub_GN, linear_1/2 .weight/.bias, as encoded)}."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    dt = DTYPES[quant]
    d, tokens, merges, w, _, _, _ = _phi3(seed, 1.0, False, {"context_length": 512})
    rng = np.random.default_rng(seed + 1)
    V = d["vocab_size"]
    w["embed"] = np.concatenate([w["embed"], rng.normal(0, 0.1, (1, d["hidden_size"])).astype(np.float32)])
    w["lm_head"] = np.concatenate([w["lm_head"], rng.normal(0, 0.1, (1, d["hidden_size"])).astype(np.float32)])
    params, enc = {}, {}

    def put(name: str, a: np.ndarray, quantise: bool) -> np.ndarray:
        if quant.startswith("q4") and quantise and a.ndim == 2:
            qw, qs = mlc_quantize(a, dt)
            params[name + ".q_weight"], params[name + ".q_scale"] = qw, qs
            return mlc_dequantize(qw, qs)
        params[name if name.endswith(("_GN", "embedding")) else name + ".weight"] = a.astype(dt)
        return a.astype(dt).astype(np.float64)

    put("model.embd", w["embed"], True)
    for i in range(d["n_layers"]):
        p, q = f"layers.{i}.", f"model.h.{i}."
        put(q + "ln", w[p + "attn_norm"], False)
        put(q + "mixer.qkv_proj", np.concatenate([w[p + "q"], w[p + "k"], w[p + "v"]]), True)
        put(q + "mixer.out_proj", w[p + "o"], True)
        put(q + "post_attention_layernorm", w[p + "ffn_norm"], False)
        put(q + "mlp.gate_up_proj", np.concatenate([w[p + "gate"], w[p + "up"]]), True)
        put(q + "mlp.down_proj", w[p + "down"], True)
    put("model.norm", w["norm"], False)
    put("lm_head", w["lm_head"], True)
    tcfg, tw, _ = tower_fixture()
    tower = {}
    for n, a in tw.items():
        if n.startswith("post_layernorm") or "position_ids" in n:
            continue                      # MLC stores post_layernorm too; its [-2] output never reads it
        full = "vision_embed_tokens.img_processor.vision_model." + n
        params[full] = a.astype(dt)
        tower[n] = a.astype(dt).astype(np.float64)
    C4, T = 4 * tcfg["hidden_size"], d["hidden_size"]
    proj = {}
    for n, shape in (("glb_GN", (1, 1, C4)), ("sub_GN", (1, 1, 1, C4))):
        params["vision_embed_tokens." + n] = rng.normal(0, 0.5, shape).astype(dt)
        proj[n] = params["vision_embed_tokens." + n].astype(np.float64).reshape(-1)
    for n, (o, k) in (("linear_1", (T, C4)), ("linear_2", (T, T))):
        base = "vision_embed_tokens.img_projection." + n
        proj[n + ".weight"] = put(base, rng.normal(0, 0.3, (o, k)).astype(np.float32), True)
        params[base + ".bias"] = rng.normal(0, 0.1, (o,)).astype(dt)
        proj[n + ".bias"] = params[base + ".bias"].astype(np.float64)
    _write_shards(folder, params)
    model_config = {
        "model_type": "phi3_v", "hidden_size": T, "vocab_size": V + 1, "num_hidden_layers": d["n_layers"],
        "num_attention_heads": d["n_heads"], "intermediate_size": d["ffn_size"], "rms_norm_eps": d["rms_eps"],
        "num_key_value_heads": d["n_kv_heads"], "max_position_embeddings": 512,
        "vision_config": {**tcfg, "projection_dim": 32, "vocab_size": None, "num_channels": 3, "kwargs": {}},
        "img_processor": {"image_dim_out": tcfg["hidden_size"], "model_name": "tiny-clip", "name": "clip_vision_model",
                          "num_img_tokens": 9},
        "position_embedding_base": d["rope_base"], "rope_scaling": None, "original_max_position_embeddings": 512,
        "context_window_size": 512, "prefill_chunk_size": 256, "head_dim": d["head_dim"],
        "tensor_parallel_shards": 1, "max_batch_size": 1}
    (folder / "mlc-chat-config.json").write_text(json.dumps({
        "model_type": "phi3_v", "quantization": quant, "model_config": model_config,
        "context_window_size": 512, "prefill_chunk_size": 256, "sliding_window_size": -1,
        "tokenizer_files": ["tokenizer.json"], "conv_template": CONV, "bos_token_id": tm.BOS_ID,
        "eos_token_id": tm.EOS_ID, "temperature": 0.0}))
    tok = json.loads(tm._hf_bpe_tokenizer_json(tokens, merges, "llama"))
    tok["added_tokens"].append({"id": V, "content": "<|image|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return {"folder": folder, "tower": (tcfg, tower), "proj": proj, "image_id": V}
