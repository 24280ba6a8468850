"""EmbeddingPipeline: OpenAI-style embedding inputs → tokens → batched BERT forward → vectors, and
for cross-encoders (a classification head on the encoder): (query, document) pairs → relevance scores.

Modelled on WebLLM's embedding.ts. Per request: tokenize (or take token ids as given), truncate to
`max_seq_length`, sort by length so each forward pads little, run batches of at most
`ChatConfig.max_batch_size` sequences, then read every vector back at once and restore input order.

Token-id inputs (`list[int]`, `list[list[int]]`) are the whole sequence, as OpenAI-compatible servers
(vLLM, text-embeddings-inference) treat them: no [CLS]/[SEP] is added, so pass the ids a tokenizer
produced with its special tokens. Over-long inputs are truncated, never rejected: text keeps its
final [SEP] (what sentence-transformers does), token ids keep their first `max_seq_length` ids.

A request never holds the event loop for long: tokenising, batch planning and turning the vectors into
lists run in a worker thread (inline in chunks under Pyodide, which has no threads), the loop is free
while the GPU computes each batch, and between batches the step stops when its caller is gone or its
deadline has passed. The tokens of one request are capped (`max_total_tokens`).
"""
from __future__ import annotations

import asyncio
import bisect
import math
import threading
import time
from array import array
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import ChatConfig
from ..errors import (EmbeddingDimensionsUnsupportedError, EmbeddingTokenLimitError, GPUOutOfMemoryError,
                      InvalidRequestError, RequestTimeoutError, ShaderF16SupportError)
from ..gpu import IN_BROWSER
from ..loaders.pairs import PairTemplate
from ..loaders.sentence_transformers import SentenceTransformerConfig
from ..kernels import tune
from ..kernels.common import warm_up
from ..models.registry import EMBEDDING, open_model

S_GRANULE = 2       # padded lengths are multiples of this: a forward's time is its padded tokens, and a
                    # new (B, S) bucket costs ~17 CPU ms of ops to build, a 32-sentence forward ~1 s
S_MIN = 16          # and at least this: every forward has B * S >= 16 rows, the same matmul kernels
BATCH_COST = 64     # a forward's fixed cost (dispatches, one pass over the weights) in padded tokens
MAX_TOTAL_TOKENS = 300_000      # tokens one request may embed, summed over its inputs (OpenAI's limit)
TOKENIZE_CHUNK = 128            # inputs tokenised per worker call: the step checks its limits between
RESULT_KEEP_BYTES = 4 << 20     # a result buffer above this is freed after its request


@dataclass
class RerankResult:
    scores: list[float]                # relevance of each document, in input order
    prompt_tokens: int                 # tokens of every (query, document) pair after truncation


@dataclass
class EmbeddingResult:
    embeddings: list[list[float]]      # in input order
    prompt_tokens: int                 # tokens embedded (after truncation), as OpenAI's usage counts
    prefill_tokens_per_s: float        # prompt_tokens / (forward + readback time)


@dataclass
class EmbedJob:
    """One request's checked, tokenised inputs, waiting for a forward (prepare_embed -> embed_jobs)."""
    seqs: list[list[int]]              # token ids, in input order
    prompt_tokens: int                 # sum of their lengths
    keep: int                          # leading dimensions of each vector the request keeps


class EmbeddingPipeline:
    """One loaded embedding model: tokenizer, BERT weights on the GPU, pooling head."""

    # What the engine reads (pipelines/protocol.py EmbeddingPipelineProtocol); set in __init__.
    dev: object
    owner: str
    chat_config: ChatConfig
    tokenizer: object
    max_seq_length: int
    is_reranker: bool
    _next_id = 0

    def __init__(self, dev, model, tokenizer, st_config: SentenceTransformerConfig,
                 chat_config: ChatConfig, max_seq_length: int, owner: str, *,
                 max_total_tokens: int = MAX_TOTAL_TOKENS, pair_template: PairTemplate | None = None,
                 name: str | None = None):
        self.dev, self.model, self.tokenizer = dev, model, tokenizer
        self._compiling = None          # pipelines queued on the background compiler at load,
        self.queued_kernels = None      # ... until the first request (and for /v1/models)
        self.st_config, self.chat_config = st_config, chat_config
        self.model_config = model.cfg
        self.max_seq_length, self.owner = max_seq_length, owner
        self.max_total_tokens = max_total_tokens
        self.dim = model.cfg.hidden_size
        # a cross-encoder scores pairs (rerank_step) and has no sentence vectors to give
        self.pair_template = pair_template
        self.is_reranker = model.cfg.num_labels > 0
        self._dst = None                # (N, C) f32 buffer the batches copy into
        self._max_result_bytes = dev.max_buffer_size
        self._keep_result_bytes = RESULT_KEEP_BYTES
        # One tokenisation at a time: a worker thread of a cancelled request may still be running when
        # the next request starts, and the native tokenizer's truncation setting is shared state.
        self._tokenize_lock = threading.Lock()
        self._stats = {"requests": 0, "tokens": 0, "seconds": 0.0}
        self._sep_id = tokenizer.token_to_id("[SEP]")
        self.name = name or Path(st_config.model_folder).name      # the id errors name
        self.matryoshka = st_config.matryoshka if chat_config.matryoshka is None else chat_config.matryoshka

    @classmethod
    async def load(cls, dev, folder: str | Path, chat_config: ChatConfig | None = None,
                   progress=None, model_id: str | None = None) -> "EmbeddingPipeline":
        """Load a sentence-transformers (or bare HF BERT) folder onto `dev`.

        chat_config.dtype picks the activation precision: "f32", "f16" (needs shader-f16) or "auto"
        = f32: retrieval compares vectors by cosine, f32 keeps them within 1e-6 of sentence-transformers
        (f16: ~1e-4), and on lavapipe f16 measured no faster within noise."""
        chat_config = chat_config or ChatConfig()
        if chat_config.max_batch_size < 1:
            raise InvalidRequestError("chat_opts max_batch_size must be at least 1.", param="max_batch_size")
        if chat_config.max_seq_length is not None and chat_config.max_seq_length < 2:
            raise InvalidRequestError("chat_opts max_seq_length must be at least 2 ([CLS] and [SEP]).",
                                      param="max_seq_length")
        dtype = chat_config.dtype
        if dtype == "auto":
            dtype = "f32"
        if dtype == "f16" and not dev.has_f16:
            raise ShaderF16SupportError()
        if dtype not in ("f32", "f16"):
            raise InvalidRequestError(f"chat_opts dtype must be 'auto', 'f32' or 'f16', got {dtype!r}.",
                                      param="dtype")
        tuning = tune.load_settings(chat_config.tune_kernels, chat_config.tune_budget_s)
        m = open_model(folder, EMBEDDING)
        try:
            if progress:
                progress(0.0, f"reading {Path(folder).name}")
            st, cfg, tensors = m.extra, m.config, m.weights
            tok_dir = Path(st.model_folder)
            # sentence-transformers' length: its config's, else min(tokenizer's model_max_length, positions)
            max_len = min(chat_config.max_seq_length or st.max_seq_length or _model_max_length(tok_dir)
                          or cfg.max_position, cfg.max_position)
            tokenizer = m.tokenizer(max_length=max_len, encoder=True)
            pairs = PairTemplate.from_tokenizer_json(_read_json(tok_dir / "tokenizer.json"), str(tok_dir)) \
                if cfg.num_labels else None
        except BaseException:
            m.close()
            raise
        cls._next_id += 1
        owner = f"embedding:{Path(folder).name}:{cls._next_id}"

        # uploads fill 5..100% of this load's progress, 5..90% when kernel tuning may follow
        top = 0.9 if tune.tunes_at_load(dev, tuning[0]) else 1.0

        def up(frac, text):
            if progress:
                progress(0.05 + (top - 0.05) * frac, text)
        try:
            model = m.arch.model_class()(dev, cfg, tensors, act_dtype=dtype, pooling=st.pooling,
                                         normalize=st.normalize, owner=owner, progress=up)
        finally:
            m.close()                # the weights are on the GPU: release the files
        max_len = min(max_len, model.max_seq_length)
        # before any op is built: the kernels come from the choices stored (BertModel builds its
        # ops per batch shape on first use; a decoder embedder runs prefill ops, built on use too)
        try:
            await tune.tune_at_load(dev, model, EMBEDDING, dtype, mode=tuning[0], budget_s=tuning[1],
                                    progress=progress and (lambda f, text: progress(top + (1 - top) * f, text)),
                                    name=model_id or Path(folder).name)
        except BaseException:
            dev.release_owner(owner)
            raise
        queued = None
        if chat_config.compile_at_load:
            if progress:
                progress(1.0, "Loading GPU shader modules")
            with dev.compiling_in_background() as queued:
                if queued is not None:           # the ops built, their pipelines queued, nothing run
                    model.compile(dev.batch())
            if queued is None or not chat_config.compile_in_background:
                if queued:
                    await dev.ready(queued)      # side by side on every core
                await warm_up(dev, model.compile)     # the first request then compiles nothing
                queued = None
        if progress:
            progress(1.0, "embedding model ready")
        pipe = cls(dev, model, tokenizer, st, chat_config, max_len, owner, pair_template=pairs, name=model_id)
        pipe._compiling = pipe.queued_kernels = queued or None
        return pipe

    # ------------------------------------------------------------------ tokens
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Text → ids with [CLS]/[SEP], truncated to max_seq_length keeping the final [SEP]."""
        if self.st_config.default_prompt:          # sentence-transformers' default_prompt_name
            texts = [self.st_config.default_prompt + t for t in texts]
        if self.st_config.do_lower_case:
            texts = [t.lower() for t in texts]
        L, out = self.max_seq_length, []
        with self._tokenize_lock:
            for text in texts:
                ids = list(self.tokenizer.encode(text, add_special_tokens=True, max_length=L))
                if len(ids) > L:        # a tokenizer that ignores max_length: truncate as it should have
                    ids = ids[:L - 1] + [ids[-1]] if ids[-1] == self._sep_id else ids[:L]
                out.append(ids)
        return out

    def _inputs_to_ids(self, inp) -> list[list[int]]:
        """All of `input` as id lists, at once (no limits, no yielding: for scripts and tests)."""
        kind, items = _input_kind(inp)
        return self._ids_of(kind, items)

    def _ids_of(self, kind: str, items: list) -> list[list[int]]:
        if kind == "text":
            return self.tokenize(items)
        return [self._check_ids(list(x)) for x in items]

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
    async def embed_step(self, input, *, deadline: float | None = None,  # noqa: A002 - OpenAI's name
                         cancelled: Callable[[], bool] | None = None, max_total_tokens: int | None = None,
                         timeout_s: float | None = None, dimensions: int | None = None) -> EmbeddingResult:
        """Embed an OpenAI `input` (str | list[str] | list[int] | list[list[int]]).

        deadline: event-loop time (time.monotonic natively) by which the step must be done; past it,
        the step stops at the next chunk or batch boundary with RequestTimeoutError (`timeout_s`, the
        timeout the deadline came from, goes into its message). cancelled: polled at the same
        boundaries; when it returns True the step stops with asyncio.CancelledError (the engine runs a
        step shielded, so its caller's cancellation reaches the step this way). max_total_tokens: the
        most tokens the inputs may hold in all (default: the pipeline's `max_total_tokens`);
        EmbeddingTokenLimitError (400) beyond it, raised before any GPU work. dimensions: OpenAI's
        field for Matryoshka models: keep the first `dimensions` of each vector, renormalised when the
        model normalises; EmbeddingDimensionsUnsupportedError (400) for other models (unless it equals
        the model's width) and beyond the width."""
        job = await self.prepare_embed(input, deadline=deadline, cancelled=cancelled,
                                       max_total_tokens=max_total_tokens, timeout_s=timeout_s,
                                       dimensions=dimensions)
        return (await self.embed_jobs([job], deadline=deadline, cancelled=cancelled, timeout_s=timeout_s))[0]

    async def prepare_embed(self, input, *, deadline: float | None = None,  # noqa: A002 - OpenAI's name
                            cancelled: Callable[[], bool] | None = None, max_total_tokens: int | None = None,
                            timeout_s: float | None = None, dimensions: int | None = None) -> EmbedJob:
        """embed_step's first half, no GPU work: every check of one request's input, then its tokens.
        Jobs of several requests can then share forwards (embed_jobs; the engine's coalescer)."""
        if self.is_reranker:
            raise InvalidRequestError(f"Model {self.name} is a reranker (cross-encoder): it scores (query, "
                                      f"document) pairs and gives no embeddings; call rerank instead.",
                                      param="model")
        keep = self._check_dimensions(dimensions)
        check = _checker(cancelled, deadline, timeout_s, "embedding")
        budget = self.max_total_tokens if max_total_tokens is None else max_total_tokens
        kind, items = _input_kind(input)
        if kind == "text" and 2 * len(items) > budget:        # [CLS] and [SEP] at least, per text
            raise EmbeddingTokenLimitError(budget)
        seqs: list[list[int]] = []
        n_tok = 0
        for i in range(0, len(items), TOKENIZE_CHUNK):
            check("tokenising")
            part = await _offload(self._ids_of, kind, items[i:i + TOKENIZE_CHUNK])
            n_tok += sum(len(s) for s in part)
            if n_tok > budget:
                raise EmbeddingTokenLimitError(budget)
            seqs.extend(part)
        return EmbedJob(seqs, n_tok, keep)

    async def embed_jobs(self, jobs: list[EmbedJob], *, deadline: float | None = None,
                         cancelled: Callable[[], bool] | None = None,
                         timeout_s: float | None = None) -> list[EmbeddingResult]:
        """embed_step's second half: the sequences of every job in one length-sorted plan of batches,
        each job's vectors back in its own order. prefill_tokens_per_s is the rate of the shared
        forwards (all jobs' tokens over their time)."""
        check = _checker(cancelled, deadline, timeout_s, "embedding")
        raw, order, dt = await self._forward([s for job in jobs for s in job.seqs], None, check)
        vecs = await _offload(_unpack_jobs, raw, order, self.dim, jobs, self.st_config.normalize)
        n_all = sum(job.prompt_tokens for job in jobs)
        self._count(n_all, dt, len(jobs))
        rate = n_all / dt if dt > 0 else 0.0
        return [EmbeddingResult(v, job.prompt_tokens, rate) for v, job in zip(vecs, jobs)]

    async def rerank_step(self, query: str, documents: list[str], *, deadline: float | None = None,
                          cancelled: Callable[[], bool] | None = None, max_total_tokens: int | None = None,
                          timeout_s: float | None = None) -> RerankResult:
        """Score each document's relevance to `query` with a cross-encoder: the pair is tokenised as
        the model's tokenizer joins two texts (truncated `longest_first` to max_seq_length), and the
        score is the first label's logit under CrossEncoder's activation (sigmoid for one label).
        Limits, deadline and cancellation as in embed_step."""
        if not self.is_reranker:
            raise InvalidRequestError(f"Model {self.name} is an embedding model, not a reranker "
                                      f"(cross-encoder); load one to rerank.", param="model")
        check = _checker(cancelled, deadline, timeout_s, "rerank")
        budget = self.max_total_tokens if max_total_tokens is None else max_total_tokens
        if self.pair_template.n_special * len(documents) > budget:
            raise EmbeddingTokenLimitError(budget)
        q = (await _offload(self._plain_ids, [query]))[0]
        seqs: list[list[int]] = []
        types: list[list[int]] = []
        n_tok = 0
        for i in range(0, len(documents), TOKENIZE_CHUNK):
            check("tokenising")
            part = await _offload(self._pairs, q, documents[i:i + TOKENIZE_CHUNK])
            n_tok += sum(len(ids) for ids, _ in part)
            if n_tok > budget:
                raise EmbeddingTokenLimitError(budget)
            seqs += [ids for ids, _ in part]
            types += [t for _, t in part]
        raw, order, dt = await self._forward(seqs, types, check)
        logits = await _offload(_unpack_vectors, raw, order, self.model.out_dim)
        sigmoid = self.model_config.classifier_activation == "sigmoid"
        self._count(n_tok, dt)
        return RerankResult([_sigmoid(v[0]) if sigmoid else v[0] for v in logits], n_tok)

    def _plain_ids(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text alone, without special tokens or truncation (a pair's parts)."""
        with self._tokenize_lock:
            return [list(self.tokenizer.encode(t, add_special_tokens=False, max_length=1 << 30)) for t in texts]

    def _pairs(self, q: list[int], docs: list[str]) -> list[tuple[list[int], list[int]]]:
        types_ok = self.model.n_types > 1        # RoBERTa-style models have one token type
        out = []
        for d in self._plain_ids(docs):
            ids, types = self.pair_template.encode(q, d, self.max_seq_length)
            out.append((ids, types if types_ok else [0] * len(ids)))
        return out

    async def _forward(self, seqs: list[list[int]], types: list[list[int]] | None, check):
        """Run every batch of `seqs` and read their outputs back: (raw f32 rows in sorted order, the
        order, seconds)."""
        check("planning")
        N, C = len(seqs), self.model.out_dim
        order, plan = await _offload(self._plan, seqs)
        esize = 4                       # the model hands out f32 values for either activation dtype
        t0 = time.perf_counter()
        dst = self._result_buffer(N * C * esize)
        if self._compiling:             # the kernels queued at load, compiled side by side
            await self.dev.ready(self._compiling)
            self._compiling = None
        try:
            for k, (start, end, B, S) in enumerate(plan):
                if k:
                    check(f"batch {k + 1} of {len(plan)}")
                idx = order[start:end]
                pair_types = {"types": [types[i] for i in idx]} if types is not None else {}
                self.model.run([seqs[i] for i in idx], B, S, dst, start * C * esize, **pair_types)
                await self.dev.sync()       # the loop serves others while the GPU computes this batch
            raw = await self.dev.read(dst, 0, N * C * esize)
        finally:
            self._trim_result_buffer()
        return raw, order, time.perf_counter() - t0

    def _count(self, n_tok: int, seconds: float, requests: int = 1) -> None:
        self._stats["requests"] += requests
        self._stats["tokens"] += n_tok
        self._stats["seconds"] += seconds

    def _check_dimensions(self, dimensions: int | None) -> int:
        """How many leading dimensions of each vector a request keeps (see embed_step)."""
        if dimensions is None or dimensions == self.dim:
            return self.dim
        if not self.matryoshka or not 0 < dimensions <= self.dim:
            raise EmbeddingDimensionsUnsupportedError(self.name, self.dim, dimensions, self.matryoshka)
        return dimensions

    def _plan(self, seqs: list[list[int]]) -> tuple[list[int], list[tuple[int, int, int, int]]]:
        # Longest first, cut into batches that pad little; input order is restored when unpacking.
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        return order, self.plan_batches([len(seqs[i]) for i in order])

    def plan_batches(self, lengths: list[int]) -> list[tuple[int, int, int, int]]:
        """Cut `lengths` (sorted longest first) into batches (start, end, B, S): B sequences padded to
        S tokens, B a power of two up to max_batch_size, S a multiple of S_GRANULE and at least S_MIN
        (up to max_seq_length). Minimises the padded tokens computed plus BATCH_COST per forward
        (weights are re-read once per forward), so a long outlier gets a batch of its own instead of
        padding 31 short sentences to its length."""
        bmax, L, n = self.chat_config.max_batch_size, self.max_seq_length, len(lengths)
        padded = [min(max(S_MIN, _round_up(k, S_GRANULE)), L) for k in lengths]
        best = [0.0] + [float("inf")] * n          # best[j]: cost of the first j sequences
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(max(0, j - bmax), j):   # batch = lengths[i:j]; its longest is lengths[i]
                c = best[i] + BATCH_COST + min(_pow2(j - i), bmax) * padded[i]
                if c < best[j]:
                    best[j], cut[j] = c, i
        plan, j = [], n
        while j > 0:
            i = cut[j]
            plan.append((i, j, min(_pow2(j - i), bmax), padded[i]))
            j = i
        return plan[::-1]

    def _result_buffer(self, nbytes: int):
        """The (N, C) result buffer, at least `nbytes`. Growth allocates the new buffer before the old one
        is released (a failed allocation leaves the old one valid) and doubles, up to the device's
        largest buffer, so a stream of slightly larger requests does not reallocate each time."""
        cur, limit = self._dst, self._max_result_bytes
        if cur is not None and cur.alive and cur.size >= nbytes:
            return cur
        if nbytes > limit:
            raise InvalidRequestError(
                f"`input` has too many inputs for this device: their vectors need {nbytes} bytes, more "
                f"than its largest buffer ({limit} bytes). Split them over several requests.", param="input")
        grown = min(max(nbytes, 2 * cur.size if cur is not None and cur.alive else 0), limit)
        try:
            new = self.dev.buffer(grown, owner=self.owner, label="embeddings")
        except GPUOutOfMemoryError:
            if grown == nbytes:
                raise
            new = self.dev.buffer(nbytes, owner=self.owner, label="embeddings")
        if cur is not None:
            cur.release()
        self._dst = new
        return new

    def _trim_result_buffer(self) -> None:
        """After an oversized request, give its result buffer back rather than hold it."""
        if self._dst is not None and self._dst.size > self._keep_result_bytes:
            self._dst.release()
            self._dst = None

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


def _checker(cancelled, deadline, timeout_s, what: str):
    """check(during): CancelledError once `cancelled()`, RequestTimeoutError past `deadline`."""
    t_begin = time.perf_counter()

    def check(during: str) -> None:
        if cancelled is not None and cancelled():
            raise asyncio.CancelledError()
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise RequestTimeoutError(timeout_s if timeout_s is not None else time.perf_counter() - t_begin,
                                      f"{what}, {during}")
    return check


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _read_json(path: Path) -> dict:
    import json
    return json.loads(path.read_text(encoding="utf-8"))


def _model_max_length(folder: Path) -> int | None:
    """tokenizer_config.json's model_max_length (None when absent or HF's "no limit" sentinel)."""
    p = folder / "tokenizer_config.json"
    n = _read_json(p).get("model_max_length") if p.is_file() else None
    return int(n) if isinstance(n, (int, float)) and 0 < n <= 1 << 20 else None


def _input_kind(inp) -> tuple[str, list]:
    """("text", texts) or ("ids", id lists) of an OpenAI `input`; element checks come later, in chunks."""
    if isinstance(inp, str):
        return "text", [inp]
    if not isinstance(inp, (list, tuple)) or len(inp) == 0:
        raise InvalidRequestError("`input` must be a non-empty string, list of strings, list of token "
                                  "ids or list of token-id lists.", param="input")
    if all(isinstance(x, str) for x in inp):
        return "text", list(inp)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in inp):
        return "ids", [inp]
    if all(isinstance(x, (list, tuple)) for x in inp):
        return "ids", list(inp)
    raise InvalidRequestError("`input` mixes types; give one string, a list of strings, a list of token "
                              "ids or a list of token-id lists.", param="input")


def _unpack_vectors(raw: bytes, order: list[int], C: int, keep: int | None = None,
                    renormalize: bool = False) -> list[list[float]]:
    """Row j of `raw` (f32, sorted order) is the vector of input order[j]; only its first `keep`
    values are kept (Matryoshka truncation), L2-renormalised when `renormalize` and keep < C."""
    flat = array("f", raw)
    keep = C if keep is None else keep
    vecs: list[list[float]] = [[]] * len(order)
    for j, i in enumerate(order):
        v = flat[j * C:j * C + keep].tolist()
        if renormalize and keep < C:
            norm = math.sqrt(math.fsum(x * x for x in v))
            v = [x / max(norm, 1e-12) for x in v]        # torch F.normalize's eps, as the model's own
        vecs[i] = v
    return vecs


def _unpack_jobs(raw: bytes, order: list[int], C: int, jobs: list[EmbedJob],
                 renormalize: bool) -> list[list[list[float]]]:
    """_unpack_vectors for the rows of several jobs laid end to end in input order: each job's vectors
    in its order, with its own truncation (the same per-row arithmetic as a job alone)."""
    if len(jobs) == 1:
        return [_unpack_vectors(raw, order, C, jobs[0].keep, renormalize)]
    starts = [0]
    for job in jobs:
        starts.append(starts[-1] + len(job.seqs))
    rows: list[list[bytes]] = [[] for _ in jobs]
    local: list[list[int]] = [[] for _ in jobs]
    for j, i in enumerate(order):
        k = bisect.bisect_right(starts, i) - 1
        rows[k].append(raw[j * C * 4:(j + 1) * C * 4])
        local[k].append(i - starts[k])
    return [_unpack_vectors(b"".join(r), o, C, job.keep, renormalize) for r, o, job in zip(rows, local, jobs)]


async def _offload(fn, *args):
    """Run `fn(*args)` in a worker thread; where there are none (Pyodide) inline, then yield once."""
    if not IN_BROWSER:
        return await asyncio.to_thread(fn, *args)
    result = fn(*args)
    await asyncio.sleep(0)
    return result


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
