"""Writers of tiny random mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral) as HF folders (one
tensor per expert, as transformers saves them) and as GGUF files laid out as llama.cpp's converter
writes them (`ffn_gate_inp` router, stacked `ffn_{gate,up,down}_exps`, `<arch>.expert_count` /
`expert_used_count` / `expert_feed_forward_length`; Mixtral as general.architecture `llama` with
its q/k rows permuted), deterministic in `seed`. Each returns {folder or path, weights (our names)}."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import tinymodels as tm
from tinyfamilies import _finish, _gguf_writer, _write_hf

# (transformers class, model_type, GGUF architecture, HF block of the router and experts, HF expert names)
KINDS = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("OlmoeForCausalLM", "olmoe", "olmoe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("MixtralForCausalLM", "mixtral", "llama", "block_sparse_moe", ("w1", "w3", "w2")),
}
MOE_DIMS = dict(n_experts=8, n_experts_used=2, expert_ffn=48)


def _moe(kind: str, seed: int, dims: dict):
    moe = {k: dims.pop(k, v) for k, v in MOE_DIMS.items()}
    d = tm._dims(**dims)
    tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = len(tokens)
    w = {n: a for n, a in tm._hf_weights(d, "qwen3" if kind == "qwen3moe" else "llama", seed).items()
         if not n.endswith((".gate", ".up", ".down"))}
    rng = np.random.default_rng(seed + 500)
    C, F, E, D = d["hidden_size"], moe["expert_ffn"], moe["n_experts"], d["head_dim"]

    def mat(n, k, scale=1.0):
        return (scale * rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    for i in range(d["n_layers"]):
        p = f"layers.{i}."
        w[p + "router"] = mat(E, C, 3.0)            # spread logits: no near-ties between experts
        for e in range(E):
            w[f"{p}experts.{e}.gate"], w[f"{p}experts.{e}.up"], w[f"{p}experts.{e}.down"] = \
                mat(F, C), mat(F, C), mat(C, F)
        if kind == "olmoe":                          # q / k norms over the whole projections
            w[p + "q_norm"] = rng.uniform(0.3, 2.0, d["n_heads"] * D).astype(np.float32)
            w[p + "k_norm"] = rng.uniform(0.3, 2.0, d["n_kv_heads"] * D).astype(np.float32)
    return d, moe, tokens, merges, w


def write_tiny_moe_safetensors(kind: str, folder, seed: int = 0, norm_topk_prob: bool = True, **dims) -> dict:
    """An HF folder of `kind` (KINDS): per-expert tensors and the router named as transformers saves them."""
    folder = Path(folder)
    arch, model_type, _, block, (g, u, dn) = KINDS[kind]
    d, moe, tokens, merges, w = _moe(kind, seed, dict(dims))
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "router": f"{block}.gate",
             "gate": g, "up": u, "down": dn}
    hf = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"], "lm_head.weight": w["lm_head"]}
    for name, a in w.items():
        if name.startswith("layers."):
            parts = name.split(".")
            if parts[2] == "experts":
                hf[f"model.layers.{parts[1]}.{block}.experts.{parts[3]}.{names[parts[4]]}.weight"] = a
            else:
                hf[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"] = a
    config = {"architectures": [arch], "model_type": model_type, "hidden_act": "silu", "attention_bias": False,
              "attention_dropout": 0.0, "num_experts_per_tok": moe["n_experts_used"], "head_dim": d["head_dim"]}
    if kind == "qwen3moe":
        config.update(num_experts=moe["n_experts"], moe_intermediate_size=moe["expert_ffn"],
                      norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    elif kind == "olmoe":
        config.update(num_experts=moe["n_experts"], intermediate_size=moe["expert_ffn"],
                      norm_topk_prob=norm_topk_prob, clip_qkv=None)
    else:
        config.update(num_local_experts=moe["n_experts"], intermediate_size=moe["expert_ffn"], sliding_window=None)
    config.update(router_aux_loss_coef=0.0, output_router_logits=False)
    _write_hf(folder, hf, config, tokens, merges, d)
    if kind != "qwen3moe":      # _write_hf's intermediate_size is the dense one: the experts' here
        import json
        c = json.loads((folder / "config.json").read_text())
        c["intermediate_size"] = moe["expert_ffn"]
        (folder / "config.json").write_text(json.dumps(c, indent=2))
    return dict(folder=folder, weights=w)


def write_tiny_moe_gguf(kind: str, path, seed: int = 0, expert_qtype: str = "", dequantized: bool = False,
                        per_expert: bool = False, **dims) -> dict:
    """The same model as llama.cpp's converter writes it: experts stacked (E, rows, k) per layer.
    `expert_qtype` (e.g. "Q8_0"): the experts quantised as llama_model_quantize stores them, or with
    `dequantized` their dequantised values in f32 (the same model in floats). `per_expert`: one
    tensor per expert, blk.{i}.ffn_{gate,up,down}.{j}.weight, as the converter wrote Mixtral before
    it stacked them."""
    gguf_arch = KINDS[kind][2]
    d, moe, tokens, merges, w = _moe(kind, seed, dict(dims))
    E = moe["n_experts"]
    if kind != "qwen3moe":                  # OLMoE's and Mixtral's feed_forward_length is the experts'
        d = {**d, "ffn_size": moe["expert_ffn"]}
    g = _gguf_writer(path, gguf_arch, d, tokens, merges, d["head_dim"])
    g.add_expert_count(E)
    g.add_expert_used_count(moe["n_experts_used"])
    if kind == "qwen3moe":
        g.add_expert_feed_forward_length(moe["expert_ffn"])
    g.add_tensor("token_embd.weight", w["embed"]); g.add_tensor("output_norm.weight", w["norm"])
    g.add_tensor("output.weight", w["lm_head"])
    table = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v",
             "o": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "router": "ffn_gate_inp"}
    for i in range(d["n_layers"]):
        p = f"layers.{i}."
        for part, name in table.items():
            if p + part not in w:
                continue
            a = w[p + part]
            if kind == "mixtral" and part in ("q", "k"):       # the llama converter's permutation
                a = tm.permute_qk(a, d["n_heads"] if part == "q" else d["n_kv_heads"])
            g.add_tensor(f"blk.{i}.{name}.weight", a)
        for part in ("gate", "up", "down"):
            if per_expert:
                for e in range(E):
                    g.add_tensor(f"blk.{i}.ffn_{part}.{e}.weight", w[f"{p}experts.{e}.{part}"])
                continue
            a = np.stack([w[f"{p}experts.{e}.{part}"] for e in range(E)])
            if not expert_qtype:
                g.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", a)
                continue
            from gguf import GGMLQuantizationType, quants
            qt = GGMLQuantizationType[expert_qtype]
            q = quants.quantize(a, qt)
            if dequantized:
                g.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", quants.dequantize(q, qt).astype(np.float32))
            else:
                g.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", q, raw_dtype=qt)
    _finish(g)
    return dict(path=Path(path), weights=w)
