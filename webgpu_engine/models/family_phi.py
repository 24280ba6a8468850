"""Phi-1 / Phi-1.5 / Phi-2 (`phi`): the attention and a dense FFN in parallel off one LayerNorm,
x += attn(ln(x)) + fc2(gelu(fc1(ln(x)))), with biases on q/k/v, the attention's output (`dense`),
fc1, fc2 and the LM head, a final LayerNorm, partial rotary (0.5 unless config.json says) and GELU in
the form config.json names (`gelu_new`: tanh; `gelu`: erf).

llama.cpp's converter writes `phi2` with separate attn_q/k/v (q/k rows unpermuted: rope pairs halves)
and GELU's tanh form in its graph. `qk_layernorm` (no released checkpoint sets it) is refused by name.
"""
from __future__ import annotations

from ..errors import UnsupportedModelError
from ..loaders.decoder_config import HF_ACTIVATIONS, DecoderFamily

# PhiForCausalLM names -> ours
HF_PHI_TO_OURS = {
    "model.embed_tokens.weight": "embed",
    "model.final_layernorm.weight": "norm", "model.final_layernorm.bias": "norm_bias",
    "lm_head.weight": "lm_head", "lm_head.bias": "lm_head_bias",
    **{f"model.layers.{{i}}.{hf}.{part}": f"layers.{{i}}.{ours}{'_bias' if part == 'bias' else ''}"
       for hf, ours in (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"),
                        ("self_attn.v_proj", "v"), ("self_attn.dense", "o"), ("mlp.fc1", "up"), ("mlp.fc2", "down"))
       for part in ("weight", "bias")},
}
_DENSE_ACTS = {"gelu": "gelu"}          # config.json's erf GELU; the tanh names read through HF_ACTIVATIONS


def parallel_dense(fields: dict, act: str, eps: float) -> dict:
    """A layer of attention and a dense FFN off the same LayerNorm(s), biases everywhere."""
    return {**fields, "norm": "layer", "rms_eps": float(eps), "parallel_norms": 1, "ffn_gated": False,
            "act": act, "qkv_bias": True}


def dense_act(name: str, where: str) -> str:
    act = _DENSE_ACTS.get(name) or HF_ACTIVATIONS.get(name)
    if act not in ("gelu", "gelu_tanh"):
        raise UnsupportedModelError(f"{where}: a dense FFN with hidden_act {name!r} is not implemented "
                                    f"(gelu, gelu_new, gelu_pytorch_tanh)")
    return act


# MLC's PhiForCausalLM (the msft layout): the final LayerNorm sits in `lm_head.ln`
MLC_PHI_TO_OURS = {
    "transformer.embd": "embed", "lm_head.ln": "norm", "lm_head.linear": "lm_head",
    "transformer.h.{i}.ln": "layers.{i}.attn_norm", "transformer.h.{i}.mixer.Wqkv": "layers.{i}.qkv",
    "transformer.h.{i}.mixer.out_proj": "layers.{i}.o", "transformer.h.{i}.mlp.fc1": "layers.{i}.up",
    "transformer.h.{i}.mlp.fc2": "layers.{i}.down",
}
# MLC's PhiConfig field -> config.json's (rotary_dim becomes partial_rotary_factor)
_MLC_CONFIG = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_head_kv": "num_key_value_heads", "n_inner": "intermediate_size",
               "layer_norm_epsilon": "layer_norm_eps", "n_positions": "max_position_embeddings"}


def _mlc(c: dict) -> dict:
    """MLC's PhiConfig in config.json's names; MLC runs GELU's tanh form whatever the source said."""
    c = {**{_MLC_CONFIG.get(k, k): v for k, v in c.items()}, "hidden_act": "gelu_new"}
    if c.get("rotary_dim") and c.get("hidden_size") and c.get("num_attention_heads"):
        c["partial_rotary_factor"] = c["rotary_dim"] / (c["hidden_size"] // c["num_attention_heads"])
    return c


def _hf(c: dict, fields: dict, where: str) -> dict:
    if c.get("qk_layernorm"):
        raise UnsupportedModelError(f"{where}: Phi's qk_layernorm is not implemented")
    return parallel_dense(fields, dense_act(c.get("hidden_act", "gelu_new"), where), c.get("layer_norm_eps", 1e-5))


def _gguf(g, fields: dict) -> dict:
    return parallel_dense(fields, "gelu_tanh", g.meta("attention.layer_norm_epsilon", 1e-5))


PHI = DecoderFamily("phi2", hf_architectures=("PhiForCausalLM",), hf_model_types=("phi",),
                    hf_defaults={"partial_rotary_factor": 0.5}, gguf_neox=True, hf_names=HF_PHI_TO_OURS,
                    gguf=_gguf, hf=_hf, mlc_model_types=("phi",), mlc_names=MLC_PHI_TO_OURS, mlc=_mlc)

FAMILIES = (PHI,)
