"""LLMChatPipeline: a loaded Llama-family chat model — its load (plan, weights, tuning, warm-up),
prompts, the conversation and stats (modelled on WebLLM's llm_chat.ts). Every generation decodes
through the batch scheduler (scheduler.py) over the paged KV pool, the one decode loop: each choice of
a request is a `sequence()`, and the pipeline's own request-level methods (prefill_step, decode_step,
take_delta, get_message, usage, forward_tokens_and_sample: WebLLM's stateful chat) drive one such
sequence, a follow-up turn reusing the conversation's prefix from the pool's cached blocks.

A generation: `prefill_step(messages | prompt)` computes the prompt (only the tokens after the
longest cached prefix) and samples the first token; `decode_step` feeds the last token and samples
the next, until EOS (unless ignore_eos), a stop string, max_tokens ("length"), a full context window
("length") or `interrupt()` ("abort"); with a grammar (`gen.grammar`, see grammar.py) the logits
are masked each step and it stops ("stop") when the grammar is complete. Page code: standard
library only.
"""
from __future__ import annotations

import asyncio
import itertools
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
    UnsupportedChatOptionError,
)
from ..gpu import Device
from ..kernels import matmul as mm, tune
from ..kernels.common import pipeline_keys, warm_up
from ..kernels.logit_mask import LogitMask
from ..models.plan import DecoderPlan, plan_decoder
from ..models.registry import LLM, open_model
from .grammar import GrammarCompiler
from .prompt import checked_ids, longest_token_bytes, prompt_ids, template_kwargs
from .sequence import Sequence
from .speculation import Speculation, SpeculationStats, same_vocabulary
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
    """Time the model's matmul shapes the adapter's profile lacks (kernels/tune.py). The scheduler's
    op lists are built after it (on first use or by _compile), so they take the choices made."""
    mode, budget_s = tuning
    await tune.tune_at_load(dev, model, LLM, dtype, mode=mode, budget_s=budget_s, progress=progress, name=name)


class LLMChatPipeline:
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
                 owner: str, plan: DecoderPlan | None = None, batch: bool = True):
        """`batch` False: no scheduler (a draft model, whose guesses batch_draft.py makes over a
        paged cache of its own)."""
        self.dev, self.model, self.tokenizer, self.template = dev, model, tokenizer, template
        self.model_config, self.chat_config, self.owner = model.cfg, chat_config, owner
        cfg = model.cfg
        # Checkpoints often pad the embedding / LM-head rows past the tokenizer (Qwen2.5: 151936
        # rows for 151665 tokens): the samplers read only the ids the tokenizer can decode, so a
        # padding id is never sampled (as if its logit were -inf) and logprobs are over real tokens.
        self.vocab_size = _valid_vocab(cfg.vocab_size, tokenizer)
        eos = set(cfg.eos_ids) | set(getattr(tokenizer, "eos_ids", None) or [])
        self.eos_ids = eos | set(chat_config.stop_token_ids)
        self.logit_processor = None
        # constrained decoding: grammars compiled per model (cached); the masks are the slots'
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_ids)
        self._longest_token: int | None = None
        self.stats = CumulativeStats()
        self.seq = self.new_sequence()            # the last finished answer (get_message)
        self.seq.stopped = True
        self._turn = None                         # the pipeline-level request (prefill_step ...): a BatchSequence
        self._last_kv: list[int] = []             # the last finished sequence's cached tokens
        self._solo = asyncio.Lock()
        self.speculation = Speculation.parse(chat_config.speculation)
        if self.speculation is not None:
            self.speculation = self.speculation.with_k(model.verify_rows_per_pass)
        if chat_config.context_overflow not in OVERFLOW_POLICIES:
            raise ChatOptionTypeError("context_overflow", f"one of {list(OVERFLOW_POLICIES)}",
                                      chat_config.context_overflow)
        self.spec_stats = SpeculationStats()            # since load
        self._software = mm.is_software_adapter(dev)    # a CPU "GPU": decode_ahead off by default, and
        #                                                 its submits may block while it is busy
        self.draft: LLMChatPipeline | None = None      # speculation "draft": the draft model's pipeline
        self.plan = plan or model.plan
        self.shifts = chat_config.context_overflow == "shift"
        # the positions a sequence's cache holds at once (a sliding window's ring: any), and those a
        # generation may reach (context shifts go on past the cache's end)
        self.cache_end = sys.maxsize if model.ring else model.ctx
        self.positions = sys.maxsize if self.shifts else self.cache_end
        self.lora = None            # models/lora.py LoraPool, made for the first adapter (engine/lora.py)
        self.scheduler = None
        if batch:                   # the decode loop: continuous batching over the paged KV pool
            if self.plan.contiguous:
                raise ValueError("a chat pipeline needs a plan with a paged KV pool (models/plan.py plan_decoder)")
            from .scheduler import Scheduler
            self.scheduler = Scheduler(self, self.plan)

    # ------------------------------------------------------------------ loading
    @classmethod
    async def load(cls, dev: Device, path, chat_config: ChatConfig | None = None, progress=None,
                   model_id: str | None = None, batch: bool = True) -> "LLMChatPipeline":
        chat_config = chat_config or ChatConfig()
        path = Path(path)
        owner = f"model:{model_id}" if model_id else f"model:llm{next(_ids)}"
        if dev.allocated_bytes(owner):   # the id loaded on this device by another engine: not its buffers
            owner = f"{owner}#{next(_ids)}"
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
                                       tuning, tunes, progress, model_id, batch)
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
                    progress, model_id, batch) -> "LLMChatPipeline":
        dtype = plan.dtype
        try:
            # uploads fill the first 90% of this load's progress when kernel tuning may follow
            model = m.arch.model_class()(dev, cfg, m.weights, owner=owner, plan=plan,
                                         progress=_scaled(progress, 0.0, 0.9) if tunes else progress)
            if tunes:
                await _tune(dev, model, dtype, tuning, _scaled(progress, 0.9, 1.0), model_id or path.name)
            pipe = cls(dev, model, tokenizer, template, chat_config, owner, plan, batch=batch)
            pipe._load_vision(path)
            if pipe.speculation is not None and pipe.speculation.method == "draft":
                pipe.draft = await pipe._load_draft(progress, model_id)
                # it guesses for every sequence of a batch at once
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

    async def _load_draft(self, progress, model_id: str | None) -> "LLMChatPipeline":
        """speculation "draft": load the draft model (a local path: the engine resolves references)
        beside this one, with this model's context window, and check that it shares the vocabulary.
        It has no scheduler: batch_draft.py guesses with it over a paged cache of its own."""
        spec, cc = self.speculation, self.chat_config
        if progress:
            progress(1.0, f"loading the draft model {spec.model}")
        dcc = ChatConfig(context_window_size=self.model.ctx, max_num_sequences=1, dtype=cc.dtype,
                         compile_at_load=False, prefill_chunk_size=cc.prefill_chunk_size)
        draft = await type(self).load(self.dev, spec.model, dcc, model_id=f"{model_id}.draft" if model_id else None,
                                      batch=False)
        if not same_vocabulary(self.tokenizer, draft.tokenizer):
            draft.dispose()
            raise UnsupportedChatOptionError("speculation", spec.describe(), (
                f"the draft model's vocabulary ({draft.tokenizer.vocab_size} tokens) differs from this "
                f"model's ({self.tokenizer.vocab_size}): a draft model must share the tokenizer"))
        return draft

    async def _compile(self, background: bool = False) -> None:
        """Create and run once every pipeline a request uses: the scheduler's op lists (decode of
        1 .. max rows, prefill of the model's warm-up heights; inputs all zero: idle rows, KV rows of
        block 0) and a slot's sampler and grammar mask; `background`: build every op list, whose
        pipelines queue on the background compiler, and run nothing."""
        sched = self.scheduler
        if sched is None:
            return
        if background:
            for kind, T in sched.compile_ops():
                sched.fwd.ops(kind, T)
            for kind, T in sched.compile_ops():     # kernels made at a first record: queued last
                for op in sched.fwd.ops(kind, T):
                    op.finish()
            return
        paged = [sched.fwd.ops(kind, T) for kind, T in sched.compile_ops()]
        slot = sched.slots[0]
        if slot.mask is None:           # the grammar mask's kernel too (its buffer is 4 B per 32 ids)
            slot.mask = LogitMask(self.dev, self.vocab_size, owner=self.owner)
            slot.mask_op = slot.mask.op(slot.logits)
        samplers = [slot.mask_op, slot.op.greedy, slot.op.full]

        def record(batch, warmed):
            keys, seen = set(), set(warmed)
            for op in (op for ops in paged for op in ops):
                k = pipeline_keys([op])
                if not k <= seen:
                    op.record(batch)
                    seen |= k
                keys |= k
            skeys = pipeline_keys(samplers)
            if not skeys <= warmed:
                slot.sampler.configure(GREEDY)
                for op in samplers:
                    op.record(batch)
            return keys | skeys
        await warm_up(self.dev, record)

    def finished(self, seq: Sequence, tokens: list[int]) -> None:
        """A sequence has finished: get_message() gives its answer (the last finished), kv_ids its
        cached tokens."""
        self.seq, self._last_kv = seq, list(tokens)

    def set_logit_processor(self, proc) -> None:
        """A WebLLM-style processor: process_logits(list[float]) -> list[float] (host round trip
        per step), optional process_sampled_token(id) and reset_state()."""
        self.logit_processor = proc

    # ------------------------------------------------------------------ request state
    def new_sequence(self, gen: GenerationConfig | None = None, req: RequestStats | None = None,
                     raw: bool = False, stats: CumulativeStats | None = None) -> Sequence:
        """A generation's state (stop rules, streamed text, stats) for this model; raw: it continues
        a completion prompt (not a chat reply); stats: where its figures go (default the model's)."""
        return Sequence(self.tokenizer, self.eos_ids, self.chat_config.stop_str,
                        self.stats if stats is None else stats, gen, req, raw)

    def _current(self) -> Sequence:
        """The pipeline-level request's sequence while it runs, else the last finished one."""
        t = self._turn
        return t.seq if t is not None and t.seq is not None and not t.seq.stopped else self.seq

    # the pipeline-level request's state (else the last finished answer's), as the engine and tests read it
    output_ids = property(lambda self: self._current().output_ids)
    token_logprobs = property(lambda self: self._current().token_logprobs)
    stopped = property(lambda self: self._current().stopped)
    finish_reason = property(lambda self: self._current().finish_reason)
    stop_str = property(lambda self: self._current().stop_str)
    _req = property(lambda self: self._current().req)         # its statistics (RequestStats)

    @property
    def kv_ids(self) -> list[int]:
        """The conversation's tokens whose K/V the pool holds (the prompt and the answer's tokens fed
        back) of the pipeline-level request while it runs, else of the last finished sequence: what
        forward_tokens_and_sample appends to (WebLLM's one conversation per model)."""
        t = self._turn
        return t.tokens() if t is not None and t.seq is not None and not t.seq.stopped else list(self._last_kv)

    def _max_token_chars(self) -> int:
        """Bytes of the longest token (prompt.py's check of a prompt's length), worked out once."""
        if self._longest_token is None:
            self._longest_token = longest_token_bytes(self.tokenizer, self.vocab_size)
        return self._longest_token

    def prompt_ids(self, messages, prompt, template_kwargs=None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids (prompt.py): a raw completion prompt as it is, or the chat template over
        `messages`; `template_kwargs` go to the template's render (e.g. enable_thinking)."""
        return prompt_ids(self.tokenizer, self.template, self.chat_config.system_message, messages, prompt,
                          template_kwargs, add_generation_prompt)

    template_kwargs = staticmethod(template_kwargs)       # what a request passes to the template (prompt.py)

    async def prompt_tokens(self, messages: list[dict] | None, gen: GenerationConfig,
                            prompt: str | None = None, req: RequestStats | None = None) -> list[int]:
        """The request's prompt ids, checked against the context window (typed errors); with
        context_overflow "truncate" the oldest turns are dropped to fit (counted in `req`). prompt.py says how."""
        truncate = self.chat_config.context_overflow in ("truncate", "shift") and self.model.ring is None
        ids, dropped = await checked_ids(self.prompt_ids, messages, prompt, self.template_kwargs(gen),
                                         window=self.cache_end, ctx=self.model.ctx, truncate=truncate,
                                         token_bytes=self._max_token_chars)   # a ring's window: any prompt
        if dropped is not None and req is not None:
            req.truncated_messages = dropped
        return ids

    # ------------------------------------------------------------------ the pipeline-level request
    # WebLLM's stateful chat: one request at a time through one sequence of the scheduler; a follow-up
    # turn reuses the conversation's prefix from the pool's cached blocks.
    def _new_turn(self):
        if self._turn is not None:
            self._turn.close()
        self._turn = self.scheduler.sequence()
        return self._turn

    async def prefill_step(self, messages: list[dict] | None, gen: GenerationConfig,
                           prompt: str | None = None) -> None:
        """Compute the prompt (reusing the cached prefix of the conversation) and sample the first token."""
        await self._new_turn().prefill_step(messages, gen, prompt)

    async def decode_step(self) -> None:
        """Feed the last sampled token and sample the next one (as prefill_step's config asked)."""
        if self._turn is not None:
            await self._turn.decode_step()

    def take_delta(self) -> str:
        return self._current().take_delta()

    def get_message(self) -> str:
        return self._current().get_message()

    def usage(self) -> dict:
        return self._current().usage()

    def interrupt(self) -> None:
        """Stop every generation of the model."""
        if self.scheduler is not None:
            self.scheduler.interrupt()

    def sequence(self):
        """A new sequence of the scheduler: what one choice of a request generates through."""
        return self.scheduler.sequence()

    def close(self) -> None:
        """The pipeline-level request is done: its sequence leaves the batch."""
        if self._turn is not None:
            self._turn.close()

    def reset_chat(self, keep_stats: bool = False) -> None:
        """Forget the conversation (the pool's cached blocks no running sequence holds go too: the
        next prompt is computed from a cold cache, as WebLLM's resetChat clears its KV cache) and,
        unless keep_stats, the statistics."""
        if self._turn is not None:
            self._turn.close()
            self._turn = None
        if self.scheduler is not None:
            self.scheduler.pool.drop_cached()
        if not keep_stats:
            self.stats = CumulativeStats()
        self._last_kv = []
        self.seq = self.new_sequence()
        self.seq.stopped = True

    def runtime_stats_text(self) -> str:
        return self.stats.text()

    async def forward_tokens_and_sample(self, ids, is_prefill: bool, gen: GenerationConfig) -> int:
        """Low-level (WebLLM's forwardTokensAndSample): append `ids` to the conversation's KV, run
        them and sample one token (nothing is detokenized, no grammar): a sequence of the scheduler
        whose prompt is the conversation so far plus `ids`, one token long (its cached blocks make it
        an append). As in WebLLM `is_prefill` only says which statistics the time counts towards
        (prefill: every id; decode: one token); it never clears the conversation (`reset_chat` does)."""
        ids = [int(i) for i in ids]
        if not ids:
            raise InvalidRequestError("input_ids is empty.", param="input_ids")
        rows = self.model.cfg.vocab_size
        bad = next((i for i in ids if not 0 <= i < rows), None)
        if bad is not None:
            raise InvalidRequestError(f"input id {bad} is outside the model's vocabulary (0..{rows - 1}).",
                                      param="input_ids")
        async with self._solo:      # with batching the engine admits several requests at once
            context = self.kv_ids + ids
            if len(context) > self.cache_end:
                raise ContextWindowTooLargeError(
                    f"{len(context)} tokens exceed the context window of {self.model.ctx}.")
            t0, turn = now(), self._new_turn()
            # the sequence's own figures go nowhere: the call counts as WebLLM counts it, below
            await turn.prefill_ids(context, replace(gen, max_tokens=1, grammar=None, stop=[]), raw=True,
                                   stats=CumulativeStats())
            r = RequestStats()
            if is_prefill:
                r.prefill_tokens, r.prefill_s = len(ids), now() - t0
            else:
                r.decode_tokens, r.decode_s = 1, now() - t0
            self.stats.add(r)
            return turn.seq.last_token

    def dispose(self) -> None:
        """Free every GPU buffer of the model (weights, KV pool, activations, samplers)."""
        if self.scheduler is not None:
            self.scheduler.close()
        if self.draft is not None:
            self.draft.dispose()
            self.draft = None
        self.model.release()
        self.dev.release_owner(self.owner)
        self._turn = None
