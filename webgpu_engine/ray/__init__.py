"""Scaling out on Ray (the optional `[ray]` extra): Ray Data batch inference (batch.py) and Ray Serve
replicas behind one HTTP endpoint (deployment.py, router.py, proxy.py, launch.py).

Ray is imported only by this package and the commands that use it; importing
`webgpu_engine.ray` itself is light, each function imports Ray when called.
"""
from __future__ import annotations

from typing import Any

__all__ = ["embed_dataset", "generate_dataset"]


def __getattr__(name: str) -> Any:
    if name in ("embed_dataset", "generate_dataset"):
        from . import batch
        return getattr(batch, name)
    raise AttributeError(name)
