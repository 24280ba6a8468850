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
from .records import EngineConfig
from .residency import LoadedModel, Residency

log = logging.getLogger("webgpu_engine.engine")


class DeviceLoss:
    """What a device loss does to the engine's Residency, and the recovery auto_recover runs: the
    engine part behind AsyncMLCEngine.guard(). `reload` is the engine's ModelLoader.reload; `lora`
    its LoRA adapters (the ones served before a loss are served again after the reload)."""

    def __init__(self, config: EngineConfig, held: Residency, lora):
        self.config = config
        self.held = held
        self.lora = lora
        self.reload = None                # set by the engine: ModelLoader.reload (they refer to each other)
        self._recovering: asyncio.Future | None = None

    def lose(self, e: BaseException, dev, what: str) -> DeviceLostError:
        """Drop every model after a loss seen during `what`; the error to raise."""
        err = self.held.lost_error(e, dev, what, self.config.auto_recover)
        self.held.lose(err, self.config.auto_recover)
        return err

    async def maybe_recover(self) -> None:
        held = self.held
        if self._recovering is not None:
            # Another request is already reloading: wait for it (its failure is reported to it;
            # here the model lookup that follows says what is loaded).
            await asyncio.wait([self._recovering])
            return
        if held.state != "device_lost" or not self.config.auto_recover or held.last_reload is None:
            return
        self._recovering = asyncio.get_running_loop().create_future()
        try:
            ids, opts = held.last_reload
            log.warning("recovering from device loss: new device, reloading %s", ids)
            loras = dict(self.lora.kept)              # lora.py: the adapters served before
            # and the pool's rank and bound reload() was given, kept where no adapter is loaded yet
            await self.reload(ids, opts, lora_max_rank=self.lora.max_rank, max_loras=self.lora.max_loras)
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
        held = self.held
        if lm is not None and not held.holds(lm) and held.state != "device_lost":
            return ModelUnloadedError(lm.model_id, what)
        dev = lm.pipeline.dev if lm is not None else None
        dev = dev if dev is not None else held.device
        if isinstance(e, DeviceLostError) or (dev is not None and dev.lost) or held.state == "device_lost":
            return self.lose(e, dev, f"{what} of model {lm.model_id}" if lm is not None else what)
        return e
