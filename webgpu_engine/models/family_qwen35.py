"""Qwen3.5 (text; `qwen3_5`, Qwen3-Next's successor): a hybrid of Gated DeltaNet layers
(`linear_attention`) and gated full-attention layers (`full_attention`, every
`full_attention_interval`-th layer unless config.json lists `layer_types`), each followed by a SwiGLU
FFN, with (1 + w) RMSNorms before the mixer, the FFN and the head.

A Gated DeltaNet layer (GatedDeltaNet below, kernels/deltanet.py):

    p = h · [Wqkv | Wz | Wb | Wa]ᵀ                       # one projection: (T, 2 Hk Dk + Hv Dv + Hv Dv + 2 Hv)
    q|k|v = silu(causal_conv1d(p[:, :2 Hk Dk + Hv Dv]))  # K taps per channel, from the conv state
    o = gated delta rule(q, k, v, b, a)                  # per value head, from its (Dk, Dv) state
    a = (rms_norm(o) * w * silu(z)) · Woutᵀ              # per value head

A full-attention layer is Qwen 3's (per-head q / k norms, here (1 + w)) with partial rotary
(`partial_rotary_factor`, default 0.25, neox pairs; text positions make the multimodal RoPE sections
one RoPE) and an output gate: q_proj gives each head's q and gate rows side by side (split on load,
`layers.i.q_gate` -> q and attn_gate), attn *= sigmoid(h · Wgᵀ) before o_proj.

The conv and delta states are a sequence's (one slot per sequence beside the paged pool), carried
from one forward to the next: a forward continues the sequence where the last one stopped, and a
forward at position 0 starts from zeros. A state holds one position's history, so prefix reuse,
speculation and context shifts go through snapshots of it (models/recurrent_snapshots.py).

Qwen's checkpoints are Qwen3_5ForConditionalGeneration folders: the text model's config in
`text_config`, its weights under `model.language_model.` (the vision tower and the multi-token
prediction layer, `mtp.*`, not read); Qwen3_5ForCausalLM folders load too.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..kernels import deltanet
from ..kernels import matmul as mm
from ..kernels.common import Tensor
from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS

_LIN = "model.layers.{i}.linear_attn."
HF_QWEN35_TO_OURS = {
    **{k: v for k, v in HF_LLAMA_TO_OURS.items() if "q_proj" not in k},
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.q_gate",    # (2 Hq D, C): per head q, gate
    _LIN + "in_proj_qkv.weight": "layers.{i}.lin_qkv",                  # (2 Hk Dk + Hv Dv, C)
    _LIN + "in_proj_z.weight": "layers.{i}.lin_z",                      # (Hv Dv, C)
    _LIN + "in_proj_b.weight": "layers.{i}.lin_b",                      # (Hv, C)
    _LIN + "in_proj_a.weight": "layers.{i}.lin_a",                      # (Hv, C)
    _LIN + "conv1d.weight": "layers.{i}.lin_conv",                      # (2 Hk Dk + Hv Dv, 1, K)
    _LIN + "A_log": "layers.{i}.lin_A_log",                             # (Hv,)
    _LIN + "dt_bias": "layers.{i}.lin_dt_bias",                         # (Hv,)
    _LIN + "norm.weight": "layers.{i}.lin_norm",                        # (Dv,): plain w, not 1 + w
    _LIN + "out_proj.weight": "layers.{i}.o",                           # (C, Hv Dv)
}
# as released (Qwen3_5ForConditionalGeneration): the same under model.language_model.
HF_QWEN35_TO_OURS.update({k.replace("model.", "model.language_model.", 1): v
                          for k, v in HF_QWEN35_TO_OURS.items() if k.startswith("model.")})
# llama.cpp's qwen35 GGUF (convert_hf_to_gguf.py Qwen3_5TextModel): norms stored as 1 + w (not the
# gated one), A as -exp(A_log), the conv squeezed to (C_conv, K), value heads in tiled order
GGUF_QWEN35_TO_OURS = {
    "blk.{i}.attn_q.weight": "layers.{i}.q_gate",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.ffn_norm",
    "blk.{i}.attn_qkv.weight": "layers.{i}.lin_qkv",
    "blk.{i}.attn_gate.weight": "layers.{i}.lin_z",
    "blk.{i}.ssm_beta.weight": "layers.{i}.lin_b",
    "blk.{i}.ssm_alpha.weight": "layers.{i}.lin_a",
    "blk.{i}.ssm_conv1d.weight": "layers.{i}.lin_conv",
    "blk.{i}.ssm_a": "layers.{i}.lin_A",                                # (Hv,): -exp(A_log)
    "blk.{i}.ssm_dt.bias": "layers.{i}.lin_dt_bias",
    "blk.{i}.ssm_norm.weight": "layers.{i}.lin_norm",
    "blk.{i}.ssm_out.weight": "layers.{i}.o",
}

# MLC-LLM's qwen3_5 artifacts (python/mlc_llm/model/qwen35: WebLLM's Qwen3.5 ids): HF's names under
# model., q|gate, k, v fused as c_attn, gate|up fused, the (1 + w) norms stored with the 1 added,
# A_log, dt_bias and conv1d_weight without a suffix; value heads in HF's order
_MLC_LIN = "model.layers.{i}.linear_attn."
MLC_QWEN35_TO_OURS = {
    "model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head",
    "model.layers.{i}.input_layernorm": "layers.{i}.attn_norm",
    "model.layers.{i}.post_attention_layernorm": "layers.{i}.ffn_norm",
    "model.layers.{i}.self_attn.c_attn": "layers.{i}.qkv_gate",          # (2 Hq D + 2 Hkv D, C)
    "model.layers.{i}.self_attn.o_proj": "layers.{i}.o",
    "model.layers.{i}.self_attn.q_norm": "layers.{i}.q_norm",
    "model.layers.{i}.self_attn.k_norm": "layers.{i}.k_norm",
    "model.layers.{i}.mlp.gate_up_proj": "layers.{i}.gate_up",
    "model.layers.{i}.mlp.down_proj": "layers.{i}.down",
    **{_MLC_LIN + mlc: f"layers.{{i}}.{ours}" for mlc, ours in (
        ("in_proj_qkv", "lin_qkv"), ("in_proj_z", "lin_z"), ("in_proj_b", "lin_b"), ("in_proj_a", "lin_a"),
        ("conv1d_weight", "lin_conv"), ("A_log", "lin_A_log"), ("dt_bias", "lin_dt_bias"), ("norm", "lin_norm"),
        ("out_proj", "o"))},
}


@dataclass
class GatedDeltaNet:
    """One Gated DeltaNet layer's own weights and sizes (its projections are the layer's qkv and o)."""

    conv: Tensor                       # (C_conv, K) f32
    heads: Tensor                      # (2 Hv + Dv,) f32: A_log | dt_bias | the gated norm's w
    n_k_heads: int
    n_v_heads: int
    k_dim: int
    v_dim: int
    eps: float
    tiled: bool = False                # value heads in llama.cpp's tiled order (a GGUF's)

    @property
    def channels(self) -> int:         # the convolved q | k | v
        return 2 * self.n_k_heads * self.k_dim + self.n_v_heads * self.v_dim

    @property
    def scratch(self) -> int:          # columns of the convolved rows
        return self.channels

    def state_shapes(self, slots: int) -> list[tuple]:
        """The conv state (the last K-1 inputs) and the delta state of `slots` sequences."""
        taps = self.conv.shape[-1]
        return [(slots, self.channels, max(taps - 1, 1)), (slots, self.n_v_heads, self.k_dim, self.v_dim)]

    def ops(self, m, kv, i: int, proj: Tensor, out: Tensor, T: int) -> list:
        """out (T, Hv Dv) from the layer's projection proj (T, C_conv + Hv Dv + 2 Hv)."""
        (conv_state, delta_state), step, rows = kv.states(i, T)
        y = m.mixer_scratch.view((T, self.channels))
        return [deltanet.causal_conv1d(m.dev, proj, self.conv, conv_state, y, step, channels=self.channels,
                                       rows=rows),
                deltanet.gated_delta_rule(m.dev, y, proj, self.heads, delta_state, out, step,
                                          n_k_heads=self.n_k_heads, n_v_heads=self.n_v_heads, k_dim=self.k_dim,
                                          v_dim=self.v_dim, z_col=self.channels, eps=self.eps, rows=rows,
                                          tiled=self.tiled)]


def _f32(t) -> bytes:
    """The f32 bytes of a small f32 / f16 / bf16 vector."""
    raw = bytes(t.data)
    if t.qtype == "f32":
        return raw
    if t.qtype == "f16":
        return struct.pack(f"<{len(raw) // 2}f", *struct.unpack(f"<{len(raw) // 2}e", raw))
    if t.qtype == "bf16":
        return b"".join(b"\0\0" + raw[i:i + 2] for i in range(0, len(raw), 2))
    raise UnsupportedModelError(f"{t.name} in {t.qtype}: f32, f16 or bf16 expected")


def _mixer(m, i: int, weights: dict, mat):
    """(input projection, GatedDeltaNet) of a linear-attention layer; None for a full-attention one."""
    c = m.cfg
    lin = c.extra["linear"]
    if not lin["layers"][i]:
        return None
    p = f"layers.{i}."
    a_log = p + ("lin_A" if p + "lin_A" in weights else "lin_A_log")       # a GGUF's A is -exp(A_log)
    names = [p + n for n in ("lin_qkv", "lin_z", "lin_b", "lin_a", "lin_conv")] + [a_log] + \
        [p + "lin_dt_bias", p + "lin_norm"]
    missing = [n for n in names if n not in weights]
    if missing:
        raise UnsupportedModelError(f"model weights lack tensor {missing[0]!r}")
    proj = mat(names[:4], p + "lin_proj")
    conv_t = weights[p + "lin_conv"]
    taps = conv_t.shape[-1]
    conv = mm.upload_vector(m.dev, conv_t.data, dtype=conv_t.qtype, owner=m.owner, label=p + "lin_conv")
    A = _f32(weights[a_log])
    if a_log.endswith("lin_A"):
        A = struct.pack(f"<{len(A) // 4}f", *(math.log(-x) for x in struct.unpack(f"<{len(A) // 4}f", A)))
    heads = A + b"".join(_f32(weights[n]) for n in names[6:])
    hw = Tensor(m.dev.upload(heads, owner=m.owner, label=p + "lin_heads"), (len(heads) // 4,), "f32")
    net = GatedDeltaNet(conv.view((conv.numel // taps, taps)), hw, lin["n_k_heads"], lin["n_v_heads"],
                        lin["k_dim"], lin["v_dim"], c.rms_eps, lin["tiled"])
    if conv.numel != net.channels * taps or hw.numel != 2 * net.n_v_heads + net.v_dim:
        raise UnsupportedModelError(f"layer {i}: conv1d {conv_t.shape} or its per-head vectors do not match "
                                    f"the config's linear-attention sizes")
    return proj, net


def _linear(where: str, types: list, taps: int, n_k_heads: int, n_v_heads: int, k_dim: int, v_dim: int,
            tiled: bool) -> dict:
    """LlamaConfig.extra["linear"]: which layers are Gated DeltaNet layers and their sizes, checked."""
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"{where}: layer_types {unknown} (linear_attention and full_attention "
                                    f"expected)")
    lin = {"layers": tuple(t == "linear_attention" for t in types), "n_k_heads": n_k_heads,
           "n_v_heads": n_v_heads, "k_dim": k_dim, "v_dim": v_dim, "tiled": tiled}
    if taps > deltanet.MAX_TAPS or n_v_heads % n_k_heads or max(k_dim, v_dim) > 256 or k_dim % 4:
        raise UnsupportedModelError(f"{where}: linear attention {lin}, conv of {taps} (value heads a multiple "
                                    f"of the key heads, head dims up to 256, the key's a multiple of 4, at most "
                                    f"{deltanet.MAX_TAPS} taps)")
    return lin


def _memory(fields: dict, lin: dict, taps: int) -> dict:
    """LlamaConfig.extra["mixer_memory"] (models/memory.py): per row, the in-projection's columns beyond
    the attention's q|k|v, the convolved rows and the output gate; per sequence, the f32 conv and delta
    states of every Gated DeltaNet layer, and a layer's larger one (a slot of its state buffer)."""
    Hk, Hv, Dk, Dv = lin["n_k_heads"], lin["n_v_heads"], lin["k_dim"], lin["v_dim"]
    conv = 2 * Hk * Dk + Hv * Dv
    qkv = (fields["n_heads"] + 2 * fields["n_kv_heads"]) * fields["head_dim"]
    q = fields["n_heads"] * fields["head_dim"]
    row = max(0, conv + Hv * Dv + 2 * Hv - qkv) + conv + max(0, Hv * Dv - q) + q
    return {"row_elems": row, "state_bytes": 4 * sum(lin["layers"]) * (Hv * Dk * Dv + conv * max(taps - 1, 1)),
            "slot_bytes": 4 * max(Hv * Dk * Dv, conv * max(taps - 1, 1))}


def _types(n: int, interval: int) -> list:
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


def _hf(c: dict, fields: dict, where: str) -> dict:
    n = fields["n_layers"]
    types = list(c.get("layer_types") or _types(n, int(c.get("full_attention_interval") or 4)))
    if len(types) != n:
        raise UnsupportedModelError(f"{where}: {len(types)} layer_types for {n} layers")
    if c.get("num_experts") or c.get("num_local_experts"):
        raise UnsupportedModelError(f"{where}: Qwen3.5's mixture-of-experts models (qwen3_5_moe) are not "
                                    f"implemented; the dense ones run")
    lin = _linear(where, types, int(c.get("linear_conv_kernel_dim", 4)), int(c.get("linear_num_key_heads", 16)),
                  int(c.get("linear_num_value_heads", 32)), int(c.get("linear_key_head_dim", 128)),
                  int(c.get("linear_value_head_dim", 128)), tiled=False)
    # transformers' Qwen3_5TextConfig rotates a quarter of each head unless config.json says otherwise
    partial = c.get("partial_rotary_factor", (c.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25))
    return {**fields, "qk_norm": True, "norm_plus_one": True, "rot_dim": int(fields["head_dim"] * float(partial)),
            "extra": {**fields.get("extra", {}), "linear": lin,
                      "mixer_memory": _memory(fields, lin, int(c.get("linear_conv_kernel_dim", 4)))}}


def _gguf(g, fields: dict) -> dict:
    # the multi-token-prediction layers the converter appends are not run
    n = fields["n_layers"] - int(g.meta("nextn_predict_layers", 0) or 0)
    n_v = int(g.meta("ssm.time_step_rank", required=True))
    # the converter writes each layer's kind where config.json lists layer_types (then the interval is
    # its default, 4, whatever the layers are)
    recurrent = g.meta("attention.recurrent_layers")
    types = ["linear_attention" if r else "full_attention" for r in recurrent[:n]] if recurrent else \
        _types(n, int(g.meta("full_attention_interval", 4)))
    lin = _linear(g.where, types,
                  int(g.meta("ssm.conv_kernel", required=True)), int(g.meta("ssm.group_count", required=True)), n_v,
                  int(g.meta("ssm.state_size", required=True)), int(g.meta("ssm.inner_size", required=True)) // n_v,
                  tiled=True)
    return {**fields, "n_layers": n, "qk_norm": True,
            "extra": {**fields.get("extra", {}), "linear": lin,
                      "mixer_memory": _memory(fields, lin, int(g.meta("ssm.conv_kernel")))}}


QWEN35 = DecoderFamily("qwen35", hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                       hf_model_types=("qwen3_5_text", "qwen3_5"), gguf_neox=True, hf_names=HF_QWEN35_TO_OURS,
                       gguf_names=GGUF_QWEN35_TO_OURS, hf=_hf, gguf=_gguf, mixer=_mixer,
                       mlc_model_types=("qwen3_5", "qwen3_5_text"), mlc_names=MLC_QWEN35_TO_OURS)

FAMILIES = (QWEN35,)

__all__ = ["FAMILIES", "GGUF_QWEN35_TO_OURS", "GatedDeltaNet", "HF_QWEN35_TO_OURS", "MLC_QWEN35_TO_OURS", "QWEN35"]
