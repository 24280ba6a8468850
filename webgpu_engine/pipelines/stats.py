"""Timing statistics of the LLM pipeline: per request (usage extra) and cumulative (runtime_stats_text)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


def now() -> float:
    return time.perf_counter()


@dataclass
class RequestStats:
    """One request: prefill of `prompt_tokens` (the part actually computed: `prefill_tokens`),
    then `decode_tokens` decode steps."""

    t_start: float = 0.0
    prompt_tokens: int = 0
    prefill_tokens: int = 0          # prompt tokens computed (the rest came from the reused KV cache)
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    t_first_token: float | None = None
    t_end: float | None = None
    breakdown: bool = False          # enable_latency_breakdown: keep the per-step times below
    step_s: list = field(default_factory=list)             # each forward + sample (prefill first)
    logit_processor_s: list = field(default_factory=list)  # host logit-processor round trip per step
    grammar: bool = False            # a constrained request: report the grammar times below
    grammar_init_s: float = 0.0      # compiling (or copying the cached) grammar for this request
    grammar_mask_s: float = 0.0      # computing the allowed-token masks, summed over the steps
    grammar_steps: int = 0
    spec: object = None              # speculative decoding's figures (speculation.SpeculationStats)
    truncated_messages: int = 0      # context_overflow "truncate": messages dropped to fit the window
    context_shifts: int = 0          # context_overflow "shift": shifts during the generation

    def extra(self) -> dict:
        end = self.t_end if self.t_end is not None else now()
        ttft = (self.t_first_token - self.t_start) if self.t_first_token is not None else 0.0
        return {
            "e2e_latency_s": end - self.t_start,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0,
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "time_to_first_token_s": ttft,
            "time_per_output_token_s": self.decode_s / self.decode_tokens if self.decode_tokens else 0.0,
            **({"latency_breakdown": self.latency_breakdown()} if self.breakdown else {}),
            **(self.spec.extra() if self.spec is not None else {}),
            **({"truncated_messages": self.truncated_messages} if self.truncated_messages else {}),
            **({"context_shifts": self.context_shifts} if self.context_shifts else {}),
            **({"grammar_init_s": self.grammar_init_s,
                "grammar_per_token_s": self.grammar_mask_s / self.grammar_steps if self.grammar_steps
                else 0.0} if self.grammar else {}),
        }

    def latency_breakdown(self) -> dict:
        """WebLLM's latencyBreakdown (seconds per step) for what runs on the host: penalties,
        logit_bias, sampling and the forward run in one GPU submission per step, so their time is
        part of `total_time` (what the step cost from recording to the token on the host)."""
        return {"total_time": list(self.step_s), "logit_processor_time": list(self.logit_processor_s)}


@dataclass
class CumulativeStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def add(self, r: RequestStats) -> None:
        self.prefill_tokens += r.prefill_tokens
        self.prefill_s += r.prefill_s
        self.decode_tokens += r.decode_tokens
        self.decode_s += r.decode_s

    def text(self) -> str:
        """WebLLM's runtimeStatsText format."""
        pf = self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0
        dc = self.decode_tokens / self.decode_s if self.decode_s else 0.0
        return f"prefill: {pf:.1f} tokens/sec, decoding: {dc:.1f} tokens/sec"
