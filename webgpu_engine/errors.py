"""Typed errors of webgpu_engine, named after WebLLM's error.ts; each carries an HTTP status."""
from __future__ import annotations


class WebGPUEngineError(Exception):
    """Base class. `http_status` is what the server answers; `error_type` goes into OpenAI error JSON."""

    http_status = 500
    error_type = "server_error"
    param: str | None = None
    retry_after: int | None = None     # seconds; the server sends it as a Retry-After header

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- request validation (400)
class InvalidRequestError(WebGPUEngineError):
    """A request field has a value the engine cannot accept; the message says what to change."""

    http_status = 400
    error_type = "invalid_request_error"


class UnclearModelToUseError(InvalidRequestError):
    def __init__(self, loaded: list[str], request_name: str = "request"):
        super().__init__(
            f"Multiple models are loaded in engine ({', '.join(loaded)}). Please specify the model "
            f"in {request_name}.model.", param="model")


class IncorrectPipelineLoadedError(InvalidRequestError):
    def __init__(self, model_id: str, expected: str, request_name: str):
        super().__init__(
            f"{request_name} expects a model of type {expected}, but {model_id} is not one. "
            f"Load a {expected} model or choose another `model`.", param="model")


class EmbeddingUnsupportedModelError(InvalidRequestError):
    def __init__(self, model_id: str):
        super().__init__(f"Model {model_id} is not an embedding model; embeddings.create needs one.",
                         param="model")


class EmbeddingTokenLimitError(InvalidRequestError):
    """An embeddings request holds more tokens, summed over its inputs, than one request may embed."""

    def __init__(self, limit: int):
        super().__init__(
            f"`input` holds more than {limit} tokens in all, the most one embeddings request may embed. "
            f"Send fewer or shorter inputs, or split them over several requests.", param="input")


class EmbeddingDimensionsUnsupportedError(InvalidRequestError):
    """`dimensions` asked of a model not trained to be truncated (Matryoshka), or beyond its width."""

    def __init__(self, model_id: str, dim: int, asked: int, matryoshka: bool):
        why = (f"`dimensions` must be between 1 and {dim}, the model's width, got {asked}." if matryoshka else
               f"Model {model_id} does not support `dimensions` (it was not trained for truncated, "
               f"Matryoshka vectors; its vectors have {dim} dimensions). Remove `dimensions`, or use a "
               f"Matryoshka model.")
        super().__init__(why, param="dimensions")


class ReloadArgumentSizeUnmatchedError(InvalidRequestError):
    def __init__(self, n_models: int, n_opts: int):
        super().__init__(
            f"Expect chat_opts, if specified, to match the size of model_id. Got {n_models} model ids "
            f"and {n_opts} chat_opts.")


class ReloadModelIdNotUniqueError(InvalidRequestError):
    def __init__(self, model_ids: list[str]):
        super().__init__(f"Need to make model_id unique when loading several models; got {model_ids}.")


# --------------------------------------------------------------------------- models (404 / 409)
class ModelNotFoundError(WebGPUEngineError):
    http_status = 404
    error_type = "invalid_request_error"


class SpecifiedModelNotFoundError(ModelNotFoundError):
    def __init__(self, loaded: list[str], requested: str):
        super().__init__(
            f"Specified model {requested} is not loaded. Loaded models: {loaded}. "
            f"Call engine.reload() with it first.", param="model")


class ModelNotInAppConfigError(ModelNotFoundError):
    def __init__(self, model_id: str, known: list[str]):
        super().__init__(f"Cannot find model record for {model_id} in the app config. Known: {known}.",
                         param="model")


class ModelNotLoadedError(WebGPUEngineError):
    http_status = 503
    error_type = "model_not_loaded"

    def __init__(self, request_name: str = "request"):
        super().__init__(f"Model not loaded before {request_name}. Call engine.reload(model_id) first.")


class ModelUnloadedError(ModelNotLoadedError):
    """The model was dropped by an intentional unload()/reload() while a request ran or waited on it
    (never reported as a device loss)."""

    def __init__(self, model_id: str, request_name: str = "request"):
        WebGPUEngineError.__init__(
            self, f"Model {model_id} was unloaded (engine.unload() or reload()) while {request_name} was "
            f"running or waiting for it. Reload the model and send the request again.")


class ReloadAbortedError(WebGPUEngineError):
    """reload() stopped because unload() (or a newer reload()) was called while it ran (WebLLM's
    reload controller): the partial load was freed and nothing is loaded."""

    http_status = 503
    error_type = "server_error"

    def __init__(self, detail: str = "engine.unload() was called"):
        super().__init__(f"The model load was aborted: {detail} while it ran. Nothing is loaded; "
                         f"call reload() again.")


class ModelManagementConflictError(WebGPUEngineError):
    """A run-time load or unload of one model that conflicts with the loaded models or a reload()."""

    http_status = 409
    error_type = "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, param="model")


class UnsupportedChatOptionError(InvalidRequestError):
    """A ChatConfig / chat_opts setting this engine does not implement (never silently ignored)."""

    def __init__(self, name: str, value, why: str):
        super().__init__(f"chat_opts {name}={value!r} is not supported: {why}", param=name)


class UnknownChatOptionError(InvalidRequestError):
    """chat_opts (or a record's overrides) names fields ChatConfig does not have."""

    def __init__(self, names: list[str], known: list[str]):
        self.names = list(names)
        super().__init__(f"Unknown chat_opts fields {self.names}; known: {known}", param="chat_opts")


class ChatOptionTypeError(InvalidRequestError):
    """A chat_opts field (or a record's override) has a value of the wrong type."""

    def __init__(self, name: str, expected: str, value):
        self.name, self.expected, self.value = name, expected, value
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        super().__init__(f"chat_opts {name} must be {expected}, got {shown} ({type(value).__name__}).",
                         param=name)


# --------------------------------------------------------------------------- admission (429 / 504)
class ModelBusyError(WebGPUEngineError):
    """The model's queue is full (EngineConfig.max_queue_length requests already wait for it)."""

    http_status = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, model_id: str, queued: int, retry_after: int):
        super().__init__(
            f"Model {model_id} is busy: {queued} requests are already waiting for it, the most this "
            f"server queues. Retry after {retry_after} s (the Retry-After header), or raise the "
            f"server's --max-queue.")
        self.retry_after = retry_after


class RequestTimeoutError(WebGPUEngineError):
    """The request ran past the engine's per-request deadline (EngineConfig.request_timeout_s),
    waiting for its model or generating; it stopped at the next step boundary and freed the model."""

    http_status = 504
    error_type = "timeout"

    def __init__(self, timeout_s: float, during: str):
        super().__init__(
            f"The request took longer than the server's request timeout of {timeout_s:g} s "
            f"(during {during}) and was stopped. Ask for fewer tokens or inputs, or retry when the "
            f"server is less busy.")


# --------------------------------------------------------------------------- device and GPU
class WebGPUNotAvailableError(WebGPUEngineError):
    http_status = 503
    error_type = "webgpu_unavailable"

    def __init__(self, detail: str = ""):
        super().__init__(
            "WebGPU is not available: no adapter was found. Install a Vulkan/Metal/DX12 driver "
            "(on Debian: apt-get install mesa-vulkan-drivers)" + (f". {detail}" if detail else "."))


class DeviceLostError(WebGPUEngineError):
    http_status = 503
    error_type = "device_lost"

    def __init__(self, detail: str = ""):
        super().__init__(
            "The WebGPU device was lost (driver reset, out of memory or destroyed)"
            + (f": {detail}" if detail else "")
            + ". Loaded models were dropped; call engine.reload() (or enable auto_recover) to continue, "
            "and try a smaller context window if it ran out of memory.")


class GPUOutOfMemoryError(WebGPUEngineError):
    """An allocation exceeds the device's limits or its memory; nothing of it stays allocated."""

    http_status = 507
    error_type = "out_of_memory"


class ShaderCompileError(WebGPUEngineError):
    """A WGSL file failed to compile; the message names the file and the line."""

    error_type = "shader_error"


class GPUValidationError(WebGPUEngineError):
    """A WebGPU validation error: a bug in a kernel's host code or shader. The message names the kernel."""

    error_type = "gpu_validation_error"


class FeatureSupportError(WebGPUEngineError):
    http_status = 400
    error_type = "feature_unsupported"

    def __init__(self, feature: str, message: str | None = None):
        # `message`: a missing piece that is not a WebGPU feature (e.g. a library absent in the browser)
        super().__init__(message or (
            f"This model requires WebGPU feature {feature}, which this device does not support. "
            f"Choose a model or variant that does not need it."))
        self.feature = feature


class ShaderF16SupportError(FeatureSupportError):
    def __init__(self):
        WebGPUEngineError.__init__(
            self, "This model requires the WebGPU feature shader-f16, which this device does not "
            "support. Use the f32 variant of the model (e.g. a *-f32 model id or chat_opts "
            "{'dtype': 'f32'}) instead.")


class ContextWindowTooLargeError(GPUOutOfMemoryError):
    http_status = 400
    error_type = "invalid_request_error"


# --------------------------------------------------------------------------- artifacts
class ArtifactError(WebGPUEngineError):
    error_type = "artifact_error"


class ArtifactFetchError(ArtifactError):
    http_status = 502


class IntegrityError(ArtifactError):
    http_status = 502


class NetworkForbiddenError(ArtifactError):
    http_status = 503


# --------------------------------------------------------------------------- model formats
class UnsupportedModelError(WebGPUEngineError):
    """A model folder or file uses a layout/feature this engine does not implement; the message
    names it (e.g. a sentence-transformers Dense module, a pooling mode, an activation)."""

    http_status = 400
    error_type = "invalid_request_error"


def supported_entry(table: dict, name: str, what: str, where: str = ""):
    """table[name], or an UnsupportedModelError saying that `what` `name` is not supported and listing
    the table's names; `where` (e.g. a file) goes in front."""
    v = table.get(name)
    if v is None:
        raise UnsupportedModelError(f"{where + ': ' if where else ''}{what} {name!r} is not supported; "
                                    f"supported: {sorted(table)}")
    return v


def unsupported_hf_config(config: dict, supported, where: str) -> UnsupportedModelError:
    """The error for a config.json whose `architectures` / `model_type` name no supported family
    (`supported`: the architecture names, listed sorted)."""
    return UnsupportedModelError(f"{where}: architectures {config.get('architectures') or []} / model_type "
                                 f"{config.get('model_type')!r} is not supported; supported: {sorted(supported)}")


# --------------------------------------------------------------------------- model files
class ModelFormatError(ArtifactError):
    """A model file (GGUF, safetensors, config.json, tokenizer) is malformed or uses something we do
    not support; the message names the file part and what is supported."""

    http_status = 422
    error_type = "model_format_error"


# --------------------------------------------------------------------------- artifact cache
class CachePathError(ArtifactError):
    """A model id names a place outside the cache (an absolute path, `..`, a link leading out); the
    cache refuses to touch it."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, model_id: str, root: str):
        super().__init__(
            f"Model id {model_id!r} does not name a folder inside the cache root {root}; give a cached "
            f"model id as `cache ls` lists it (no absolute paths, no '..').", param="model")


class CacheQuotaError(ArtifactError):
    """The cache's disk has too little free space for a download; the message says how much is needed."""

    http_status = 507
    error_type = "insufficient_storage"


# --------------------------------------------------------------------------- model references
class ModelReferenceError(ModelNotInAppConfigError):
    """A model reference (app-config id, .gguf path, model folder, URL, Hugging Face `ORG/REPO[:QUANT]`)
    that names no loadable model. `reference` is what was given; `tried` says, per reading of it,
    why it did not lead to a model."""

    def __init__(self, reference: str, tried: list[str], hint: str = ""):
        self.reference = reference
        self.tried = list(tried)
        self.hint = hint
        lines = "; ".join(self.tried) if self.tried else "nothing matched"
        WebGPUEngineError.__init__(
            self, f"Cannot load model {reference!r}: {lines}. "
            + (hint or "Give an app-config model id, a .gguf file, a Hugging Face model folder, an "
                       "https:// URL, or a Hugging Face repo id ORG/REPO[:QUANT]."), param="model")


class AmbiguousModelReferenceError(ModelReferenceError):
    """A repo or selector matches several model files; the message lists them."""

    http_status = 400

    def __init__(self, reference: str, candidates: list[str], how: str):
        self.candidates = list(candidates)
        ModelReferenceError.__init__(
            self, reference, [f"it matches {len(candidates)} files: {', '.join(candidates)}"],
            hint=f"Pick one: {how}.")


class ModelAccessError(ModelReferenceError):
    """The repo exists but refuses us (gated or private): a token is needed."""

    http_status = 403
    error_type = "permission_error"

    def __init__(self, reference: str, detail: str):
        ModelReferenceError.__init__(
            self, reference, [detail],
            hint="Accept the model's licence on its Hugging Face page and set HF_TOKEN to a token of "
                 "that account (or run `huggingface-cli login`).")


# --------------------------------------------------------------------------- Ollama's model store
class OllamaManifestNotFoundError(ModelReferenceError):
    """An `ollama:NAME[:TAG]` reference whose manifest is not in the store (or a malformed name)."""

    def __init__(self, reference: str, tried: list[str]):
        ModelReferenceError.__init__(self, reference, tried, hint="Pull it with `ollama pull NAME:TAG`, or "
                                     "point $OLLAMA_MODELS at the store that holds it.")


class OllamaBlobError(ModelFormatError):
    """A blob of Ollama's store named by a manifest is missing, or its bytes do not match its digest."""
