"""A decoder's load settings, resolved once: the chat options, the device and the model's header
config in, a frozen DecoderPlan out. The memory estimate (models/memory.py, engine/memory.py), the
load (pipelines/llm.py -> models/llama.py), the batch scheduler's paged pool (pipelines/scheduler.py)
and /v1/models read the same numbers, so what is estimated is what is allocated and what is reported.
Standard library only (runs in the page).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ContextWindowTooLargeError, ShaderF16SupportError, UnsupportedChatOptionError
from ..kernels.common import DTYPE_SIZE, Ring
from ..kernels.kv_quant import KV_QUANTS, KV_BLOCK, kv_row_bytes, quant_supported

# KV-pool blocks when no size is asked for: max_num_sequences full contexts, at most this many tokens
# beyond two contexts (preemption and prefix sharing cover the rest)
POOL_TOKENS_CAP = 8192
CTX_STEP = 256           # suggested context windows are multiples of this
KV_CACHE_DTYPES = ("auto", "f16", "f32") + tuple(KV_QUANTS)     # chat_config.kv_cache_dtype


def activation_dtype(dtype: str, dev) -> str:
    """The activation (and KV) precision a load asks for: "auto" is f16 where the device has
    shader-f16 (f16 reproduces the f32 greedy tokens on the golden prompts and halves activation/KV
    traffic), else f32. ShaderF16SupportError for f16 on a device without it."""
    if dtype == "auto":
        return "f16" if dev.has_f16 else "f32"
    if dtype == "f16" and not dev.has_f16:
        raise ShaderF16SupportError()
    return dtype


def model_context(cfg, context_window: int) -> int:
    """The KV rows of one sequence: the asked window, at most the model's trained length (the whole
    trained length when the window is 0 or negative)."""
    limit = cfg.context_length if cfg.context_length > 0 else context_window
    return min(context_window, limit) if context_window > 0 else limit


def prefill_rows(prefill_chunk: int, ctx: int) -> int:
    """Rows of one prefill forward (the activations' height): the chunk, within the context."""
    return max(1, min(prefill_chunk, ctx))


def cache_rows(cfg, context_window: int, prefill_chunk: int, ring: Ring | None = None) -> tuple[int, int]:
    """(KV rows of one sequence, rows of one prefill forward): model_context's, or with a sliding
    window's ring its window plus the rows one forward writes past it (the chunk, at most the window)."""
    if ring is None:
        ctx = model_context(cfg, context_window)
        return ctx, prefill_rows(prefill_chunk, ctx)
    chunk = prefill_rows(prefill_chunk, ring.window)
    return ring.window + chunk, chunk


# `max_num_sequences` 0 on lavapipe (a CPU adapter) when bench/batch_width.py has stored no width of its
# own: its WIDTH_RULE (the widest width whose full decode step costs under 3 one-row steps and whose
# lone row at most 1.25 of one) on SmolLM2-135M Q4_1, 2-core host at load 19, CPU ms a step: width 4
# one row 59.7, four 135.6 (fused one-row kernels); width 8 eight rows 148.3 (2.5x one row: 18.5 ms
# a row against 33.9) but one row 91.9 (1.54x: the row-invariant tiled kernels, norms and gates
# apart); width 16 sixteen 216.3, one 94.3. Width 8 waits for a wide path whose lone row costs
# about the fused one's.
CPU_WIDTH = 4


def auto_width(dev) -> int:
    """Sequences decoded together when `max_num_sequences` is 0: on a CPU adapter the width measured
    for it (kernels/profiles.py load_width) or CPU_WIDTH; 4 on another software adapter (a browser's
    SwiftShader: not measured); 16 on a GPU (a decode step streams the weights once for all rows)."""
    from ..kernels import profiles
    from ..kernels.matmul import is_cpu_adapter, is_software_adapter
    if is_cpu_adapter(dev):
        return profiles.load_width(dev) or CPU_WIDTH
    return 4 if is_software_adapter(dev) else 16


def max_sequences(dev, max_num_sequences: int, prefill_chunk: int) -> int:
    """Sequences decoded together; 0 means "as suits the device" (auto_width); never more than the
    prefill chunk."""
    n = int(max_num_sequences)
    if n == 0:
        n = auto_width(dev)
    return max(1, min(n, int(prefill_chunk)))


def pool_blocks(max_seqs: int, ctx: int, block_size: int, pool_tokens: int = 0) -> int:
    """Blocks of a model's pool: `pool_tokens` when given, else max_seqs full contexts but at most
    max(2 contexts, POOL_TOKENS_CAP tokens); never less than one full context plus a block, so a lone
    sequence always fits."""
    want = pool_tokens or min(max_seqs * ctx, max(2 * ctx, POOL_TOKENS_CAP))
    return max(-(-want // block_size), -(-ctx // block_size) + 1)


@dataclass(frozen=True)
class DecoderPlan:
    """What one decoder load allocates (see the module's note)."""

    dtype: str                 # activations and KV cache: "f32" | "f16"
    context: int               # KV rows of one sequence (the model's trained length at most)
    prefill_chunk: int         # rows of one prefill forward
    max_sequences: int         # decoded together by the batch scheduler (1: one request at a time)
    kv_block_size: int = 16    # tokens per paged KV block
    kv_pool_blocks: int = 0    # blocks of the paged pool (0: a model built by hand, with a contiguous
    #                            cache of one sequence instead: models/llama.py ContiguousKV)
    kv_cache_dtype: str = ""   # the KV cache and pool: "q8_0" / "q4_0" (kernels/kv_quant.py), or "" (= dtype)
    ring: Ring | None = None   # a sliding window with sinks: context = its window + one prefill chunk of rows

    @property
    def act_bytes(self) -> int:
        return DTYPE_SIZE[self.dtype]

    @property
    def kv_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    def kv_bytes_per_token(self, cfg) -> int:
        """K and V of one position, every layer."""
        return 2 * cfg.n_kv_heads * sum(kv_row_bytes(self.kv_dtype, D) for D in cfg.cache_head_dims())

    @property
    def contiguous(self) -> bool:
        """Whether the model keeps a contiguous cache of one sequence (built by hand, no pool)."""
        return self.kv_pool_blocks == 0

    def kv_layer_bytes(self, cfg) -> int:
        """One layer's K (or V) contiguous cache, (Hkv, context, D) (the widest layer's); 0 with a pool."""
        return cfg.n_kv_heads * self.context * kv_row_bytes(self.kv_dtype, cfg.max_head_dim) if self.contiguous else 0

    def kv_cache_bytes(self, cfg) -> int:
        """The paged pool (or a hand-built model's contiguous cache)."""
        rows = self.context if self.contiguous else self.kv_block_size * self.kv_pool_blocks
        return self.kv_bytes_per_token(cfg) * rows


def resolve_max_sequences(dev, chat_config) -> int:
    """chat_config.max_num_sequences as max_sequences resolves it."""
    return max_sequences(dev, chat_config.max_num_sequences, chat_config.prefill_chunk_size)


def kv_cache_dtype(cfg, chat_config, dtype: str) -> str:
    """The KV caches' dtype beyond the activations' ("" for none): chat_config.kv_cache_dtype "q8_0" or
    "q4_0" where the heads allow it; "f16" / "f32" are the activations' own."""
    want = getattr(chat_config, "kv_cache_dtype", "auto")
    if want in ("auto", dtype):
        return ""
    if want in ("f16", "f32"):
        raise UnsupportedChatOptionError("kv_cache_dtype", want, (
            f"an {want} KV cache goes with {want} activations: load with dtype {want!r} (or \"auto\"), "
            f"or use kv_cache_dtype \"q8_0\" or \"q4_0\""))
    if not quant_supported(cfg.head_dim):
        raise UnsupportedChatOptionError("kv_cache_dtype", want, (
            f"a {want} KV cache needs a head_dim that is a multiple of {KV_BLOCK}; this model's is {cfg.head_dim}"))
    return want


def plan_decoder(cfg, chat_config, dev) -> DecoderPlan:
    """The DecoderPlan of a Llama-family decoder with header config `cfg` loaded with `chat_config`
    (context_window_size, prefill_chunk_size, dtype, max_num_sequences, kv_block_size,
    kv_pool_tokens) on `dev`. The paged pool is capped at what the device binds per layer;
    ContextWindowTooLargeError when that cannot hold one full context."""
    window = getattr(chat_config, "sliding_window_size", -1) or -1
    if window > 0 and 0 < cfg.context_length < window:
        raise UnsupportedChatOptionError("sliding_window_size", window, (
            f"the window is larger than this model's trained context ({cfg.context_length} tokens)"))
    if window > 0 and getattr(cfg, "kv_sources", None):
        raise UnsupportedChatOptionError("sliding_window_size", window, (
            "this model's last layers attend earlier layers' caches (Gemma 4), which a ring of sinks and a "
            "window does not keep yet; leave sliding_window_size unset (the model's own windows still apply)"))
    dtype = chat_config.dtype
    if dtype == "auto" and getattr(chat_config, "kv_cache_dtype", "auto") in ("f16", "f32"):
        dtype = chat_config.kv_cache_dtype          # the cache follows the activations: both as asked
    dtype = activation_dtype(dtype, dev)
    ring = Ring(max(int(getattr(chat_config, "attention_sink_size", 0) or 0), 0), window) if window > 0 else None
    ctx, chunk = cache_rows(cfg, chat_config.context_window_size, chat_config.prefill_chunk_size, ring)
    seqs = resolve_max_sequences(dev, chat_config)
    bs = int(chat_config.kv_block_size)
    kv = kv_cache_dtype(cfg, chat_config, dtype)
    if kv and ring is not None:
        raise UnsupportedChatOptionError("kv_cache_dtype", kv, (
            "a sliding window's ring (sliding_window_size) keeps its KV pool in the activations' dtype: "
            "leave kv_cache_dtype \"auto\" with a sliding window, or leave sliding_window_size unset"))
    from ..kernels.attention_paged import max_pool_blocks
    cap = max_pool_blocks(dev, bs, cfg.n_kv_heads, cfg.max_head_dim, kv or dtype)
    one = -(-ctx // bs) + 1                        # a lone sequence of a full context always fits
    blocks = min(pool_blocks(seqs, ctx, bs, chat_config.kv_pool_tokens), cap)
    if blocks < one:
        block = bs * cfg.n_kv_heads * kv_row_bytes(kv or dtype, cfg.max_head_dim)
        fit = (cap - 1) * bs // CTX_STEP * CTX_STEP
        raise ContextWindowTooLargeError(
            f"A paged KV cache for a context of {ctx} tokens needs {one * block} bytes per layer ({one} "
            f"blocks of {bs} tokens), but this device binds at most {cap * block} bytes of it "
            f"({cap} blocks). Use a smaller context_window_size (at most {fit}).", param="context_window_size")
    return DecoderPlan(dtype, ctx, chunk, seqs, bs, blocks, kv, ring)
