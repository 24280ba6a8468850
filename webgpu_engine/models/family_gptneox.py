"""GPT-NeoX (Pythia, RedPajama-INCITE, ...): LayerNorms with biases, the attention and a dense FFN
(dense_h_to_4h -> GELU -> dense_4h_to_h) in parallel off two norms of the layer's input,
x += attn(ln1(x)) + ffn(ln2(x)) (`use_parallel_residual`, true by default; false: in sequence, as
RedPajama-INCITE-3B), biases on the fused q|k|v, the attention's output and the FFN, partial rotary
(`rotary_pct`, 0.25 by default; base `rotary_emb_base`), an untied head (`embed_out`).

HF stores q|k|v per head ((H, 3, D) rows: `layers.i.qkv_heads`, gathered into q, k, v on load);
llama.cpp's converter and MLC's reorder them to q|k|v. llama.cpp's graph runs GELU's tanh form; a GGUF
does not say which GELU, and GPT-NeoX models were trained with (and transformers runs) the erf form,
which is what runs here from every source.
"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily
from .family_phi import dense_act, parallel_dense

HF_GPTNEOX_TO_OURS = {
    "gpt_neox.embed_in.weight": "embed", "embed_out.weight": "lm_head",
    "gpt_neox.final_layer_norm.weight": "norm", "gpt_neox.final_layer_norm.bias": "norm_bias",
    **{f"gpt_neox.layers.{{i}}.{hf}.{part}": f"layers.{{i}}.{ours}{'_bias' if part == 'bias' else ''}"
       for hf, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                        ("attention.query_key_value", "qkv_heads"), ("attention.dense", "o"),
                        ("mlp.dense_h_to_4h", "up"), ("mlp.dense_4h_to_h", "down"))
       for part in ("weight", "bias")},
}

# MLC's names are HF's (its converter reorders query_key_value to q|k|v), without the part suffix
MLC_GPTNEOX_TO_OURS = {k.removesuffix(".weight"): v.replace("qkv_heads", "qkv")
                       for k, v in HF_GPTNEOX_TO_OURS.items() if not k.endswith(".bias")}


def _neox(fields: dict, eps: float, parallel: bool, act: str = "gelu") -> dict:
    return {**parallel_dense(fields, act, eps), "parallel_norms": 2 if parallel else 0}


def _gguf(g, fields: dict) -> dict:
    return _neox(fields, g.meta("attention.layer_norm_epsilon", 1e-5), bool(g.meta("use_parallel_residual", True)))


def _hf(c: dict, fields: dict, where: str) -> dict:
    """transformers 4's names (rotary_pct, rotary_emb_base) where rope_parameters does not say."""
    fields = {**fields, "rot_dim": int(fields["head_dim"] * float(c.get("partial_rotary_factor",
                                                                       c.get("rotary_pct", 0.25)))),
              "rope_base": float(c.get("rope_theta", c.get("rotary_emb_base", 10000.0)))}
    return {**_neox(fields, c.get("layer_norm_eps", 1e-5), bool(c.get("use_parallel_residual", True)),
                    dense_act(c.get("hidden_act", "gelu"), where)),
            "qkv_bias": bool(c.get("attention_bias", True))}


GPTNEOX = DecoderFamily("gptneox", hf_architectures=("GPTNeoXForCausalLM",), hf_model_types=("gpt_neox",),
                        gguf_neox=True, hf_names=HF_GPTNEOX_TO_OURS, gguf=_gguf, hf=_hf,
                        mlc_model_types=("gpt_neox",), mlc_names=MLC_GPTNEOX_TO_OURS)

FAMILIES = (GPTNEOX,)
