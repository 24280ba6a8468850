"""Mixtures of experts: Qwen3-MoE, OLMoE and Mixtral, each a Llama-style attention (Qwen3-MoE with
Qwen 3's per-head q/k norms, OLMoE with OLMo 2's whole-projection q/k norms but pre norms) whose FFN
is n_experts gated SwiGLU FFNs, n_experts_used of them per token:

    p = softmax(h · Wrouterᵀ); top-k of p (renormalised: Qwen3-MoE's norm_topk_prob, Mixtral always,
    OLMoE's norm_topk_prob, false in its checkpoints); x += sum_j p_j · FFN_{e_j}(h)

(LlamaConfig.n_experts / n_experts_used / moe_norm_topk; models/experts.py uploads the experts
stacked, kernels/moe.py routes and reads only the chosen ones.) HF folders keep one tensor per
expert (`mlp.experts.{j}.gate_proj`, Mixtral's `block_sparse_moe.experts.{j}.w1/w3/w2`) and the
router as `mlp.gate` / `block_sparse_moe.gate`; llama.cpp's GGUFs the stacked `ffn_*_exps` and
`ffn_gate_inp` (loaders/gguf.py), with `<arch>.expert_count` / `expert_used_count` /
`expert_feed_forward_length`, read once in loaders/decoder_config.py. llama.cpp's converter writes
Mixtral as general.architecture `llama` (q/k rows permuted), so a Mixtral GGUF opens as the Llama
family with experts; Qwen3-MoE and OLMoE store q/k unpermuted (rope pairs halves).
"""
from __future__ import annotations

import re

from ..errors import UnsupportedModelError
from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS


class ExpertNames(dict):
    """A safetensors name table whose expert entries say `experts.{j}`: they match every expert j."""

    _EXPERT = re.compile(r"\.experts\.(\d+)\.")

    def get(self, key, default=None):
        m = self._EXPERT.search(key)
        if m is None:
            return super().get(key, default)
        ours = super().get(f"{key[:m.start()]}.experts.{{j}}.{key[m.end():]}")
        return ours.replace("{j}", m.group(1)) if ours else default


def _expert_table(block: str, gate: str, up: str, down: str) -> ExpertNames:
    dense = {k: v for k, v in HF_LLAMA_TO_OURS.items() if ".mlp." not in k}
    e = f"model.layers.{{i}}.{block}.experts.{{j}}."
    return ExpertNames({**dense, f"model.layers.{{i}}.{block}.gate.weight": "layers.{i}.router",     # (E, C)
                        e + f"{gate}.weight": "layers.{i}.experts.{j}.gate",                        # (F, C)
                        e + f"{up}.weight": "layers.{i}.experts.{j}.up",                            # (F, C)
                        e + f"{down}.weight": "layers.{i}.experts.{j}.down"})                       # (C, F)


HF_QWEN3MOE_TO_OURS = _expert_table("mlp", "gate_proj", "up_proj", "down_proj")     # OLMoE's too
HF_MIXTRAL_TO_OURS = _expert_table("block_sparse_moe", "w1", "w3", "w2")


def _refuse(c: dict, where: str, **dense) -> None:
    """Options that make some layers dense or change the layer are refused by name."""
    for key, ok in dense.items():
        if c.get(key) not in ok:
            raise UnsupportedModelError(f"{where}: {key} {c.get(key)!r} is not supported (MoE layers "
                                        f"everywhere, as the released checkpoints have them)")


def _experts(c: dict, fields: dict, count: str, ffn: str, norm: bool) -> dict:
    return {**fields, "n_experts": int(c[count]), "n_experts_used": int(c["num_experts_per_tok"]),
            "ffn_size": int(c[ffn]), "moe_norm_topk": norm}


def _qwen3moe_hf(c: dict, fields: dict, where: str) -> dict:
    _refuse(c, where, mlp_only_layers=([], None), decoder_sparse_step=(1, None))
    return {**_experts(c, fields, "num_experts", "moe_intermediate_size", bool(c.get("norm_topk_prob", False))),
            "qk_norm": True}


def _olmoe_hf(c: dict, fields: dict, where: str) -> dict:
    _refuse(c, where, clip_qkv=(None,))
    return {**_experts(c, fields, "num_experts", "intermediate_size", bool(c.get("norm_topk_prob", False))),
            "qk_norm": True, "qk_norm_whole": True}


def _olmoe_gguf(g, fields: dict) -> dict:
    # llama.cpp's olmoe graph does not renormalise the chosen weights (OLMoE's norm_topk_prob false)
    return {**fields, "qk_norm_whole": True, "moe_norm_topk": bool(g.meta("expert_weights_norm", False))}


def _mixtral_hf(c: dict, fields: dict, where: str) -> dict:
    return _experts(c, fields, "num_local_experts", "intermediate_size", True)


QWEN3MOE = DecoderFamily("qwen3moe", hf_architectures=("Qwen3MoeForCausalLM",), hf_model_types=("qwen3_moe",),
                         gguf_neox=True, hf_names=HF_QWEN3MOE_TO_OURS, hf=_qwen3moe_hf)
OLMOE = DecoderFamily("olmoe", hf_architectures=("OlmoeForCausalLM",), hf_model_types=("olmoe",), gguf_neox=True,
                      hf_names=HF_QWEN3MOE_TO_OURS, hf=_olmoe_hf, gguf=_olmoe_gguf)
MIXTRAL = DecoderFamily("mixtral", hf_architectures=("MixtralForCausalLM",), hf_model_types=("mixtral",),
                        hf_defaults={"use_sliding_window": True}, hf_names=HF_MIXTRAL_TO_OURS, hf=_mixtral_hf)

FAMILIES = (QWEN3MOE, OLMOE, MIXTRAL)
