"""A tiny random Qwen3.5 text model (transformers' Qwen3_5ForCausalLM, `qwen3_5_text`) with the parts
the released checkpoints have, at sizes a test runs in seconds:

- Gated DeltaNet layers (`linear_attention`): one projection of x to q|k|v (through a causal
  depthwise conv1d of 4 taps and SiLU), z (the output gate), b (beta) and a (the decay); q / k
  L2-normalised per head, 2 key heads serving 4 value heads; the gated delta rule over a (Dk, Dv)
  state per value head; a gated RMSNorm (plain w, times silu(z)) before out_proj;
- gated full-attention layers every third layer: q_proj gives each head's q and its output gate
  side by side, q / k RMSNorms (1 + w), partial rotary (a quarter of the head, neox pairs);
- (1 + w) RMSNorms before the mixer, the FFN and the head; an untied LM head.

Deterministic for a seed; names are transformers'. Used by tests/test_qwen35.py and
tests/fixtures/make_qwen35.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import tinymodels as tm
from tinyfamilies import _write_hf, write_released_hf

DIMS = dict(vocab_size=300, hidden_size=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_size=96, head_dim=16,
            context_length=512, rope_base=1e6, rms_eps=1e-6, tie_embeddings=False)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention",
               "linear_attention", "linear_attention", "full_attention"]


def qwen35_weights(seed: int = 0, **dims) -> tuple[dict, list, list, dict]:
    """(dims, tokens, merges, {HF name: array}) of the tiny model."""
    d = tm._dims(**{**DIMS, **dims})
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = V = len(tokens)
    rng = np.random.default_rng(seed)
    C, F, H, Hkv, D = d["hidden_size"], d["ffn_size"], d["n_heads"], d["n_kv_heads"], d["head_dim"]
    Hk, Hv = LINEAR["linear_num_key_heads"], LINEAR["linear_num_value_heads"]
    Dk, Dv, K = LINEAR["linear_key_head_dim"], LINEAR["linear_value_head_dim"], LINEAR["linear_conv_kernel_dim"]

    def mat(n, k):                      # std 1/sqrt(k): activations stay O(1) through the layers
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n, center=0.0, spread=0.2):  # (1 + w) norms: w near 0
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": (rng.standard_normal((V, C)) / np.sqrt(C)).astype(np.float32),
         "model.norm.weight": vec(C), "lm_head.weight": mat(V, C)}
    for i, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = vec(C), vec(C)
        if kind == "full_attention":
            w[p + "self_attn.q_proj.weight"] = mat(2 * H * D, C)          # per head: q rows, then gate rows
            w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"] = mat(Hkv * D, C), mat(Hkv * D, C)
            w[p + "self_attn.o_proj.weight"] = mat(C, H * D)
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = vec(D), vec(D)
        else:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = mat(2 * Hk * Dk + Hv * Dv, C)
            w[a + "in_proj_z.weight"] = mat(Hv * Dv, C)
            w[a + "in_proj_b.weight"], w[a + "in_proj_a.weight"] = mat(Hv, C), mat(Hv, C)
            w[a + "conv1d.weight"] = (rng.standard_normal((2 * Hk * Dk + Hv * Dv, 1, K)) * 0.5).astype(np.float32)
            w[a + "dt_bias"] = vec(Hv, 0.5, 0.5)
            w[a + "A_log"] = np.log(rng.uniform(0.5, 8.0, Hv)).astype(np.float32)
            w[a + "norm.weight"] = vec(Dv, 1.0)
            w[a + "out_proj.weight"] = mat(C, Hv * Dv)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = mat(F, C), mat(F, C)
        w[p + "mlp.down_proj.weight"] = mat(C, F)
    return d, tokens, merges, w


def qwen35_config(d: dict) -> dict:
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "head_dim": d["head_dim"],
            "hidden_act": "silu", "layer_types": LAYER_TYPES, "attention_bias": False, **LINEAR,
            "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_base"], "partial_rotary_factor": 0.25,
                                "mrope_section": [1, 1, 0], "mrope_interleaved": True}}


def write_tiny_qwen35_safetensors(folder, seed: int = 0, released: bool = False, **dims) -> dict:
    """The HF folder (config.json, model.safetensors, tokenizer) of the tiny model; `released`: laid
    out as Qwen's checkpoints are, a Qwen3_5ForConditionalGeneration whose text model's config is
    `text_config` and whose weights lie under model.language_model., beside a vision tower and the
    multi-token-prediction layer (neither read)."""
    d, tokens, merges, w = qwen35_weights(seed, **dims)
    folder = Path(folder)
    if released:
        w = write_released_hf(folder, w, qwen35_config(d), tokens, merges, d,
                              architecture="Qwen3_5ForConditionalGeneration", model_type="qwen3_5",
                              towers={"model.visual.patch_embed.proj.weight": np.ones((4, 12), np.float32),
                                      "mtp.fc.weight": np.ones((4, 8), np.float32)},
                              config={"vision_config": {"model_type": "qwen3_5"}, "tie_word_embeddings": False})
    else:
        _write_hf(folder, w, qwen35_config(d), tokens, merges, d)
    return dict(folder=folder, weights=w, dims=d)


def _reorder_v_heads(a: np.ndarray, axis: int, n_k: int, per_k: int, head: int) -> np.ndarray:
    """Value heads from HF's order (grouped by key head) to llama.cpp's tiled order along `axis`, as
    convert_hf_to_gguf.py's _LinearAttentionVReorderBase does."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(n_k, per_k, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def write_tiny_qwen35_gguf(path, seed: int = 0, **dims) -> dict:
    """The same model as llama.cpp's converter writes it (arch qwen35, Qwen3_5TextModel): norms as 1 + w
    (not the gated norm), A as -exp(A_log), dt_bias as ssm_dt.bias, the conv squeezed to (C, K), the
    value heads of every linear-attention tensor reordered from grouped to tiled, q_proj (q | gate per
    head) as attn_q; the ssm.* sizes, each layer's kind (attention.recurrent_layers) and
    full_attention_interval in the metadata. Checked once against the converter itself (llama.cpp
    vendored by llama-cpp-python 0.3.36, `--no-mtp`): the same tensors, names and shapes, equal values
    (ssm_a within an f32 rounding of exp), the same qwen35.* keys."""
    from tinyfamilies import _finish, _gguf_writer
    d, tokens, merges, w = qwen35_weights(seed, **dims)
    Hk, Hv = LINEAR["linear_num_key_heads"], LINEAR["linear_num_value_heads"]
    Dk, Dv = LINEAR["linear_key_head_dim"], LINEAR["linear_value_head_dim"]
    g = _gguf_writer(path, "qwen35", d, tokens, merges, int(d["head_dim"] * 0.25))
    g.add_key_length(d["head_dim"]); g.add_value_length(d["head_dim"])
    g.add_ssm_conv_kernel(LINEAR["linear_conv_kernel_dim"]); g.add_ssm_state_size(Dk)
    g.add_ssm_group_count(Hk); g.add_ssm_time_step_rank(Hv); g.add_ssm_inner_size(Hv * Dv)
    # as the converter writes a config.json with layer_types: each layer's kind, the interval at its default
    g.add_array("qwen35.attention.recurrent_layers", [t == "linear_attention" for t in LAYER_TYPES])
    g.add_full_attention_interval(4)
    g.add_rope_dimension_sections([1, 1, 0, 0])

    def v_order(a, axis, head):
        return _reorder_v_heads(a, axis, Hk, Hv // Hk, head)

    plus1 = lambda a: (a + 1).astype(np.float32)   # noqa: E731
    g.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    g.add_tensor("output_norm.weight", plus1(w["model.norm.weight"]))
    g.add_tensor("output.weight", w["lm_head.weight"])
    table = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight"}
    for i in range(d["n_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, ours in table.items():
            if p + hf in w:
                g.add_tensor(b + ours, plus1(w[p + hf]) if hf.endswith("norm.weight") else w[p + hf])
        a = p + "linear_attn."
        if a + "A_log" not in w:
            continue
        qkv = w[a + "in_proj_qkv.weight"]
        g.add_tensor(b + "attn_qkv.weight", np.concatenate([qkv[:2 * Hk * Dk], v_order(qkv[2 * Hk * Dk:], 0, Dv)]))
        g.add_tensor(b + "attn_gate.weight", v_order(w[a + "in_proj_z.weight"], 0, Dv))
        g.add_tensor(b + "ssm_beta.weight", v_order(w[a + "in_proj_b.weight"], 0, 1))
        g.add_tensor(b + "ssm_alpha.weight", v_order(w[a + "in_proj_a.weight"], 0, 1))
        g.add_tensor(b + "ssm_a", (-np.exp(v_order(w[a + "A_log"], 0, 1))).astype(np.float32))
        g.add_tensor(b + "ssm_dt.bias", v_order(w[a + "dt_bias"], 0, 1))
        conv = w[a + "conv1d.weight"][:, 0, :]
        g.add_tensor(b + "ssm_conv1d.weight", np.concatenate([conv[:2 * Hk * Dk], v_order(conv[2 * Hk * Dk:], 0, Dv)]))
        g.add_tensor(b + "ssm_norm.weight", w[a + "norm.weight"])
        g.add_tensor(b + "ssm_out.weight", v_order(w[a + "out_proj.weight"], 1, Dv))
    _finish(g)
    return dict(path=Path(path), weights=w, dims=d)


def write_tiny_qwen35_mlc(folder, quant: str, seed: int = 0, **dims) -> dict:
    """The same model as MLC-LLM's converter writes it (model_type qwen3_5, its qwen35 loader): HF's
    names under model., q_proj | k_proj | v_proj fused as self_attn.c_attn, gate | up as
    mlp.gate_up_proj, the (1 + w) norms stored with the 1 added (not the gated norm), linear_attn's
    A_log, dt_bias and conv1d_weight as parameters of their own; q4f16_1 / q4f32_1 quantise every
    matrix (MLC's group quantisation, tests/test_mlc.py). Returns {"folder", "encoded": {HF name: the
    float values the files encode}} (the same model as an HF folder of those values runs the same)."""
    import shutil
    from test_mlc import _write_shards, mlc_dequantize, mlc_quantize
    d, tokens, merges, w = qwen35_weights(seed, **dims)
    dt = {"q0f32": np.float32, "q0f16": np.float16, "q4f16_1": np.float16, "q4f32_1": np.float32}[quant]
    folder = Path(folder)
    hf = write_tiny_qwen35_safetensors(folder / "hf", seed, **dims)["folder"]
    params, encoded = {}, {}
    fused = {"self_attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    groups = {n[:-len(".weight")] if n.endswith(".weight") else n: (n,) for n in w}
    for i in range(d["n_layers"]):
        for mlc, parts in fused.items():
            names = tuple(f"model.layers.{i}.{p}.weight" for p in parts)
            if names[0] in w:
                groups[f"model.layers.{i}.{mlc}"] = names
                for n in names:
                    del groups[n[:-len(".weight")]]
    groups = {(k + "_weight" if k.endswith(".conv1d") else k): v for k, v in groups.items()}
    for mlc, names in groups.items():
        full = np.concatenate([w[n] for n in names]) if len(names) > 1 else w[names[0]]
        plus1 = mlc.endswith("norm") and not mlc.endswith("linear_attn.norm")
        if plus1:
            full = full + np.float32(1)
        suffix = "" if mlc.endswith(("A_log", "dt_bias", "conv1d_weight")) else ".weight"
        if quant.startswith("q4") and full.ndim == 2:
            qw, qs = mlc_quantize(full, dt)
            params[mlc + ".q_weight"], params[mlc + ".q_scale"] = qw, qs
            full = mlc_dequantize(qw, qs)
        else:
            full = full.astype(dt)
            params[mlc + suffix] = full
        full = np.asarray(full, np.float64) - (1 if plus1 else 0)
        rows = np.cumsum([0] + [w[n].shape[0] for n in names])
        for n, a, b in zip(names, rows[:-1], rows[1:]):
            encoded[n] = full[a:b].reshape(w[n].shape)
    _write_shards(folder, params)
    c = json.loads((hf / "config.json").read_text())
    mc = {k: c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                            "num_key_value_heads", "rms_norm_eps", "vocab_size", "head_dim", "hidden_act",
                            "attention_bias", "tie_word_embeddings", *LINEAR)}
    mc.update(rope_theta=d["rope_base"], partial_rotary_factor=0.25, context_window_size=d["context_length"],
              prefill_chunk_size=128, full_attention_interval=LAYER_TYPES.index("full_attention") + 1,
              dtype="float32" if dt is np.float32 else "float16")
    (folder / "mlc-chat-config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "quantization": quant, "model_config": mc, "context_window_size": d["context_length"],
        "prefill_chunk_size": 128, "sliding_window_size": -1, "bos_token_id": c["bos_token_id"],
        "eos_token_id": c["eos_token_id"]}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / f, folder / f)
    shutil.rmtree(hf)
    return dict(folder=folder, encoded=encoded, dims=d)
