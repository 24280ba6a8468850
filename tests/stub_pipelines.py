"""Stub pipelines for the engine's locking/protocol tests (the only place a stub is allowed).

They implement the pipeline protocols (webgpu_engine/pipelines/protocol.py; tests/test_pipeline_protocol.py
checks them), hold a real (small) GPU buffer owned by `model:<id>` so that freeing can be checked, and
produce text that is a pure function of the input, one word per decode step, so interleaving between
requests would be visible in the outputs.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import (DeviceLostError, EmbeddingDimensionsUnsupportedError, EmbeddingTokenLimitError,
                                  FeatureSupportError, InvalidRequestError, RequestTimeoutError)
from webgpu_engine.pipelines.embedding import MAX_TOTAL_TOKENS, EmbeddingResult

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


class StubTokenizer:
    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = False, max_length: int | None = None) -> list[int]:
        return [sum(map(ord, w)) % self.vocab_size for w in text.split()][:max_length]

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()


class StubGrammars:
    """What the real GrammarCompiler does where llguidance is missing: constrained requests are refused."""

    def compile(self, fmt):
        raise FeatureSupportError("llguidance", message="The stub pipeline compiles no grammars.")


class StubLLM:
    """Answers "<last user words reversed> w1 w2 ..." one word per decode step."""

    load_delay = 0.0          # seconds per load progress step (to cancel a reload mid-way)
    step_delay = 0.002        # seconds per decode step
    answer_words = 6
    lose_device_at_step: int | None = None
    instances: list["StubLLM"] = []
    stop_str = None           # stop strings are not matched here

    def __init__(self, dev, model_id, chat_config):
        self.dev, self.model_id, self.chat_config = dev, model_id, chat_config
        self.owner = f"model:{model_id}"
        self.tokenizer = StubTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.template = None                  # no chat template: tools go into the system message
        self.grammars = StubGrammars()
        self.buf = dev.buffer(4096, owner=self.owner, label="stub-weights")
        self.stopped, self.finish_reason = True, None
        self._target: list[str] = []
        self._out: list[str] = []
        self._sent = 0
        self._interrupt = False
        self._gen = None                      # the current request's GenerationConfig
        self.token_logprobs: list[dict] = []
        self.logit_processor = None
        self.steps = 0
        self.disposed = False
        self.prefills: list[dict] = []
        StubLLM.instances.append(self)

    @classmethod
    async def load(cls, dev, path, chat_config: ChatConfig, progress=None, model_id=None):
        for i in range(4):
            if progress:
                progress(i / 4, f"stub load step {i}")
            await asyncio.sleep(cls.load_delay)
            dev.buffer(1024, owner=f"model:{model_id}", label=f"stub-part{i}")
        if progress:
            progress(1.0, "stub loaded")
        return cls(dev, model_id, chat_config)

    def set_logit_processor(self, proc) -> None:
        self.logit_processor = proc

    async def prefill_step(self, messages, gen, prompt=None):
        self.dev.check_alive()
        src = prompt if prompt is not None else messages[-1]["content"]
        self.prefills.append({"messages": messages, "prompt": prompt, "gen": gen})
        words = src.split()[::-1]
        if gen.temperature > 0:
            rng = random.Random(gen.seed)
            words += [rng.choice(WORDS) for _ in range(self.answer_words)]
        else:
            words += WORDS[:self.answer_words]
        self._target, self._out, self._sent = words, [], 0
        self._gen = gen                          # what the decode steps sample with
        self.token_logprobs = []
        self.stopped, self.finish_reason, self._interrupt = False, None, False
        self._prompt_tokens = len(self.tokenizer.encode(src))
        await asyncio.sleep(self.step_delay)
        self._emit(gen)

    def _emit(self, gen):
        w = self._target[len(self._out)]
        if self.logit_processor is not None:
            self.logit_processor.process_sampled_token(len(self._out))
        self._out.append(w)
        if gen.logprobs:
            top = [{"token": w, "logprob": -0.5}, {"token": "x", "logprob": -1.5}][:max(1, gen.top_logprobs)]
            self.token_logprobs.append({"token": w, "logprob": -0.5, "bytes": list(w.encode()),
                                        "top_logprobs": top if gen.top_logprobs else []})
        text = " ".join(self._out)
        for s in gen.stop:
            if s in text:
                self._out = text[:text.index(s)].split()
                self.stopped, self.finish_reason = True, "stop"
                return
        if gen.max_tokens is not None and len(self._out) >= gen.max_tokens:
            self.stopped, self.finish_reason = True, "length"
        elif len(self._out) >= len(self._target):
            self.stopped, self.finish_reason = True, "stop"

    async def decode_step(self):
        self.steps += 1
        if StubLLM.lose_device_at_step is not None and self.steps >= StubLLM.lose_device_at_step:
            StubLLM.lose_device_at_step = None
            self.dev.mark_lost("stub: simulated driver reset")
            raise DeviceLostError("stub: simulated driver reset")
        self.dev.check_alive()
        await asyncio.sleep(self.step_delay)
        if self._interrupt:
            self.stopped, self.finish_reason = True, "abort"
            return
        self._emit(self._gen)

    def take_delta(self) -> str:
        text = " ".join(self._out)
        d = text[self._sent:]
        self._sent = len(text)
        return d

    def get_message(self) -> str:
        return " ".join(self._out)

    def usage(self) -> dict:
        return {"prompt_tokens": self._prompt_tokens, "completion_tokens": len(self._out),
                "total_tokens": self._prompt_tokens + len(self._out),
                "extra": {"decode_tokens_per_s": 100.0, "time_to_first_token_s": 0.01}}

    def interrupt(self):
        self._interrupt = True

    def reset_chat(self, keep_stats=False):
        self._out, self._sent = [], 0

    def sequence(self):
        return self          # one request at a time

    def close(self) -> None:
        pass

    def runtime_stats_text(self) -> str:
        return f"stub: {self.steps} decode steps"

    async def forward_tokens_and_sample(self, ids, is_prefill, gen) -> int:
        await asyncio.sleep(0)
        return (sum(ids) + (7 if is_prefill else 1)) % self.tokenizer.vocab_size

    def dispose(self):
        self.disposed = True
        self.dev.release_owner(self.owner)


@dataclass
class StubEmbedJob:
    """prepare_embed's checked, tokenised request (the real EmbedJob's fields, and the texts the stub
    "model" turns into vectors)."""
    seqs: list
    prompt_tokens: int
    keep: int
    texts: list


class StubEmbedder:
    """Embeds text t as [len(t), 1, 0] (token ids as [their count, 1, 0]), with the real
    pipeline's two steps (prepare_embed: checks and tokens; embed_jobs: one "forward" for the jobs
    of several requests), limits, deadline and cancellation."""

    step_delay = 0.001
    dim = 3

    def __init__(self, dev, model_id, chat_config):
        self.dev, self.model_id, self.chat_config = dev, model_id, chat_config
        self.owner = f"model:{model_id}"
        self.tokenizer = StubTokenizer()
        self.max_seq_length = 512
        self.is_reranker = False
        self.buf = dev.buffer(2048, owner=self.owner, label="stub-embedder")
        self.calls = 0                    # forwards run (one per group of coalesced requests)

    @classmethod
    async def load(cls, dev, path, chat_config, progress=None, model_id=None):
        if progress:
            progress(1.0, "stub embedder loaded")
        return cls(dev, model_id, chat_config)

    async def embed_step(self, input, *, deadline=None, cancelled=None, max_total_tokens=None,  # noqa: A002
                         timeout_s=None, dimensions=None):
        job = await self.prepare_embed(input, deadline=deadline, cancelled=cancelled,
                                       max_total_tokens=max_total_tokens, timeout_s=timeout_s,
                                       dimensions=dimensions)
        return (await self.embed_jobs([job], deadline=deadline, cancelled=cancelled, timeout_s=timeout_s))[0]

    async def prepare_embed(self, input, *, deadline=None, cancelled=None, max_total_tokens=None,  # noqa: A002
                            timeout_s=None, dimensions=None):
        if dimensions is not None and dimensions != self.dim:
            raise EmbeddingDimensionsUnsupportedError(self.model_id, self.dim, dimensions, False)
        if isinstance(input, str):
            items = [input]
        elif input and all(isinstance(t, int) for t in input):
            items = [list(input)]                # one input given as token ids
        else:
            items = list(input)
        seqs = [self.tokenizer.encode(t)[:self.max_seq_length] if isinstance(t, str) else list(t) for t in items]
        n = sum(len(q) for q in seqs)
        budget = MAX_TOTAL_TOKENS if max_total_tokens is None else max_total_tokens
        if n > budget:
            raise EmbeddingTokenLimitError(budget)
        texts = [t if isinstance(t, str) else q for t, q in zip(items, seqs)]
        return StubEmbedJob(seqs, n, self.dim, texts)

    async def embed_jobs(self, jobs, *, deadline=None, cancelled=None, timeout_s=None):
        self.dev.check_alive()
        self.calls += 1
        await asyncio.sleep(self.step_delay)
        if cancelled is not None and cancelled():
            raise asyncio.CancelledError()
        if deadline is not None and asyncio.get_running_loop().time() > deadline:
            raise RequestTimeoutError(timeout_s or 0.0, "embedding")
        return [EmbeddingResult([[float(len(t)), 1.0, 0.0] for t in job.texts], job.prompt_tokens, 1000.0)
                for job in jobs]

    async def rerank_step(self, query, documents, *, deadline=None, cancelled=None, max_total_tokens=None,
                          timeout_s=None):
        raise InvalidRequestError(f"Model {self.model_id} is an embedding model, not a reranker "
                                  f"(cross-encoder); call embeddings instead.", param="model")

    def runtime_stats_text(self):
        return f"stub embedder: {self.calls} forwards"

    def dispose(self):
        self.dev.release_owner(self.owner)


def stub_config(device, **kw):
    """An EngineConfig whose app config has stub LLMs `stub-llm`, `stub-llm-2` and `stub-emb`."""
    from webgpu_engine.engine import AppConfig, EngineConfig, ModelRecord
    recs = [ModelRecord("stub-llm", "stub/llm", "llm"), ModelRecord("stub-llm-2", "stub/llm2", "llm"),
            ModelRecord("stub-emb", "stub/emb", "embedding"),
            ModelRecord("stub-needs-foo", "stub/foo", "llm", required_features=["foo-feature"]),
            ModelRecord("stub-f16", "stub/f16", "llm", required_features=["shader-f16"],
                        f32_variant="stub-llm"),
            ModelRecord("stub-f16-only", "stub/f16o", "llm", required_features=["shader-f16"])]
    return EngineConfig(app_config=AppConfig(recs), device=device,
                        pipeline_factories={"llm": StubLLM, "embedding": StubEmbedder}, **kw)


class StubChatStream:
    """Chat chunks as the chat route streams them (`deltas`, then a last chunk with `finish`), or an
    engine error after them (as a lost device's): what the Responses and Messages event streams are
    made from."""

    _released = False
    prompt_tokens = 5
    stop_reason = None

    def __init__(self, deltas: list[dict], error: Exception | None = None, finish: str = "stop"):
        self.deltas, self.error, self.finish, self.closed = deltas, error, finish, False
        self.usage = {"prompt_tokens": 5, "completion_tokens": len(deltas)}

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        for d in self.deltas:
            yield {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        if self.error is not None:
            raise self.error
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": self.finish}]}

    async def aclose(self):
        self.closed = True
