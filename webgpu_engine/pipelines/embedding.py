"""EmbeddingPipeline: OpenAI-style embedding inputs → tokens → batched BERT forward → vectors.

Modelled on WebLLM's embedding.ts. Per request: tokenize (or take token ids as given), truncate to
`max_seq_length`, sort by length so each forward pads little, run batches of at most
`ChatConfig.max_batch_size` sequences, then read every vector back at once and restore input order.

Token-id inputs (`list[int]`, `list[list[int]]`) are the whole sequence, as OpenAI-compatible servers
(vLLM, text-embeddings-inference) treat them: no [CLS]/[SEP] is added, so pass the ids a tokenizer
produced with its special tokens. Over-long inputs are truncated, never rejected: text keeps its
final [SEP] (what sentence-transformers does), token ids keep their first `max_seq_length` ids.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import ChatConfig
from ..errors import InvalidRequestError, ShaderF16SupportError
from ..loaders import hf_config
from ..loaders.safetensors import load_safetensors_folder
from ..loaders.sentence_transformers import SentenceTransformerConfig, load_sentence_transformer_config
from ..loaders.tokenizer import load_tokenizer
from ..models.bert import BertModel

S_GRANULE = 16      # padded lengths are multiples of this: few distinct buckets, little padding


@dataclass
class EmbeddingResult:
    embeddings: list[list[float]]      # in input order
    prompt_tokens: int                 # tokens embedded (after truncation), as OpenAI's usage counts
    prefill_tokens_per_s: float        # prompt_tokens / (forward + readback time)


class EmbeddingPipeline:
    """One loaded embedding model: tokenizer, BERT weights on the GPU, pooling head."""

    _next_id = 0

    def __init__(self, dev, model: BertModel, tokenizer, st_config: SentenceTransformerConfig,
                 chat_config: ChatConfig, max_seq_length: int, owner: str):
        self.dev, self.model, self.tokenizer = dev, model, tokenizer
        self.st_config, self.chat_config = st_config, chat_config
        self.model_config = model.cfg
        self.max_seq_length, self.owner = max_seq_length, owner
        self.dim = model.cfg.hidden_size
        self._dst = None                # (N, C) f32 buffer the batches copy into
        self._stats = {"requests": 0, "tokens": 0, "seconds": 0.0}
        self._cls_id = _special_id(tokenizer, "[CLS]")
        self._sep_id = _special_id(tokenizer, "[SEP]")

    @classmethod
    async def load(cls, dev, folder: str | Path, chat_config: ChatConfig | None = None,
                   progress=None) -> "EmbeddingPipeline":
        """Load a sentence-transformers (or bare HF BERT) folder onto `dev`.

        chat_config.dtype picks the activation precision: "f32", "f16" (needs shader-f16) or "auto"
        (f32: on the adapters we measured f16 buys little for this small model and costs accuracy)."""
        chat_config = chat_config or ChatConfig()
        st = load_sentence_transformer_config(folder)
        if progress:
            progress(0.0, f"reading {Path(folder).name}")
        cfg = hf_config.load_bert_config(st.model_folder)
        tokenizer = load_tokenizer(st.model_folder)
        dtype = chat_config.dtype
        if dtype == "auto":
            dtype = "f32"
        if dtype == "f16" and not dev.has_f16:
            raise ShaderF16SupportError()
        if dtype not in ("f32", "f16"):
            raise InvalidRequestError(f"chat_opts dtype must be 'auto', 'f32' or 'f16', got {dtype!r}.",
                                      param="dtype")
        cls._next_id += 1
        owner = f"embedding:{Path(folder).name}:{cls._next_id}"
        tensors = load_safetensors_folder(st.model_folder)

        def up(frac, text):
            if progress:
                progress(0.05 + 0.95 * frac, text)
        model = BertModel(dev, cfg, tensors, act_dtype=dtype, pooling=st.pooling, normalize=st.normalize,
                          owner=owner, progress=up)
        limit = model.max_seq_length
        max_len = min(chat_config.max_seq_length or st.max_seq_length or limit, limit)
        if chat_config.max_batch_size < 1:
            raise InvalidRequestError("chat_opts max_batch_size must be at least 1.", param="max_batch_size")
        if progress:
            progress(1.0, "embedding model ready")
        return cls(dev, model, tokenizer, st, chat_config, max_len, owner)

    # ------------------------------------------------------------------ tokens
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Text → ids with [CLS]/[SEP], truncated to max_seq_length keeping the final [SEP]."""
        if self.st_config.do_lower_case:
            texts = [t.lower() for t in texts]
        enc = getattr(self.tokenizer, "encode_batch", None)
        seqs = enc(texts) if enc is not None else [self.tokenizer.encode(t) for t in texts]
        out = []
        for ids in seqs:
            ids = list(ids)
            if self._cls_id is not None and (not ids or ids[0] != self._cls_id):
                ids.insert(0, self._cls_id)
            if self._sep_id is not None and ids[-1] != self._sep_id:
                ids.append(self._sep_id)
            if len(ids) > self.max_seq_length:
                tail = [ids[-1]] if ids[-1] == self._sep_id else []
                ids = ids[:self.max_seq_length - len(tail)] + tail
            out.append(ids)
        return out

    def _inputs_to_ids(self, inp) -> list[list[int]]:
        if isinstance(inp, str):
            return self.tokenize([inp])
        if not isinstance(inp, (list, tuple)) or len(inp) == 0:
            raise InvalidRequestError("`input` must be a non-empty string, list of strings, list of token "
                                      "ids or list of token-id lists.", param="input")
        if all(isinstance(x, str) for x in inp):
            return self.tokenize(list(inp))
        if all(isinstance(x, int) and not isinstance(x, bool) for x in inp):
            return [self._check_ids(list(inp))]
        if all(isinstance(x, (list, tuple)) for x in inp):
            return [self._check_ids(list(x)) for x in inp]
        raise InvalidRequestError("`input` mixes types; give one string, a list of strings, a list of token "
                                  "ids or a list of token-id lists.", param="input")

    def _check_ids(self, ids: list) -> list[int]:
        V = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError("`input` contains an empty token-id list; give at least one id.",
                                      param="input")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
                raise InvalidRequestError(f"`input` token ids must be integers in [0, {V}), got {t!r}.",
                                          param="input")
        return ids[:self.max_seq_length]

    # ------------------------------------------------------------------ forward
    async def embed_step(self, input) -> EmbeddingResult:  # noqa: A002 - OpenAI's field name
        """Embed an OpenAI `input` (str | list[str] | list[int] | list[list[int]])."""
        seqs = self._inputs_to_ids(input)
        t0 = time.perf_counter()
        N, C = len(seqs), self.dim
        esize = 4                       # the model hands out f32 vectors for either activation dtype
        dst = self._result_buffer(N * C * esize)
        # Longest first: each batch pads to its own longest member, and order is restored below.
        order = sorted(range(N), key=lambda i: -len(seqs[i]))
        bmax = self.chat_config.max_batch_size
        for start in range(0, N, bmax):
            idx = order[start:start + bmax]
            chunk = [seqs[i] for i in idx]
            S = min(_round_up(max(len(s) for s in chunk), S_GRANULE), self.max_seq_length)
            B = min(_pow2(len(chunk)), bmax)
            self.model.run(chunk, B, S, dst, start * C * esize)
        raw = await self.dev.read(dst, 0, N * C * esize)
        flat = struct.unpack(f"<{N * C}f", raw)
        vecs: list[list[float]] = [[]] * N
        for j, i in enumerate(order):
            vecs[i] = list(flat[j * C:(j + 1) * C])
        dt = time.perf_counter() - t0
        n_tok = sum(len(s) for s in seqs)
        self._stats["requests"] += 1
        self._stats["tokens"] += n_tok
        self._stats["seconds"] += dt
        return EmbeddingResult(vecs, n_tok, n_tok / dt if dt > 0 else 0.0)

    def _result_buffer(self, nbytes: int):
        if self._dst is None or self._dst.size < nbytes:
            if self._dst is not None:
                self._dst.release()
            # Grow geometrically so a stream of slightly larger requests does not reallocate each time.
            size = max(nbytes, 2 * self._dst.size if self._dst is not None else 0)
            self._dst = self.dev.buffer(size, owner=self.owner, label="embeddings")
        return self._dst

    # ------------------------------------------------------------------ stats and life
    def runtime_stats_text(self) -> str:
        s = self._stats
        tps = s["tokens"] / s["seconds"] if s["seconds"] else 0.0
        return f"embed: {s['requests']} requests, {s['tokens']} tokens, {tps:.1f} tok/s"

    def dispose(self) -> None:
        """Free every GPU buffer of this model: dev.allocated_bytes(owner) is 0 afterwards."""
        self.model.dispose()
        self._dst = None
        self.dev.release_owner(self.owner)


def _special_id(tokenizer, token: str) -> int | None:
    for name in ("token_to_id", "piece_to_id"):
        f = getattr(tokenizer, name, None)
        if f is not None:
            return f(token)
    return None


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
