"""A tiny random gpt-oss (GptOssForCausalLM) written as transformers saves one: q/k/v/o with biases,
a sink logit per head, sliding-window layers alternating with full ones (`layer_types`), YaRN RoPE,
a router with a bias, experts stacked for x · W (`mlp.experts.gate_up_proj` (E, C, 2F) with gate and
up columns interleaved, `down_proj` (E, F, C)) with biases and a clamped SwiGLU; a byte-level BPE
vocabulary with harmony's special tokens. Deterministic in `seed`. write_tiny_gptoss_gguf writes the
same model as llama.cpp's converter does (GptOssModel: gate and up de-interleaved and transposed to
ffn_gate_exps / ffn_up_exps (E, F, C), ffn_down_exps (E, C, F), their biases beside, attn_sinks,
post_attention_norm as the FFN's norm, the window and YaRN in the metadata), the experts in f32 or
MXFP4 (gguf.quants, as the converter repacks OpenAI's MXFP4 blocks).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import tinymodels as tm

# harmony's special tokens (o200k_harmony's names), after the tiny vocabulary
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                  "<|call|>"]
DIMS = dict(vocab_size=300, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
            n_experts_used=2, expert_ffn=32, sliding_window=24, context_length=1024, rope_base=150000.0,
            yarn_factor=8.0, yarn_original=64, swiglu_limit=7.0, swiglu_alpha=1.702, rms_eps=1e-5)
# the chat template: harmony as gpt-oss's tokenizer_config.json renders it, in short (tests/fixtures)
TEMPLATE = Path(__file__).parent / "fixtures" / "gptoss_chat_template.jinja"


def tiny_gptoss(seed: int = 0, **dims) -> tuple[dict, list, list, dict]:
    """(dims, tokens, merges, {HF name: f32 array})."""
    d = {**DIMS, **dims}
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    tokens = tokens + HARMONY_TOKENS
    d["vocab_size"] = len(tokens)
    rng = np.random.default_rng(seed)
    C, V, D, E, F = d["hidden_size"], d["vocab_size"], d["head_dim"], d["n_experts"], d["expert_ffn"]
    Hq, Hkv = d["n_heads"], d["n_kv_heads"]

    def mat(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def vec(n, center=0.0, spread=0.1):
        return (center + spread * rng.standard_normal(n)).astype(np.float32)
    w = {"model.embed_tokens.weight": rng.standard_normal((V, C)).astype(np.float32),
         "model.norm.weight": vec(C, 1.0), "lm_head.weight": mat(V, C)}
    for i in range(d["n_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = vec(C, 1.0), vec(C, 1.0)
        for name, rows in (("q", Hq * D), ("k", Hkv * D), ("v", Hkv * D)):
            w[f"{p}self_attn.{name}_proj.weight"], w[f"{p}self_attn.{name}_proj.bias"] = mat(rows, C), vec(rows)
        w[p + "self_attn.o_proj.weight"], w[p + "self_attn.o_proj.bias"] = mat(C, Hq * D), vec(C)
        w[p + "self_attn.sinks"] = rng.uniform(-1.0, 2.0, Hq).astype(np.float32)
        w[p + "mlp.router.weight"], w[p + "mlp.router.bias"] = mat(E, C, scale=3.0), vec(E, spread=0.5)
        # x · W (E, C, 2F): gate and up columns interleaved; a sixth of them past the clamp at 7
        w[p + "mlp.experts.gate_up_proj"] = (5.0 * rng.standard_normal((E, C, 2 * F)) / np.sqrt(C)).astype(np.float32)
        w[p + "mlp.experts.gate_up_proj_bias"] = vec(E * 2 * F, spread=0.5).reshape(E, 2 * F)
        w[p + "mlp.experts.down_proj"] = (rng.standard_normal((E, F, C)) / np.sqrt(F)).astype(np.float32)
        w[p + "mlp.experts.down_proj_bias"] = vec(E * C).reshape(E, C)
    return d, tokens, merges, w


def hf_config(d: dict, tokens: list) -> dict:
    ids = {t: tokens.index(t) for t in HARMONY_TOKENS}
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": d["vocab_size"],
            "hidden_size": d["hidden_size"], "intermediate_size": d["expert_ffn"], "head_dim": d["head_dim"],
            "num_hidden_layers": d["n_layers"], "num_attention_heads": d["n_heads"],
            "num_key_value_heads": d["n_kv_heads"], "num_local_experts": d["n_experts"],
            "num_experts_per_tok": d["n_experts_used"], "sliding_window": d["sliding_window"],
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d["n_layers"])],
            "max_position_embeddings": d["context_length"], "rms_norm_eps": d["rms_eps"],
            "rope_parameters": {"rope_type": "yarn", "rope_theta": d["rope_base"], "factor": d["yarn_factor"],
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                                "original_max_position_embeddings": d["yarn_original"]},
            "swiglu_limit": d["swiglu_limit"], "swiglu_alpha": d["swiglu_alpha"], "attention_bias": True,
            "attention_dropout": 0.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "router_aux_loss_coef": 0.0, "output_router_logits": False, "initializer_range": 0.02,
            "bos_token_id": tm.BOS_ID, "eos_token_id": ids["<|return|>"], "pad_token_id": tm.EOS_ID,
            "torch_dtype": "float32"}


def _tokenizer_json(tokens: list, merges: list) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tm.SPECIAL_TOKENS + HARMONY_TOKENS])
    return tk.to_str()


def write_tiny_gptoss_safetensors(folder, seed: int = 0, dtype: str = "f32", mxfp4: bool = False, **dims) -> dict:
    """The HF folder (config.json, model.safetensors in f32, bf16 or "bf16-values" (bf16's values in
    f32), tokenizer files with harmony's
    template, generation_config.json stopping at <|return|> and <|call|>). `mxfp4`: the experts'
    matrices as OpenAI releases them (mxfp4_blocks: the blocks gguf.quants makes of their rows)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d, tokens, merges, w = tiny_gptoss(seed, **dims)
    if mxfp4:
        for name in [n for n in w if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = mxfp4_blocks(np.ascontiguousarray(w.pop(name).transpose(0, 2, 1)))
            w[name + "_blocks"], w[name + "_scales"] = blocks, scales
    if dtype == "bf16":     # round to nearest even, as torch's .to(bfloat16)
        enc = {n: ("bf16", a.shape, _bf16(a)) if a.dtype == np.float32 else ("u8", a.shape, a.tobytes())
               for n, a in w.items()}
    elif dtype == "bf16-values":     # those values, stored as f32
        enc = {n: ("f32", a.shape, (np.frombuffer(_bf16(a), np.uint16).astype(np.uint32) << 16).tobytes())
               if a.dtype == np.float32 else ("u8", a.shape, a.tobytes()) for n, a in w.items()}
    else:
        enc = {n: ("f32" if a.dtype == np.float32 else "u8", a.shape, a.tobytes()) for n, a in w.items()}
    tm.write_safetensors(folder / "model.safetensors", enc, {"format": "pt"})
    config = hf_config(d, tokens)
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tokens.index("<|return|>"), tokens.index("<|call|>")], "bos_token_id": tm.BOS_ID}))
    (folder / "tokenizer.json").write_text(_tokenizer_json(tokens, merges))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE.read_text() if TEMPLATE.is_file() else tm.CHATML_TEMPLATE,
        "bos_token": tm.SPECIAL_TOKENS[tm.BOS_ID], "eos_token": "<|return|>", "pad_token": tm.SPECIAL_TOKENS[tm.EOS_ID],
        "add_bos_token": False, "model_max_length": d["context_length"], "tokenizer_class": "GPT2Tokenizer"}))
    return dict(folder=folder, weights=w, dims=d, tokens=tokens)


def mxfp4_blocks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks (..., G, 16), scales (..., G)) in OpenAI's layout (value 2i of a block in byte i's low
    nibble, 2i + 1 in its high one) of the MXFP4 blocks gguf.quants makes of `rows` (..., 32 G)."""
    import gguf
    q = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4)
    q = q.reshape(*rows.shape[:-1], rows.shape[-1] // 32, 17)
    codes = np.concatenate([q[..., 1:] & 0x0F, q[..., 1:] >> 4], axis=-1)      # ggml: value j, j + 16
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(q[..., 0])


def _bf16(a: np.ndarray) -> bytes:
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def write_tiny_gptoss_gguf(path, seed: int = 0, expert_qtype: str = "", dequantized: bool = False, fused: bool = False,
                           **dims) -> dict:
    """The GGUF (general.architecture gpt-oss) of tiny_gptoss(seed). `expert_qtype` "MXFP4": the
    experts' matrices quantised; with `dequantized`, those quantised values stored as f32 instead.
    `fused`: gate and up as one ffn_gate_up_exps (E, 2F, C) and bias, as the converter's
    --fuse-gate-up-exps writes them."""
    import gguf
    d, tokens, merges, w = tiny_gptoss(seed, **dims)
    g = gguf.GGUFWriter(str(path), "gpt-oss")
    g.add_name("tiny-gpt-oss")
    g.add_context_length(d["context_length"]); g.add_embedding_length(d["hidden_size"])
    g.add_block_count(d["n_layers"]); g.add_feed_forward_length(d["expert_ffn"])
    g.add_head_count(d["n_heads"]); g.add_head_count_kv(d["n_kv_heads"])
    g.add_key_length(d["head_dim"]); g.add_value_length(d["head_dim"])
    g.add_rope_freq_base(d["rope_base"]); g.add_layer_norm_rms_eps(d["rms_eps"])
    g.add_expert_count(d["n_experts"]); g.add_expert_used_count(d["n_experts_used"])
    g.add_expert_feed_forward_length(d["expert_ffn"]); g.add_sliding_window(d["sliding_window"])
    g.add_rope_scaling_type(gguf.RopeScalingType.YARN); g.add_rope_scaling_factor(d["yarn_factor"])
    g.add_rope_scaling_orig_ctx_len(d["yarn_original"])
    g.add_rope_scaling_yarn_beta_fast(32.0); g.add_rope_scaling_yarn_beta_slow(1.0)
    g.add_tokenizer_model("gpt2"); g.add_tokenizer_pre("smollm")
    g.add_token_list(tokens)
    g.add_token_types([3] * len(tm.SPECIAL_TOKENS) + [1] * (len(tokens) - len(tm.SPECIAL_TOKENS) - len(HARMONY_TOKENS))
                      + [3] * len(HARMONY_TOKENS))
    g.add_token_merges(merges)
    g.add_bos_token_id(tm.BOS_ID); g.add_eos_token_id(tokens.index("<|return|>")); g.add_add_bos_token(False)
    if TEMPLATE.is_file():
        g.add_chat_template(TEMPLATE.read_text())
    g.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    g.add_tensor("output_norm.weight", w["model.norm.weight"]); g.add_tensor("output.weight", w["lm_head.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
             **{f"self_attn.{x}_proj.{kind}": f"attn_{y}.{kind}" for x, y in
                (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for kind in ("weight", "bias")}}
    for i in range(d["n_layers"]):
        p = f"model.layers.{i}."
        for hf, ours in names.items():
            g.add_tensor(f"blk.{i}.{ours}", w[p + hf])
        gate_up, bias = w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.gate_up_proj_bias"]
        mats = {"gate": gate_up[:, :, ::2].transpose(0, 2, 1), "up": gate_up[:, :, 1::2].transpose(0, 2, 1),
                "down": w[p + "mlp.experts.down_proj"].transpose(0, 2, 1)}
        if fused:
            g.add_tensor(f"blk.{i}.ffn_gate_up_exps.bias", np.concatenate([bias[:, ::2], bias[:, 1::2]], 1))
            mats = {"gate_up": np.concatenate([mats.pop("gate"), mats.pop("up")], 1), **mats}
        else:
            g.add_tensor(f"blk.{i}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, ::2]))
            g.add_tensor(f"blk.{i}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
        for part, a in mats.items():
            a = np.ascontiguousarray(a)
            if expert_qtype:
                qt = gguf.GGMLQuantizationType[expert_qtype]
                q = gguf.quants.quantize(a, qt)
                if dequantized:
                    g.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", gguf.quants.dequantize(q, qt).astype(np.float32))
                else:
                    g.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", q, raw_dtype=qt)
            else:
                g.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", a)
    g.write_header_to_file(); g.write_kv_data_to_file(); g.write_tensors_to_file(); g.close()
    return dict(path=Path(path), dims=d, tokens=tokens)
