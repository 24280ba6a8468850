"""Model references: one string naming a model, resolved once into a `ModelRecord`.

    resolve_model_reference("SmolLM2-135M-Instruct-Q4_1")          # an app-config id
    resolve_model_reference("./Qwen2.5-0.5B-Instruct-Q4_K_M.gguf")   # a local GGUF file
    resolve_model_reference("~/models/all-MiniLM-L6-v2")            # an HF or sentence-transformers folder
    resolve_model_reference("https://host/models/tiny.gguf")         # a URL of a file (or of a folder, '/')
    resolve_model_reference("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")  # a Hugging Face repo [+ quant]
    resolve_model_reference("ollama:llama3.2:1b")                    # Ollama's model store (ollama_store.py)

Tried in that order. What kind of model it is comes from the files: a GGUF's general.architecture (a
chat LLM), config.json's `architectures` (…ForCausalLM: a chat LLM; BERT: an embedder), a
sentence-transformers modules.json (an embedder). The id served (and listed by /v1/models) is the
file or folder name, the repo id (with its selector) for Hugging Face, unless `model_id` names one.
Resolved records point at files on disk: Hugging Face files in the HF cache (cache/hf.py), URLs in
our artifact cache, local paths in place; the engine then loads them without further fetching.
Explicit records (an app config) win over everything. Standard library only at module level.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import re
from dataclasses import replace
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from ..errors import (AmbiguousModelReferenceError, InvalidRequestError, ModelFormatError, ModelReferenceError,
                      NetworkForbiddenError, UnsupportedModelError)
from .records import LLM, AppConfig, ModelRecord

DEFAULT_QUANT = "Q4_K_M"        # what llama.cpp's -hf picks in a repo of several GGUFs
_HF_HOSTS = ("huggingface.co", "hf.co")
_REPO_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w./-]+?))?(?::(?P<sel>[^:/]+))?$")
_SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# progress(fraction, text) for the downloads of the reference being resolved (resolve_model_reference
# sets it; the download calls below read it), so the fetch helpers need no extra parameter.
_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("reference_progress", default=None)
# The files of an HF or sentence-transformers folder the loaders read (weights, configs, tokenizer, and
# the model card: whether the vectors may be truncated, `dimensions`).
FOLDER_PATTERNS = ["*.json", "*.safetensors", "vocab.txt", "merges.txt", "tokenizer*", "README.md"]
# An MLC artifact's files (its chat config, tensor cache, shards, tokenizer; not the model library)
MLC_PATTERNS = ["*.json", "params_shard_*.bin", "tokenizer*", "*.model", "vocab.txt", "merges.txt"]
# WebLLM's prebuilt model ids (`Llama-3.2-1B-Instruct-q4f16_1-MLC`): repos of the mlc-ai org
_WEBLLM_ID_RE = re.compile(r"^[\w.-]+-q\d+(?:f|bf)\d+(?:_\d+)?-MLC(?:-[\w.-]+)?$")


# --------------------------------------------------------------------------- inspecting files
def _gguf_record(path: Path, reference: str) -> dict:
    """Type and trained context of a GGUF, refused when no model here can run it."""
    from ..loaders.gguf import GGUFFile
    from ..loaders.tensor_info import SUPPORTED_QTYPES
    from ..models.registry import ARCHITECTURES, architecture
    if _SHARD_RE.search(path.name):
        raise UnsupportedModelError(f"{reference}: {path.name} is one part of a split GGUF; merge the parts "
                                    f"into one file (llama-gguf-split --merge) and load that.")
    with GGUFFile(path) as g:
        name = g.architecture
        arch = architecture(name, reference)
        if arch.gguf_config is None:
            runs = sorted(n for n, a in ARCHITECTURES.items() if a.gguf_config is not None)
            raise UnsupportedModelError(f"{reference}: a {name} GGUF is not supported (the {name} family "
                                        f"loads from a Hugging Face folder); GGUF architectures: {runs}")
        odd = sorted({t.qtype for t in g.weights().values()} - set(SUPPORTED_QTYPES))
        if odd:
            raise UnsupportedModelError(
                f"{reference}: GGUF tensors of type {', '.join(odd)} cannot be run; use a GGUF quantized "
                f"to one of {', '.join(SUPPORTED_QTYPES)}.")
        ctx = g.metadata.get(f"{name}.context_length")
    return {"model_type": arch.kind, "context": int(ctx) if ctx else None}


def _config_record(config: Path, reference: str, sentence_transformers: bool) -> dict:
    """Type and trained context from a config.json, refused when no model here runs it."""
    from ..models.registry import DECODER_EMBEDDERS, hf_architecture
    try:
        c = json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{config} is not valid JSON: {e}") from None
    arch = hf_architecture(c, f"{reference}: config.json")
    if sentence_transformers and arch.name in DECODER_EMBEDDERS:    # Qwen3-Embedding, gte-Qwen2
        arch = DECODER_EMBEDDERS[arch.name]
    if arch.kind == LLM and sentence_transformers:
        raise UnsupportedModelError(f"{reference}: a sentence-transformers model over a {arch.name} decoder "
                                    f"is not supported; decoder embedders here are Llama-family models "
                                    f"({', '.join(sorted(DECODER_EMBEDDERS))}).")
    ctx = c.get("max_position_embeddings") if arch.kind == LLM else None
    return {"model_type": arch.kind, "context": int(ctx) if ctx else None}


def _transformer_subfolder(modules_json: Path) -> str:
    """Where a sentence-transformers folder keeps its Transformer ("" flat, "0_Transformer" older saves)."""
    from ..loaders.sentence_transformers import transformer_subfolder
    try:
        modules = json.loads(modules_json.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{modules_json} is not valid JSON: {e}") from None
    return transformer_subfolder(modules, str(modules_json))


def _folder_record(folder: Path, reference: str) -> dict:
    """Type and trained context of a Hugging Face or sentence-transformers folder."""
    st = (folder / "modules.json").is_file()
    model = folder / _transformer_subfolder(folder / "modules.json") if st else folder
    missing = [n for n in ("config.json", "tokenizer.json") if not (model / n).is_file()]
    if not any(model.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        where = f" (in {model.relative_to(folder)}/, where its modules.json puts the Transformer)" \
            if model != folder else ""
        raise ModelReferenceError(reference, [
            f"{folder} is not a Hugging Face model folder nor a sentence-transformers one: it lacks "
            f"{', '.join(missing)}{where}"], hint="Point at a folder with config.json, model.safetensors and "
                                                  "tokenizer.json, or at a .gguf file.")
    return _config_record(model / "config.json", reference, st)


def _mlc_record(folder: Path, reference: str) -> dict:
    """Type, context and chat-config defaults of an MLC artifact (WebLLM's models, loaders/mlc.py)."""
    from ..loaders.mlc import read_chat_config
    try:
        return {"model_type": LLM, **read_chat_config(folder)}
    except (ModelFormatError, UnsupportedModelError) as e:
        raise ModelReferenceError(reference, [str(e)]) from e


def _record(path: Path, reference: str, model_id: str, origin: str | None = None) -> ModelRecord:
    info = _gguf_record(path, reference) if path.is_file() else _mlc_record(path, reference) \
        if (path / "mlc-chat-config.json").is_file() else _folder_record(path, reference)
    overrides = dict(info.get("overrides", {}))
    if info["model_type"] == LLM and info["context"]:
        from ..config import ChatConfig
        default = ChatConfig().context_window_size
        if info["context"] < default:          # never ask for more than the model was trained on
            overrides["context_window_size"] = info["context"]
    return ModelRecord(model_id=model_id, model=str(path), model_type=info["model_type"],
                       overrides=overrides, reference=origin or reference)


def _local(path: Path, reference: str, model_id: str | None) -> ModelRecord:
    path = path.expanduser().resolve()
    projector = None
    if path.is_dir() and not (path / "config.json").is_file():
        from ..vision.mmproj import split_projector
        ggufs, projector = split_projector(sorted(path.glob("*.gguf")))
        if len(ggufs) == 1:
            path = ggufs[0]
        elif ggufs:
            raise AmbiguousModelReferenceError(reference, [g.name for g in ggufs], "name the .gguf file itself")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelReferenceError(reference, [f"{path} is a file but not a .gguf"],
                                  hint="Give a .gguf file, or the folder holding config.json and the weights.")
    name = path.stem if path.is_file() else path.name
    rec = _record(path, reference, model_id or name)
    if projector is not None and rec.model_type == LLM:     # a GGUF and its projector (llama.cpp's --mmproj)
        rec.overrides["mmproj"] = str(projector)
    return rec


# --------------------------------------------------------------------------- Hugging Face repos
def _matches(name: str, selector: str) -> bool:
    base = PurePosixPath(name).name
    if selector.lower() in (name.lower(), base.lower()):
        return True
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(selector)}(?![A-Za-z0-9_])", base, re.I) is not None


def _pick_gguf(reference: str, repo: str, files: list[str], selector: str | None) -> str | None:
    """The GGUF of the repo the selector names (None: the repo is a folder model)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and not PurePosixPath(f).name.startswith("mmproj")]
    folder = "config.json" in files and any(f.endswith(".safetensors") for f in files)
    if selector is None:
        if folder or not ggufs:
            return None
        if len(ggufs) == 1:
            return ggufs[0]
        default = [f for f in ggufs if _matches(f, DEFAULT_QUANT)]
        if len(default) == 1:
            return default[0]
        raise AmbiguousModelReferenceError(reference, ggufs, f"append :QUANT to the repo id, e.g. {repo}:Q4_0")
    hits = [f for f in ggufs if _matches(f, selector)]
    if len(hits) == 1:
        return hits[0]
    if hits and all(_SHARD_RE.search(f) for f in hits):
        raise UnsupportedModelError(f"{reference}: the {selector} GGUF of {repo} is split into {len(hits)} "
                                    f"files, which this engine cannot load; merge them (llama-gguf-split "
                                    f"--merge) and load the merged file, or choose a smaller quant.")
    if hits:
        raise AmbiguousModelReferenceError(reference, hits,
                                           f"name the file itself: {repo}:{PurePosixPath(hits[0]).name}")
    have = ", ".join(PurePosixPath(f).name for f in ggufs) or "no .gguf files"
    why = " (it is a folder model)" if folder else ""
    raise ModelReferenceError(reference, [f"no GGUF in {repo} matches {selector!r} (the repo has {have})"],
                              hint=f"Choose one of its files, or drop the selector{why}.")


def _pick_projector(files: list[str], gguf: str) -> str | None:
    """The multimodal projector GGUF (mmproj*.gguf) of a GGUF repo for its model file `gguf`: the one
    beside it, an f16 one where there are several (llama.cpp's releases), else the first by name."""
    folder = PurePosixPath(gguf).parent
    found = sorted(f for f in files if f.lower().endswith(".gguf") and PurePosixPath(f).name.startswith("mmproj"))
    found = [f for f in found if PurePosixPath(f).parent == folder] or found
    return next((f for f in found if _matches(f, "f16")), found[0]) if found else None


def _hugging_face(reference: str, repo: str, revision: str | None, selector: str | None,
                  model_id: str | None, offline: bool | None) -> ModelRecord:
    from ..cache import hf
    files, _ = hf.repo_files(repo, revision, offline=offline, reference=reference)
    if not files:
        raise ModelReferenceError(reference, [f"the Hugging Face repo {repo} holds no files"])
    shown = model_id or (f"{repo}:{selector}" if selector else repo)
    if "mlc-chat-config.json" in files:          # an MLC artifact (WebLLM's models)
        path = hf.download_folder(repo, MLC_PATTERNS, revision, offline=offline, reference=reference,
                                  progress=_PROGRESS.get())
        return _record(path, reference, shown, f"hf://{repo}")
    gguf = _pick_gguf(reference, repo, files, selector)
    if gguf is not None:
        path = hf.download_file(repo, gguf, revision, offline=offline, reference=reference,
                                progress=_PROGRESS.get())
        rec = _record(path, reference, shown, f"hf://{repo}/{gguf}")
        projector = _pick_projector(files, gguf)
        if projector is not None and rec.model_type == LLM:     # the repo's mmproj too, as llama.cpp's -hf
            rec.overrides["mmproj"] = str(hf.download_file(repo, projector, revision, offline=offline,
                                                           reference=reference, progress=_PROGRESS.get()))
        return rec
    st = "modules.json" in files
    # a sentence-transformers repo may keep its Transformer in a subfolder (0_Transformer/)
    sub = _transformer_subfolder(hf.download_file(repo, "modules.json", revision, offline=offline,
                                                  reference=reference)) if st else ""
    pre = f"{sub}/" if sub else ""
    if pre + "config.json" not in files:
        raise ModelReferenceError(reference, [f"the Hugging Face repo {repo} holds neither a .gguf nor a "
                                              f"{pre}config.json (files: {', '.join(files[:12])})"])
    here = [f[len(pre):] for f in files if f.startswith(pre) and "/" not in f[len(pre):]]
    if not any(f.endswith(".safetensors") for f in here) or "tokenizer.json" not in here:
        where = f"in {sub}/ (where its modules.json puts the Transformer)" if sub else "at its top level"
        raise ModelReferenceError(reference, [
            f"the Hugging Face repo {repo} lacks safetensors weights or tokenizer.json {where} "
            f"(this engine reads no pytorch_model.bin)"], hint="Choose a repo with model.safetensors and "
                                                              "tokenizer.json, or a GGUF repo.")
    # The architecture is checked on config.json alone, before any weight is downloaded.
    config = hf.download_file(repo, pre + "config.json", revision, offline=offline, reference=reference)
    _config_record(config, reference, st)
    patterns = list(FOLDER_PATTERNS) + [pre + p for p in FOLDER_PATTERNS if sub]
    if st:
        patterns += [f"{p.parent.as_posix()}/*" for p in map(PurePosixPath, files)
                     if p.name == "config.json" and len(p.parts) == 2 and p.parent.as_posix() != sub]
    path = hf.download_folder(repo, patterns, revision, offline=offline, reference=reference,
                              progress=_PROGRESS.get())
    return _record(path, reference, shown, f"hf://{repo}")


# --------------------------------------------------------------------------- URLs
def _url(reference: str, model_id: str | None, offline: bool | None) -> ModelRecord:
    """A URL of a .gguf file or of a model folder (ending in '/'), fetched through the artifact cache."""
    from .. import cache
    u = urlparse(reference)
    parts = [unquote(p) for p in u.path.split("/") if p]
    host = (u.hostname or "").lower()
    if host in _HF_HOSTS and len(parts) >= 2:
        repo = "/".join(parts[:2])
        if len(parts) >= 5 and parts[2] in ("resolve", "blob"):         # ORG/REPO/resolve/REV/FILE
            return _hugging_face(reference, repo, parts[3], "/".join(parts[4:]), model_id, offline)
        if len(parts) == 2:
            return _hugging_face(reference, repo, None, None, model_id, offline)
    if not parts:
        raise ModelReferenceError(reference, ["the URL names no file or folder"])
    cache_id = f"{Path(parts[-1]).stem}-{hashlib.sha1(reference.encode()).hexdigest()[:10]}"
    if not u.path.endswith("/"):
        if not parts[-1].lower().endswith(".gguf"):
            raise ModelReferenceError(reference, [f"the URL names {parts[-1]}, which is not a .gguf"],
                                      hint="Give the URL of a .gguf file, or of a model folder ending in '/'.")
        base = reference.rsplit("/", 1)[0] + "/"
        arts = cache.artifacts_from_bases(cache_id, {parts[-1]: (None, None)}, [base])
        path = cache.fetch_model_sync(cache_id, arts, offline=offline, bar=False, progress=_PROGRESS.get())
        return _record(Path(path), reference, model_id or Path(parts[-1]).stem)
    return _record(_fetch_folder(reference, cache_id, offline), reference, model_id or parts[-1])


def _fetch_folder(base: str, cache_id: str, offline: bool | None) -> Path:
    """Fetch a model folder by URL: its configs first, then what they name (weights, pooling config)."""
    from .. import cache
    from ..errors import ArtifactFetchError

    def get(names: list[str], required: bool) -> list[Path]:
        got = []
        for name in names:
            arts = cache.artifacts_from_bases(cache_id, {name: (None, None)}, [base])
            try:
                got.append(cache.fetch_model_sync(cache_id, arts, offline=offline, bar=False,
                                                  progress=_PROGRESS.get()))
            except (ArtifactFetchError, NetworkForbiddenError):     # an optional file the folder lacks
                if required:
                    raise
        return got
    folder = cache.model_dir("model", cache_id)
    get(["mlc-chat-config.json"], False)
    if (folder / "mlc-chat-config.json").is_file():       # an MLC artifact (WebLLM's models)
        return _fetch_mlc_folder(get, folder)
    # modules.json first: an older sentence-transformers save keeps its Transformer in 0_Transformer/
    get(["modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "README.md"], False)
    st = (folder / "modules.json").is_file()
    sub = _transformer_subfolder(folder / "modules.json") if st else ""
    pre = f"{sub}/" if sub else ""
    get([pre + "config.json", pre + "tokenizer.json"], True)
    get([pre + n for n in ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                           "model.safetensors.index.json")] + ([pre + "sentence_bert_config.json"] if sub else []),
        False)
    index = folder / pre / "model.safetensors.index.json"
    if index.is_file():
        get([pre + n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))], True)
    else:
        get([pre + "model.safetensors"], True)
    if st:
        for m in json.loads((folder / "modules.json").read_text()):
            if m.get("path") and m["path"] != sub:
                get([f"{m['path']}/config.json"], False)
    return folder


def _fetch_mlc_folder(get, folder: Path) -> Path:
    """An MLC folder by URL: its tensor cache (either name), tokenizer files, then the shards it lists."""
    get(["tensor-cache.json"], False)
    cache_file = folder / "tensor-cache.json"
    if not cache_file.is_file():
        get(["ndarray-cache.json"], True)
        cache_file = folder / "ndarray-cache.json"
    get(["tokenizer.json"], True)
    get(["tokenizer_config.json"], False)
    try:
        shards = sorted({str(r["dataPath"]) for r in json.loads(cache_file.read_text())["records"]})
    except (ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f"{cache_file}: no shard records ({e})") from e
    get(shards, True)
    return folder


# --------------------------------------------------------------------------- Ollama's store
def _ollama(reference: str, model_id: str | None) -> ModelRecord:
    """An `ollama:` reference: its GGUF blob in place (checked against its digest), the params and
    system layers as ChatConfig overrides, served under Ollama's name (ollama_store.py reads the store)."""
    from .ollama_store import PREFIX, TEMPLATE, open_store_model, verify
    model = open_store_model(reference)
    verify(model, reference)
    rec = _record(model.gguf, reference, model_id or model.name.shown)
    if rec.model_type == LLM and model.template is not None and not _has_jinja_template(model.gguf):
        raise UnsupportedModelError(f"{reference}: its GGUF has no Jinja chat template and this engine "
                                    f"does not run Ollama's Go template layer ({TEMPLATE}); use a GGUF "
                                    f"with tokenizer.chat_template.")
    if rec.model_type == LLM:
        rec.overrides.update(model.chat_overrides(rec.overrides.get("context_window_size")))
    if model.projector is not None:       # a vision model's projector layer: its mmproj
        from ..vision.mmproj import is_mmproj
        if rec.model_type != LLM or not is_mmproj(model.projector):
            raise ModelFormatError(f"{reference}: its projector layer {model.projector} is not a multimodal "
                                   f"projector GGUF (general.architecture 'clip') of a chat model")
        rec.overrides["mmproj"] = str(model.projector)
    if model.adapters:              # Ollama's ADAPTER: served by the batch scheduler (engine/lora.py)
        if rec.model_type != LLM or len(model.adapters) > 1:
            raise UnsupportedModelError(f"{reference}: {len(model.adapters)} adapter layers on a "
                                        f"{rec.model_type} model; this engine applies one, to a chat model.")
        rec.lora = str(model.adapters[0])
        rec.overrides.setdefault("max_num_sequences", 0)
    rec.reference = PREFIX + model.name.shown
    return rec


def _has_jinja_template(path: Path) -> bool:
    from ..loaders.gguf import GGUFFile
    with GGUFFile(path) as g:
        return bool(g.chat_template)


# --------------------------------------------------------------------------- entry points
def resolve_model_reference(reference: str, *, model_id: str | None = None, app_config: AppConfig | None = None,
                            offline: bool | None = None, progress=None) -> ModelRecord:
    """The ModelRecord `reference` names (see the module docstring); blocking (it may download, and
    reports the downloads to `progress(fraction, text)` when given). Raises ModelReferenceError (with
    what was tried), AmbiguousModelReferenceError, ModelAccessError, UnsupportedModelError,
    NetworkForbiddenError."""
    token = _PROGRESS.set(progress)
    try:
        return _resolve(reference.strip(), model_id, app_config, offline)
    finally:
        _PROGRESS.reset(token)


def _resolve(ref: str, model_id: str | None, app_config: AppConfig | None, offline: bool | None) -> ModelRecord:
    if app_config is not None and ref in app_config.ids():
        rec = app_config.get(ref)
        if model_id in (None, rec.model_id):
            return rec
        if not rec.is_local:        # the artifact cache keeps a remote record's files under its id
            raise InvalidRequestError(f"Model {ref} comes from the app config and keeps its id; a "
                                      f"model_id alias applies to files, folders, URLs and repos.",
                                      param="model_id")
        return replace(rec, model_id=model_id)
    tried = [f"not a model id of the app config ({', '.join(app_config.ids())})"] if app_config else []
    if re.match(r"^https?://", ref, re.I):
        return _url(ref, model_id, offline)
    low = ref.lower()
    if low.startswith("ollama:"):                  # Ollama's model store (ollama_store.py)
        return _ollama(ref, model_id)
    for prefix in ("hf://", "hf.co/", "huggingface.co/"):
        if low.startswith(prefix):
            return _hf_repo_id(ref, ref[len(prefix):], model_id, offline, tried)
    path = Path(ref).expanduser()
    if path.exists():
        return _local(path, ref, model_id)
    tried.append(f"no file or folder at {path.resolve()}")
    if ref.startswith((".", "/", "~")) or "\\" in ref:
        raise ModelReferenceError(ref, tried)
    from ..webllm_catalogue import WEBLLM_BY_ID
    web = WEBLLM_BY_ID.get(ref)
    if web is not None:                            # WebLLM's prebuilt id: its repo and context window
        rec = _hf_repo_id(ref, web.repo, model_id or ref, offline, tried)
        ctx = {"context_window_size": web.context_window_size} if web.context_window_size else {}
        return replace(rec, overrides={**rec.overrides, **ctx})
    if _WEBLLM_ID_RE.match(ref):                   # another WebLLM-style id: its mlc-ai repo
        return _hf_repo_id(ref, f"mlc-ai/{ref}", model_id or ref, offline, tried)
    if not _REPO_RE.match(ref):
        raise ModelReferenceError(ref, tried + ["not a Hugging Face repo id ORG/REPO[:QUANT]"])
    return _hf_repo_id(ref, ref, model_id, offline, tried)


def is_hub_repo_record(rec: ModelRecord) -> bool:
    """A record (WebLLM's app config) whose `model` is a Hugging Face repo's URL, with no model_file:
    WebLLM's form of its prebuilt models (`https://huggingface.co/mlc-ai/<id>`)."""
    u = urlparse(rec.model)
    return (not rec.model_file and (u.hostname or "").lower() in _HF_HOSTS
            and len([p for p in u.path.split("/") if p]) == 2)


def hub_repo_record(rec: ModelRecord, progress=None) -> ModelRecord:
    """Such a record resolved like its URL (into the Hugging Face cache; an MLC artifact's model_lib is
    not needed): the files' defaults, then the record's own overrides."""
    got = resolve_model_reference(rec.model, model_id=rec.model_id, progress=progress)
    if rec.model_lib not in ("builtin", ""):
        logging.getLogger("webgpu_engine.engine").debug("%s: model_lib %s is not used (our kernels run the "
                                                        "weights)", rec.model_id, rec.model_lib)
    return replace(rec, model=got.model, model_type=got.model_type, overrides={**got.overrides, **rec.overrides},
                   reference=rec.model)


def _hf_repo_id(reference: str, spec: str, model_id: str | None, offline: bool | None,
                tried: list[str]) -> ModelRecord:
    m = _REPO_RE.match(spec)
    if m is None:
        raise ModelReferenceError(reference, tried + ["not a Hugging Face repo id ORG/REPO[:QUANT]"])
    try:
        return _hugging_face(reference, m["repo"], m["rev"], m["sel"], model_id, offline)
    except NetworkForbiddenError as e:      # offline, and the HF cache lacks it: say what else was tried
        raise ModelReferenceError(reference, tried + [f"as a Hugging Face repo: {e}"]) from e
    except ModelReferenceError as e:
        if type(e) is ModelReferenceError and tried:
            raise ModelReferenceError(reference, tried + e.tried, e.hint) from e
        raise


async def records_for(app_config: AppConfig, refs: list, aliases: list | None = None,
                      progress=None) -> tuple[AppConfig, list[ModelRecord]]:
    """The records of `refs` (app-config ids or model references, named by `aliases` where one is
    given) and the app config with the resolved ones added. App-config ids cost nothing; other
    references resolve in a worker thread (they may read headers or download): `progress(k, fraction,
    text)` reports the downloads of refs[k], from that thread."""
    records: list[ModelRecord] = []
    new: list[ModelRecord] = []
    aliases = list(aliases or []) + [None] * (len(refs) - len(aliases or []))
    for k, (item, alias) in enumerate(zip(refs, aliases)):
        if item in app_config.ids() and alias in (None, item):
            records.append(app_config.get(item))
        else:
            report = None if progress is None else (lambda f, text, k=k: progress(k, f, text))
            rec = await asyncio.to_thread(resolve_model_reference, item, model_id=alias,
                                          app_config=app_config, progress=report)
            new.append(rec)
            records.append(rec)
    return (app_config.with_records(*new) if new else app_config), records


__all__ = ["resolve_model_reference", "records_for", "DEFAULT_QUANT", "FOLDER_PATTERNS"]
