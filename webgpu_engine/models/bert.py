"""BERT / XLM-RoBERTa encoder forward (embedders and cross-encoders) as a readable sequence of kernel calls.

A batch of B sequences is padded to S tokens and flattened to T = B*S rows; `lengths` (B,) says how
many rows of each sequence are real. Attention masks keys j >= lengths[b]; pooling reads only real
rows, so what padded rows hold never reaches an output.

    x = LN(word[ids] + pos[offset + s] + type[types])                      (T, C)
    for each layer:
        qkv = x·Wqkvᵀ + bqkv                                               (T, 3C)  [q | k | v]
        x1  = LN(attn(qkv, lengths)·Woᵀ + bo + x)                          (T, C)
        x   = LN(gelu(x1·W1ᵀ + b1)·W2ᵀ + b2 + x1)                          (T, C)
    embedder:      out = pool(x, lengths) (mean | cls | max | lasttoken | weightedmean),
                   L2-normalised if asked                                                (B, C)
    cross-encoder: out = tanh(x[b, 0]·Wdᵀ + bd)·Woutᵀ + bout                            (B, num_labels)

XLM-RoBERTa is the same encoder: its positions start at padding_idx + 1 (`position_offset`) and it
has one token type. NomicBert (nomic-embed-text) is too, with three changes: no position table but
rotary positions on q and k (half-split pairs, position s inside each sequence), a SwiGLU
feed-forward x1 = LN((silu(x1·Wgᵀ) * x1·Wuᵀ)·W2ᵀ + x1), and no biases on its linear layers. A cross-encoder's head (BERT's pooler + classifier, RoBERTa's classifier.dense +
out_proj) is the same dense-tanh-dense on the first token; the activation CrossEncoder applies to
the logits (sigmoid for one label) is the pipeline's.

Activation buffers live in an arena sized for the largest (B, S) bucket seen; the kernel ops of each
bucket are built once (bind groups, params) and replayed, so a forward creates nothing on the GPU.
"""
from __future__ import annotations

from collections import OrderedDict
import struct
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..kernels import matmul as mm
from ..kernels import nn
from ..kernels.common import Op, Tensor, new_tensor, pipeline_keys
from ..loaders.hf_config import map_hf_names, named_weight
from ..loaders.tensor_info import TensorInfo
from ..loaders.model_config import BertConfig

POOLINGS = ("mean", "cls", "max", "lasttoken", "weightedmean")     # sentence-transformers' names
MAX_CACHED_BUCKETS = 8


@dataclass
class _Layer:
    qkv: mm.QWeight                 # (3C, C) rows [q | k | v]
    qkv_b: Tensor | None            # (3C,); None: no bias (NomicBert)
    o: mm.QWeight                   # (C, C)
    o_b: Tensor | None
    attn_ln_w: Tensor
    attn_ln_b: Tensor
    ff1: mm.QWeight                 # (F, C); SwiGLU: (2F, C) rows [gate | up]
    ff1_b: Tensor | None
    ff2: mm.QWeight                 # (C, F)
    ff2_b: Tensor | None
    ffn_ln_w: Tensor
    ffn_ln_b: Tensor


@dataclass
class _Arena:
    """Activation buffers for up to `t_cap` token rows and `b_cap` sequences."""

    t_cap: int
    b_cap: int
    ids: Tensor                     # (T,) u32 token ids, pad id in padded rows
    pos: Tensor                     # (T,) u32 position id of each row (offset + place in its sequence)
    types: Tensor                   # (T,) u32 token type of each row (the second text of a pair: 1)
    lengths: Tensor                 # (B,) u32
    x: Tensor                       # (T, C) hidden state between layers
    x1: Tensor                      # (T, C) after the attention block
    tmp: Tensor                     # (T, C) projection outputs
    ctx: Tensor                     # (T, C) attention output
    qkv: Tensor                     # (T, 3C)
    ff: Tensor                      # (T, F); SwiGLU: (T, 2F) [gate | up]
    ffg: Tensor                     # (T, F) gelu(ff)
    pooled: Tensor                  # (B, C) f32 (cross-encoders: the first token's row)
    head: Tensor                    # (B, C) f32 tanh(dense) of a cross-encoder's head (1 row otherwise)
    out: Tensor                     # (B, out_dim) f32 pooled, normalised or scored: what is copied out

    def tensors(self):
        return [self.ids, self.pos, self.types, self.lengths, self.x, self.x1, self.tmp, self.ctx, self.qkv,
                self.ff, self.ffg, self.pooled, self.head, self.out]


def f32_to_f16(data, *, pure: bool = False):
    """Little-endian f32 values as f16 ones, rounded to nearest even: numpy natively, the standard
    library's struct in the browser page, which has no numpy (the same bits: both round to nearest
    even; `pure` forces the struct path)."""
    if not pure:
        try:
            import numpy as np
            return np.frombuffer(data, np.float32).astype(np.float16)
        except ImportError:
            pass
    mv, out, step = memoryview(data).cast("B"), bytearray(), 1 << 20
    for i in range(0, len(mv), step):
        n = len(mv[i:i + step]) // 4
        out += struct.pack(f"<{n}e", *struct.unpack(f"<{n}f", mv[i:i + step]))
    return bytes(out)


class BertModel:
    """A BERT encoder's weights on the GPU plus its pooling head; `run` embeds one padded batch."""

    FFNS = ("gelu", "swiglu")          # feed-forward forms this class runs (a subclass may add its own)

    def __init__(self, dev, cfg: BertConfig, tensors: dict[str, TensorInfo], *, act_dtype: str = "f32",
                 pooling: str = "mean", normalize: bool = False, owner: str = "model:bert", progress=None):
        if cfg.hidden_act != "gelu" or cfg.ffn not in self.FFNS:
            raise UnsupportedModelError(f"BERT hidden_act {cfg.hidden_act!r} is not supported (erf 'gelu' only).")
        if pooling not in POOLINGS:
            raise UnsupportedModelError(f"pooling {pooling!r} is not supported; use one of {POOLINGS}.")
        if act_dtype not in ("f32", "f16"):
            raise ValueError(f"act_dtype must be f32 or f16, got {act_dtype!r}")
        if cfg.num_labels and act_dtype != "f32":
            # the head reads its pooled row as f32 (scores are compared to 1e-4 and cost nothing)
            raise UnsupportedModelError("cross-encoders run with f32 activations; load with dtype 'f32' or 'auto'")
        self.dev, self.cfg, self.owner = dev, cfg, owner
        self.act_dtype, self.pooling, self.normalize = act_dtype, pooling, normalize
        self._arena: _Arena | None = None
        self._ops: OrderedDict[tuple[int, int], Op] = OrderedDict()
        self._rope_steps: dict[int, object] = {}        # S -> step buffer (0, 0, 0, S) of rotary models
        try:
            self._upload(tensors, progress)
        except BaseException:
            dev.release_owner(owner)
            raise

    # ------------------------------------------------------------------ weights
    def _upload(self, tensors: dict[str, TensorInfo], progress) -> None:
        dev, cfg, own = self.dev, self.cfg, self.owner
        C, F = cfg.hidden_size, cfg.intermediate_size

        if cfg.gguf:                               # already ours (loaders/gguf.py's table names them)
            from ..loaders.gguf import GGUF_TO_OURS
            table, named = GGUF_TO_OURS, tensors
        else:
            table = "nomic" if cfg.arch == "nomic_bert" else "bert"
            named = map_hf_names(tensors, table)   # our names (loaders/hf_config.py's one table)

        def get(key: str, i: int = 0, shape: tuple | None = None) -> TensorInfo:
            return named_weight(named, key.format(i=i), table, "BERT", cfg.arch, shape)

        def weight(parts: list[TensorInfo], label: str, matrix: bool = False) -> mm.QWeight:
            n = sum(p.shape[0] for p in parts)
            qtype, data = parts[0].qtype, [p.data for p in parts]
            if matrix and self.act_dtype == "f16" and all(p.qtype == "f32" for p in parts):
                # f16 activations: an f32 file's layer matrices as f16 too, half the words a lane
                # loads (lavapipe: 13-25% less CPU time per GEMM than f32 weights; cosine to the f32
                # vectors ~1 - 1e-6, within f16 activations' own error)
                qtype, data = "f16", [f32_to_f16(d) for d in data]
            return mm.upload_weight(dev, data, qtype, n, parts[0].shape[1], owner=own, label=label)

        def vector(parts: list[TensorInfo], label: str) -> Tensor:
            data = parts[0].data if len(parts) == 1 else b"".join(bytes(p.data) for p in parts)
            return mm.upload_vector(dev, data, dtype=parts[0].qtype, owner=own, label=label)

        def bias(keys: list[str], i: int, label: str) -> Tensor | None:
            # NomicBert's linear layers have no biases (qkv_proj_bias / mlp_fc*_bias false)
            if cfg.arch == "nomic_bert" and not all(f"layers.{i}.{k}" in named for k in keys):
                return None
            return vector([get("layers.{i}." + k, i) for k in keys], label)

        self.word = weight([get("embed", shape=(cfg.vocab_size, C))], "word_embeddings")
        if cfg.rope_base > 0:
            self.max_position, self.pos_table = cfg.max_position, None
        else:
            pos = get("pos_embed")
            if pos.shape[1] != C:
                raise UnsupportedModelError(f"position embeddings have width {pos.shape[1]}, expected {C}")
            self.max_position = pos.shape[0]
            self.pos_table = weight([pos], "position_embeddings")
        tt = get("type_embed")
        if tt.shape[1] != C:
            raise UnsupportedModelError(f"token type embeddings have width {tt.shape[1]}, expected {C}")
        self.n_types = tt.shape[0]
        self.type_table = weight([tt], "token_type_embeddings")
        if cfg.num_labels:
            L = cfg.num_labels
            self.head_dense = weight([get("head_dense", shape=(C, C))], "head.dense")
            self.head_dense_b = vector([get("head_dense_bias", shape=(C,))], "head.dense_b")
            self.head_out = weight([get("head_out", shape=(L, C))], "head.out")
            self.head_out_b = vector([get("head_out_bias", shape=(L,))], "head.out_b")
        self.emb_ln_w = vector([get("embed_norm", shape=(C,))], "emb_ln.w")
        self.emb_ln_b = vector([get("embed_norm_bias", shape=(C,))], "emb_ln.b")
        self.layers: list[_Layer] = []
        for i in range(cfg.n_layers):
            g = lambda key, shape=None: get("layers.{i}." + key, i, shape)  # noqa: E731
            fused = f"layers.{i}.qkv" in named
            swiglu = cfg.ffn == "swiglu"
            self.layers.append(_Layer(
                qkv=weight([g("qkv", (3 * C, C))] if fused else [g("q", (C, C)), g("k", (C, C)), g("v", (C, C))],
                           f"l{i}.qkv", True),
                qkv_b=bias(["qkv_bias"] if fused else ["q_bias", "k_bias", "v_bias"], i, f"l{i}.qkv_b"),
                o=weight([g("o", (C, C))], f"l{i}.o", True), o_b=bias(["o_bias"], i, f"l{i}.o_b"),
                attn_ln_w=vector([g("attn_norm")], f"l{i}.attn_ln.w"),
                attn_ln_b=vector([g("attn_norm_bias")], f"l{i}.attn_ln.b"),
                ff1=weight([g("gate", (F, C)), g("up", (F, C))] if swiglu else [g("up", (F, C))], f"l{i}.ff1",
                           True),
                ff1_b=bias(["gate_bias", "up_bias"] if swiglu else ["up_bias"], i, f"l{i}.ff1_b"),
                ff2=weight([g("down", (C, F))], f"l{i}.ff2", True),
                ff2_b=bias(["down_bias"], i, f"l{i}.ff2_b"),
                ffn_ln_w=vector([g("ffn_norm")], f"l{i}.ffn_ln.w"),
                ffn_ln_b=vector([g("ffn_norm_bias")], f"l{i}.ffn_ln.b")))
            if progress:
                progress((i + 1) / cfg.n_layers, f"uploading BERT layer {i + 1}/{cfg.n_layers}")

    @property
    def max_seq_length(self) -> int:
        return min(self.max_position, self.cfg.max_position) - self.cfg.position_offset

    @property
    def out_dim(self) -> int:
        """Values per sequence that `run` hands out: the labels' scores or the vector's width."""
        return self.cfg.num_labels or self.cfg.hidden_size

    # ------------------------------------------------------------------ activations and ops
    def _ensure_arena(self, B: int, S: int) -> _Arena:
        a = self._arena
        if a is not None and a.t_cap >= B * S and a.b_cap >= B:
            return a
        # Grow (never shrink within a load): every cached op binds the old buffers, so drop them all.
        t_cap = max(B * S, a.t_cap if a else 0)
        b_cap = max(B, a.b_cap if a else 0)
        self._drop_ops()
        if a is not None:
            for t in a.tensors():
                t.buf.release()
        C, F, d, own = self.cfg.hidden_size, self.cfg.intermediate_size, self.act_dtype, self.owner
        O, Hr = self.out_dim, b_cap if self.cfg.num_labels else 1
        G = 1 if self.cfg.ffn == "gelu" else 2              # gated FFNs: both halves side by side

        def act(shape, label, dtype=d):
            return new_tensor(self.dev, shape, dtype, owner=own, label=label)
        self._arena = _Arena(t_cap, b_cap, ids=act((t_cap,), "ids", "u32"), pos=act((t_cap,), "pos_ids", "u32"),
                             types=act((t_cap,), "type_ids", "u32"),
                             lengths=act((b_cap,), "lengths", "u32"), x=act((t_cap, C), "x"),
                             x1=act((t_cap, C), "x1"), tmp=act((t_cap, C), "tmp"), ctx=act((t_cap, C), "ctx"),
                             qkv=act((t_cap, 3 * C), "qkv"), ff=act((t_cap, G * F), "ff"), ffg=act((t_cap, F), "ffg"),
                             # pooled vectors are f32 even for f16 activations: they are read back
                             pooled=act((b_cap, C), "pooled", "f32"), head=act((Hr, C), "head", "f32"),
                             out=act((b_cap, O), "out", "f32"))
        return self._arena

    def _drop_ops(self) -> None:
        for op in self._ops.values():
            op.release()
        self._ops.clear()

    def _bucket_ops(self, B: int, S: int) -> Op:
        """All dispatches of one forward for a (B, S) bucket, built once and replayed."""
        key = (B, S)
        op = self._ops.get(key)
        if op is not None:
            self._ops.move_to_end(key)
            return op
        a = self._ensure_arena(B, S)
        dev, cfg, C = self.dev, self.cfg, self.cfg.hidden_size
        op, x = self._encoder_ops(a, B, S)
        lengths, pooled, out = a.lengths.view((B,)), a.pooled.view((B, C)), a.out.view((B, self.out_dim))
        pool = {"mean": nn.mean_pool, "cls": nn.cls_pool, "max": nn.max_pool, "lasttoken": nn.last_pool,
                "weightedmean": nn.weighted_mean_pool}[self.pooling]
        if self.cfg.num_labels:
            # cross-encoder head on the first token: out = tanh(x0·Wdᵀ + bd)·Woutᵀ + bout     (B, L)
            head = a.head.view((B, C))
            op += nn.cls_pool(dev, x, lengths, pooled)
            op += mm.matmul(dev, pooled, self.head_dense, head, bias=self.head_dense_b)
            op += nn.tanh(dev, head, head)
            op += mm.matmul(dev, head, self.head_out, out, bias=self.head_out_b)
        elif self.normalize:
            op += pool(dev, x, lengths, pooled)                                      # (B, C)
            op += nn.l2_normalize(dev, pooled, out)
        else:
            op += pool(dev, x, lengths, out)
        op.name = f"bert[{B}x{S}]"
        self._ops[key] = op
        while len(self._ops) > MAX_CACHED_BUCKETS:
            self._ops.popitem(last=False)[1].release()
        return op

    def _encoder_ops(self, a: _Arena, B: int, S: int) -> tuple[Op, Tensor]:
        """The encoder's dispatches for a (B, S) bucket and the tensor holding its last hidden states."""
        dev, cfg = self.dev, self.cfg
        T, C, F, H, D = B * S, cfg.hidden_size, cfg.intermediate_size, cfg.n_heads, cfg.head_dim
        eps = float(cfg.layer_norm_eps)
        ids, pos, types, lengths = a.ids.view((T,)), a.pos.view((T,)), a.types.view((T,)), a.lengths.view((B,))
        x, x1, tmp, ctx = (t.view((T, C)) for t in (a.x, a.x1, a.tmp, a.ctx))
        G = 1 if cfg.ffn == "gelu" else 2
        qkv, ff, ffg = a.qkv.view((T, 3 * C)), a.ff.view((T, G * F)), a.ffg.view((T, F))

        # x = LN(word[ids] + type[types] + pos[offset + s])   (rotary models: no pos)   (T, C)
        op = mm.embedding(dev, ids, self.word, tmp)
        op += mm.embedding(dev, types, self.type_table, x1)
        op += nn.add(dev, tmp, x1, x1)
        if self.pos_table is not None:
            op += mm.embedding(dev, pos, self.pos_table, ctx)
        op += nn.layer_norm(dev, x1, self.emb_ln_w, self.emb_ln_b, x, eps=eps,
                            residual=ctx if self.pos_table is not None else None)
        for L in self.layers:
            # self-attention block: x1 = LN(attn(x)·Woᵀ + bo + x)
            op += mm.matmul(dev, x, L.qkv, qkv, bias=L.qkv_b)                       # (T, 3C)
            if cfg.rope_base > 0:       # q and k heads rotated by their place in their sequence
                op += nn.rope(dev, a.qkv.view((T, 3 * H, D)), self.rope_step(S), n_heads=2 * H, head_dim=D,
                              rot_dim=cfg.rot_dim, base=cfg.rope_base, neox=True)
            op += nn.attention_bidir(dev, qkv, lengths, ctx, batch=B, seq=S, n_heads=H, head_dim=D,
                                     scale=D ** -0.5)                                # (T, C)
            op += mm.matmul(dev, ctx, L.o, tmp, bias=L.o_b)                          # (T, C)
            op += nn.layer_norm(dev, tmp, L.attn_ln_w, L.attn_ln_b, x1, eps=eps, residual=x)
            # feed-forward block: x = LN(gelu(x1·W1ᵀ + b1)·W2ᵀ + b2 + x1)   (SwiGLU: silu(gate) * up)
            op += mm.matmul(dev, x1, L.ff1, ff, bias=L.ff1_b)                        # (T, F) | (T, 2F)
            op += nn.silu_mul(dev, ff, ffg) if cfg.ffn == "swiglu" else nn.gelu(dev, ff, ffg)
            op += mm.matmul(dev, ffg, L.ff2, tmp, bias=L.ff2_b)                      # (T, C)
            op += nn.layer_norm(dev, tmp, L.ffn_ln_w, L.ffn_ln_b, x, eps=eps, residual=x1)
        return op, x

    def rope_step(self, S: int):
        """The step buffer (pos0 0, all rows, -, S) that makes rope restart its positions every S rows."""
        buf = self._rope_steps.get(S)
        if buf is None:
            buf = self._rope_steps[S] = self.dev.upload(_u32([0, 0, 0, S]), owner=self.owner,
                                                        label=f"rope.step[{S}]")
        return buf

    def compile(self, batch, warmed=frozenset()) -> set:
        """Build the ops of the smallest bucket and record one run of them into `batch`, so that
        nothing compiles on the first request (pipelines are created here; drivers that compile on
        first dispatch, such as lavapipe, do so when the batch runs). Every bucket has S >= 16 (so
        B * S >= 16 rows: the same tiled matmuls and attention variant): they share these
        pipelines. Nothing is recorded when every pipeline is in `warmed`; returns their keys."""
        S = min(16, self.max_seq_length)
        op = self._bucket_ops(1, S)
        keys = pipeline_keys([op])
        if keys <= warmed:                  # already run on this device
            return keys
        a = self._arena
        self.dev.write(a.ids.buf, _u32([self.cfg.pad_id] * S))
        self.dev.write(a.pos.buf, _u32([self.cfg.position_offset + s for s in range(S)]))
        self.dev.write(a.types.buf, _u32([0] * S))
        self.dev.write(a.lengths.buf, _u32([1]))
        op.record(batch)
        return keys

    # ------------------------------------------------------------------ forward
    def run(self, seqs: list[list[int]], B: int, S: int, dst, dst_offset: int = 0,
            types: list[list[int]] | None = None) -> None:
        """Embed `seqs` (each 1..S ids, len(seqs) <= B) padded into the (B, S) bucket and copy the
        (len(seqs), out_dim) f32 vectors (or scores) into buffer `dst` at byte `dst_offset`. `types`:
        each sequence's token types (a cross-encoder's pairs; None: all 0). Submits; the caller reads
        `dst` back. Padding sequences get length 1 so no row divides by zero."""
        if not 0 < len(seqs) <= B:
            raise ValueError(f"BertModel.run: {len(seqs)} sequences for a batch of {B}")
        if any(not 0 < len(s) <= S for s in seqs) or S > self.max_seq_length:
            raise ValueError(f"BertModel.run: every sequence needs 1..{S} ids (S <= {self.max_seq_length})")
        op = self._bucket_ops(B, S)
        a = self._arena
        pad = self.cfg.pad_id
        ids: list[int] = []
        for s in seqs:
            ids.extend(s)
            ids.extend([pad] * (S - len(s)))
        ids.extend([pad] * (S * (B - len(seqs))))
        lengths = [len(s) for s in seqs] + [1] * (B - len(seqs))
        tt = [0] * (S * B)
        for b, t in enumerate(types or ()):
            if len(t) != len(seqs[b]) or any(not 0 <= v < self.n_types for v in t):
                raise ValueError(f"BertModel.run: token types of sequence {b} must be {len(seqs[b])} values "
                                 f"in [0, {self.n_types})")
            tt[b * S:b * S + len(t)] = t
        off = self.cfg.position_offset
        self.dev.write(a.ids.buf, _u32(ids))
        self.dev.write(a.pos.buf, _u32([off + s for s in range(S)] * B))
        self.dev.write(a.types.buf, _u32(tt))
        self.dev.write(a.lengths.buf, _u32(lengths))
        batch = op.record(self.dev.batch())
        batch.copy(a.out.buf, dst, len(seqs) * self.out_dim * 4, 0, dst_offset)
        self.dev.submit(batch)

    def dispose(self) -> None:
        """Free every GPU buffer of the model (weights, activations, params)."""
        self._drop_ops()
        self._arena = None
        self._rope_steps.clear()
        self.dev.release_owner(self.owner)


def _u32(values: list[int]) -> bytes:
    from array import array
    arr = array("I", values)
    return arr.tobytes()
