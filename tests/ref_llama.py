"""numpy reference forward pass of a Llama-family decoder (Llama, Qwen, Mistral, Phi-3, Gemma), for tests.

Independent of the GPU code: it takes dequantized float weights under our tensor names
(loaders' GGUF_TO_OURS names: embed, norm, lm_head, layers.{i}.{attn_norm,q,k,v,q_bias,...}) and a
LlamaConfig, and computes all positions at once in float64 (or float32):

    x = embed[ids]
    for layer: x += o(attn(rope(q(norm(x))), rope(k(norm(x))), v(norm(x))))   (GQA, causal)
               x += down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x))                                                 (lm_head = embed if tied)
"""
from __future__ import annotations

import numpy as np


def weights_from_infos(infos: dict, dtype=np.float64) -> dict:
    """{our name: TensorInfo} (bytes as stored) -> {our name: float array}, dequantized on the host."""
    from webgpu_engine.kernels.quant_ref import dequantize
    out = {}
    for name, t in infos.items():
        if len(t.shape) == 1:
            out[name] = dequantize(t.data, t.qtype, 1, t.shape[0]).reshape(-1).astype(dtype)
        else:
            n = int(np.prod(t.shape[:-1]))
            out[name] = dequantize(t.data, t.qtype, n, t.shape[-1]).reshape(t.shape).astype(dtype)
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, rot_dim, base, neox, factors=None, mscale=1.0):
    """x (T, H, D): rotate the first rot_dim dims of each head; pairs are (i, i + rot/2) when neox,
    else (2i, 2i + 1). `factors`: RoPE scaling, frequency i divided by factors[i]; the rotated
    dims are multiplied by `mscale` (longrope's attention factor)."""
    half = rot_dim // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rot_dim)           # (half,)
    if factors is not None:
        inv = inv / np.asarray(factors, np.float64)
    ang = pos[:, None].astype(np.float64) * inv[None, :]                          # (T, half)
    cos = (np.cos(ang) * mscale)[:, None, :].astype(x.dtype)
    sin = (np.sin(ang) * mscale)[:, None, :].astype(x.dtype)
    y = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:rot_dim]
        y[..., :half] = a * cos - b * sin
        y[..., half:rot_dim] = a * sin + b * cos
    else:
        a, b = x[..., 0:rot_dim:2], x[..., 1:rot_dim:2]
        y[..., 0:rot_dim:2] = a * cos - b * sin
        y[..., 1:rot_dim:2] = a * sin + b * cos
    return y


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


class RefLlama:
    """Keeps a KV cache so it can also check incremental (prefill then decode) use."""

    def __init__(self, cfg, weights: dict, dtype=np.float64, context: int | None = None, ops: dict | None = None,
                 ring: tuple[int, int] | None = None):
        """`context`: the context window, which picks longrope's long or short factors; `ops`: a
        family's new math, {point: fn(i, array) -> array} at the points of DecoderFamily.ops ("embed"
        and "inputs" (T, C) with i = -1, "qkv" (T, Hq + 2 Hkv, D), "attn", "ffn", "layer_end" (T, C),
        "logits" with i = -1); `ring` (sinks S, window W): WebLLM's
        sliding window with attention sinks, as MLC runs it: the query at pos sees positions < S,
        scored with q rotated at min(pos, W), and pos - (W - S) .. pos."""
        self.cfg, self.dtype, self.ops, self.ring = cfg, dtype, ops or {}, ring
        self.w = {k: np.asarray(v, dtype) for k, v in weights.items()}
        for name in list(self.w):                  # Phi-3's fused q|k|v and gate|up
            p, _, part = name.rpartition(".")
            if part == "qkv":
                self.w[p + ".q"], self.w[p + ".k"], self.w[p + ".v"] = np.split(
                    self.w.pop(name), [cfg.q_dim, cfg.q_dim + cfg.kv_dim])
            elif part in ("gate_up", "up") and p + ".gate" not in self.w and len(self.w[name]) == 2 * cfg.ffn_size:
                self.w[p + ".gate"], self.w[p + ".up"] = np.split(self.w.pop(name), 2)
        self.factors = cfg.rope_freq_factors if context is None else cfg.rope_factors_for(context)
        if cfg.norm_plus_one:                      # HF Gemma: x * (1 + w)
            for name in self.w:
                if name == "norm" or name.endswith("norm"):
                    self.w[name] = self.w[name] + 1.0
        self.reset()

    def reset(self):
        L = self.cfg.n_layers
        self.k_cache = [None] * L        # (n_kv, S, D)
        self.v_cache = [None] * L
        self.pos = 0

    def forward(self, ids, all_logits: bool = True):
        """Logits (T, V) for tokens `ids` appended at positions pos..pos+T-1."""
        c, w = self.cfg, self.w
        ids = np.asarray(ids, np.int64)
        T = ids.size
        pos = np.arange(self.pos, self.pos + T)
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        x = w["embed"][ids] * np.float32(c.embed_scale)                            # (T, C)
        for point in ("embed", "inputs"):
            x = self.ops[point](-1, x) if point in self.ops else x
        act = silu if c.act == "silu" else gelu_tanh
        for i in range(c.n_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "attn_norm"], c.rms_eps)
            q = h @ w[p + "q"].T                                                   # (T, H*D)
            k = h @ w[p + "k"].T                                                   # (T, Hkv*D)
            v = h @ w[p + "v"].T
            if p + "q_bias" in w:
                q, k, v = q + w[p + "q_bias"], k + w[p + "k_bias"], v + w[p + "v_bias"]
            if p + "q_norm" in w:                                                  # Qwen3
                q = rms_norm(q.reshape(T, H, D), w[p + "q_norm"], c.rms_eps)
                k = rms_norm(k.reshape(T, Hkv, D), w[p + "k_norm"], c.rms_eps)
            if "qkv" in self.ops:
                q, k, v = np.split(self.ops["qkv"](i, np.concatenate(
                    [q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)], 1)), [H, H + Hkv], 1)
            base, factors = c.rope_of(i, self.factors)
            rk = (c.rot_dim, base, c.rope_neox, factors, c.rope_attn_factor)
            q0 = q.reshape(T, H, D)
            q, k = rope(q0, pos, *rk), rope(k.reshape(T, Hkv, D), pos, *rk)
            v = v.reshape(T, Hkv, D)
            kc = k.transpose(1, 0, 2) if self.k_cache[i] is None else \
                np.concatenate([self.k_cache[i], k.transpose(1, 0, 2)], axis=1)    # (Hkv, S, D)
            vc = v.transpose(1, 0, 2) if self.v_cache[i] is None else \
                np.concatenate([self.v_cache[i], v.transpose(1, 0, 2)], axis=1)
            self.k_cache[i], self.v_cache[i] = kc, vc
            S = kc.shape[1]
            kq = np.repeat(kc, c.n_rep, axis=0)                                     # (H, S, D)
            vq = np.repeat(vc, c.n_rep, axis=0)
            att = np.einsum("thd,hsd->hts", q, kq) * (c.attn_scale or D ** -0.5)   # (H, T, S)
            if c.attn_softcap:
                att = c.attn_softcap * np.tanh(att / c.attn_softcap)
            mask = np.arange(S)[None, :] > pos[:, None]                            # (T, S) causal
            if self.ring:                                  # the sinks, then the window before the query
                n_sink, win = self.ring
                qs = rope(q0, np.minimum(pos, win), *rk)
                att[:, :, :n_sink] = (np.einsum("thd,hsd->hts", qs, kq[:, :n_sink])
                                      * (c.attn_scale or D ** -0.5))
                mask |= (np.arange(S)[None, :] >= n_sink) & (np.arange(S)[None, :] < pos[:, None] - (win - n_sink))
            elif c.window_of(i):                                                   # sliding window
                mask |= np.arange(S)[None, :] <= pos[:, None] - c.window_of(i)
            att = np.where(mask[None], -np.inf, att)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hts,hsd->thd", att, vq).reshape(T, H * D)
            if "attn" in self.ops:
                o = self.ops["attn"](i, o)
            a = o @ w[p + "o"].T + (w[p + "o_bias"] if p + "o_bias" in w else 0.0)
            x = x + (rms_norm(a, w[p + "post_attn_norm"], c.rms_eps) if c.post_norms else a)
            h = rms_norm(x, w[p + "ffn_norm"], c.rms_eps)
            f = act(h @ w[p + "gate"].T) * (h @ w[p + "up"].T)
            f = (self.ops["ffn"](i, f) if "ffn" in self.ops else f) @ w[p + "down"].T
            x = x + (rms_norm(f, w[p + "post_ffn_norm"], c.rms_eps) if c.post_norms else f)
            x = self.ops["layer_end"](i, x) if "layer_end" in self.ops else x
        self.pos += T
        x = rms_norm(x if all_logits else x[-1:], w["norm"], c.rms_eps)
        head = w.get("lm_head", w["embed"])
        logits = x @ head.T                                                        # (T, V)
        if c.final_softcap:
            logits = c.final_softcap * np.tanh(logits / c.final_softcap)
        return self.ops["logits"](-1, logits) if "logits" in self.ops else logits


def greedy(cfg, weights, prompt_ids, n: int, dtype=np.float64) -> list[int]:
    """n greedy tokens after prompt_ids (no stop)."""
    m = RefLlama(cfg, weights, dtype)
    logits = m.forward(prompt_ids, all_logits=False)[-1]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = m.forward([t])[-1]
    return out
