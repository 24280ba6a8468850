"""ModernBERT encoder forward (gte-modernbert, modernbert-embed) as a readable sequence of kernel calls.

Pre-norm blocks, rotary positions, GeGLU, no biases, LayerNorms without bias (their bias is 0), and
attention that alternates: every `global_attn_every_n_layers`-th layer sees all keys, the others only
keys within local_attention / 2 of the query (with their own RoPE base):

    x = LN(word[ids])                                                     (T, C)
    for layer i:
        h   = x if i == 0 else LN(x)
        qkv = h·Wqkvᵀ, q and k rotated (base: global or local)            (T, 3C)
        x  += attn(qkv, lengths, window_i)·Woᵀ                            (T, C)
        x  += (gelu(u) * g)·W2ᵀ  with [u | g] = LN(x)·Wiᵀ                 (T, C)
    hidden = LN_final(x), then pooling as BertModel                       (B, C)

The batch layout, activation arena, bucket cache, pooling and `run` are BertModel's.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..kernels import matmul as mm
from ..kernels import nn
from ..kernels.common import Op, Tensor
from ..loaders.hf_config import map_hf_names, named_weight
from ..loaders.tensor_info import TensorInfo
from .bert import BertModel, _Arena


@dataclass
class _Layer:
    attn_ln_w: Tensor | None        # None in layer 0 (its input is the embedding's norm already)
    attn_ln_b: Tensor | None
    qkv: mm.QWeight                 # (3C, C) rows [q | k | v]
    o: mm.QWeight                   # (C, C)
    ffn_ln_w: Tensor
    ffn_ln_b: Tensor
    ff1: mm.QWeight                 # (2F, C) rows [input | gate]
    ff2: mm.QWeight                 # (C, F)
    window: int                     # keys within this distance of the query (0: all)
    rope_base: float


class ModernBertModel(BertModel):
    FFNS = ("geglu",)

    def _upload(self, tensors: dict[str, TensorInfo], progress) -> None:
        dev, cfg, own = self.dev, self.cfg, self.owner
        C, F = cfg.hidden_size, cfg.intermediate_size
        if cfg.num_labels:
            raise UnsupportedModelError("ModernBERT cross-encoders are not supported yet")
        named = map_hf_names(tensors, "modernbert")

        def get(ours: str, shape: tuple | None = None) -> TensorInfo:
            return named_weight(named, ours, "modernbert", "ModernBERT", "ModernBertModel", shape)

        def weight(t: TensorInfo, label: str) -> mm.QWeight:
            return mm.upload_weight(dev, [t.data], t.qtype, t.shape[0], t.shape[1], owner=own, label=label)

        zero = mm.upload_vector(dev, bytes(4 * C), owner=own, label="zero_bias")   # norm_bias false

        def norm(name: str, label: str) -> tuple[Tensor, Tensor]:
            w = get(name, (C,))
            b = named.get(name + "_bias")
            return (mm.upload_vector(dev, w.data, dtype=w.qtype, owner=own, label=label + ".w"),
                    mm.upload_vector(dev, b.data, dtype=b.qtype, owner=own, label=label + ".b") if b else zero)
        for key in named:
            if key.endswith(("qkv_bias", "o_bias", "up_bias", "down_bias")):
                raise UnsupportedModelError(f"ModernBERT with linear biases ({key}) is not supported")
        self.word = weight(get("embed", (cfg.vocab_size, C)), "tok_embeddings")
        self.emb_ln_w, self.emb_ln_b = norm("embed_norm", "emb_ln")
        self.final_ln_w, self.final_ln_b = norm("norm", "final_norm")
        self.max_position, self.pos_table, self.n_types = cfg.max_position, None, 1
        windows = cfg.layer_windows or (0,) * cfg.n_layers
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            attn_ln = norm(p + "attn_norm", f"l{i}.attn_ln") if i else (None, None)
            ffn_ln = norm(p + "ffn_norm", f"l{i}.ffn_ln")
            self.layers.append(_Layer(
                attn_ln_w=attn_ln[0], attn_ln_b=attn_ln[1], qkv=weight(get(p + "qkv", (3 * C, C)), f"l{i}.qkv"),
                o=weight(get(p + "o", (C, C)), f"l{i}.o"), ffn_ln_w=ffn_ln[0], ffn_ln_b=ffn_ln[1],
                ff1=weight(get(p + "up", (2 * F, C)), f"l{i}.ff1"), ff2=weight(get(p + "down", (C, F)), f"l{i}.ff2"),
                window=windows[i], rope_base=cfg.local_rope_base if windows[i] else cfg.rope_base))
            if progress:
                progress((i + 1) / cfg.n_layers, f"uploading ModernBERT layer {i + 1}/{cfg.n_layers}")

    def _encoder_ops(self, a: _Arena, B: int, S: int) -> tuple[Op, Tensor]:
        dev, cfg = self.dev, self.cfg
        T, C, F, H, D = B * S, cfg.hidden_size, cfg.intermediate_size, cfg.n_heads, cfg.head_dim
        eps = float(cfg.layer_norm_eps)
        ids, lengths = a.ids.view((T,)), a.lengths.view((B,))
        x, x1, h, ctx = (t.view((T, C)) for t in (a.x, a.x1, a.tmp, a.ctx))
        qkv, ff, ffg = a.qkv.view((T, 3 * C)), a.ff.view((T, 2 * F)), a.ffg.view((T, F))

        # x = LN(word[ids])                                                         (T, C)
        op = mm.embedding(dev, ids, self.word, h)
        op += nn.layer_norm(dev, h, self.emb_ln_w, self.emb_ln_b, x, eps=eps)
        for L in self.layers:
            # attention block: x += attn(LN(x))·Woᵀ   (layer 0: no norm)
            src = x
            if L.attn_ln_w is not None:
                op += nn.layer_norm(dev, x, L.attn_ln_w, L.attn_ln_b, h, eps=eps)
                src = h
            op += mm.matmul(dev, src, L.qkv, qkv)                                    # (T, 3C)
            # q and k heads rotated by their place in their sequence
            op += nn.rope(dev, a.qkv.view((T, 3 * H, D)), self.rope_step(S), n_heads=2 * H, head_dim=D,
                          base=L.rope_base, neox=True)
            op += nn.attention_bidir(dev, qkv, lengths, ctx, batch=B, seq=S, n_heads=H, head_dim=D,
                                     scale=D ** -0.5, window=L.window)               # (T, C)
            op += mm.matmul(dev, ctx, L.o, x, accumulate=True)
            # feed-forward block: x += (gelu(u) * g)·W2ᵀ, [u | g] = LN(x)·Wiᵀ
            op += nn.layer_norm(dev, x, L.ffn_ln_w, L.ffn_ln_b, h, eps=eps)
            op += mm.matmul(dev, h, L.ff1, ff)                                        # (T, 2F)
            op += nn.gelu_mul(dev, ff, ffg)                                           # (T, F)
            op += mm.matmul(dev, ffg, L.ff2, x, accumulate=True)
        op += nn.layer_norm(dev, x, self.final_ln_w, self.final_ln_b, x1, eps=eps)
        return op, x1
