"""gpt-oss (OpenAI's gpt-oss-20b / -120b): a mixture of experts whose layers differ from Llama's in
what they add:

    a = softmax([q · kᵀ * scale, sink_h]) · v, the sink dropped    # a learned logit per q head
    (sliding-window layers alternate with full ones, `layer_types`; q/k/v/o biases; YaRN RoPE)
    e, w = top-k(h · Wrouterᵀ + b), softmax over the k              # = softmax top-k renormalised
    FFN_e(h) = ((clamp(u, ±limit) + 1) * g * sigmoid(alpha g)) · Wdownᵀ + b_down,
               g = min(h · Wgᵀ + b_g, limit), u = h · Wuᵀ + b_u        # swiglu_oai

(LlamaConfig.attn_sinks, act "swiglu_oai" with act_alpha / act_limit; kernels: attention sinks,
expert biases, silu_mul's swiglu_oai.) Its HF folder stacks the experts for x · W with gate and up
columns interleaved (models/experts.py transposes them at upload), or, as OpenAI releases them, in
MXFP4 (blocks and scales in the row layout, repacked into ggml's MXFP4 blocks at upload); llama.cpp's GGUF
(general.architecture `gpt-oss`) stacks them as the other MoE families, biases beside. Its answers
are in harmony (channels: analysis as reasoning_content, final as content, commentary to
functions.NAME as tool calls), parsed by engine/harmony.py.
"""
from __future__ import annotations

from ..errors import ModelFormatError, UnsupportedModelError
from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS
from ..loaders.tensor_info import LazyTensorInfo, TensorInfo

_L = "model.layers.{i}."
HF_GPTOSS_TO_OURS = {**{k: v for k, v in HF_LLAMA_TO_OURS.items() if ".mlp." not in k},
                     _L + "self_attn.o_proj.bias": "layers.{i}.o_bias",
                     _L + "self_attn.sinks": "layers.{i}.sinks",                          # (Hq,)
                     _L + "mlp.router.weight": "layers.{i}.router",                       # (E, C)
                     _L + "mlp.router.bias": "layers.{i}.router_bias",                    # (E,)
                     _L + "mlp.experts.gate_up_proj": "layers.{i}.gate_up_exps_t",        # (E, C, 2F)
                     _L + "mlp.experts.gate_up_proj_bias": "layers.{i}.gate_up_exps_t_bias",  # (E, 2F)
                     _L + "mlp.experts.down_proj": "layers.{i}.down_exps_t",              # (E, F, C)
                     _L + "mlp.experts.down_proj_bias": "layers.{i}.down_exps_bias",      # (E, C)
                     # OpenAI's release: MXFP4 in the row layout, gate and up rows interleaved
                     _L + "mlp.experts.gate_up_proj_blocks": "layers.{i}.gate_up_blocks",  # (E, 2F, C/32, 16)
                     _L + "mlp.experts.gate_up_proj_scales": "layers.{i}.gate_up_scales",  # (E, 2F, C/32)
                     _L + "mlp.experts.down_proj_blocks": "layers.{i}.down_blocks",        # (E, C, F/32, 16)
                     _L + "mlp.experts.down_proj_scales": "layers.{i}.down_scales"}        # (E, C, F/32)


def _gptoss_hf(c: dict, fields: dict, where: str) -> dict:
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(fields["n_layers"])]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"{where}: layer_types {sorted(set(types))} (sliding / full attention only)")
    quant = (c.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise UnsupportedModelError(f"{where}: quantization_config {quant!r} (gpt-oss: bf16 or MXFP4 experts)")
    return {**fields, "n_experts": int(c["num_local_experts"]), "n_experts_used": int(c["num_experts_per_tok"]),
            "moe_norm_topk": True, "act": "swiglu_oai", "act_alpha": float(c.get("swiglu_alpha", 1.702)),
            "act_limit": float(c.get("swiglu_limit", 7.0)), "attn_sinks": True, "qkv_bias": True,
            "window_layers": tuple(t == "sliding_attention" for t in types)}


class MXFP4Stack(LazyTensorInfo):
    """Rows row0, row0 + step, ... of OpenAI's MXFP4 expert stack (blocks (E, R, G, 16): value 2i of a
    block in byte i's low nibble, 2i + 1 in its high one; scales (E, R, G) E8M0) as ggml's MXFP4 stack
    (E, n, 32 G) (per block the scale byte, then byte j: value j low, j + 16 high), repacked when its
    bytes are first read. The same values bit for bit (kernels/qtypes.py mxfp4)."""

    def __init__(self, blocks: TensorInfo, scales: TensorInfo, row0: int, step: int):
        E, R, G, B = blocks.shape
        if B != 16 or tuple(scales.shape) != (E, R, G) or {blocks.qtype, scales.qtype} != {"u8"}:
            raise ModelFormatError(f"{blocks.name}: {blocks.qtype} {blocks.shape} / {scales.qtype} {scales.shape} "
                                   f"are not MXFP4 blocks (E, R, G, 16) and scales (E, R, G) in u8")
        self._src = (blocks, scales, row0, step)
        super().__init__(blocks.name, "mxfp4", (E, len(range(row0, R, step)), 32 * G), None, blocks.offset)

    def _make(self) -> memoryview:
        blocks, scales, row0, step = self._src
        E, R, G, _ = blocks.shape
        return repack_mxfp4(blocks.data, scales.data, E, R, G, row0, step)


def repack_mxfp4(blocks, scales, E: int, R: int, G: int, row0: int, step: int) -> memoryview:
    """ggml's MXFP4 blocks of rows row0::step of each expert (see MXFP4Stack); numpy where installed."""
    from importlib.util import find_spec
    if find_spec("numpy") is not None:
        import numpy as np
        b = np.frombuffer(blocks, np.uint8, E * R * G * 16).reshape(E, R, G, 16)[:, row0::step]
        sc = np.frombuffer(scales, np.uint8, E * R * G).reshape(E, R, G)[:, row0::step]
        out = np.empty(b.shape[:3] + (17,), np.uint8)
        lo, hi = b[..., :8], b[..., 8:]
        out[..., 0] = sc
        out[..., 1::2] = (lo & 0x0F) | (hi << 4)         # value 2m low, 2m + 16 high
        out[..., 2::2] = (lo >> 4) | (hi & 0xF0)         # value 2m + 1 low, 2m + 17 high
        return memoryview(out.reshape(-1))
    rows = [e * R + r for e in range(E) for r in range(row0, R, step)]
    b, sc = bytes(blocks), bytes(scales)
    out = bytearray(len(rows) * G * 17)
    for i, row in enumerate(rows):
        for g in range(G):
            src, o = (row * G + g) * 16, (i * G + g) * 17
            out[o] = sc[row * G + g]
            for m in range(8):
                lo, hi = b[src + m], b[src + 8 + m]
                out[o + 1 + 2 * m] = (lo & 0x0F) | ((hi & 0x0F) << 4)
                out[o + 2 + 2 * m] = (lo >> 4) | (hi & 0xF0)
    return memoryview(out)


def _gptoss_weights(weights: dict) -> dict:
    """OpenAI's MXFP4 experts as the stacks the model reads: gate (even rows) and up (odd rows) of
    gate_up, and down."""
    out = {n: t for n, t in weights.items() if not n.endswith(("_blocks", "_scales"))}
    for name in [n for n in weights if n.endswith(".gate_up_blocks") or n.endswith(".down_blocks")]:
        p, part = name.rsplit(".", 1)[0] + ".", name.rsplit(".", 1)[1][:-len("_blocks")]
        scales = weights.get(f"{p}{part}_scales")
        if scales is None:
            raise ModelFormatError(f"{weights[name].name} has no scales beside it")
        if part == "down":
            out[p + "down_exps"] = MXFP4Stack(weights[name], scales, 0, 1)
        else:
            out[p + "gate_exps"], out[p + "up_exps"] = (MXFP4Stack(weights[name], scales, r, 2) for r in (0, 1))
    return out


def _gptoss_gguf(g, fields: dict) -> dict:
    """llama.cpp's gpt-oss: the file carries the window, not the layers' pattern (even layers slide,
    llama.cpp's swa pattern 2) nor the SwiGLU's constants (its graph's: alpha 1.702, limit 7)."""
    return {**fields, "moe_norm_topk": True, "act": "swiglu_oai", "act_alpha": 1.702, "act_limit": 7.0,
            "attn_sinks": True, "window_layers": tuple(i % 2 == 0 for i in range(fields["n_layers"]))}


GPTOSS = DecoderFamily("gpt-oss", hf_architectures=("GptOssForCausalLM",), hf_model_types=("gpt_oss",),
                       hf_defaults={"use_sliding_window": True, "sliding_window": 128}, gguf_neox=True,
                       hf_names=HF_GPTOSS_TO_OURS, hf=_gptoss_hf, gguf=_gptoss_gguf,
                       gguf_names={"blk.{i}.post_attention_norm.weight": "layers.{i}.ffn_norm"},
                       chat_format="harmony", hf_weights=_gptoss_weights)

FAMILIES = (GPTOSS,)
