"""LoRA adapters served beside their base (vLLM's --lora-modules, /v1/load_lora_adapter): a loaded
chat model keeps its adapters by name (LoadedModel.lora_adapters: name -> path); a request whose
`model` is an adapter's name runs on the base with that adapter (models/lora.py), in the same
batch as the base's and other adapters' requests. The AsyncMLCEngine mix-in; standard library only.
"""
from __future__ import annotations

import asyncio

from ..errors import InvalidRequestError, ModelNotLoadedError, SpecifiedModelNotFoundError
from ..gpu import IN_BROWSER
from .records import LLM


class LoraAdapters:
    """AsyncMLCEngine's adapter half (engine.py's __init__ sets `models`)."""

    def lora_base(self, name: str | None):
        """The LoadedModel that serves adapter `name`, or None."""
        return next((lm for lm in self.models.values() if name in lm.lora_adapters), None)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, model: str | None = None,
                                max_rank: int | None = None) -> None:
        """Register adapter `lora_name` from `lora_path` (a PEFT folder) over the loaded chat model
        `model` (default: the one loaded chat model) without reloading it; requests then pick it by
        `model` = lora_name. Refused (LoraAdapterError, naming the tensor) where it does not fit."""
        from ..models.lora import load_adapter
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
        ad = load_adapter(lora_path, lora_name) if IN_BROWSER else \
            await asyncio.to_thread(load_adapter, lora_path, lora_name)
        lm.pipeline.add_lora(ad, max_rank)
        lm.lora_adapters[lora_name] = lora_path

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Forget adapter `lora_name` (refused while requests run with it)."""
        lm = self.lora_base(lora_name)
        if lm is None:
            raise SpecifiedModelNotFoundError(list(self.models) + self.lora_names(), lora_name)
        lm.pipeline.lora.unregister(lora_name)
        del lm.lora_adapters[lora_name]

    def lora_names(self) -> list[str]:
        return [n for lm in self.models.values() for n in lm.lora_adapters]

    async def _load_lora_adapters(self, adapters: dict | None) -> None:
        """reload()'s lora_adapters {name: path}: each over the one chat model loaded, the pool's rank
        the largest of theirs."""
        if not adapters:
            return
        if not isinstance(adapters, dict):
            raise InvalidRequestError("lora_adapters must map adapter names to paths.", param="lora_adapters")
        from ..models.lora import load_adapter
        ranks = [load_adapter(p, n).rank for n, p in adapters.items()]
        for name, path in adapters.items():
            await self.load_lora_adapter(name, path, max_rank=max(ranks))
