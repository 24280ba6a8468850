"""Ollama's model store as a model reference: `ollama:NAME[:TAG]`, `ollama:NS/NAME:TAG`, `ollama:HOST/NS/NAME:TAG`.

The store lives at $OLLAMA_MODELS (default ~/.ollama/models), laid out as Ollama writes it:

    manifests/registry.ollama.ai/library/NAME/TAG    JSON: {"config": {...}, "layers": [{mediaType, digest, size}]}
    blobs/sha256-<hex>                               content-addressed files, named by their sha256

The layer of mediaType `application/vnd.ollama.image.model` is the GGUF, used in place (never
copied). The `params` layer (JSON: stop, temperature, top_p, repeat_penalty, num_ctx, ...) and the
`system` layer become the record's ChatConfig overrides; the `template` layer (Ollama's Go template)
is refused by name where the GGUF carries no Jinja chat template of its own; an `adapter` layer (a
GGUF LoRA, Ollama's ADAPTER) is applied to every request of the model (engine/lora.py); a `projector`
layer (a vision model's multimodal projector GGUF) is loaded beside the model (its ChatConfig mmproj,
vision/mmproj.py); without one, a model GGUF holding its own vision tower (Ollama's gemma3 blobs:
`v.*` / `mm.*` tensors, `gemma3.vision.*` keys) takes images from it (vision/mmproj.py OLLAMA_TO_HF,
found at load by vision/runner.py); messages layers are refused by name. A blob's sha256 is checked once per process,
at first resolve, and remembered by path, size and mtime (a changed file is hashed again). The model
is served under Ollama's name (`NAME:TAG`, `NS/NAME:TAG` outside `library`, `HOST/NS/NAME:TAG` off the default
registry). engine/references.py makes the ModelRecord from what this module reads (it imports
this module, never the other way). Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..config import SAMPLING_FIELDS
from ..errors import (
    ModelFormatError,
    OllamaBlobError,
    OllamaManifestNotFoundError,
    UnsupportedModelError,
)

log = logging.getLogger("webgpu_engine.engine")

PREFIX = "ollama:"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MEDIA = "application/vnd.ollama.image."
MODEL, PARAMS, SYSTEM, TEMPLATE = MEDIA + "model", MEDIA + "params", MEDIA + "system", MEDIA + "template"
ADAPTER, PROJECTOR = MEDIA + "adapter", MEDIA + "projector"
# layers this engine cannot apply: refused by name rather than silently dropped
REFUSED = {MEDIA + "messages": "a preset conversation (MESSAGE lines)"}
IGNORED = {MEDIA + "license"}
# params layer key -> ChatConfig field (config.SAMPLING_FIELDS; the rest are listed in the log as not applied)
PARAMS_TO_CHAT_CONFIG = {f.ollama: f.chat_config for f in SAMPLING_FIELDS if f.ollama and f.chat_config}
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}(:\d{1,5})?$")


def store_root() -> Path:
    """$OLLAMA_MODELS, else ~/.ollama/models (read at each call: tests and users may set it late)."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    name: str
    tag: str

    @property
    def shown(self) -> str:
        """The name Ollama prints and serves."""
        if self.host != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.name}:{self.tag}"
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.name}:{self.tag}"
        return f"{self.name}:{self.tag}"

    def manifest(self, root: Path) -> Path:
        return root / "manifests" / self.host / self.namespace / self.name / self.tag


def parse_name(reference: str) -> OllamaName:
    """`[ollama:][HOST/][NS/]NAME[:TAG]` → its parts (tag `latest` when omitted). Each part is a
    plain file name: nothing can point outside the store."""
    spec = reference[len(PREFIX):] if reference.lower().startswith(PREFIX) else reference
    parts = spec.split("/")
    last = parts[-1]
    name, _, tag = last.partition(":")
    tag = tag or DEFAULT_TAG
    if len(parts) > 3 or not all(parts):
        raise OllamaManifestNotFoundError(reference, [f"{spec!r} is not an Ollama model name "
                                                      f"[HOST/][NAMESPACE/]NAME[:TAG]"])
    host = parts[0] if len(parts) == 3 else DEFAULT_HOST
    ns = parts[-2] if len(parts) >= 2 else DEFAULT_NAMESPACE
    bad = [p for p in (ns, name, tag) if not _PART.match(p) or p in (".", "..")]
    if bad or not _HOST.match(host):
        raise OllamaManifestNotFoundError(reference, [f"{spec!r} is not an Ollama model name: "
                                                      f"{(bad or [host])[0]!r} is not a valid part"])
    return OllamaName(host, ns, name.lower() if host == DEFAULT_HOST else name, tag)


@dataclass
class OllamaModel:
    """One manifest of the store, its layers read (the GGUF not opened)."""

    name: OllamaName
    manifest_path: Path
    manifest_digest: str              # sha256 of the manifest file (what `ollama list` shows as ID)
    gguf: Path
    size: int                         # bytes of all layers
    config: dict = field(default_factory=dict)     # the config blob (model_family, file_type, ...)
    params: dict = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    adapters: list = field(default_factory=list)   # the adapter layers' GGUF LoRA blobs
    projector: Path | None = None                  # the projector layer's mmproj GGUF blob
    checked: list = field(default_factory=list)    # (path, digest, size) of the blobs used

    def chat_overrides(self, trained_context: int | None) -> dict:
        """ChatConfig overrides from the params and system layers."""
        out = {PARAMS_TO_CHAT_CONFIG[k]: v for k, v in self.params.items() if k in PARAMS_TO_CHAT_CONFIG}
        if isinstance(out.get("stop_str"), str):
            out["stop_str"] = [out["stop_str"]]
        ctx = self.params.get("num_ctx")
        if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0:
            out["context_window_size"] = min(ctx, trained_context) if trained_context else ctx
        if self.system:
            out["system_message"] = self.system
        rest = sorted(set(self.params) - set(PARAMS_TO_CHAT_CONFIG) - {"num_ctx"})
        if rest:
            log.info("%s: params not applied by this engine: %s", self.name.shown, ", ".join(rest))
        return out


def _blob(root: Path, layer: dict, reference: str, what: str) -> Path:
    digest = layer.get("digest")
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ModelFormatError(f"{reference}: the manifest's {what} layer has no valid sha256 digest "
                               f"({str(digest)[:80]!r})")
    path = root / "blobs" / digest.replace(":", "-")
    if not path.is_file():
        raise OllamaBlobError(f"{reference}: the {what} layer's blob {path} is missing from the Ollama "
                              f"store; pull the model again (ollama pull).")
    return path


def _read_manifest(path: Path, reference: str) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFormatError(f"{reference}: the Ollama manifest {path} is not valid JSON ({e})") from None
    if not isinstance(m, dict) or not isinstance(m.get("layers"), list) \
            or not all(isinstance(x, dict) for x in m["layers"]):
        raise ModelFormatError(f"{reference}: the Ollama manifest {path} has no list of layers")
    return m, raw


def open_store_model(reference: str, root: Path | None = None) -> OllamaModel:
    """The manifest `reference` names and its layers' blobs; raises OllamaManifestNotFoundError,
    OllamaBlobError (missing), ModelFormatError (bad JSON), UnsupportedModelError (messages layers,
    two projectors; no model layer). Digests are not checked here (verify())."""
    root = root or store_root()
    name = parse_name(reference)
    path = name.manifest(root)
    if not path.is_file():
        raise OllamaManifestNotFoundError(reference, [f"no manifest at {path} (the Ollama store is "
                                                      f"$OLLAMA_MODELS, else ~/.ollama/models)"])
    m, raw = _read_manifest(path, reference)
    layers = m["layers"]
    for layer in layers:
        kind = layer.get("mediaType")
        if kind in REFUSED:
            raise UnsupportedModelError(f"{reference}: its manifest has {REFUSED[kind]} layer ({kind}), "
                                        f"which this engine cannot apply; use a model without one.")
    models = [x for x in layers if x.get("mediaType") == MODEL]
    if len(models) != 1:
        raise UnsupportedModelError(f"{reference}: the manifest {path} has {len(models)} layers of type "
                                    f"{MODEL}; this engine loads exactly one GGUF.")
    out = OllamaModel(name, path, hashlib.sha256(raw).hexdigest(), _blob(root, models[0], reference, "model"),
                      sum(int(x.get("size") or 0) for x in layers))
    out.checked.append((out.gguf, models[0]["digest"], models[0].get("size")))
    cfg = m.get("config")
    if isinstance(cfg, dict) and isinstance(cfg.get("digest"), str):
        p = root / "blobs" / cfg["digest"].replace(":", "-")
        try:       # the config blob only describes (family, parameter size): optional
            c = json.loads(p.read_text(encoding="utf-8"))
            out.config = c if isinstance(c, dict) else {}
        except (OSError, ValueError):
            pass
    for layer in layers:
        kind = layer.get("mediaType")
        if kind in (PARAMS, SYSTEM, TEMPLATE):
            what = kind.rsplit(".", 1)[1]
            p = _blob(root, layer, reference, what)
            out.checked.append((p, layer["digest"], layer.get("size")))
            text = p.read_text(encoding="utf-8", errors="replace")
            if kind == PARAMS:
                try:
                    params = json.loads(text)
                except ValueError as e:
                    raise ModelFormatError(f"{reference}: the params layer {p} is not valid JSON ({e})") from None
                if not isinstance(params, dict):
                    raise ModelFormatError(f"{reference}: the params layer {p} is not a JSON object")
                out.params = params
            elif kind == SYSTEM:
                out.system = text
            else:
                out.template = text
        elif kind == PROJECTOR:
            if out.projector is not None:
                raise UnsupportedModelError(f"{reference}: its manifest has two projector layers; this "
                                            f"engine loads one.")
            out.projector = _blob(root, layer, reference, "projector")
            out.checked.append((out.projector, layer["digest"], layer.get("size")))
        elif kind == ADAPTER:
            out.adapters.append(_blob(root, layer, reference, "adapter"))
            out.checked.append((out.adapters[-1], layer["digest"], layer.get("size")))
        elif kind not in (MODEL, *IGNORED) and kind is not None:
            log.info("%s: layer %s not used", reference, kind)
    return out


# --------------------------------------------------------------------------- digests
_VERIFIED: dict[tuple[str, int, int], str] = {}    # (path, size, mtime_ns) -> sha256 hex seen
_LOCK = threading.Lock()


def verify(model: OllamaModel, reference: str) -> None:
    """Check each blob used against its digest (and size), hashing a file only when its path, size
    or mtime changed since it was last hashed in this process. OllamaBlobError on a mismatch."""
    for path, digest, size in model.checked:
        st = path.stat()
        if isinstance(size, int) and size != st.st_size:
            raise OllamaBlobError(f"{reference}: blob {path} holds {st.st_size} bytes, its manifest says "
                                  f"{size}; the store is damaged — pull the model again.")
        key = (str(path), st.st_size, st.st_mtime_ns)
        with _LOCK:
            seen = _VERIFIED.get(key)
        if seen is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            seen = h.hexdigest()
            with _LOCK:
                _VERIFIED[key] = seen
        if "sha256:" + seen != digest:
            raise OllamaBlobError(f"{reference}: blob {path} does not match its digest {digest} (sha256 is "
                                  f"{seen}); the store is damaged — pull the model again.")


# --------------------------------------------------------------------------- listing
def list_store(root: Path | None = None) -> list[dict]:
    """Every model of the store: name, size, family and parameter size (from the config blob, no
    GGUF opened), manifest digest and mtime. Manifests that do not parse are listed with `error`."""
    root = root or store_root()
    base = root / "manifests"
    out = []
    for path in sorted(base.glob("*/*/*/*")) if base.is_dir() else []:
        if not path.is_file():
            continue
        host, ns, name, tag = path.relative_to(base).parts
        shown = OllamaName(host, ns, name, tag).shown
        row = {"name": shown, "modified_at": path.stat().st_mtime}
        try:
            m = open_store_model(PREFIX + f"{host}/{ns}/{name}:{tag}", root)
            row.update(size=m.size, digest=m.manifest_digest, family=m.config.get("model_family"),
                       parameter_size=m.config.get("model_type"), quantization_level=m.config.get("file_type"))
        except Exception as e:  # noqa: BLE001 - a damaged entry is shown, not fatal to the listing
            row["error"] = str(e)
        out.append(row)
    return out


__all__ = [
    "PREFIX",
    "OllamaModel",
    "OllamaName",
    "list_store",
    "open_store_model",
    "parse_name",
    "store_root",
    "verify",
]
