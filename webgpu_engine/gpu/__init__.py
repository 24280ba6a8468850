"""GPU layer: one interface (`Device`), a native backend (wgpu-py) and a browser backend (Pyodide)."""
from __future__ import annotations

import sys

from .base import STORAGE, UNIFORM, AdapterInfo, Batch, BindGroup, Buffer, Device, Pipeline, round_up4

IN_BROWSER = sys.platform == "emscripten"


async def request_device(adapter_name: str | None = None, power_preference: str = "high-performance",
                         required_features: tuple[str, ...] = ()) -> Device:
    """A device on the best adapter of this platform (navigator.gpu inside Pyodide, wgpu-py elsewhere)."""
    if IN_BROWSER:
        from .browser import request_device as req
    else:
        from .native import request_device as req
    return await req(adapter_name=adapter_name, power_preference=power_preference,
                     required_features=required_features)


def request_device_sync(**kw) -> Device:
    import asyncio
    return asyncio.run(request_device(**kw))


__all__ = ["Device", "Buffer", "Pipeline", "BindGroup", "Batch", "AdapterInfo", "STORAGE", "UNIFORM",
           "round_up4", "request_device", "request_device_sync", "IN_BROWSER"]
