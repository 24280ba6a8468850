"""Device loss (AsyncMLCEngine, engine.py): the request in flight fails with DeviceLostError, every
model is dropped, and later requests get ModelNotLoadedError — unless `EngineConfig.auto_recover`, in
which case the next request re-creates the device and reloads the same models from the cache
(requests that were queued at the loss had started no GPU work: they wait for that reload and run on
the reloaded model). A loss during reload() is handled alike. An intentional unload() (or reload())
is never a loss: requests running on a dropped model get ModelUnloadedError.
Standard library only at module level (this runs in the browser too).
"""
from __future__ import annotations

import asyncio
import logging

from ..errors import DeviceLostError, ModelUnloadedError
from .loading import LoadedModel

log = logging.getLogger("webgpu_engine.engine")


class DeviceLossHandling:
    """AsyncMLCEngine's device-loss half (a mixin: engine.py's __init__ sets the state used here)."""

    def on_device_lost(self, err: BaseException) -> None:
        """Drop every model and all GPU state after a loss (called by the request that saw it)."""
        if self.state == "device_lost":
            return
        log.error("%s (dropping all loaded models%s)", err,
                  "; they reload on the next request" if self.config.auto_recover else "")
        self.device_lost_reason = getattr(err, "detail", None) or str(err)
        models, self.models = self.models, {}
        for lm in models.values():
            lm.dropped_by_loss = True
            self._dispose(lm)
        if self.device is not None and not self.device.lost:
            self.device.mark_lost(str(err))
        self.device = None           # dead; get_device() requests a fresh one on the next reload
        self.state = "device_lost"

    def _lost_error(self, e: BaseException, dev, what: str) -> DeviceLostError:
        """A DeviceLostError saying what was lost and during what (the class adds what to try)."""
        reason = (dev.lost_reason if dev is not None else None) or self.device_lost_reason
        if not reason:
            reason = getattr(e, "detail", None) or str(e) or type(e).__name__
        detail = f"{reason}, during {what}"
        if self.config.auto_recover and self._last_reload:
            detail += (f" (auto_recover is on: the next request reloads "
                       f"{', '.join(self._last_reload[0])} on a new device)")
        err = DeviceLostError(detail)
        err.detail = detail
        return err

    def _dropped_error(self, lm: LoadedModel, request_name: str) -> Exception:
        """Why a request's model is gone: a device loss, or an intentional unload/reload (never a loss)."""
        if self.state == "device_lost":
            err = DeviceLostError(self.device_lost_reason or "")
            err.detail = self.device_lost_reason
            return err
        return ModelUnloadedError(lm.model_id, request_name)

    def check_loaded(self, lm: LoadedModel, request_name: str) -> None:
        """Raise when `lm` was dropped (unload, reload, device loss) since the request picked it."""
        if self.models.get(lm.model_id) is not lm:
            raise self._dropped_error(lm, request_name)

    async def _maybe_recover(self) -> None:
        if self._recovering is not None:
            # Another request is already reloading: wait for it (its failure is reported to it;
            # here the model lookup that follows says what is loaded).
            await asyncio.wait([self._recovering])
            return
        if self.state != "device_lost" or not self.config.auto_recover or self._last_reload is None:
            return
        self._recovering = asyncio.get_running_loop().create_future()
        try:
            ids, opts = self._last_reload
            log.warning("recovering from device loss: new device, reloading %s", ids)
            loras = dict(self.lora.kept)              # lora.py: the adapters served before
            await self.reload(ids, opts)
            await self.lora.restore(loras)
        finally:
            self._recovering.set_result(None)
            self._recovering = None

    async def guard(self, awaitable, lm: LoadedModel | None = None, what: str = "a GPU step"):
        """Await one pipeline step (`what` of model `lm`, e.g. "decode"); on device loss drop all GPU
        state and raise a DeviceLostError that says during what it happened.

        A failure of a model that an intentional unload()/reload() dropped while the step ran is
        reported as ModelUnloadedError, never as a device loss. Any error while the device is lost
        counts as the loss (a destroyed device fails calls in many ways).
        A cancelled caller (client gone, consumer stopped) still lets the step in flight finish:
        abandoning a readback half-way would leave the pipeline's buffers in an unusable state, and
        one decode step is short."""
        task = asyncio.ensure_future(awaitable)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                self._classify(task.exception(), lm, what)
            raise
        except Exception as e:
            err = self._classify(e, lm, what)
            if err is e:
                raise
            raise err from e

    def _classify(self, e: Exception, lm: LoadedModel | None, what: str) -> Exception:
        """The error a request sees for a failed step (see guard); handles a device loss on the way."""
        if lm is not None and self.models.get(lm.model_id) is not lm and self.state != "device_lost":
            return ModelUnloadedError(lm.model_id, what)
        dev = lm.pipeline.dev if lm is not None else None
        dev = dev if dev is not None else self.device
        if isinstance(e, DeviceLostError) or (dev is not None and dev.lost) or self.state == "device_lost":
            err = self._lost_error(e, dev, f"{what} of model {lm.model_id}" if lm is not None else what)
            self.on_device_lost(err)
            return err
        return e
