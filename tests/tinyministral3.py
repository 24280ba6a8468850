"""A tiny random Ministral 3 (transformers' Ministral3ForCausalLM, model_type `ministral3`) whose RoPE
and query temperature matter within its 320 test positions: YaRN (factor 4) over an original context
of 64 positions, so the queries are scaled by 1 + beta ln(1 + floor(pos / 64)) from position 64 on.
Llama's weights and names (tests/tinymodels.py); deterministic for a seed. Also as released
(Mistral3ForConditionalGeneration: `text_config`, `model.language_model.` names, a vision tower beside
that is not read). Used by tests/test_ministral3.py and tests/fixtures/make_ministral3.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

import tinymodels as tm
from webgpu_engine.loaders.safetensors import write_safetensors

DIMS = dict(context_length=512, seed=21)
ORIGINAL = 64
ROPE = {"rope_type": "yarn", "type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 512, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.2}


def ministral3_config(base: dict) -> dict:
    """config.json of Ministral3ForCausalLM from tinymodels' Llama config."""
    c = {k: v for k, v in base.items() if k not in ("rope_theta", "sliding_window", "rope_scaling")}
    return {**c, "architectures": ["Ministral3ForCausalLM"], "model_type": "ministral3",
            "rope_parameters": dict(ROPE), "sliding_window": None}


# the released folder's text-model names: transformers 5's, and transformers 4's as older folders hold them
RELEASED = {"released": ("model.language_model.", "lm_head.weight"),
            "released_v4": ("language_model.model.", "language_model.lm_head.weight")}


def save_weights(folder: Path, info: dict, weights: dict, layout: str = "causal_lm", more: dict | None = None) -> None:
    """model.safetensors of `weights` ({our name: values}) in f32 under info's HF names (as `layout`
    names them: causal_lm, or one of RELEASED), and `more` ({HF name: values}) beside them."""
    prefix, head = RELEASED.get(layout, ("model.", "lm_head.weight"))
    tensors = {info["hf_names"][o].replace("model.", prefix, 1).replace("lm_head.weight", head): w
               for o, w in weights.items()}
    tensors.update(more or {})
    write_safetensors(folder / "model.safetensors",
                      {k: ("f32", w.shape, np.ascontiguousarray(w, np.float32).tobytes()) for k, w in tensors.items()},
                      {"format": "pt"})


def write_tiny_ministral3_safetensors(folder, seed: int = DIMS["seed"], layout: str = "causal_lm", **dims) -> dict:
    """tinymodels' Llama folder as Ministral3ForCausalLM (`layout` causal_lm), or as the multimodal
    release lays it out (RELEASED). Returns tinymodels' info (its `config` is not Ministral 3's)."""
    folder = Path(folder)
    dims = {**{k: v for k, v in DIMS.items() if k != "seed"}, **dims}
    info = tm.write_tiny_llama_safetensors(folder, arch="mistral", seed=seed, **dims)
    config = ministral3_config(json.loads((folder / "config.json").read_text()))
    if layout not in RELEASED:
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        return info
    rng = np.random.default_rng(seed)
    save_weights(folder, info, info["weights"], layout,
          {"model.vision_tower.transformer.layers.0.attention.q_proj.weight": rng.standard_normal((8, 8)),
           "model.multi_modal_projector.linear_1.weight": rng.standard_normal((8, 8))})
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
        "text_config": config, "vision_config": {"model_type": "pixtral", "hidden_size": 8},
        "image_token_index": 10, "eos_token_id": config["eos_token_id"]}, indent=2))
    return info


# mlc-llm's Ministral 3 scales every score by get_mscale(factor, mscale_all_dim)^2 and has no temperature
MLC_SOFTMAX = (0.1 * math.log(ROPE["factor"]) * ROPE["mscale_all_dim"] + 1) ** 2


def write_mlc_equivalent(folder, weights: dict | None = None, seed: int = DIMS["seed"]) -> Path:
    """An HF Ministral3ForCausalLM folder that computes what MLC computes for the tiny model's artifact:
    no query temperature (llama_4_scaling_beta 0) and q_proj times MLC_SOFTMAX (a score is linear in
    q). `weights`: {our name: values} to hold (default: the tiny model's)."""
    folder = Path(folder)
    info = write_tiny_ministral3_safetensors(folder, seed=seed)
    w = {o: np.asarray(a, np.float64) for o, a in (weights or info["weights"]).items()}
    w.update({o: a * MLC_SOFTMAX for o, a in w.items() if o.endswith(".q")})
    save_weights(folder, info, w)
    c = json.loads((folder / "config.json").read_text())
    c["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    return folder


def write_tiny_ministral3_mlc(folder, quant: str, seed: int = DIMS["seed"]) -> dict:
    """The tiny model as mlc-llm's converter writes it (model_type ministral3, its ministral3 loader:
    MLC's Llama names, q|k|v as self_attn.qkv_proj, gate|up as mlp.gate_up_proj; model_config with
    rope_parameters less rope_theta, which is position_embedding_base). Returns {"folder", "encoded":
    {our name: the values the files encode}}."""
    from test_mlc import write_mlc
    folder = Path(folder)
    info = write_tiny_ministral3_safetensors(folder.parent / f"{folder.name}-hf", seed=seed)
    encoded = write_mlc(folder, {**info, "arch": "llama"}, quant)     # MLC's Llama names
    chat = json.loads((folder / "mlc-chat-config.json").read_text())
    rope = {k: v for k, v in ROPE.items() if k != "rope_theta"}
    chat["model_type"] = "ministral3"
    chat["model_config"].update(rope_parameters=rope, hidden_act="silu", sliding_window_size=-1,
                                attention_sink_size=0, tensor_parallel_shards=1,
                                dtype="float32" if quant.endswith("f32_1") or quant == "q0f32" else "float16")
    (folder / "mlc-chat-config.json").write_text(json.dumps(chat))
    return dict(folder=folder, encoded=encoded)
