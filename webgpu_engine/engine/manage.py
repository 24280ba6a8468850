"""Models on a running engine: load one more model beside those already loaded, or unload one, while
the others keep serving (the server's admin routes; reload() replaces every model at once instead).

A load goes through the same steps as reload(): the reference resolves into a record, the features
and the memory estimate are checked against what the loaded models already hold before anything is
allocated, and a failed or cancelled load frees what it allocated. An unloaded model's requests in
flight or queued fail with ModelUnloadedError, as after unload(). With auto_recover, the models a
device loss reloads are the ones loaded at that moment.
Standard library only (this runs in the browser too).
"""
from __future__ import annotations

from ..errors import InvalidRequestError, ModelManagementConflictError, SpecifiedModelNotFoundError
from .engine import AsyncMLCEngine
from .residency import LoadedModel


async def load_model(engine: AsyncMLCEngine, model: str, chat_opts: dict | None = None,
                     alias: str | None = None) -> LoadedModel:
    """Load `model` (an app-config id or a model reference, named `alias` when given) next to the
    loaded models; typed errors as reload()'s, and ModelManagementConflictError (409) when its id
    is loaded already or a reload() runs."""
    if chat_opts is not None and not isinstance(chat_opts, dict):
        raise InvalidRequestError("`chat_opts` must be an object of ChatOptions fields.", param="chat_opts")
    async with engine.loader.manage_lock:
        if engine.state == "loading":
            raise ModelManagementConflictError("A reload of every model is in progress; load the model "
                                               "when it has finished.")
        return await engine.loader.load_beside(model, chat_opts, alias)


async def unload_model(engine: AsyncMLCEngine, model_id: str) -> None:
    """Unload one model and free its GPU memory; the others keep serving."""
    async with engine.loader.manage_lock:
        if engine.held.remove(model_id) is None:
            raise SpecifiedModelNotFoundError(list(engine.models), model_id)
