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


def _hf(c: dict, fields: dict, where: str) -> dict:
    if c.get("qk_layernorm"):
        raise UnsupportedModelError(f"{where}: Phi's qk_layernorm is not implemented")
    return parallel_dense(fields, dense_act(c.get("hidden_act", "gelu_new"), where), c.get("layer_norm_eps", 1e-5))


def _gguf(g, fields: dict) -> dict:
    return parallel_dense(fields, "gelu_tanh", g.meta("attention.layer_norm_epsilon", 1e-5))


PHI = DecoderFamily("phi2", hf_architectures=("PhiForCausalLM",), hf_model_types=("phi",),
                    hf_defaults={"partial_rotary_factor": 0.5}, gguf_neox=True, hf_names=HF_PHI_TO_OURS,
                    gguf=_gguf, hf=_hf)

FAMILIES = (PHI,)
