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
from ..models.memory import MemoryEstimate, estimate_bert, estimate_llm  # noqa: F401 - re-exported
from ..models.plan import plan_decoder

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
    """(architecture, model config, extra, {name: _Shape}) of a model on disk, cached by path, sizes
    and mtimes so that reloads (and auto-recovery) do not parse the headers again."""
    key = _file_key(kind, path)
    hit = _HEADERS.get(key)
    if hit is not None:
        return hit
    from ..models.registry import open_model
    m = open_model(path, kind)
    try:
        shapes = {n: _Shape(t.qtype, tuple(t.shape)) for n, t in m.weights.items()}
    finally:
        m.close()
    if len(_HEADERS) >= _MAX_HEADERS:
        _HEADERS.pop(next(iter(_HEADERS)))
    _HEADERS[key] = (m.arch, m.config, m.extra, shapes)
    return _HEADERS[key]


def estimate_for(model_type: str, path, chat_config, dev) -> MemoryEstimate:
    """Estimate a model on disk from its headers (GGUF / safetensors + config.json) with its family's
    estimate (models/registry.py); raises on files it cannot read (the caller falls back to the
    record's number)."""
    path = Path(path)
    limit = min(dev.max_storage_binding, dev.max_buffer_size)
    arch, cfg, st, shapes = _headers(model_type, path)
    if arch.kind == "llm":     # what the load allocates: the same plan (models/plan.py), a vision tower too
        from ..vision.runner import memory
        plan = plan_decoder(cfg, chat_config, dev)
        return memory(path, arch.estimate(cfg, shapes, plan, max_binding=limit), plan.context,
                      mmproj=chat_config.mmproj, chunk=plan.prefill_chunk)
    max_len = min(chat_config.max_seq_length or st.max_seq_length or cfg.max_position, cfg.max_position)
    dtype = "f32" if chat_config.dtype == "auto" else chat_config.dtype    # encoders: f32 unless asked
    return arch.estimate(cfg, shapes, max_batch_size=chat_config.max_batch_size, max_seq_length=max_len,
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
