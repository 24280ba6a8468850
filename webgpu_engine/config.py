"""Configuration types shared by pipelines and the engine (plain dataclasses: they run in Pyodide too).

`ModelRecord` says what to load, `ChatConfig` how to run it (per load), `GenerationConfig` how to
sample one request — the same split as WebLLM's config.ts. `SamplingParams` is the part of a
GenerationConfig the GPU sampler (kernels/sampling.py) takes, built once per request.
`SAMPLING_FIELDS` declares each sampling setting once, with its name in every API and file format
this engine reads (OpenAI, WebLLM, Ollama, MLC's chat config) and the ChatConfig field of its model
default: the protocol rules, Ollama's options and params layers, the MLC loader and the request path
read their names from it.
"""
from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import ChatOptionTypeError, UnknownChatOptionError


@dataclass(frozen=True)
class SamplingField:
    """One sampling setting, declared once, as each place names it (None: that place has none).

    name: GenerationConfig's field (a request's setting); openai: the OpenAI / vLLM request field;
    webllm: WebLLM's GenerationConfig / ChatOptions field; ollama: Ollama's `options` key, which is
    also its Modelfile PARAMETER and params-layer key; mlc: the mlc-chat-config.json key;
    chat_config: the ChatConfig field holding a model's default (its file's, its record's or the
    load's chat options), which a request's value overrides (stop strings: adds to)."""

    name: str
    openai: str | None
    webllm: str | None
    ollama: str | None
    mlc: str | None
    chat_config: str | None


SAMPLING_FIELDS = (
    SamplingField("temperature", "temperature", "temperature", "temperature", "temperature", "temperature"),
    SamplingField("top_p", "top_p", "top_p", "top_p", "top_p", "top_p"),
    SamplingField("top_k", "top_k", None, "top_k", None, None),
    SamplingField("min_p", "min_p", None, "min_p", None, None),
    SamplingField("frequency_penalty", "frequency_penalty", "frequency_penalty", "frequency_penalty",
                  "frequency_penalty", "frequency_penalty"),
    SamplingField("presence_penalty", "presence_penalty", "presence_penalty", "presence_penalty",
                  "presence_penalty", "presence_penalty"),
    SamplingField("repetition_penalty", "repetition_penalty", "repetition_penalty", "repeat_penalty",
                  "repetition_penalty", "repetition_penalty"),
    SamplingField("stop", "stop", "stop", "stop", None, "stop_str"),   # MLC: conv_template.stop_str
    SamplingField("max_tokens", "max_tokens", "max_tokens", "num_predict", None, None),
    SamplingField("seed", "seed", "seed", "seed", None, None),
    SamplingField("logit_bias", "logit_bias", "logit_bias", None, None, None),
    SamplingField("logprobs", "logprobs", "logprobs", None, None, None),
    SamplingField("top_logprobs", "top_logprobs", "top_logprobs", None, None, None),
    SamplingField("ignore_eos", "ignore_eos", "ignore_eos", None, None, None),
    SamplingField("n", "n", "n", None, None, None),
)
SAMPLING_BY_NAME = {f.name: f for f in SAMPLING_FIELDS}
# the settings a model's chat config gives a default for (ChatConfig field: request field)
MODEL_DEFAULTS = {f.chat_config: f.name for f in SAMPLING_FIELDS if f.chat_config}


@dataclass(frozen=True)
class SamplingParams:
    """One request's settings of the GPU sampler (kernels/sampling.py `Sampler.configure`), built
    once from a validated GenerationConfig (`GenerationConfig.sampling()`). Field names are the
    GenerationConfig's and the request's (top_k and min_p as vLLM names them). temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0: off
    min_p: float = 0.0                 # 0: off; keeps tokens with p >= min_p * the best token's p
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added logit
    logprobs: bool = False
    top_logprobs: int = 0              # best alternatives reported per token (sampling(): 0 without logprobs)
    seed: int | None = None            # None: a random stream

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)


@dataclass
class GenerationConfig:
    """Per-request sampling settings (OpenAI / WebLLM field names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0: off
    min_p: float = 0.0                 # 0: off
    max_tokens: int | None = None      # None: until EOS or the context window is full
    stop: list[str] = field(default_factory=list)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    enable_thinking: bool | None = None    # passed to the chat template (None: the template's default)
    reasoning_effort: str | None = None    # passed to the chat template (gpt-oss: low / medium / high)
    continue_final_message: bool = False   # the answer continues the final (assistant) message
    latency_breakdown: bool = False        # usage.extra.latency_breakdown: per-step times
    grammar: Any = None                    # a compiled grammar (pipelines.grammar.Grammar): constrained
    grammar_init_s: float = 0.0            # time the request spent compiling it (0 when cached)
    tools: list | None = None              # function definitions for the chat template

    def merged(self, **overrides: Any) -> "GenerationConfig":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling(self) -> SamplingParams:
        """The sampler's part of this config (top_logprobs only with logprobs)."""
        params = {f.name: getattr(self, f.name) for f in fields(SamplingParams)}
        if not self.logprobs:
            params["top_logprobs"] = 0
        return SamplingParams(**params)


@dataclass
class ChatConfig:
    """Per-load settings, merged as: file config ← record overrides ← chat_opts."""

    context_window_size: int = 4096
    prefill_chunk_size: int = 256
    sliding_window_size: int = -1
    attention_sink_size: int = 0
    dtype: str = "auto"                # "auto" | "f32" | "f16": activation precision
    kv_cache_dtype: str = "auto"       # chat: the KV cache's precision: "auto" (the activations'), "f16",
    #                                    "f32", "q8_0" (llama.cpp's 8-bit blocks: about half of f16's
    #                                    bytes), "q4_0" (its 4-bit blocks: about 0.28x; kernels/kv_quant.py)
    temperature: float = 0.7
    top_p: float = 0.95
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_str: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    system_message: str | None = None
    max_batch_size: int = 32           # embeddings: sequences per forward pass
    max_seq_length: int | None = None  # embeddings: truncation length (None: the model's)
    matryoshka: bool | None = None     # embeddings: may `dimensions` truncate the vectors? (None: as
    #                                    the model card says; a record's overrides may set it)
    max_num_sequences: int = 1         # chat: sequences decoded together (continuous batching,
    #                                    pipelines/scheduler.py); 1: one request at a time, as WebLLM;
    #                                    0: as suits the device (on a CPU adapter the width measured
    #                                    there, models/plan.py auto_width: 4; 16 on a GPU)
    kv_block_size: int = 16            # chat with max_num_sequences > 1: tokens per KV-cache block
    kv_pool_tokens: int = 0            # ... and tokens the KV pool holds (0: max_num_sequences contexts,
    #                                    at most max(2 contexts, 8192); at least one full context)
    compile_at_load: bool = True       # create and run every pipeline once while loading, so the
    #                                    first request compiles nothing; False: a faster load, the
    #                                    first requests compile what they use
    compile_in_background: bool = True  # with compile_at_load, where the backend can (native): the
    #                                    load returns once the weights are up and the kernels compile
    #                                    on worker threads, in the order a first request uses them; a
    #                                    request compiles in place only what no worker has reached
    tune_kernels: str | None = None    # time this model's matmul shapes that the adapter's kernel
    #                                    profile lacks before building its kernels (kernels/tune.py):
    #                                    "auto" (GPU adapters, not software ones), "on", "off";
    #                                    None: $WEBGPU_ENGINE_TUNE, else "auto"
    context_overflow: str = "error"    # chat: a prompt longer than the context window: "error" (a 400
    #                                    naming the limit) or "truncate" (the oldest turns after the
    #                                    system prompt dropped until it fits; usage.extra says how many);
    #                                    "shift": as truncate, and a generation reaching the window goes
    #                                    on: the tokens after the first n_keep lose their older half
    #                                    (llama.cpp's context shift, per sequence)
    n_keep: int = 0                    # ... tokens a context shift always keeps (the prompt's start)
    speculation: dict | str | None = None  # chat: speculative decoding, {"method": "ngram", "k": 3,
    #                                    "n": 8} or "ngram" (k: automatic; pipelines/speculation.py);
    #                                    per sequence of the batch
    mmproj: str | None = None          # chat, a GGUF model: its multimodal projector GGUF (llama.cpp's
    #                                    --mmproj: the vision tower and projector; vision/mmproj.py)
    tune_budget_s: float | None = None  # ... for about this many seconds (None: $WEBGPU_ENGINE_TUNE_BUDGET,
    #                                     else 20); shapes left untimed are timed by a later load
    decode_ahead: bool | None = None   # chat (the batch scheduler, one slot or many): submit decode step
    #                                    n + 1 before reading step n's token (already on the GPU), so the host's
    #                                    recording overlaps the GPU's work; the same tokens either way.
    #                                    None: on, except on software adapters (lavapipe: host and
    #                                    "GPU" share the cores; measured no faster there)
    reuse_decoded_kv: bool = False     # chat: a conversation that goes on reuses the KV rows its answers'
    #                                    decode steps wrote, not only those a prefill wrote (a faster next
    #                                    turn: SmolLM2 on lavapipe, after a 128-token answer, 0.3 s to the
    #                                    first token instead of 1.0 s); the decode kernels round otherwise
    #                                    than the prefill's, so an answer may then depend on the cache's
    #                                    history in the last bits of a logit (False: warm equals cold)

    def updated(self, opts: dict | None) -> "ChatConfig":
        """A copy with `opts` (chat_opts, a record's overrides) applied. Each value is checked against
        its field's type (an int is accepted for a float field, never a bool for a number) and
        UnknownChatOptionError / ChatOptionTypeError (400) name the field."""
        if not opts:
            return self
        hints = _chat_config_types()
        unknown = sorted(set(opts) - set(hints))
        if unknown:
            raise UnknownChatOptionError(unknown, sorted(hints))
        return replace(self, **{k: _checked(k, hints[k], v) for k, v in opts.items()})


# --------------------------------------------------------------------------- chat_opts value checks
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean (true or false)",
               dict: "an object"}


@functools.lru_cache(maxsize=None)
def _chat_config_types() -> dict:
    return typing.get_type_hints(ChatConfig)


def _expected(hint) -> str:
    """How the error message names a field's type: "a number", "a list of strings or null", ..."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        names = ["null" if a is type(None) else _expected(a) for a in args]
        return ", ".join(names[:-1]) + " or " + names[-1]
    if typing.get_origin(hint) is list:
        return "a list of " + _expected(args[0]).split(" ", 1)[1] + "s"
    return _TYPE_NAMES[hint]


def _checked(name: str, hint, value):
    """`value` as field `name` of type `hint` holds it (ints become floats for float fields, tuples
    lists), or ChatOptionTypeError."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in typing.get_args(hint):
            return None
        for arm in typing.get_args(hint):
            if arm is not type(None):
                try:
                    return _checked(name, arm, value)
                except ChatOptionTypeError:
                    pass
        raise ChatOptionTypeError(name, _expected(hint), value)
    if typing.get_origin(hint) is list:
        if not isinstance(value, (list, tuple)):
            raise ChatOptionTypeError(name, _expected(hint), value)
        (item,) = typing.get_args(hint)
        try:
            return [_checked(name, item, v) for v in value]
        except ChatOptionTypeError:
            raise ChatOptionTypeError(name, _expected(hint), value) from None
    ok = (isinstance(value, bool) if hint is bool else
          isinstance(value, int) and not isinstance(value, bool) if hint is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          if hint is float else isinstance(value, hint))
    if not ok:
        raise ChatOptionTypeError(name, _expected(hint) if hint is not float else "a finite number", value)
    return float(value) if hint is float else value
