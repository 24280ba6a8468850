"""LoRA adapters served beside their base (vLLM's --lora-modules, /v1/load_lora_adapter): a loaded
chat model keeps its adapters by name (LoadedModel.lora_adapters: name -> path); a request whose
`model` is an adapter's name runs on the base with that adapter (models/lora.py), in the same
batch as the base's and other adapters' requests. A part of AsyncMLCEngine (engine.py delegates its
adapter methods here), reading only the engine's loaded models; standard library only.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ..errors import InvalidRequestError, ModelNotLoadedError, SpecifiedModelNotFoundError
from ..gpu import IN_BROWSER
from .records import LLM

log = logging.getLogger("webgpu_engine.engine")


class LoraAdapters:
    """The adapters of an engine's loaded chat models; `models()` gives the engine's loaded models
    ({model id: LoadedModel}, each with its `lora_adapters` {name: path})."""

    def __init__(self, models: Callable[[], dict]):
        self._models = models
        # what is served: name -> (base id, path, pool rank, pool slots), for a reload after a device loss
        self.kept: dict[str, tuple] = {}
        # reload()'s lora_max_rank and max_loras (vLLM's --max-lora-rank, --max-loras): the rank and
        # the adapter bound of a pool made afterwards (None: the adapters' largest rank / 16, 4)
        self.max_rank: int | None = None
        self.max_loras: int | None = None

    @property
    def models(self) -> dict:
        return self._models()

    def lora_base(self, name: str | None):
        """The LoadedModel that serves adapter `name`, or None."""
        return next((lm for lm in self.models.values() if name in lm.lora_adapters), None)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, model: str | None = None,
                                max_rank: int | None = None) -> None:
        """Register adapter `lora_name` from `lora_path` (a PEFT folder or a GGUF LoRA file) over the
        loaded chat model `model` (default: the one loaded chat model) without reloading it; requests
        then pick it by `model` = lora_name. Refused (LoraAdapterError, naming the tensor) where it does
        not fit."""
        lm = self._lora_base_for(lora_name, lora_path, model)
        _add_to(lm.pipeline, await _read(lora_path, lora_name), max_rank or self.max_rank, self.max_loras,
                exact=max_rank is None and self.max_rank is not None)
        lm.lora_adapters[lora_name] = lora_path
        self.kept[lora_name] = (lm.model_id, lora_path, lm.pipeline.lora.max_rank, lm.pipeline.lora.slots)

    def _lora_base_for(self, lora_name, lora_path, model: str | None):
        """The chat model an adapter named lora_name is loaded over (typed errors for bad names)."""
        if not isinstance(lora_name, str) or not lora_name or not isinstance(lora_path, str) or not lora_path:
            raise InvalidRequestError("lora_name and lora_path must be non-empty strings.", param="lora_name")
        llms = {k: lm for k, lm in self.models.items() if lm.model_type == LLM}
        if not llms:
            raise ModelNotLoadedError("load_lora_adapter")
        if model is None and len(llms) > 1:
            raise InvalidRequestError(f"Several chat models are loaded ({', '.join(llms)}): say which one "
                                      f"the adapter is for.", param="model")
        lm = llms.get(model) if model is not None else next(iter(llms.values()))
        if lm is None:
            raise SpecifiedModelNotFoundError(list(self.models), model)
        if lora_name in self.models or (self.lora_base(lora_name) not in (None, lm)):
            raise InvalidRequestError(f"The name {lora_name!r} is taken by a loaded model or adapter.",
                                      param="lora_name")
        return lm

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Forget adapter `lora_name` (refused while requests run with it)."""
        lm = self.lora_base(lora_name)
        if lm is None:
            raise SpecifiedModelNotFoundError(list(self.models) + self.lora_names(), lora_name)
        lm.pipeline.lora.unregister(lora_name)
        del lm.lora_adapters[lora_name]
        self.kept.pop(lora_name, None)

    def lora_names(self) -> list[str]:
        return [n for lm in self.models.values() for n in lm.lora_adapters]

    async def load_adapters(self, adapters: dict | None, max_rank: int | None = None,
                            max_loras: int | None = None) -> None:
        """reload()'s lora_adapters {name: path}: each over the one chat model loaded, the pool's rank
        `max_rank` (an adapter of a larger rank is refused) or else the largest of theirs, its bound
        `max_loras` adapters on the GPU at once (else models/lora.py's DEFAULT_SLOTS)."""
        from ..protocol.errors import FieldTypeError
        for field, v in (("lora_max_rank", max_rank), ("max_loras", max_loras)):
            if v is not None and (type(v) is not int or v < 1):
                raise FieldTypeError(field, "an integer >= 1", v)
        self.kept, self.max_rank, self.max_loras = {}, max_rank, max_loras
        if not adapters:
            return
        if not isinstance(adapters, dict):
            raise InvalidRequestError("lora_adapters must map adapter names to paths.", param="lora_adapters")
        bases = {name: self._lora_base_for(name, path, None) for name, path in adapters.items()}
        read = {name: await _read(path, name) for name, path in adapters.items()}
        rank = max_rank or max(ad.rank for ad in read.values())
        for name, ad in read.items():
            pipe = bases[name].pipeline
            _add_to(pipe, ad, rank, max_loras, exact=max_rank is not None)
            bases[name].lora_adapters[name] = adapters[name]
            self.kept[name] = (bases[name].model_id, adapters[name], pipe.lora.max_rank, pipe.lora.slots)

    async def restore(self, kept: dict) -> None:
        """After the reload that follows a device loss (auto_recover): the adapters `kept` served
        before, each over its base again (one that no longer loads is logged and left out)."""
        for name, (base, path, rank, slots) in kept.items():
            self.max_loras = slots
            try:
                await self.load_lora_adapter(name, path, base, rank)
            except Exception as e:  # noqa: BLE001 - the models serve on without it
                log.warning("LoRA adapter %s not restored after the device loss: %s", name, e)


class UnknownLoraAdapterError(InvalidRequestError):
    """A request's `lora` entry names no adapter served over the model (llama.cpp: invalid adapter id)."""

    def __init__(self, param: str, got: object, names: list[str]):
        served = ", ".join(f"{i}: {n!r}" for i, n in enumerate(names)) or "none"
        super().__init__(f"`{param}` names no LoRA adapter of this model, got {got!r}; its adapters "
                         f"(id: name, in load order) are {served}.", param=param)


def request_adapter(lm, req: dict) -> str | None:
    """The adapter entry (models/lora.py adapter_key) a request's rows run with, or None (the base).
    Its `lora` (llama.cpp's per-request scales: [{"id": N, "scale": S}], N the adapter's place in
    load order, or {"name": NAME, ...}; scale 1 where left out) decides where given: an adapter not
    in it runs at scale 0, i.e. not at all. Else the adapter its `model` names, at scale 1, else the
    model's own (an Ollama ADAPTER layer). Several adapters apply together where their ranks add up
    to at most the pool's."""
    lora = req.get("lora")
    if lora is None:
        return req.get("model") if req.get("model") in lm.lora_adapters else lm.default_adapter
    from ..models.lora import adapter_key
    from ..protocol.errors import FieldTypeError, RangeError, UnsupportedFieldsError
    if not isinstance(lora, list):
        raise FieldTypeError("lora", 'a list of {"id" or "name", "scale"} objects', lora)
    names, scales = list(lm.lora_adapters), {}
    for i, e in enumerate(lora):
        at = f"lora[{i}]"
        if not isinstance(e, dict) or set(e) - {"id", "name", "scale"} or ("id" in e) == ("name" in e):
            raise FieldTypeError(at, 'an object with "id" (an adapter\'s place in load order) or "name", '
                                     'and "scale"', e)
        field, kind = ("id", int) if "id" in e else ("name", str)
        ref, scale = e[field], e.get("scale", 1.0)
        if type(ref) is not kind:
            raise FieldTypeError(f"{at}.{field}", "an integer" if kind is int else "a string", ref)
        if not (0 <= ref < len(names) if kind is int else ref in names):
            raise UnknownLoraAdapterError(f"{at}.{field}", ref, names)
        name = names[ref] if kind is int else ref
        if type(scale) not in (int, float):
            raise FieldTypeError(f"{at}.scale", "a number", scale)
        if not 0.0 <= scale < float("inf"):
            raise RangeError(f"{at}.scale", 0, float("inf"), scale,
                             extra="0 leaves the adapter out, 1 is the adapter as trained")
        if name in scales:
            raise UnsupportedFieldsError("lora", f"adapter {name!r} is listed twice; give each once.")
        scales[name] = float(scale)
    on = {n: s for n, s in scales.items() if s != 0.0}
    if len(on) > 1:
        lm.pipeline.lora.check_together(on)
    return adapter_key(on) if on else None


async def record_adapter(pipe, rec) -> str:
    """The adapter of model record `rec` (ModelRecord.lora: an Ollama ADAPTER layer) registered with
    its just-loaded pipeline under a name no request can give: the adapter its requests run with."""
    name = f"{rec.model_id}\0adapter"
    _add_to(pipe, await _read(rec.lora, name), None, None)
    return name


async def _read(path: str, name: str):
    """models/lora.py's adapter at `path` (a worker thread reads it, except in the page)."""
    from ..models.lora import load_adapter
    return load_adapter(path, name) if IN_BROWSER else await asyncio.to_thread(load_adapter, path, name)


def _add_to(pipe, adapter, max_rank: int | None, slots: int | None, exact: bool = False) -> None:
    """Register models/lora.py LoraAdapter `adapter` with chat pipeline `pipe` (checked against the
    model now, uploaded into the pool on first use; the base is not reloaded). The pool is made for
    the first adapter, of rank max(max_rank, its rank) (`exact`: max_rank, a larger one refused) and
    `slots` adapters, and its scheduler's rows read it."""
    from ..models.lora import DEFAULT_MAX_RANK, DEFAULT_SLOTS, LoraPool
    if pipe.lora is None:
        rank = max_rank if exact else max(max_rank or DEFAULT_MAX_RANK, adapter.rank)
        pipe.lora = LoraPool(pipe.model, max_rank=rank, slots=slots or DEFAULT_SLOTS, owner=pipe.owner)
        pipe.scheduler.fwd.attach_lora(pipe.lora)
    pipe.lora.register(adapter)
