"""Decoder embedders (Qwen3-Embedding, gte-Qwen2): a Llama-family decoder whose last hidden state,
after the final norm, at the last token is the sentence vector (sentence-transformers' `lasttoken`
pooling), L2-normalised when the folder's module stack ends in Normalize.

    x = decoder(ids)           # LlamaModel's causal prefill, no LM head                (T, C)
    v = rms_norm(x[T-1])       # the last real token; the tokenizer appended <|endoftext|>  (1, C)
    v = v / ||v||              # Normalize                                              (1, C)

Each input runs as its own causal sequence from position 0 (chunked through the KV cache when it is
longer than the prefill chunk), so there is no padding to mask and left- or right-padding in the
reference makes no difference: RoPE depends on position differences only, and causal attention never
lets a token see the rows after it. The cost is one pass over the weights per input, where a padded
batch would share it. Rows are padded up to a multiple of 16 at the end of a sequence (the last real
row cannot see them), so a few op lists serve every length.

The object offers the pipeline (pipelines/embedding.py) BertModel's interface: `cfg` (with
`max_position`, `num_labels`), `max_seq_length`, `out_dim`, `n_types`, `run`, `compile`, `dispose`.
Standard library only (runs in the page).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import UnsupportedModelError
from ..kernels import nn
from ..kernels.common import Op, new_tensor, pipeline_keys
from ..loaders.hf_config import load_llama_config, map_hf_names
from ..loaders.model_config import LlamaConfig
from .llama import LlamaModel

ROW_GRANULE = 16          # prefill rows are padded to a multiple of this (few op lists)
PREFILL_CHUNK = 256       # rows per forward; longer inputs go through the KV cache in chunks
DEFAULT_MAX_POSITION = 32768
# The KV cache is sized for the longest input at load: Qwen3-Embedding's folder allows 32768 tokens,
# ~7.5 GB of f32 cache for the 0.6B model. Inputs beyond this are truncated (sentence-transformers
# would embed them whole).
MAX_EMBED_LENGTH = 8192


@dataclass
class DecoderEmbedderConfig(LlamaConfig):
    """LlamaConfig plus what the embedding pipeline reads of an encoder's config."""

    num_labels: int = 0               # no classification head (not a cross-encoder)
    embed_length: int = 0             # the longest input (tokens) the cache is sized for; 0: max_position

    @property
    def max_position(self) -> int:
        return self.context_length if self.context_length > 0 else DEFAULT_MAX_POSITION


def load_config(folder) -> DecoderEmbedderConfig:
    """The decoder's config.json as a DecoderEmbedderConfig; its embed_length is sentence-transformers'
    max_seq_length (sentence_bert_config.json, else the tokenizer's model_max_length), at most
    MAX_EMBED_LENGTH and the model's positions."""
    c = load_llama_config(folder)
    cfg = DecoderEmbedderConfig(**{f.name: getattr(c, f.name) for f in fields(c) if f.init})
    folder = Path(folder)
    n = None
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        p = folder / name
        v = json.loads(p.read_text(encoding="utf-8")).get(key) if p.is_file() else None
        if isinstance(v, (int, float)) and 0 < v <= 1 << 20:
            n = int(v)
            break
    cfg.embed_length = min(n or cfg.max_position, cfg.max_position, MAX_EMBED_LENGTH)
    return cfg


def decoder_names(tensors: dict) -> dict:
    """{our name: tensor} of a decoder's safetensors. Sentence-transformers folders save the bare
    `Qwen3Model` / `Qwen2Model` (names without the `model.` prefix a *ForCausalLM file has)."""
    bare = {n if n.startswith(("model.", "lm_head.")) else "model." + n: t for n, t in tensors.items()}
    return map_hf_names(bare, "llama")


def cache_rows(cfg: DecoderEmbedderConfig, max_seq_length: int | None = None) -> int:
    """KV-cache rows for inputs of up to max_seq_length (default: the config's embed_length) tokens:
    rounded up to whole ROW_GRANULE rows (padded rows are written too), within the model's positions."""
    L = min(max_seq_length or cfg.embed_length or cfg.max_position, cfg.max_position)
    return min(_round_up(L, ROW_GRANULE), cfg.max_position)


class DecoderEmbedder:
    """A LlamaModel used as an embedder: weights, a KV cache of max_seq_length rows, a pooling tail."""

    def __init__(self, dev, cfg: DecoderEmbedderConfig, tensors: dict, *, act_dtype: str = "f32",
                 pooling: str = "lasttoken", normalize: bool = False, owner: str = "model:decoder_embedder",
                 progress=None, max_seq_length: int | None = None):
        if pooling != "lasttoken":
            raise UnsupportedModelError(f"decoder embedders pool the last token; this folder asks for "
                                        f"{pooling!r} pooling, which is not supported for {cfg.arch}")
        if act_dtype == "f16" and not normalize:
            raise UnsupportedModelError("a decoder embedder without Normalize runs with f32 activations; "
                                        "load with dtype 'f32' or 'auto'")
        self.dev, self.cfg, self.owner = dev, cfg, owner
        self.act_dtype, self.pooling, self.normalize = act_dtype, pooling, normalize
        self.n_types = 1
        L = min(max_seq_length or cfg.embed_length or cfg.max_position, cfg.max_position)
        ctx = cache_rows(cfg, L)
        self.llm = LlamaModel(dev, cfg, decoder_names(tensors), owner=owner, context_window=ctx,
                              prefill_chunk=min(PREFILL_CHUNK, ctx), dtype=act_dtype, progress=progress)
        self._max_len = min(L, self.llm.ctx)
        C = cfg.hidden_size
        # the pooled row read back: f32 whatever the activations (l2_normalize writes f32 from f16)
        self.out = new_tensor(dev, (1, C), "f32", owner=owner, label="pooled")
        self._tails: dict[int, Op] = {}           # T -> rms_norm of row T-1 (+ normalise) into `out`

    @property
    def max_seq_length(self) -> int:
        return self._max_len

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden_size

    # ------------------------------------------------------------------ ops
    def _tail(self, T: int) -> Op:
        """v = rms_norm(x[T-1]) (/ ||v||) into `out`                                     (1, C)"""
        op = self._tails.get(T)
        if op is None:
            m, C = self.llm, self.cfg.hidden_size
            last = m.last if self.normalize or self.act_dtype != "f32" else self.out
            op = nn.rms_norm(self.dev, m.x.view((1, C), (T - 1) * C), m.final_norm, last, eps=self.cfg.rms_eps)
            if self.normalize:
                op += nn.l2_normalize(self.dev, last, self.out)
            if len(self._tails) >= 2 * ROW_GRANULE:
                self._tails.pop(next(iter(self._tails))).release()
            self._tails[T] = op
        return op

    def _chunks(self, n: int) -> list[tuple[int, int, int]]:
        """(pos0, real rows, rows run) of each forward of an n-token sequence."""
        P, out = self.llm.chunk, []
        for pos0 in range(0, n, P):
            real = min(P, n - pos0)
            rows = min(_round_up(real, ROW_GRANULE), P, self.llm.ctx - pos0)
            out.append((pos0, real, rows))
        return out

    def compile(self, batch, warmed=frozenset()) -> set:
        """Build the ops of a ROW_GRANULE-row forward and its tail and record one run into `batch`, so
        the first request compiles nothing (every length uses the same row-invariant kernels)."""
        T = min(ROW_GRANULE, self.llm.chunk)
        ops = self.llm.ops_for(T, with_head=False) + [self._tail(T)]
        keys = pipeline_keys(ops)
        if keys <= warmed:
            return keys
        self.llm.record_prefill(batch, [0] * T, 0, with_head=False)
        self._tail(T).record(batch)
        return keys

    # ------------------------------------------------------------------ forward
    def run(self, seqs: list[list[int]], B: int, S: int, dst, dst_offset: int = 0, types=None) -> None:
        """Embed each of `seqs` (1..max_seq_length ids) alone and copy its (C,) f32 vector into `dst`
        at byte dst_offset + j * C * 4. B and S (the pipeline's padded bucket) are only checked: each
        sequence runs at its own length. Submits once per forward; the caller reads `dst` back."""
        if types is not None:
            raise UnsupportedModelError("decoder embedders take no token types (they are not cross-encoders)")
        if not 0 < len(seqs) <= B:
            raise ValueError(f"DecoderEmbedder.run: {len(seqs)} sequences for a batch of {B}")
        if any(not 0 < len(s) <= self._max_len for s in seqs):
            raise ValueError(f"DecoderEmbedder.run: every sequence needs 1..{self._max_len} ids")
        nbytes = self.cfg.hidden_size * 4
        for j, ids in enumerate(seqs):
            for pos0, real, rows in self._chunks(len(ids)):
                batch = self.dev.batch()
                part = ids[pos0:pos0 + real]
                # pad rows after the last real one: causal attention keeps them out of its row
                self.llm.record_prefill(batch, part + [part[-1]] * (rows - real), pos0, with_head=False)
                if pos0 + real == len(ids):
                    self._tail(real).record(batch)
                    batch.copy(self.out.buf, dst, nbytes, 0, dst_offset + j * nbytes)
                # the next chunk (or sequence) rewrites ids and the step uniform: submit this one first
                self.dev.submit(batch)

    def dispose(self) -> None:
        """Free every GPU buffer of the model (weights, cache, activations, params)."""
        for op in self._tails.values():
            op.release()
        self._tails.clear()
        self.llm.release()


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
