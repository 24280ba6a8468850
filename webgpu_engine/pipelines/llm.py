"""LLMChatPipeline: a loaded Llama-family chat model — conversation, KV reuse, prefill/decode steps,
GPU sampling, stop rules, logprobs and stats (modelled on WebLLM's llm_chat.ts).

One request: `prefill_step(messages | prompt)` computes the prompt (only the tokens after the
longest prefix already in the KV cache) and samples the first token; `decode_step` feeds the last
token and samples the next, until EOS (unless ignore_eos), a stop string, max_tokens ("length"),
a full context window ("length") or `interrupt()` ("abort"). A request with a grammar
(`gen.grammar`, see grammar.py) masks the logits each step with the matcher's allowed tokens and
stops ("stop") when the grammar is complete. Page code: standard library only.
"""
from __future__ import annotations

import asyncio
import itertools
import struct
import logging
import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from ..config import GREEDY, ChatConfig, GenerationConfig
from ..errors import (
    ChatOptionTypeError,
    ContextWindowTooLargeError,
    InvalidRequestError,
)
from ..gpu import IN_BROWSER, Device
from ..kernels import matmul as mm, tune
from ..kernels.common import pipeline_keys, warm_up
from ..kernels.logit_mask import LogitMask
from ..kernels.sampling import Sampler
from ..models.plan import DecoderPlan, plan_decoder
from ..models.registry import LLM, open_model
from .decode_paths import DecodePaths
from .grammar import GrammarCompiler
from .prompt import checked_ids, longest_token_bytes, prompt_ids, template_kwargs
from .sequence import Sequence, configure_sampler, process_logits
from .speculation import Speculation, SpeculationStats
from .stats import CumulativeStats, RequestStats, now

OVERFLOW_POLICIES = ("error", "truncate", "shift")
_log = logging.getLogger("webgpu_engine.pipelines")

_ids = itertools.count()


def _valid_vocab(rows: int, tokenizer) -> int:
    """The ids worth sampling: the model's logit rows, cut to the tokenizer's size when smaller."""
    n = getattr(tokenizer, "vocab_size", None)
    return min(rows, n) if isinstance(n, int) and n > 0 else rows


def _scaled(progress, lo: float, hi: float):
    """`progress` with its fraction mapped into [lo, hi] (None stays None)."""
    if progress is None:
        return None
    return lambda frac, text: progress(lo + (hi - lo) * frac, text)


async def _tune(dev: Device, model, dtype: str, tuning: tuple, progress, name: str) -> None:
    """Time the model's matmul shapes the adapter's profile lacks (kernels/tune.py); when the
    family reads the profile, rebuild the decode ops the model built before the choices existed.
    Prefill ops are built later, on first use or by _compile."""
    mode, budget_s = tuning
    if await tune.tune_at_load(dev, model, LLM, dtype, mode=mode, budget_s=budget_s, progress=progress,
                               name=name) and mm.kernel_family(dev) == "tuned":
        model.rebuild_decode_ops()


class LLMChatPipeline(DecodePaths):
    # What the engine reads (pipelines/protocol.py ChatPipelineProtocol); set in __init__.
    dev: Device
    owner: str
    chat_config: ChatConfig
    queued_kernels: list | None = None   # pipelines its load queued on the background compiler
    vision = None                        # a vision-language model's image side (vision/runner.py)
    tokenizer: object
    template: object
    vocab_size: int
    grammars: GrammarCompiler
    stopped: bool
    finish_reason: str | None
    token_logprobs: list[dict]

    def __init__(self, dev: Device, model, tokenizer, template, chat_config: ChatConfig,
                 owner: str, plan: DecoderPlan | None = None):
        self.dev, self.model, self.tokenizer, self.template = dev, model, tokenizer, template
        self.model_config, self.chat_config, self.owner = model.cfg, chat_config, owner
        cfg = model.cfg
        # Checkpoints often pad the embedding / LM-head rows past the tokenizer (Qwen2.5: 151936
        # rows for 151665 tokens): the sampler reads only the ids the tokenizer can decode, so a
        # padding id is never sampled (as if its logit were -inf) and logprobs are over real tokens.
        self.vocab_size = _valid_vocab(cfg.vocab_size, tokenizer)
        self.sampler = Sampler(dev, self.vocab_size, owner=owner)
        # The sampler writes its token into the model's ids[0]: the next decode step's input.
        self._sample_op = self.sampler.op(model.logits.view((self.vocab_size,)), model.ids)
        eos = set(cfg.eos_ids) | set(getattr(tokenizer, "eos_ids", None) or [])
        self.eos_ids = eos | set(chat_config.stop_token_ids)
        self.logit_processor = None
        # constrained decoding: grammars compiled per model (cached); the GPU mask made on first use
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_ids)
        self._mask: LogitMask | None = None
        self._mask_op = None
        self.kv_ids: list[int] = []          # tokens whose K/V sit in the cache, positions 0..n-1
        self.kv_exact = 0                     # its leading rows a prefill wrote: a cold prefill's, bit for bit
        self._longest_token: int | None = None
        self.stats = CumulativeStats()
        self._new_request_state()
        self.scheduler = None
        self._solo = asyncio.Lock()
        self.speculation = Speculation.parse(chat_config.speculation)
        if self.speculation is not None:
            self.speculation = self.speculation.with_k(model.verify_rows_per_pass)
        model.verify_rows = self.speculation.k + 1 if self.speculation else 0     # built at load
        if chat_config.context_overflow not in OVERFLOW_POLICIES:
            raise ChatOptionTypeError("context_overflow", f"one of {list(OVERFLOW_POLICIES)}",
                                      chat_config.context_overflow)
        self.spec_stats = SpeculationStats()            # since load
        self._row_sample_ops: list = []                 # the sampler's op per verify row
        self._row_results = None                        # their results, one readback per verify
        self._row_masks: list = []                      # (LogitMask, op) per verify row under a grammar
        self._ahead = None                              # decode_ahead: the Readback of a step in flight
        self._software = mm.is_software_adapter(dev)    # a CPU "GPU": decode_ahead off by default, and
        #                                                 its submits may block while it is busy
        self.host_s = 0.0                               # decode steps' host time (record + submit), since load
        self.draft: LLMChatPipeline | None = None      # speculation "draft": the draft model's pipeline
        self._decode_step_s: float | None = None        # a fused decode step's time (auto_off), smoothed
        # what was allocated: the load's plan, or (a model built by hand) the model's own, for one sequence
        self.plan = plan or model.plan
        self.shifts = chat_config.context_overflow == "shift"
        # the positions the cache holds at once (a sliding window's ring: any), and those a generation
        # may reach (context shifts go on past the cache's end)
        self.cache_end = sys.maxsize if model.ring else model.ctx
        self.positions = sys.maxsize if self.shifts else self.cache_end
        self.lora = None            # models/lora.py LoraPool, made for the first adapter (engine/lora.py)
        if self.plan.max_sequences > 1:            # continuous batching over a paged KV cache
            from .scheduler import Scheduler
            self.scheduler = Scheduler(self, self.plan)

    # ------------------------------------------------------------------ loading
    @classmethod
    async def load(cls, dev: Device, path, chat_config: ChatConfig | None = None, progress=None,
                   model_id: str | None = None) -> "LLMChatPipeline":
        chat_config = chat_config or ChatConfig()
        path = Path(path)
        owner = f"model:{model_id}" if model_id else f"model:llm{next(_ids)}"
        tuning = tune.load_settings(chat_config.tune_kernels, chat_config.tune_budget_s)
        m = open_model(path, LLM)
        cfg, close = m.config, m.close
        try:
            tokenizer, template = m.tokenizer(), m.template()
        except BaseException:
            close()
            raise
        try:
            plan = plan_decoder(cfg, chat_config, dev)   # dtype, context, chunk, sequences, pool
        except BaseException:
            close()
            raise
        chat_config = replace(chat_config, max_num_sequences=plan.max_sequences)
        tunes = tune.tunes_at_load(dev, tuning[0])
        # compile_at_load: the pipelines built while loading queue on the background compiler
        # (where the backend has one); without compile_in_background the load then compiles them
        # side by side on every core and runs each once before it returns
        with dev.compiling_in_background() if chat_config.compile_at_load else nullcontext() as queued:
            try:
                pipe = await cls._load(dev, m, path, cfg, tokenizer, template, chat_config, plan, owner,
                                       tuning, tunes, progress, model_id)
            finally:
                close()
        if queued and not chat_config.compile_in_background:
            try:
                await dev.ready(queued)
                await pipe._compile()
            except BaseException:
                pipe.dispose()
                raise
        elif queued:
            pipe.queued_kernels = queued
            if progress:
                progress(1.0, f"compiling {dev.compiles_pending()} GPU kernels in the background")
        if progress:
            ring = pipe.model.ring
            span = f"sliding window {ring.window}, {ring.sinks} sinks" if ring else f"context {pipe.model.ctx}"
            progress(1.0, f"loaded {cfg.name or path.name} ({plan.dtype}, {span})")
        return pipe

    @classmethod
    async def _load(cls, dev, m, path, cfg, tokenizer, template, chat_config, plan, owner, tuning, tunes,
                    progress, model_id) -> "LLMChatPipeline":
        dtype = plan.dtype
        try:
            # uploads fill the first 90% of this load's progress when kernel tuning may follow
            model = m.arch.model_class()(dev, cfg, m.weights, owner=owner, plan=plan,
                                         progress=_scaled(progress, 0.0, 0.9) if tunes else progress)
            if tunes:
                await _tune(dev, model, dtype, tuning, _scaled(progress, 0.9, 1.0), model_id or path.name)
            pipe = cls(dev, model, tokenizer, template, chat_config, owner, plan)
            pipe._load_vision(path)
            if pipe.speculation is not None and pipe.speculation.method == "draft":
                pipe.draft = await pipe._load_draft(progress, model_id)
                if pipe.scheduler is not None:     # it guesses for every sequence of a batch at once
                    pipe.scheduler.spec.use_draft(pipe.draft, plan.kv_pool_blocks, plan.kv_block_size)
            if chat_config.compile_at_load:
                if progress:
                    progress(1.0, "Loading GPU shader modules")
                await pipe._compile(background=dev.deferring)   # so the first request compiles nothing
        except BaseException:
            dev.release_owner(owner)
            raise
        return pipe

    def _load_vision(self, path) -> None:
        """The image side of a vision-language model's folder, or of a GGUF with its projector GGUF
        (chat_config.mmproj) (vision/runner.py); none for text models."""
        from ..vision.runner import VisionInputs
        self.vision = VisionInputs.load(self.dev, path, self.model, self.owner, mmproj=self.chat_config.mmproj,
                                        tokenizer=self.tokenizer)
        if self.vision is not None:
            self.template = self.vision.template(self.template)
            if self.shifts:
                self.vision.unavailable = ("context_overflow 'shift' would compute an image's rows again "
                                           "without the image: load with another context_overflow")

    async def _compile(self, background: bool = False) -> None:
        """Create and run once every pipeline of the model and the sampler (see LlamaModel.compile);
        `background`: build every op list, whose pipelines queue on the background compiler, and
        run nothing."""
        self._make_mask()                 # the grammar mask's kernel too (its buffer is 4 B per 32 ids)
        samplers = [self._mask_op, self._sample_op.greedy, self._sample_op.full]

        sched = self.scheduler
        if background:
            self.model.build_ops()
            for kind, T in (sched.compile_ops() if sched else ()):
                sched.fwd.ops(kind, T)
            return
        paged = [sched.fwd.ops(kind, T) for kind, T in sched.compile_ops()] if sched else []

        def record(batch, warmed):
            keys = self.model.compile(batch, warmed)
            # the batch scheduler's ops: each op whose pipelines nothing above runs (inputs all
            # zero: idle rows, KV rows of block 0); the matmuls are mostly the prefill's
            seen = keys | warmed
            for op in (op for ops in paged for op in ops):
                k = pipeline_keys([op])
                if not k <= seen:
                    op.record(batch)
                    seen |= k
                keys |= k
            skeys = pipeline_keys(samplers)
            if not skeys <= warmed:
                self.sampler.configure(GREEDY)
                for op in samplers:
                    op.record(batch)
            return keys | skeys
        await warm_up(self.dev, record)

    def _make_mask(self) -> None:
        if self._mask is None:
            self._mask = LogitMask(self.dev, self.vocab_size, owner=self.owner)
            self._mask_op = self._mask.op(self.model.logits.view((self.vocab_size,)))

    def finished(self, seq: Sequence) -> None:
        """A batched sequence has finished: get_message() gives its answer (the last finished)."""
        self.seq = seq

    def set_logit_processor(self, proc) -> None:
        """A WebLLM-style processor: process_logits(list[float]) -> list[float] (host round trip
        per step), optional process_sampled_token(id) and reset_state()."""
        self.logit_processor = proc

    # ------------------------------------------------------------------ request state
    def _new_request_state(self, gen: GenerationConfig | None = None, req: RequestStats | None = None,
                           raw: bool = False) -> None:
        self.seq = self.new_sequence(gen, req, raw)
        if self.seq.matcher is not None:
            self._make_mask()

    def new_sequence(self, gen: GenerationConfig | None = None, req: RequestStats | None = None,
                     raw: bool = False) -> Sequence:
        """A generation's state (stop rules, streamed text, stats) for this model; raw: it continues
        a completion prompt (not a chat reply)."""
        return Sequence(self.tokenizer, self.eos_ids, self.chat_config.stop_str, self.stats, gen, req, raw)

    # the current request's state, as the engine and tests read it
    output_ids = property(lambda self: self.seq.output_ids)
    token_logprobs = property(lambda self: self.seq.token_logprobs)
    stopped = property(lambda self: self.seq.stopped)
    finish_reason = property(lambda self: self.seq.finish_reason)
    stop_str = property(lambda self: self.seq.stop_str)
    detok = property(lambda self: self.seq.detok)
    _req = property(lambda self: self.seq.req)
    _last_token = property(lambda self: self.seq.last_token)

    def _max_token_chars(self) -> int:
        """Bytes of the longest token (prompt.py's check of a prompt's length), worked out once."""
        if self._longest_token is None:
            self._longest_token = longest_token_bytes(self.tokenizer, self.vocab_size)
        return self._longest_token

    def _configure_sampler(self, gen: GenerationConfig, seen_ids) -> None:
        configure_sampler(self.sampler, gen, seen_ids)
        if self.logit_processor is not None and hasattr(self.logit_processor, "reset_state"):
            self.logit_processor.reset_state()

    def prompt_ids(self, messages, prompt, template_kwargs=None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids (prompt.py): a raw completion prompt as it is, or the chat template over
        `messages`; `template_kwargs` go to the template's render (e.g. enable_thinking)."""
        return prompt_ids(self.tokenizer, self.template, self.chat_config.system_message, messages, prompt,
                          template_kwargs, add_generation_prompt)

    # ------------------------------------------------------------------ steps
    async def prefill_step(self, messages: list[dict] | None, gen: GenerationConfig,
                           prompt: str | None = None) -> None:
        """Compute the prompt (reusing the cached prefix of the conversation) and sample the first token."""
        self._drop_ahead()                 # a step the last request left in flight (it stopped early)
        self._new_request_state(gen, RequestStats(t_start=now(), breakdown=gen.latency_breakdown),
                                raw=prompt is not None)
        ids = await self.prompt_tokens(messages, gen, prompt)
        if self.vision is not None:       # each image paired with its tokens
            from ..vision.requests import images_of
            self.vision.prepare(ids, images_of(messages))
        # KV reuse: keep the longest common prefix with what the cache holds (at least one new token
        # must be computed to get logits); a raw prompt reuses only if it extends the cache too.
        keep = self._reuse_prefix(ids)
        self._req.prompt_tokens, self._req.prefill_tokens = len(ids), len(ids) - keep
        self._configure_sampler(gen, ids)
        if self._speculates(gen):
            self._req.spec = SpeculationStats()
        t0 = now()
        if self.vision is not None:       # the tower over the images not in the reused prefix
            await self.vision.encode(keep)
        res = await self._forward(ids[keep:], keep)
        if self.vision is not None:
            self.vision.done()
        self._req.prefill_s = now() - t0
        if self._req.breakdown:
            self._req.step_s.append(self._req.prefill_s)
        self._req.t_first_token = now()
        self._accept(res)

    template_kwargs = staticmethod(template_kwargs)       # what a request passes to the template (prompt.py)

    async def prompt_tokens(self, messages: list[dict] | None, gen: GenerationConfig,
                            prompt: str | None = None, req: RequestStats | None = None) -> list[int]:
        """The request's prompt ids, checked against the context window (typed errors); with
        context_overflow "truncate" the oldest turns are dropped to fit (counted in `req`, default
        the current request's stats). prompt.py says how."""
        truncate = self.chat_config.context_overflow in ("truncate", "shift") and self.model.ring is None
        ids, dropped = await checked_ids(self.prompt_ids, messages, prompt, self.template_kwargs(gen),
                                         window=self.cache_end, ctx=self.model.ctx, truncate=truncate,
                                         token_bytes=self._max_token_chars)   # a ring's window: any prompt
        if dropped is not None:
            (req if req is not None else self._req).truncated_messages = dropped
        return ids

    async def decode_step(self) -> None:
        """Feed the last sampled token and sample the next one (as prefill_step's config asked)."""
        if self.seq.stopped:
            return
        if self.seq.interrupted:
            self._drop_ahead()
            return self.seq.finish("abort")
        if self.shifts and len(self.kv_ids) + 1 > self.model.ctx:
            await self._shift_context()
        spec = self._req.spec
        if spec is not None and not spec.off:
            verdict = self._auto_off(spec)
            if verdict == "speculate":
                return await self._speculative_step()
            if verdict == "off":         # the rest of the request decodes through the fused path
                spec.off = 1
                self.spec_stats.off += 1
            # "time": this one step decodes fused, timed; the next step judges
        elif self._ahead is not None or self._decodes_ahead():
            return await self._step_ahead()
        await self._fused_step()

    async def _fused_step(self) -> None:
        """One decode step through the fused one-row kernels, timed (auto_off's yardstick)."""
        if self._req.spec is not None:
            # the verify steps sample into their rows' results, not into the model's input id
            self.dev.write(self.model.ids.buf, struct.pack("<I", self._last_token))
        t0 = now()
        res = await self._forward([self._last_token], len(self.kv_ids), decode=True)
        dt = now() - t0
        self._count_decode(dt, 1)
        # auto_off's yardstick, smoothed (a first step may still compile its pipelines)
        self._decode_step_s = dt if self._decode_step_s is None else 0.8 * self._decode_step_s + 0.2 * dt
        self._accept(res)

    def _count_decode(self, dt: float, tokens: int) -> None:
        """A decode step's time and the tokens it gave, in the request's statistics."""
        self._req.decode_s += dt
        self._req.decode_tokens += tokens
        if self._req.breakdown:
            self._req.step_s.append(dt)

    async def _forward(self, ids: list[int], pos0: int, decode: bool = False):
        """Run ids at positions pos0.. through the model (in prefill chunks) and sample from the logits
        of the last one. In decode the input id is already on the GPU (written by the sampler)."""
        m, dev = self.model, self.dev
        if decode:
            batch = dev.batch()
            m.record_decode(batch, pos0)
        else:
            P = m.chunk
            spans = self.vision.spans(len(ids), pos0, P) if self.vision is not None else \
                [(i, min(i + P, len(ids))) for i in range(0, len(ids), P)]
            for i, end in spans:            # chunks of P rows (an image's rows in one)
                part = ids[i:end]
                batch = dev.batch()
                if self.vision is not None:
                    self.vision.stage(pos0 + i, len(part))
                m.record_prefill(batch, part, pos0 + i, with_head=end >= len(ids))
                if end < len(ids):
                    await dev.ready(batch)    # kernels still compiling in the background
                    dev.submit(batch)
                    # a submit while the GPU is busy can block until it drains (lavapipe): wait for
                    # the chunk off the event loop, so other requests and /health go on meanwhile
                    await dev.sync()
        if not decode and pos0 == self.kv_exact:
            self.kv_exact += len(ids)
        self.kv_ids.extend(ids)
        t_lp = 0.0
        if self.logit_processor is not None:
            dev.submit(batch)
            t0 = now()
            await self._process_logits()
            t_lp = now() - t0
            batch = dev.batch()
        if self._req.breakdown:          # kept only when the request asked for the breakdown
            self._req.logit_processor_s.append(t_lp)
        if self.seq.matcher is not None:
            batch = await self._apply_mask(batch)
        self._sample_op.record(batch)
        await dev.ready(batch)
        dev.submit(batch)
        res = await self.sampler.read()   # waits for the step off the event loop
        if self.logit_processor is not None and hasattr(self.logit_processor, "process_sampled_token"):
            self.logit_processor.process_sampled_token(res.token)
        return res

    async def _apply_mask(self, batch):
        """Submit the model's step and compute the grammar's allowed tokens meanwhile (a worker
        thread: llguidance releases the GIL), upload them and start a batch that masks the logits
        (the sampler's op follows in it)."""
        m = self.seq.matcher
        if not IN_BROWSER:
            job = asyncio.ensure_future(asyncio.to_thread(m.mask))
            self.dev.submit(batch)
            bits = await job
        else:
            self.dev.submit(batch)
            bits = m.mask()
        self._mask.write(bits)
        batch = self.dev.batch()
        self._mask_op.record(batch)
        return batch

    async def _process_logits(self) -> None:
        await process_logits(self.dev, self.logit_processor, self.model.logits)

    def _accept(self, res) -> None:
        # with context shifts or a ring the window's end does not end the answer
        self.seq.accept(res.token, res.logprob, res.top, len(self.kv_ids), self.positions)

    # ------------------------------------------------------------------ results
    def take_delta(self) -> str:
        return self.seq.take_delta()

    def get_message(self) -> str:
        return self.seq.get_message()

    def usage(self) -> dict:
        return self.seq.usage()

    def interrupt(self) -> None:
        self.seq.interrupted = True
        if self.scheduler is not None:
            self.scheduler.interrupt()

    def sequence(self):
        """The object a request generates through: this pipeline (one request at a time), or with
        continuous batching a new sequence of the scheduler (same request-level methods)."""
        return self if self.scheduler is None else self.scheduler.sequence()

    def close(self) -> None:
        """The request is done with its sequence (one-request mode: nothing to do)."""

    def reset_chat(self, keep_stats: bool = False) -> None:
        self._drop_ahead()
        self.kv_ids, self.kv_exact = [], 0
        if not keep_stats:
            self.stats = CumulativeStats()
        self._new_request_state()
        self.seq.stopped = True

    def runtime_stats_text(self) -> str:
        return self.stats.text()

    async def forward_tokens_and_sample(self, ids, is_prefill: bool, gen: GenerationConfig) -> int:
        async with self._solo:      # with batching the engine admits several requests at once
            return await self._forward_tokens_and_sample(ids, is_prefill, gen)

    async def _forward_tokens_and_sample(self, ids, is_prefill: bool, gen: GenerationConfig) -> int:
        """Low-level (WebLLM's forwardTokensAndSample): append `ids` to the KV cache, run them and
        sample one token (nothing is detokenized). As in WebLLM `is_prefill` only says which
        statistics the time counts towards (prefill: every id; decode: one token); it never clears
        the cache (`reset_chat` does)."""
        self._drop_ahead()
        ids = [int(i) for i in ids]
        if not ids:
            raise InvalidRequestError("input_ids is empty.", param="input_ids")
        if len(self.kv_ids) + len(ids) > self.cache_end:
            raise ContextWindowTooLargeError(
                f"{len(self.kv_ids) + len(ids)} tokens exceed the context window of {self.model.ctx}.")
        rows = self.model.cfg.vocab_size
        bad = next((i for i in ids if not 0 <= i < rows), None)
        if bad is not None:
            raise InvalidRequestError(f"input id {bad} is outside the model's vocabulary (0..{rows - 1}).",
                                      param="input_ids")
        self._configure_sampler(gen, self.kv_ids + ids)
        self.seq.matcher = None                  # the low-level path samples unconstrained
        t0 = now()
        res = await self._forward(ids, len(self.kv_ids))
        r = RequestStats()
        if is_prefill:
            r.prefill_tokens, r.prefill_s = len(ids), now() - t0
        else:
            r.decode_tokens, r.decode_s = 1, now() - t0
        self.stats.add(r)
        self.seq.last_token = res.token
        return res.token

    def dispose(self) -> None:
        """Free every GPU buffer of the model (weights, KV cache, activations, sampler)."""
        self._drop_ahead()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.draft is not None:
            self.draft.dispose()
            self.draft = None
        self.model.release()
        self.sampler.release()
        if self._mask is not None:
            self._mask.release()
        for mk, _ in self._row_masks:
            mk.release()
        self._row_masks = []
        self.dev.release_owner(self.owner)
        self.kv_ids = []
