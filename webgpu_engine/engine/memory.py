"""GPU memory planning for loads: what a model will hold on the GPU (weights, KV cache, activations),
what the device allows, and a fail-fast check that runs before anything is allocated.

WebGPU reports no free or total memory, so the engine keeps a budget of its own: the `max_memory_bytes`
engine option, else env WEBGPU_ENGINE_MAX_MEMORY ("6G", "512M", bytes), else a guess from the adapter
type. Estimates mirror what the pipelines allocate (models/llama.py, models/bert.py, the sampler) from
the model's headers only (no tensor bytes are read); a record's `vram_required_MB` is the fallback.
Standard library only at module level (this runs in the page too).
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ContextWindowTooLargeError, GPUOutOfMemoryError

log = logging.getLogger("webgpu_engine.engine")

ENV_MAX_MEMORY = "WEBGPU_ENGINE_MAX_MEMORY"
MiB, GiB = 1 << 20, 1 << 30
# Budgets when nothing is configured. CPU adapters (lavapipe, SwiftShader) and integrated GPUs draw
# on system RAM: half of it. A discrete GPU's VRAM is not visible through WebGPU; 16 GiB admits the
# models a typical card holds. Unknown (e.g. a browser, which hides the adapter type): 4 GiB, about
# what a page can get before the browser resets the device.
DEFAULT_DISCRETE_BYTES = 16 * GiB
DEFAULT_UNKNOWN_BYTES = 4 * GiB
CTX_STEP = 256           # suggested context windows are multiples of this
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": MiB, "mb": MiB, "mib": MiB,
          "g": GiB, "gb": GiB, "gib": GiB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_bytes(text) -> int:
    """"6G", "512MiB", "1.5gb", "123456" → bytes (binary units: the way GPU memory is quoted)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte count (e.g. 6G, 512M, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):      # Windows, Pyodide
        return None


def default_budget(dev) -> int:
    """The budget guessed from the adapter when nothing is configured (see the module docstring)."""
    kind = (getattr(dev.info, "adapter_type", "") or "").lower()
    if "cpu" in kind or "integrated" in kind:
        ram = _physical_memory()
        return ram // 2 if ram else DEFAULT_UNKNOWN_BYTES
    if "discrete" in kind:
        return DEFAULT_DISCRETE_BYTES
    return DEFAULT_UNKNOWN_BYTES


def memory_budget(dev, option: int | str | None = None) -> tuple[int, str]:
    """(bytes the engine may hold on `dev` in all, where that number comes from)."""
    if option is not None:
        return parse_bytes(option), "the max_memory_bytes engine option"
    env = os.environ.get(ENV_MAX_MEMORY)
    if env:
        return parse_bytes(env), f"env {ENV_MAX_MEMORY}"
    return default_budget(dev), f"the default for a {dev.info.adapter_type or 'unknown'} adapter " \
                                f"(set {ENV_MAX_MEMORY} or max_memory_bytes to change it)"


@dataclass
class MemoryEstimate:
    """Bytes one model will hold on the GPU. `kv_per_token`: KV-cache bytes per token of context
    window (0 for encoders); `largest_buffer`: the biggest single allocation, checked against the
    device's per-buffer limits."""

    weights: int
    kv_cache: int = 0
    activations: int = 0
    context_window: int = 0
    kv_per_token: int = 0
    ctx_activations: int = 0         # the part of `activations` that grows with the context window
    largest_buffer: int = 0
    largest_label: str = ""
    source: str = "estimate"         # "estimate" (from the model's headers) | "record" (vram_required_MB)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def _r4(n: int) -> int:
    return max(4, (int(n) + 3) & ~3)


def _weight_bytes(t, max_binding: int) -> tuple[int, int]:
    """(bytes on the GPU, largest buffer) of one tensor: matrices in the GPU row layout (split across
    buffers at the binding limit, as upload_weight does), vectors as f32."""
    from ..kernels.matmul import gpu_row_bytes
    if len(t.shape) < 2:
        return _r4(4 * t.numel), _r4(4 * t.numel)
    n, k = t.shape[0], t.shape[-1]
    row = gpu_row_bytes(t.qtype, k)
    per_buf = max(1, min(n, max_binding // row)) * row
    return _r4(n * row), _r4(min(per_buf, n * row))


def estimate_llm(cfg, tensors: dict, *, context_window: int, prefill_chunk: int, act_dtype: str,
                 max_binding: int) -> MemoryEstimate:
    """A Llama-family decoder as models/llama.py + the sampler allocate it. `tensors`: our weight names
    → TensorInfo (only names, qtypes and shapes are used). The context window is clamped to the
    model's trained length, as the model does."""
    esz = 2 if act_dtype == "f16" else 4
    limit = cfg.context_length if cfg.context_length > 0 else context_window
    ctx = min(context_window, limit) if context_window > 0 else limit
    P = max(1, min(prefill_chunk, ctx))
    weights, largest, label = 0, 0, ""
    for name, t in tensors.items():
        nb, big = _weight_bytes(t, max_binding)
        weights += nb
        if big > largest:
            largest, label = big, f"weight {name}"
    kv_tok = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * esz       # K and V, every layer
    kv_buf = cfg.n_kv_heads * ctx * cfg.head_dim * esz                     # one (Hkv, ctx, D) cache
    C, F, V = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    act = esz * P * (2 * C + cfg.qkv_dim + cfg.q_dim + 3 * F) + 4 * P + esz * (C + V)
    act += 4 * V * 3 + 4 * (V + 31) // 32 + 1024          # sampler: bias, history, scratch, io, params
    act += 64 * 1024                                         # per-op params uniforms (~16 B x ops)
    # split-key decode attention: per layer (Hq, splits, D/4 + 1) vec4 partials, at most 128 splits
    # of at least 32 keys (kernels/nn.attention; CPU adapters use fewer): grows with the context.
    partials = cfg.n_layers * cfg.n_heads * min(128, -(-ctx // 32)) * (cfg.head_dim // 4 + 1) * 16
    act += partials
    for size, what in ((kv_buf, f"KV cache of one layer ({ctx} tokens)"), (esz * P * 2 * F, "gate_up activations"),
                       (4 * V, "logits")):
        if size > largest:
            largest, label = size, what
    return MemoryEstimate(weights, kv_tok * ctx, act, ctx, kv_tok, partials, largest, label)


def estimate_bert(cfg, tensors: dict, *, max_batch_size: int, max_seq_length: int, act_dtype: str,
                  max_binding: int) -> MemoryEstimate:
    """A BERT encoder as models/bert.py allocates it, with the activation arena of the largest batch
    (max_batch_size sequences of max_seq_length tokens) and the pipeline's result buffer."""
    esz = 2 if act_dtype == "f16" else 4
    weights, largest, label = 0, 0, ""
    for name, t in tensors.items():
        if "token_type" in name and len(t.shape) == 2:       # only row 0 is uploaded
            nb = big = _r4(4 * t.shape[1])
        elif "position_ids" in name:                           # a buffer of some checkpoints, not a weight
            continue
        else:
            nb, big = _weight_bytes(t, max_binding)
        weights += nb
        if big > largest:
            largest, label = big, f"weight {name}"
    C, F = cfg.hidden_size, cfg.intermediate_size
    B = max(1, max_batch_size)                 # batches are min(pow2, max_batch_size) sequences
    T = B * max_seq_length
    act = esz * T * (4 * C + 3 * C + 2 * F) + 4 * (2 * T + B) + 2 * 4 * B * C
    act += 2 * 4 * B * C + 64 * 1024                          # result buffer (grows x2), op params
    for size, what in ((esz * T * F, f"FFN activations of a {B}x{max_seq_length} batch"),):
        if size > largest:
            largest, label = size, what
    return MemoryEstimate(weights, 0, act, 0, 0, 0, largest, label)


@dataclass(frozen=True)
class _Shape:
    """What an estimate needs of a tensor (no bytes: keeping a TensorInfo would keep its file mapped)."""

    qtype: str
    shape: tuple

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_HEADERS: dict = {}          # (kind, path, size, mtime) -> (config, extra, {name: _Shape}); parsed once
_MAX_HEADERS = 8


def _file_key(kind: str, path: Path) -> tuple:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return (kind, str(path)) + tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                     for f in files if f.is_file())


def _headers(kind: str, path: Path):
    """(model config, extra, {name: _Shape}) of a model on disk, cached by path, sizes and mtimes so
    that reloads (and auto-recovery) do not parse the headers again."""
    key = _file_key(kind, path)
    hit = _HEADERS.get(key)
    if hit is not None:
        return hit
    extra = None
    if kind == "llm" and path.is_dir():
        from ..loaders.hf_config import load_llama_config
        from ..loaders.safetensors import SafetensorsFolder
        f = SafetensorsFolder(path)
        cfg, tensors, close = load_llama_config(path), f.weights("llama"), f.close
    elif kind == "llm":
        from ..loaders.gguf import GGUFFile
        g = GGUFFile(path)
        cfg, tensors, close = g.model_config(), g.weights(), g.close
    else:
        from ..loaders import hf_config
        from ..loaders.safetensors import load_safetensors_folder
        from ..loaders.sentence_transformers import load_sentence_transformer_config
        extra = load_sentence_transformer_config(path)
        cfg = hf_config.load_bert_config(extra.model_folder)
        tensors, close = load_safetensors_folder(extra.model_folder), None
    try:
        shapes = {n: _Shape(t.qtype, tuple(t.shape)) for n, t in tensors.items()}
    finally:
        tensors = None
        if close is not None:
            close()
    if len(_HEADERS) >= _MAX_HEADERS:
        _HEADERS.pop(next(iter(_HEADERS)))
    _HEADERS[key] = (cfg, extra, shapes)
    return cfg, extra, shapes


def estimate_for(model_type: str, path, chat_config, dev) -> MemoryEstimate:
    """Estimate a model on disk from its headers (GGUF / safetensors + config.json); raises on files
    it cannot read (the caller falls back to the record's number)."""
    path = Path(path)
    limit = min(dev.max_storage_binding, dev.max_buffer_size)
    cfg, st, shapes = _headers("llm" if model_type == "llm" else "bert", path)
    if model_type == "llm":
        dtype = chat_config.dtype if chat_config.dtype != "auto" else ("f16" if dev.has_f16 else "f32")
        return estimate_llm(cfg, shapes, context_window=chat_config.context_window_size,
                            prefill_chunk=chat_config.prefill_chunk_size, act_dtype=dtype, max_binding=limit)
    max_len = min(chat_config.max_seq_length or st.max_seq_length or cfg.max_position, cfg.max_position)
    dtype = "f32" if chat_config.dtype == "auto" else chat_config.dtype
    return estimate_bert(cfg, shapes, max_batch_size=chat_config.max_batch_size, max_seq_length=max_len,
                         act_dtype=dtype, max_binding=limit)


def from_record(vram_required_MB: float) -> MemoryEstimate:
    return MemoryEstimate(int(vram_required_MB * MiB), source="record")


def estimate_model(factory, builtin: bool, record, path, chat_config, dev) -> MemoryEstimate | None:
    """A model's estimate for the pre-load check: the pipeline class's own (`estimate_memory(path,
    chat_config, dev)`), ours for the built-in pipelines, else the record's vram_required_MB; None
    when nothing is known (then only the pipeline's own checks apply)."""
    f = getattr(factory, "estimate_memory", None)
    try:
        if f is not None:
            return f(path, chat_config, dev)
        if builtin:
            return estimate_for(record.model_type, path, chat_config, dev)
    except Exception as e:  # noqa: BLE001 - the pipeline's own load reports a bad file properly
        log.debug("no memory estimate for %s: %s", record.model_id, e)
    if record.vram_required_MB:
        return from_record(record.vram_required_MB)
    return None


def _mb(n: int) -> str:
    return f"{n} bytes ({n / MiB:.1f} MiB)"


def check_fits(model_id: str, est: MemoryEstimate, dev, budget: int, budget_source: str,
               in_use: int) -> None:
    """Raise ContextWindowTooLargeError / GPUOutOfMemoryError, naming bytes needed and available,
    when `est` cannot fit: a buffer over the device's per-buffer limit, or a total over what is left
    of the budget after `in_use` bytes. The suggestion is the largest context window that fits."""
    limit = min(dev.max_buffer_size, dev.max_storage_binding)
    what = f"Model {model_id}"
    if est.largest_buffer > limit:
        if est.kv_per_token and est.largest_label.startswith("KV cache"):
            per_tok = est.largest_buffer // max(1, est.context_window)
            fit = limit // per_tok // CTX_STEP * CTX_STEP
            raise ContextWindowTooLargeError(
                f"{what}: a context window of {est.context_window} tokens needs a KV cache buffer of "
                f"{_mb(est.largest_buffer)} per layer, but this device ({dev.info.name}) allows at most "
                f"{_mb(limit)} per buffer. Use a smaller context_window_size (at most {fit}).",
                param="context_window_size")
        raise GPUOutOfMemoryError(
            f"{what}: its {est.largest_label} needs one buffer of {_mb(est.largest_buffer)}, but this "
            f"device ({dev.info.name}) allows at most {_mb(limit)} per buffer. Use a smaller "
            f"max_batch_size / max_seq_length or another model.")
    available = budget - in_use
    if est.total <= available:
        return
    parts = f"weights {_mb(est.weights)}, activations {_mb(est.activations)}"
    if est.kv_per_token:
        parts += f", KV cache {_mb(est.kv_cache)} for {est.context_window} tokens"
    where = (f"{_mb(available)} available (budget {_mb(budget)} from {budget_source}"
             + (f", {_mb(in_use)} already in use or reserved for the models loaded before it"
                if in_use else "") + ")")
    if est.source == "record":
        raise GPUOutOfMemoryError(
            f"{what} needs about {_mb(est.total)} on the GPU (its record's vram_required_MB), more than "
            f"the {where}. Unload other models or choose a smaller model.")
    if est.kv_per_token:
        # what a smaller window still costs; context-bound activations are taken as linear in the
        # window (they grow slower), so the suggested window surely fits
        per_tok = est.kv_per_token + -(-est.ctx_activations // max(1, est.context_window))
        room = available - est.weights - (est.activations - est.ctx_activations)
        fit = room // per_tok // CTX_STEP * CTX_STEP if room > 0 else 0
        if fit >= CTX_STEP:
            raise ContextWindowTooLargeError(
                f"{what} with a context window of {est.context_window} tokens needs {_mb(est.total)} on "
                f"the GPU ({parts}), more than the {where}. Use a smaller context_window_size "
                f"(at most {fit}).", param="context_window_size")
    hint = ("Use a smaller max_batch_size / max_seq_length, " if not est.kv_per_token
            else "Even a small context window does not fit: ")
    raise GPUOutOfMemoryError(
        f"{what} needs {_mb(est.total)} on the GPU ({parts}), more than the {where}. {hint}unload "
        f"other models, choose a smaller model or raise the budget.")


__all__ = ["MemoryEstimate", "estimate_llm", "estimate_bert", "estimate_for", "estimate_model", "from_record",
           "check_fits", "memory_budget", "default_budget", "parse_bytes", "ENV_MAX_MEMORY"]
