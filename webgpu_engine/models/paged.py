"""The decoder's forward over a paged KV cache, for many sequences at once (continuous batching).

A loaded LlamaModel's weights and activations, plus one K and one V pool per layer
(kernels/attention_paged.py; models/kv_pool.py decides which blocks a sequence owns):

    decode step (rows = S running sequences, one token each):
        x = embed(ids)                                         # (S, C)
        per layer: the maths of LlamaModel._build, with
            rope(q, k) at positions[s]; k, v -> pool rows slots[s]
            attention of row s over lens[s] keys of block table s
        logits = rms_norm(x) · Wheadᵀ                          # (S, V)
    prefill chunk (rows = T tokens of one sequence at positions pos0 ..):
        the same with causal attention over the sequence's table; logits of the last row only

A decode row's matmul sums do not depend on how many rows run (`decode_rows`: the GPU family's
decode kernel in groups of 8 rows, the CPU family's row-invariant kernels), prefill rows' neither on
the chunking (`row_invariant`), and a sequence's attention depends only on its own keys (the split-key decode kernel, never the short form whose
use would depend on the longest sequence in the step): a sequence's tokens are the same alone or in
any batch. Op lists are built once per row count and replayed; per step the host writes the small
u32 inputs (ids, positions, slots, lens, tables, step). Standard library only (runs in the page).
"""
from __future__ import annotations

import struct

from ..kernels import attention_paged as ap
from ..kernels import matmul as mm
from ..kernels import nn
from ..kernels.common import DTYPE_SIZE, Op, OpCache, new_tensor

_MAX_CACHED = 24


class PagedForward:
    """Batched forward passes of `model` over a pool of n_blocks blocks of block_size tokens."""

    def __init__(self, model, *, max_seqs: int, n_blocks: int, block_size: int, owner: str):
        c, dev, dt = model.cfg, model.dev, model.dtype
        if max_seqs > model.chunk:
            raise ValueError(f"max_num_sequences {max_seqs} exceeds the prefill chunk {model.chunk}")
        self.model, self.cfg, self.dev, self.owner = model, c, dev, owner
        self.max_seqs, self.block_size, self.n_blocks = int(max_seqs), int(block_size), int(n_blocks)
        self.max_blocks = -(-model.ctx // self.block_size)        # blocks of one full context
        P, S = model.chunk, self.max_seqs
        self.ids = new_tensor(dev, (P,), "u32", owner=owner, label="paged.ids")
        self.positions = new_tensor(dev, (P,), "u32", owner=owner, label="paged.positions")
        self.slots = new_tensor(dev, (P,), "u32", owner=owner, label="paged.slots")
        self.lens = new_tensor(dev, (S,), "u32", owner=owner, label="paged.lens")
        self.tables = new_tensor(dev, (S * self.max_blocks,), "u32", owner=owner, label="paged.tables")
        self.step = dev.buffer(16, owner=owner, label="paged.step")              # (pos0, n_new, ., 0)
        self.logits = new_tensor(dev, (S, c.vocab_size), dt, owner=owner, label="paged.logits")
        self.pools = [ap.new_kv_pool(dev, self.n_blocks, self.block_size, c.n_kv_heads, c.head_dim, dt,
                                     owner=owner, label=f"kv_pool.{i}") for i in range(c.n_layers)]
        self._ops = OpCache(_MAX_CACHED)                   # (kind, rows) -> list[Op]

    @staticmethod
    def pool_bytes(cfg, n_blocks: int, block_size: int, dtype: str) -> int:
        return 2 * cfg.n_layers * n_blocks * block_size * cfg.n_kv_heads * cfg.head_dim * DTYPE_SIZE[dtype]

    # ------------------------------------------------------------------ op lists
    def _build(self, T: int, decode: bool) -> list[Op]:
        m, c, dev = self.model, self.cfg, self.dev
        H, Hkv, D, C = c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_size
        x, h = m.x.view((T, C)), m.h.view((T, C))
        qkv, qkv2 = m.qkv.view((T, H + 2 * Hkv, D)), m.qkv.view((T, c.qkv_dim))
        attn, gu, ffn = m.attn.view((T, H * D)), m.gate_up.view((T, 2 * c.ffn_size)), m.ffn.view((T, c.ffn_size))
        eps, scale = c.rms_eps, c.attn_scale or D ** -0.5
        # decode rows: sums independent of the row count; prefill rows: also of the chunking
        inv = dict(decode_rows=True) if decode else dict(row_invariant=True)
        heads = dict(n_q_heads=H, n_kv_heads=Hkv, head_dim=D)
        ops = [mm.embedding(dev, self.ids.view((T,)), m.embed, x)]
        if c.embed_scale != 1.0:
            ops.append(nn.scale(dev, x, x, c.embed_scale))
        for i, L in enumerate(m.layers):
            kp, vp = self.pools[i]
            ops += [nn.rms_norm(dev, x, L.attn_norm, h, eps=eps),
                    mm.matmul(dev, h, L.qkv, qkv2, bias=L.qkv_bias, **inv)]
            if L.qk_norm is not None:
                ops.append(nn.head_rms_norm(dev, qkv, L.qk_norm, n_q_heads=H, n_k_heads=Hkv, head_dim=D, eps=eps))
            base, factors = c.rope_of(i, m.rope_factors)
            ops.append(ap.paged_rope_kv(dev, qkv, kp, vp, self.positions.view((T,)), self.slots.view((T,)),
                                        **heads, rot_dim=c.rot_dim, base=base, neox=c.rope_neox,
                                        factors=factors, mscale=c.rope_attn_factor))
            win = dict(window=c.window_of(i), softcap=c.attn_softcap)
            if decode:
                ops.append(ap.paged_decode(dev, qkv, kp, vp, attn, self.lens.view((T,)),
                                           self.tables.view((T * self.max_blocks,)), **heads, max_seqs=T,
                                           max_blocks=self.max_blocks, scale=scale, **win))
            else:
                ops.append(ap.paged_prefill(dev, qkv, kp, vp, attn, self.step, self.tables.view((self.max_blocks,)),
                                            **heads, max_blocks=self.max_blocks, scale=scale, max_t=T, **win))
            if L.post_attn_norm is not None:
                ops += [mm.matmul(dev, attn, L.o, h, bias=L.o_bias, **inv),
                        nn.rms_norm(dev, h, L.post_attn_norm, h, eps=eps), nn.add(dev, x, h, x)]
            else:
                ops.append(mm.matmul(dev, attn, L.o, x, bias=L.o_bias, accumulate=True, **inv))
            ops += [nn.rms_norm(dev, x, L.ffn_norm, h, eps=eps),
                    mm.matmul(dev, h, L.gate_up, gu, **inv),
                    nn.silu_mul(dev, gu, ffn, pairs=L.gate_pairs, act=c.act)]
            if L.post_ffn_norm is not None:
                ops += [mm.matmul(dev, ffn, L.down, h, **inv),
                        nn.rms_norm(dev, h, L.post_ffn_norm, h, eps=eps), nn.add(dev, x, h, x)]
            else:
                ops.append(mm.matmul(dev, ffn, L.down, x, accumulate=True, **inv))
        if decode:                     # logits of every row
            logits = self.logits.view((T, c.vocab_size))
            ops += [nn.rms_norm(dev, x, m.final_norm, h, eps=eps),
                    mm.matmul(dev, h, m.lm_head, logits, decode_rows=True)]
        else:                          # the last row's logits, into row 0
            logits = self.logits.view((1, c.vocab_size))
            ops += [nn.rms_norm(dev, m.x.view((1, C), (T - 1) * C), m.final_norm, m.last, eps=eps),
                    mm.matmul(dev, m.last, m.lm_head, logits, row_invariant=True)]
        if c.final_softcap:
            ops.append(nn.softcap(dev, logits, logits, c.final_softcap))
        return ops

    def _head_free(self, T: int) -> list[Op]:
        """A prefill chunk without logits (a chunk before the last, or a recomputed prefix)."""
        ops = self.ops("prefill", T)
        n = 3 if self.cfg.final_softcap else 2
        return ops[:-n]

    def ops(self, kind: str, T: int) -> list[Op]:
        return self._ops.get((kind, T), lambda: self._build(T, kind == "decode"))

    # ------------------------------------------------------------------ steps
    def record_decode(self, batch, tokens: list[int], inputs: dict) -> None:
        """One token for each of S = len(tokens) sequences; inputs: KVPool.decode_inputs(ids, S,
        max_blocks). Logits rows 0 .. S-1."""
        S, dev = len(tokens), self.dev
        dev.write(self.ids.buf, struct.pack(f"<{S}I", *tokens))
        dev.write(self.positions.buf, struct.pack(f"<{S}I", *inputs["positions"]))
        dev.write(self.slots.buf, struct.pack(f"<{S}I", *inputs["slots"]))
        dev.write(self.lens.buf, struct.pack(f"<{S}I", *inputs["lens"]))
        dev.write(self.tables.buf, struct.pack(f"<{len(inputs['tables'])}I", *inputs["tables"]))
        for op in self.ops("decode", S):
            op.record(batch)            # the split-key attention always: see the module's note

    def record_prefill(self, batch, tokens: list[int], pos0: int, slots: list[int], table: list[int],
                       with_head: bool) -> None:
        """T = len(tokens) <= chunk tokens of one sequence at positions pos0 ..; their KV goes to
        `slots`; table: the sequence's block ids (those holding keys 0 .. pos0+T-1). With the head,
        the last row's logits go to row 0."""
        T, dev = len(tokens), self.dev
        dev.write(self.ids.buf, struct.pack(f"<{T}I", *tokens))
        dev.write(self.positions.buf, struct.pack(f"<{T}I", *range(pos0, pos0 + T)))
        dev.write(self.slots.buf, struct.pack(f"<{T}I", *slots))
        dev.write(self.tables.buf, struct.pack(f"<{len(table)}I", *table))
        dev.write(self.step, struct.pack("<4I", pos0, T, pos0 + T, 0))
        for op in (self.ops("prefill", T) if with_head else self._head_free(T)):
            op.record(batch)

    def logits_row(self, r: int):
        return self.logits.view((self.cfg.vocab_size,), r * self.cfg.vocab_size)

    def release(self) -> None:
        self._ops.release()
