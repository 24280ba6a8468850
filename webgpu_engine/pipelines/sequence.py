"""One generation's state in the batch scheduler (scheduler.py; the pipeline's own request-level
methods, llm.py, drive one such sequence): the streamed text and its stop strings, the output ids, logprob entries, the stop
rules (EOS unless ignore_eos, stop strings, a finished grammar, max_tokens, a full context window,
an interrupt) and the request's statistics. Page code: standard library only.
"""
from __future__ import annotations

import struct
from array import array

from ..config import GenerationConfig
from .detokenizer import StreamDetokenizer, safe_token_bytes
from .stats import CumulativeStats, RequestStats, now


def configure_sampler(sampler, gen: GenerationConfig, seen_ids) -> None:
    """A GPU sampler (kernels/sampling.py) set for one request: its sampling settings, seed, and
    the prompt as the penalties' history."""
    sampler.configure(gen.sampling())
    sampler.reset_history(seen_ids)


async def process_logits(dev, proc, lg) -> None:
    """Run a WebLLM logit processor over the logits row `lg` (f32 or f16) on the host, in place: a
    readback, process_logits(list[float]) -> list[float], a write."""
    raw = await dev.read(lg.buf, lg.offset, lg.nbytes)
    vals = array("f", raw) if lg.dtype == "f32" else array("f", struct.unpack(f"<{lg.numel}e", raw))
    out = array("f", [float(v) for v in proc.process_logits(list(vals))])
    dev.write(lg.buf, out.tobytes() if lg.dtype == "f32" else struct.pack(f"<{len(out)}e", *out), lg.offset)


class Sequence:
    """What one choice of a request has produced so far and whether it is done."""

    def __init__(self, tokenizer, eos_ids: set, stop_str: list, stats: CumulativeStats,
                 gen: GenerationConfig | None = None, req: RequestStats | None = None, raw: bool = False):
        self.tokenizer, self.eos_ids, self.stats = tokenizer, eos_ids, stats
        # a raw completion continues its prompt: it keeps a SentencePiece word-boundary space in
        # front of its first token (a chat reply drops it, as the tokenizer's decode does)
        self.detok = StreamDetokenizer(tokenizer.token_bytes, list(stop_str) + list(gen.stop if gen else []),
                                       strip_leading_space=False if raw else None)
        self.output_ids: list[int] = []
        self.token_logprobs: list[dict] = []
        self.stopped, self.finish_reason = False, None
        self.interrupted = False
        self.last_token: int | None = None
        self.max_tokens = gen.max_tokens if gen else None
        self.ignore_eos = bool(gen.ignore_eos) if gen else False
        self.want_logprobs = bool(gen.logprobs or gen.top_logprobs) if gen else False
        self.req = req if req is not None else RequestStats()
        self.matcher = None
        if gen is not None and gen.grammar is not None:
            t0 = now()
            self.matcher = gen.grammar.matcher()
            self.req.grammar = True
            self.req.grammar_init_s = gen.grammar_init_s + (now() - t0)

    def accept(self, tok: int, logprob: float, top, kv_len: int, ctx: int) -> None:
        """Take the sampled token and apply the stop rules; kv_len: tokens in the KV cache now."""
        self.last_token = tok
        m = self.matcher
        # under a grammar, an end token is only allowed where the grammar is complete: it ends the answer.
        # The end token counts in usage (as vLLM counts it) but has no logprob entry: the content
        # holds no text of it, and OpenAI never lists it.
        if tok in self.eos_ids and (not self.ignore_eos or m is not None):
            self.output_ids.append(tok)
            return self.finish("stop")
        if self.want_logprobs:
            self.token_logprobs.append(self.logprob_entry(tok, logprob, top))
        self.output_ids.append(tok)
        if m is not None and not m.consume(tok):
            raise RuntimeError(f"the sampler gave token {tok}, which the grammar does not allow: {m.error}")
        if self.detok.add(tok):
            return self.finish("stop")
        if m is not None and m.stopped:          # the grammar allows nothing more
            return self.finish("stop")
        if self.max_tokens is not None and len(self.output_ids) >= self.max_tokens:
            return self.finish("length")
        if kv_len >= ctx:                        # no room to feed this token back
            return self.finish("length")

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the answer (None: another rule did, or none yet)."""
        return self.detok.stop_str

    def finish(self, reason: str) -> None:
        if self.stopped:
            return
        self.stopped, self.finish_reason = True, reason
        if self.matcher is not None:
            self.req.grammar_mask_s, self.req.grammar_steps = self.matcher.mask_s, self.matcher.steps
            self.matcher = None
        self.detok.flush()         # the last delta stays for take_delta
        self.req.t_end = now()
        self.stats.add(self.req)

    def logprob_entry(self, tok: int, lp: float, top) -> dict:
        token_bytes = safe_token_bytes(self.tokenizer.token_bytes)

        def ent(t, v):
            b = token_bytes(t)
            return {"token": b.decode("utf-8", "replace"), "logprob": float(v), "bytes": list(b)}
        e = ent(tok, lp)
        e["top_logprobs"] = [ent(t, v) for t, v in top]
        return e

    # ------------------------------------------------------------------ results
    def take_delta(self) -> str:
        return self.detok.take_delta()

    def get_message(self) -> str:
        return self.detok.text

    def usage(self) -> dict:
        r = self.req
        n = len(self.output_ids)
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": n,
                "total_tokens": r.prompt_tokens + n, "extra": r.extra()}
