"""Writers of tiny random-weight models of the families beyond Llama (Phi-3, ...), as HF folders and
GGUF files, deterministic in `seed`; they reuse tests/tinymodels.py's weights, tokenizer and config.
Each returns what the loader must produce: {path or folder, config (LlamaConfig), weights}."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import tinymodels as tm
from webgpu_engine.loaders.model_config import LlamaConfig
from webgpu_engine.models.family_stablelm import HF_STABLELM_TO_OURS


def _tokenizer_files(folder: Path, tokens, merges, d: dict) -> None:
    (folder / "tokenizer.json").write_text(tm._hf_bpe_tokenizer_json(tokens, merges, "llama"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tm.CHATML_TEMPLATE, "bos_token": tm.SPECIAL_TOKENS[tm.BOS_ID],
        "eos_token": tm.SPECIAL_TOKENS[tm.EOS_ID], "pad_token": tm.SPECIAL_TOKENS[tm.EOS_ID],
        "add_bos_token": False, "model_max_length": d["context_length"], "tokenizer_class": "GPT2Tokenizer"}))


def _write_hf(folder: Path, tensors: dict, config: dict, tokens, merges, d: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tm.write_safetensors(folder / "model.safetensors",
                         {n: ("f32", a.shape, a.astype(np.float32).tobytes()) for n, a in tensors.items()},
                         {"format": "pt"})
    base = {"vocab_size": len(tokens), "hidden_size": d["hidden_size"], "intermediate_size": d["ffn_size"],
            "num_hidden_layers": d["n_layers"], "num_attention_heads": d["n_heads"],
            "num_key_value_heads": d["n_kv_heads"], "rms_norm_eps": d["rms_eps"], "rope_theta": d["rope_base"],
            "max_position_embeddings": d["context_length"], "tie_word_embeddings": d["tie_embeddings"],
            "bos_token_id": tm.BOS_ID, "eos_token_id": tm.EOS_ID, "pad_token_id": tm.EOS_ID,
            "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps({**base, **config}, indent=2))
    _tokenizer_files(folder, tokens, merges, d)


def write_released_hf(folder: Path, tensors: dict, text_config: dict, tokens, merges, d: dict, *,
                      architecture: str, model_type: str, towers: dict, config: dict) -> dict:
    """An HF folder laid out as a multimodal release is (Gemma 4, Qwen3.5): the text model's weights
    under model.language_model., its config.json as `text_config` of a *ForConditionalGeneration
    config (`config`: its other keys), and `towers` ({name: array}: weights beside it, not read).
    Returns the tensors written."""
    w = {k.replace("model.", "model.language_model.", 1): a for k, a in tensors.items()}
    w.update(towers)
    _write_hf(folder, w, text_config, tokens, merges, d)
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": model_type, "text_config": text,
        "eos_token_id": text["eos_token_id"], **config}, indent=2))
    return w


def _gguf_writer(path, arch: str, d: dict, tokens, merges, rot_dim: int, layer_norm: bool = False):
    """A GGUFWriter with the shared keys and the tokenizer written (`layer_norm`: the norms' epsilon as
    LayerNorm families write it, attention.layer_norm_epsilon)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(d["context_length"]); w.add_embedding_length(d["hidden_size"])
    w.add_block_count(d["n_layers"]); w.add_feed_forward_length(d["ffn_size"])
    w.add_head_count(d["n_heads"]); w.add_head_count_kv(d["n_kv_heads"])
    w.add_rope_freq_base(d["rope_base"])
    (w.add_layer_norm_eps if layer_norm else w.add_layer_norm_rms_eps)(d["rms_eps"])
    w.add_rope_dimension_count(rot_dim); w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens); w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(tm.BOS_ID); w.add_eos_token_id(tm.EOS_ID); w.add_add_bos_token(False)
    w.add_chat_template(tm.CHATML_TEMPLATE)
    return w


def _finish(w) -> None:
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


# ============================================================================ Phi-3
def _phi3(seed: int, partial_rotary: float, longrope: bool, dims: dict):
    d = tm._dims(**dims)
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = len(tokens)
    w = tm._hf_weights(d, "llama", seed)
    rot = int(d["head_dim"] * partial_rotary)
    rng = np.random.default_rng(seed + 100)
    # factors in f32, as both file formats keep them
    short = tuple(float(v) for v in np.float32(1.0 + 0.5 * rng.random(rot // 2))) if longrope else None
    long = tuple(float(v) for v in np.float32(2.0 + 6.0 * rng.random(rot // 2))) if longrope else None
    return d, tokens, merges, w, rot, short, long


PHI3_ORIGINAL_CONTEXT = 64


def phi3_config(d, rot, short, long, attn) -> LlamaConfig:
    return LlamaConfig(arch="phi3", vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], n_layers=d["n_layers"],
                       n_heads=d["n_heads"], n_kv_heads=d["n_kv_heads"], head_dim=d["head_dim"],
                       ffn_size=d["ffn_size"], rope_base=d["rope_base"], rot_dim=rot, rope_neox=True,
                       rms_eps=d["rms_eps"], context_length=d["context_length"], bos_id=tm.BOS_ID,
                       eos_ids=[tm.EOS_ID], rope_freq_factors=short, rope_long_factors=long,
                       rope_original_context=PHI3_ORIGINAL_CONTEXT if long else 0,
                       rope_attn_factor=attn, rope_scaling="longrope" if long else "")


def phi3_attn_factor(d) -> float:
    import math
    s = d["context_length"] / PHI3_ORIGINAL_CONTEXT
    return math.sqrt(1 + math.log(s) / math.log(PHI3_ORIGINAL_CONTEXT))


def write_tiny_phi3_safetensors(folder, seed: int = 0, partial_rotary: float = 0.75, longrope: bool = True,
                                **dims) -> dict:
    """An HF Phi3ForCausalLM folder: fused qkv_proj and gate_up_proj, `longrope` scaling (short and
    long factors, original context 64) and partial rotary (Phi-4-mini's 0.75)."""
    folder = Path(folder)
    d, tokens, merges, w, rot, short, long = _phi3(seed, partial_rotary, longrope, dims)
    hf = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"], "lm_head.weight": w["lm_head"]}
    for i in range(d["n_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        hf[q + "input_layernorm.weight"] = w[p + "attn_norm"]
        hf[q + "self_attn.qkv_proj.weight"] = np.concatenate([w[p + "q"], w[p + "k"], w[p + "v"]])
        hf[q + "self_attn.o_proj.weight"] = w[p + "o"]
        hf[q + "post_attention_layernorm.weight"] = w[p + "ffn_norm"]
        hf[q + "mlp.gate_up_proj.weight"] = np.concatenate([w[p + "gate"], w[p + "up"]])
        hf[q + "mlp.down_proj.weight"] = w[p + "down"]
    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
              "partial_rotary_factor": partial_rotary, "sliding_window": None,
              "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
              "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}
    if longrope:
        config["rope_scaling"] = {"type": "longrope", "short_factor": list(short), "long_factor": list(long)}
    _write_hf(folder, hf, config, tokens, merges, d)
    return dict(folder=folder, config=phi3_config(d, rot, short, long, phi3_attn_factor(d) if long else 1.0),
                weights=w)


def write_tiny_phi3_gguf(path, seed: int = 0, partial_rotary: float = 0.75, longrope: bool = True, **dims) -> dict:
    """The same model as llama.cpp's converter writes it (arch phi3): attn_qkv, ffn_up holding gate|up,
    rope_factors_long/short.weight, rope.scaling.attn_factor and original_context_length."""
    d, tokens, merges, w, rot, short, long = _phi3(seed, partial_rotary, longrope, dims)
    attn = phi3_attn_factor(d) if long else 1.0
    g = _gguf_writer(path, "phi3", d, tokens, merges, rot)
    if long:
        g.add_float32("phi3.rope.scaling.attn_factor", attn)
        g.add_uint32("phi3.rope.scaling.original_context_length", PHI3_ORIGINAL_CONTEXT)
        g.add_tensor("rope_factors_long.weight", np.asarray(long, np.float32))
        g.add_tensor("rope_factors_short.weight", np.asarray(short, np.float32))
    g.add_tensor("token_embd.weight", w["embed"]); g.add_tensor("output_norm.weight", w["norm"])
    g.add_tensor("output.weight", w["lm_head"])
    for i in range(d["n_layers"]):
        p, b = f"layers.{i}.", f"blk.{i}."
        g.add_tensor(b + "attn_norm.weight", w[p + "attn_norm"])
        g.add_tensor(b + "attn_qkv.weight", np.concatenate([w[p + "q"], w[p + "k"], w[p + "v"]]))
        g.add_tensor(b + "attn_output.weight", w[p + "o"])
        g.add_tensor(b + "ffn_norm.weight", w[p + "ffn_norm"])
        g.add_tensor(b + "ffn_up.weight", np.concatenate([w[p + "gate"], w[p + "up"]]))
        g.add_tensor(b + "ffn_down.weight", w[p + "down"])
    _finish(g)
    return dict(path=Path(path), config=phi3_config(d, rot, short, long, float(np.float32(attn))), weights=w)


# ============================================================================ Gemma 1 / 2 / 3
GEMMA_DIMS = dict(tie_embeddings=True, rope_base=10000.0, rms_eps=1e-6)


def _gemma(arch: str, seed: int, dims: dict):
    d = tm._dims(**{**GEMMA_DIMS, **({"n_layers": 6, "rope_base": 1e6} if arch == "gemma3" else {}), **dims})
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = len(tokens)
    w = tm._hf_weights(d, "llama", seed)
    w["embed"] = (w["embed"] / np.sqrt(d["hidden_size"])).astype(np.float32)   # O(1) once times sqrt(C)
    rng = np.random.default_rng(seed + 200)
    for name in list(w):                # Gemma's norms hold w of x * (1 + w): values around 0
        if name.endswith("norm"):
            w[name] = (0.2 * rng.standard_normal(w[name].shape)).astype(np.float32)
    if arch == "gemma":                 # Gemma 1: a Llama layer
        return d, tokens, merges, w
    for i in range(d["n_layers"]):
        p = f"layers.{i}."
        for n in ("post_attn_norm", "post_ffn_norm"):
            w[p + n] = (0.2 * rng.standard_normal(d["hidden_size"])).astype(np.float32)
        if arch == "gemma3":
            for n in ("q_norm", "k_norm"):
                w[p + n] = (0.2 * rng.standard_normal(d["head_dim"])).astype(np.float32)
    return d, tokens, merges, w


def _gemma_local(arch: str, n: int) -> list[bool]:
    return [i % 2 == 0 if arch == "gemma2" else (i + 1) % 6 != 0 for i in range(n)]


def write_tiny_gemma_safetensors(folder, arch: str = "gemma2", seed: int = 0, sliding_window: int = 48,
                                 attn_softcap: float = 0.0, final_softcap: float = 0.0, **dims) -> dict:
    """An HF GemmaForCausalLM / Gemma2ForCausalLM / Gemma3ForCausalLM folder (norm weights w of
    x * (1 + w); tied embeddings): Gemma 1 has Llama's layer and names and no window (hidden_act
    "gelu", as the official releases say); Gemma 2 slides every other layer from the first, Gemma 3
    all but every sixth (rope_local_base_freq 10000 there, rope_theta 1e6 on the global ones)."""
    folder = Path(folder)
    d, tokens, merges, w = _gemma(arch, seed, dims)
    names = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "ffn_norm": "post_attention_layernorm" if arch == "gemma" else "pre_feedforward_layernorm",
             "post_ffn_norm": "post_feedforward_layernorm",
             "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    hf = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"]}
    for name, a in w.items():
        if name.startswith("layers."):
            _, i, part = name.split(".")
            hf[f"model.layers.{i}.{names[part]}.weight"] = a
    if arch == "gemma":
        config = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "head_dim": d["head_dim"],
                  "hidden_act": "gelu", "attention_bias": False}
    else:
        local = _gemma_local(arch, d["n_layers"])
        config = {"architectures": ["Gemma2ForCausalLM" if arch == "gemma2" else "Gemma3ForCausalLM"],
                  "model_type": "gemma2" if arch == "gemma2" else "gemma3_text", "head_dim": d["head_dim"],
                  "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": d["head_dim"],
                  "sliding_window": sliding_window, "attention_bias": False,
                  "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
                  "final_logit_softcapping": final_softcap or None,
                  "attn_logit_softcapping": attn_softcap or None}
    if arch == "gemma3":
        config.update(rope_local_base_freq=10000.0, sliding_window_pattern=6, rope_scaling=None)
    _write_hf(folder, hf, config, tokens, merges, d)
    return dict(folder=folder, weights=w)


def write_tiny_gemma_gguf(path, arch: str = "gemma2", seed: int = 0, sliding_window: int = 48,
                          attn_softcap: float = 0.0, final_softcap: float = 0.0, **dims) -> dict:
    """The same model as llama.cpp's converter writes it: norm weights stored as 1 + w, no output
    matrix (tied), gemma2/gemma3 keys for the window and the caps (Gemma 1: none)."""
    d, tokens, merges, w = _gemma(arch, seed, dims)
    g = _gguf_writer(path, arch, d, tokens, merges, d["head_dim"])
    g.add_key_length(d["head_dim"]); g.add_value_length(d["head_dim"])
    if arch != "gemma":
        g.add_sliding_window(sliding_window)
    if arch == "gemma2":
        g.add_float32("gemma2.attn_logit_softcapping", attn_softcap or 0.0)
        g.add_float32("gemma2.final_logit_softcapping", final_softcap or 0.0)
    table = {"attn_norm": "attn_norm", "post_attn_norm": "post_attention_norm", "ffn_norm": "ffn_norm",
             "post_ffn_norm": "post_ffw_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate": "ffn_gate", "up": "ffn_up",
             "down": "ffn_down"}
    g.add_tensor("token_embd.weight", w["embed"]); g.add_tensor("output_norm.weight", w["norm"] + 1.0)
    for name, a in w.items():
        if name.startswith("layers."):
            _, i, part = name.split(".")
            g.add_tensor(f"blk.{i}.{table[part]}.weight", a + 1.0 if part.endswith("norm") else a)
    _finish(g)
    return dict(path=Path(path), weights=w)


# ============================================================================ OLMo 2
def _olmo2(seed: int, dims: dict):
    d = tm._dims(**dims)
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = len(tokens)
    w = {n: a for n, a in tm._hf_weights(d, "llama", seed).items() if not n.endswith(("attn_norm", "ffn_norm"))}
    rng = np.random.default_rng(seed + 300)
    C, D = d["hidden_size"], d["head_dim"]
    for i in range(d["n_layers"]):
        p = f"layers.{i}."
        w[p + "post_attn_norm"], w[p + "post_ffn_norm"] = (
            (1.0 + 0.2 * rng.standard_normal(C)).astype(np.float32) for _ in range(2))
        # scales that vary across heads: a norm per head would give other values
        w[p + "q_norm"] = (rng.uniform(0.3, 2.0, d["n_heads"] * D)).astype(np.float32)
        w[p + "k_norm"] = (rng.uniform(0.3, 2.0, d["n_kv_heads"] * D)).astype(np.float32)
        w[p + "q"] *= np.repeat(rng.uniform(0.2, 3.0, d["n_heads"]), D)[:, None].astype(np.float32)
    return d, tokens, merges, w


def write_tiny_olmo2_safetensors(folder, seed: int = 0, **dims) -> dict:
    """An HF Olmo2ForCausalLM folder: post_attention_layernorm / post_feedforward_layernorm after the
    attention and the FFN (none before), q_norm (Hq D,) and k_norm (Hkv D,) over the projections; q
    heads of different scales, so a per-head norm would differ."""
    folder = Path(folder)
    d, tokens, merges, w = _olmo2(seed, dims)
    names = {"post_attn_norm": "post_attention_layernorm", "post_ffn_norm": "post_feedforward_layernorm",
             "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    hf = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"], "lm_head.weight": w["lm_head"]}
    for name, a in w.items():
        if name.startswith("layers."):
            _, i, part = name.split(".")
            hf[f"model.layers.{i}.{names[part]}.weight"] = a
    config = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_act": "silu",
              "attention_bias": False, "attention_dropout": 0.0}
    _write_hf(folder, hf, config, tokens, merges, d)
    return dict(folder=folder, weights=w)


def write_tiny_olmo2_gguf(path, seed: int = 0, **dims) -> dict:
    """The same model as llama.cpp's converter writes it (arch olmo2): attn_q_norm / attn_k_norm over
    the projections, post_attention_norm and post_ffw_norm, q/k rows unpermuted."""
    d, tokens, merges, w = _olmo2(seed, dims)
    g = _gguf_writer(path, "olmo2", d, tokens, merges, d["head_dim"])
    table = {"post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm", "q": "attn_q",
             "k": "attn_k", "v": "attn_v", "o": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
             "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
    g.add_tensor("token_embd.weight", w["embed"]); g.add_tensor("output_norm.weight", w["norm"])
    g.add_tensor("output.weight", w["lm_head"])
    for name, a in w.items():
        if name.startswith("layers."):
            _, i, part = name.split(".")
            g.add_tensor(f"blk.{i}.{table[part]}.weight", a)
    _finish(g)
    return dict(path=Path(path), weights=w)


# ============================================================================ StableLM 2
def _stablelm(seed: int, partial_rotary: float, dims: dict):
    d = tm._dims(**dims)
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = len(tokens)
    w = tm._hf_weights(d, "qwen2", seed)                  # q/k/v biases
    rng = np.random.default_rng(seed + 400)
    for name in [n for n in w if n.endswith("norm")]:     # LayerNorm biases of O(0.3): they matter
        w[name + "_bias"] = (0.3 * rng.standard_normal(d["hidden_size"])).astype(np.float32)
    return d, tokens, merges, w, int(d["head_dim"] * partial_rotary)


def write_tiny_stablelm_safetensors(folder, seed: int = 0, partial_rotary: float = 0.25, **dims) -> dict:
    """An HF StableLmForCausalLM folder as stablelm-2-zephyr-1_6b is configured: LayerNorms with
    biases, use_qkv_bias, partial rotary 0.25, no qk_layernorm, no parallel residual."""
    folder = Path(folder)
    d, tokens, merges, w, rot = _stablelm(seed, partial_rotary, dims)
    table = {v: k for k, v in HF_STABLELM_TO_OURS.items()}
    hf = {}
    for name, a in w.items():
        if name.startswith("layers."):
            _, i, part = name.split(".")
            hf[table["layers.{i}." + part].replace("{i}", i)] = a
        else:
            hf[table[name]] = a
    config = {"architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "hidden_act": "silu",
              "use_qkv_bias": True, "qk_layernorm": False, "use_parallel_residual": False,
              "partial_rotary_factor": partial_rotary, "layer_norm_eps": d["rms_eps"],
              "attention_dropout": 0.0, "hidden_dropout": 0.0}
    _write_hf(folder, hf, config, tokens, merges, d)
    return dict(folder=folder, weights=w, rot_dim=rot)


def write_tiny_stablelm_gguf(path, seed: int = 0, partial_rotary: float = 0.25, **dims) -> dict:
    """The same model as llama.cpp's converter writes it (arch stablelm): attn_norm / ffn_norm /
    output_norm with .bias, q/k/v biases, rope.dimension_count the rotated dims, layer_norm_epsilon,
    q/k rows unpermuted."""
    d, tokens, merges, w, rot = _stablelm(seed, partial_rotary, dims)
    g = _gguf_writer(path, "stablelm", d, tokens, merges, rot, layer_norm=True)
    table = {"embed": "token_embd.weight", "norm": "output_norm.weight", "norm_bias": "output_norm.bias",
             "lm_head": "output.weight"}
    for name, a in w.items():
        if name.startswith("layers."):
            _, i, part = name.split(".")
            base = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v",
                    "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}[part.removesuffix("_bias")]
            g.add_tensor(f"blk.{i}.{base}.{'bias' if part.endswith('_bias') else 'weight'}", a)
        else:
            g.add_tensor(table[name], a)
    _finish(g)
    return dict(path=Path(path), weights=w, rot_dim=rot)


# ============================================================================ Phi-1 / 1.5 / 2
def _phi(seed: int, partial_rotary: float, dims: dict):
    d = tm._dims(**dims)
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = len(tokens)
    w = {n: a for n, a in tm._hf_weights(d, "qwen2", seed).items() if not n.endswith(("gate", "ffn_norm"))}
    rng = np.random.default_rng(seed + 500)
    C, F, V = d["hidden_size"], d["ffn_size"], d["vocab_size"]
    for name, n in [("norm_bias", C), ("lm_head_bias", V)] + [
            (f"layers.{i}.{b}", n) for i in range(d["n_layers"])
            for b, n in (("attn_norm_bias", C), ("o_bias", C), ("up_bias", F), ("down_bias", C))]:
        w[name] = (0.3 * rng.standard_normal(n)).astype(np.float32)
    return d, tokens, merges, w, int(d["head_dim"] * partial_rotary)


def write_tiny_phi_safetensors(folder, seed: int = 0, partial_rotary: float = 0.5, hidden_act: str = "gelu_new",
                               **dims) -> dict:
    """An HF PhiForCausalLM folder (phi-1_5 / phi-2's layout): one LayerNorm feeding the attention and
    the dense fc1 -> GELU -> fc2 FFN in parallel, biases on q/k/v, dense, fc1, fc2 and the LM head
    (all of O(0.3)), final_layernorm, partial rotary 0.5."""
    from webgpu_engine.models.family_phi import HF_PHI_TO_OURS
    folder = Path(folder)
    d, tokens, merges, w, rot = _phi(seed, partial_rotary, dims)
    table = {v: k for k, v in HF_PHI_TO_OURS.items()}
    hf = {}
    for name, a in w.items():
        layer = name.split(".")
        hf[table["layers.{i}." + layer[2]].replace("{i}", layer[1]) if layer[0] == "layers" else table[name]] = a
    config = {"architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_act": hidden_act,
              "partial_rotary_factor": partial_rotary, "layer_norm_eps": d["rms_eps"], "qk_layernorm": False,
              "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}
    _write_hf(folder, hf, config, tokens, merges, d)
    return dict(folder=folder, weights=w, rot_dim=rot)


def write_tiny_phi_gguf(path, seed: int = 0, partial_rotary: float = 0.5, fused_qkv: bool = False,
                        **dims) -> dict:
    """The same model as llama.cpp's converter writes a PhiForCausalLM (arch phi2): attn_norm,
    attn_q/k/v, attn_output, ffn_up, ffn_down, output_norm and output each with its .bias,
    rope.dimension_count the rotated dims, layer_norm_epsilon, q/k rows unpermuted. `fused_qkv`:
    attn_qkv (weight and bias), as it converted the older msft layout (mixer.Wqkv)."""
    d, tokens, merges, w, rot = _phi(seed, partial_rotary, dims)
    g = _gguf_writer(path, "phi2", d, tokens, merges, rot, layer_norm=True)
    file_w = dict(w)
    if fused_qkv:
        for i in range(d["n_layers"]):
            p = f"layers.{i}."
            for end in ("", "_bias"):
                g.add_tensor(f"blk.{i}.attn_qkv.{'bias' if end else 'weight'}",
                             np.concatenate([file_w.pop(p + part + end) for part in "qkv"]))
    top = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "up": "ffn_up", "down": "ffn_down"}
    for name, a in file_w.items():
        parts = name.split(".")
        base = parts[-1].removesuffix("_bias")
        gguf_name = f"blk.{parts[1]}.{layer[base]}" if parts[0] == "layers" else top[base]
        g.add_tensor(f"{gguf_name}.{'bias' if name.endswith('_bias') else 'weight'}", a)
    _finish(g)
    return dict(path=Path(path), weights=w, rot_dim=rot)


# ============================================================================ GPT-NeoX
def _gptneox(seed: int, rotary_pct: float, dims: dict):
    d = tm._dims(**{"n_kv_heads": tm.LLAMA_DIMS["n_heads"], **dims})
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = len(tokens)
    w = {n: a for n, a in tm._hf_weights(d, "qwen2", seed).items() if not n.endswith("gate")}
    rng = np.random.default_rng(seed + 600)
    C, F = d["hidden_size"], d["ffn_size"]
    for name, n in [("norm_bias", C)] + [(f"layers.{i}.{b}", n) for i in range(d["n_layers"])
                                         for b, n in (("attn_norm_bias", C), ("ffn_norm_bias", C), ("o_bias", C),
                                                      ("up_bias", F), ("down_bias", C))]:
        w[name] = (0.3 * rng.standard_normal(n)).astype(np.float32)
    return d, tokens, merges, w, int(d["head_dim"] * rotary_pct)


def write_tiny_gptneox_safetensors(folder, seed: int = 0, rotary_pct: float = 0.25, parallel: bool = True,
                                   **dims) -> dict:
    """An HF GPTNeoXForCausalLM folder with transformers 4's config names (rotary_pct, rotary_emb_base):
    query_key_value in its per-head layout ((H, 3, D) rows, bias alike), LayerNorms with biases,
    dense_h_to_4h -> GELU (erf) -> dense_4h_to_h, use_parallel_residual `parallel` (Pythia: true;
    RedPajama-INCITE: false), every bias of O(0.3), embed_out untied."""
    from webgpu_engine.models.family_gptneox import HF_GPTNEOX_TO_OURS
    folder = Path(folder)
    d, tokens, merges, w, rot = _gptneox(seed, rotary_pct, dims)
    H, D = d["n_heads"], d["head_dim"]
    table = {v: k for k, v in HF_GPTNEOX_TO_OURS.items()}
    hf = {}
    for name, a in w.items():
        parts = name.split(".")
        if parts[0] != "layers":
            hf[table[name]] = a
        elif parts[2] in ("q", "k", "q_bias", "k_bias"):
            continue
        elif parts[2] in ("v", "v_bias"):            # per head: q_h | k_h | v_h
            end = parts[2][1:]
            qkv = np.stack([w[f"layers.{parts[1]}.{x}{end}"].reshape(H, D, -1) for x in "qkv"], axis=1)
            hf[table["layers.{i}.qkv_heads" + end].replace("{i}", parts[1])] = qkv.reshape(3 * H * D, -1).squeeze(-1) \
                if end else qkv.reshape(3 * H * D, -1)
        else:
            hf[table["layers.{i}." + parts[2]].replace("{i}", parts[1])] = a
    config = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_act": "gelu",
              "rotary_pct": rotary_pct, "rotary_emb_base": d["rope_base"], "use_parallel_residual": parallel,
              "layer_norm_eps": d["rms_eps"], "attention_bias": True, "attention_dropout": 0.0,
              "hidden_dropout": 0.0}
    _write_hf(folder, hf, config, tokens, merges, d)
    return dict(folder=folder, weights=w, rot_dim=rot)


def write_tiny_gptneox_gguf(path, seed: int = 0, rotary_pct: float = 0.25, parallel: bool = True, **dims) -> dict:
    """The same model as llama.cpp's converter writes it (arch gptneox): attn_qkv reordered to
    q | k | v (weight and bias), attn_norm / ffn_norm / output_norm with .bias, attn_output, ffn_up,
    ffn_down with .bias, use_parallel_residual, layer_norm_epsilon, rope.dimension_count."""
    d, tokens, merges, w, rot = _gptneox(seed, rotary_pct, dims)
    g = _gguf_writer(path, "gptneox", d, tokens, merges, rot, layer_norm=True)
    g.add_parallel_residual(parallel)
    top = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "o": "attn_output", "up": "ffn_up", "down": "ffn_down"}
    for name, a in w.items():
        parts = name.split(".")
        base, kind = parts[-1].removesuffix("_bias"), "bias" if name.endswith("_bias") else "weight"
        if parts[0] != "layers":
            g.add_tensor(f"{top[base]}.{kind}", a)
        elif base == "v":
            end = "_bias" if kind == "bias" else ""
            g.add_tensor(f"blk.{parts[1]}.attn_qkv.{kind}",
                         np.concatenate([w[f"layers.{parts[1]}.{x}{end}"] for x in "qkv"]))
        elif base not in ("q", "k"):
            g.add_tensor(f"blk.{parts[1]}.{layer[base]}.{kind}", a)
    _finish(g)
    return dict(path=Path(path), weights=w, rot_dim=rot)
