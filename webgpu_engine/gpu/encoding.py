"""Command encoding shared by the backends: a batch's ops (base.Batch: dispatches, copies,
readbacks) into one command encoder, in each backend's spelling of the WebGPU calls. Standard
library only (runs in the page)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Buffer, round_up4


@dataclass(frozen=True)
class PassApi:
    """A backend's spelling (method names) of the command-encoding calls that `encode_ops` makes."""

    begin: str            # encoder.begin() -> compute pass
    set_pipeline: str     # pass.set_pipeline(raw pipeline)
    set_bind_group: str   # pass.set_bind_group(0, raw bind group)
    dispatch: str         # pass.dispatch(x, y, z)
    end: str              # pass.end()
    copy: str             # encoder.copy(src raw, src offset, dst raw, dst offset, size)

    def calls(self, cpass) -> tuple:
        """(set_pipeline(raw pipeline), set_bind_group(raw bind group) at index 0, dispatch(x, y, z))
        on `cpass`: the three calls every dispatch makes (a backend may call its API more directly)."""
        bind = getattr(cpass, self.set_bind_group)
        return getattr(cpass, self.set_pipeline), lambda bg: bind(0, bg), getattr(cpass, self.dispatch)


def encode_ops(ops: list, enc, api: PassApi) -> None:
    """Encode a batch's ops in order: consecutive dispatches share one compute pass (the pipeline is
    set only when it changes); a buffer copy ends the pass."""
    cpass = last_pipe = None
    for op in ops:
        if op[0] == "d":
            if cpass is None:
                cpass, last_pipe = getattr(enc, api.begin)(), None
                set_pipeline, set_bind_group, dispatch = api.calls(cpass)
            _, pipe, bg, x, y, z = op
            if pipe.raw is not last_pipe:
                set_pipeline(pipe.raw)
                last_pipe = pipe.raw
            set_bind_group(bg.raw)
            dispatch(x, y, z)
        else:
            if cpass is not None:
                getattr(cpass, api.end)()
                cpass = None
            if op[0] == "r":                 # a readback: into the staging buffer submit() gave it
                rb = op[1]
                getattr(enc, api.copy)(rb.src.raw, rb.offset, rb.staging, 0, round_up4(rb.n))
                continue
            _, src, so, dst, do, n = op
            getattr(enc, api.copy)(src.raw, so, dst.raw, do, n)
    if cpass is not None:
        getattr(cpass, api.end)()


def released_buffer(ops: list) -> "Buffer | None":
    """A buffer a batch's ops use that was released since they were recorded (None: all alive)."""
    for op in ops:
        if op[0] == "d":
            bufs = (b[0] if isinstance(b, tuple) else b for b in op[2].buffers)
        elif op[0] == "c":
            bufs = (op[1], op[3])
        else:
            bufs = (op[1].src,)
        for b in bufs:
            if not b.alive:
                return b
    return None
