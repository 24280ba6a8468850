"""wgpu-py's private names, every use of them in this one module, each with the public API as its
fallback. The native backend (native.py) takes two fast paths wgpu-py 0.32 offers only privately:

- Per-dispatch calls straight into wgpu-native: a compute pass's set_pipeline, set_bind_group and
  dispatch_workgroups call wgpu-native's C functions through wgpu-py's cffi module
  (`wgpu.backends.wgpu_native._ffi`) on the objects' `._internal` handles. wgpu-py's methods wrap
  each C call in an error scope of its own (about 7 us a call; a SmolLM2 decode step makes about
  480 of them), though wgpu-native records a pass's errors in its encoder and reports them at
  finish(), which keeps wgpu-py's wrapper (so errors stay typed).
- Mapping without wgpu-py's sync submit: map_async's mode "READ_NOSYNC" skips the empty submit that
  wgpu-py makes before mapping for reading (gfx-rs/wgpu-native#305). Where a submit blocks until the
  GPU drains (lavapipe), that submit held the event loop; the native device makes it itself from a
  worker thread and then maps with this mode.

The fallback covers both: where a name is missing (a wgpu-py other than the pinned `<0.33`), or with
$WEBGPU_ENGINE_WGPU_PUBLIC=1 (or `wgpu_calls(public=True)`), the pass's public methods run (the same
commands, more host time per dispatch) and maps use wgpu.MapMode.READ (the same bytes; wgpu-py's own
sync submit then runs on the event loop too, after the device's, which has already waited for the
GPU: it blocks the loop only where other work was submitted in between).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

import wgpu

from .encoding import PassApi

PUBLIC_ENV = "WEBGPU_ENGINE_WGPU_PUBLIC"
_log = logging.getLogger("webgpu_engine.gpu")

# wgpu-py's public spelling of the calls encode_ops makes
_NAMES = ("begin_compute_pass", "set_pipeline", "set_bind_group", "dispatch_workgroups", "end",
          "copy_buffer_to_buffer")
PUBLIC_PASS = PassApi(*_NAMES)


@dataclass(frozen=True)
class _DirectPassApi(PassApi):
    """The per-dispatch calls on wgpu-native's C functions; the ops hold the pipelines and bind groups
    until the submit."""

    fns: tuple = field(default=(), compare=False)   # set pipeline, set bind group, dispatch, NULL

    def calls(self, cpass) -> tuple:
        h = getattr(cpass, "_internal", None)
        if h is None:                       # a pass without wgpu-native's handle: its own methods
            return super().calls(cpass)
        set_pipeline, set_bind_group, dispatch, null = self.fns
        return (lambda p: set_pipeline(h, p._internal), lambda bg: set_bind_group(h, 0, bg._internal, 0, null),
                lambda x, y, z: dispatch(h, x, y, z))


@functools.cache
def _direct_pass() -> PassApi | None:
    """The pass spelling with direct calls, or None where this wgpu-py lacks the names."""
    try:
        from wgpu.backends.wgpu_native import _ffi
        lib = _ffi.lib
        fns = (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
               lib.wgpuComputePassEncoderDispatchWorkgroups, _ffi.ffi.NULL)
    except (ImportError, AttributeError) as e:
        _log.warning("wgpu-py %s: no direct dispatch calls (%s); its public methods run", wgpu.__version__, e)
        return None
    return _DirectPassApi(*_NAMES, fns=fns)


@functools.cache
def _read_synced_mode():
    """map_async's mode for a read whose sync submit was made: READ_NOSYNC where this wgpu-py's
    map_async knows it (a constant it compares the mode with), else READ."""
    try:
        from wgpu.backends.wgpu_native import GPUBuffer
        known = "READ_NOSYNC" in GPUBuffer.map_async.__code__.co_consts
    except (ImportError, AttributeError):
        known = False
    if not known:
        _log.warning("wgpu-py %s: no READ_NOSYNC map mode; maps for reading make wgpu-py's sync submit",
                     wgpu.__version__)
    return "READ_NOSYNC" if known else wgpu.MapMode.READ


@dataclass(frozen=True)
class WgpuCalls:
    """How the native backend makes the calls that have a private fast path."""

    pass_api: PassApi       # encode_ops's spelling of the pass calls
    map_read_synced: object  # map_async's mode for reading once the device made the sync submit itself

    @property
    def direct_dispatch(self) -> bool:
        return self.pass_api is not PUBLIC_PASS

    @property
    def nosync_map(self) -> bool:
        return self.map_read_synced == "READ_NOSYNC"


def wgpu_calls(public: bool | None = None) -> WgpuCalls:
    """The fast paths this wgpu-py has, or none with `public` (default: $WEBGPU_ENGINE_WGPU_PUBLIC set
    to anything but 0 / false / no)."""
    if public is None:
        public = os.environ.get(PUBLIC_ENV, "").strip().lower() not in ("", "0", "false", "no")
    if public:
        return WgpuCalls(PUBLIC_PASS, wgpu.MapMode.READ)
    return WgpuCalls(_direct_pass() or PUBLIC_PASS, _read_synced_mode())


__all__ = ["PUBLIC_ENV", "PUBLIC_PASS", "WgpuCalls", "wgpu_calls"]
