"""Measured matmul kernel choices per adapter, kept in the artifact cache's `profiles` scope.

The tuner (kernels/tune.py) times the candidate kernels on a model's real shapes and stores, per
adapter, one JSON file `<cache root>/profiles/<adapter id>/matmul.json`:

    {"adapter": {"vendor": ..., "architecture": ..., "driver": ..., "device": ..., "backend": ...},
     "choices": {"q4_1|1536|576|t1": "decode-r2-l16-w64", "q4_1|1536|576|prefill": "base", ...},
     "timings": {...}}

A choice is a matmul/gpu.py variant key or "base" (the kernels the adapter's built-in strategy runs
there). The matmul package (select.py) reads the choices through `choice` when the kernel family is "tuned". The adapter
id is derived from vendor, architecture, driver (the adapter's description), device name and
backend, so a driver update starts a new profile. Beside it, `batch.json` keeps the decode batch
width measured for the adapter (`load_width` / `save_width`: bench/batch_width.py). Page code: standard library only.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from ..cache.artifact import cache_root, model_dir

SCOPE = "profiles"
FILE = "matmul.json"
BASE = "base"              # a choice: the adapter's built-in kernels for that shape
MAX_DECODE_T = 8

_loaded: dict = {}         # adapter id -> choices (or {} when none is stored), read once per process


def adapter_fields(dev) -> dict:
    i = dev.info
    return {"vendor": i.vendor, "architecture": i.architecture, "driver": i.description,
            "device": i.device, "backend": i.backend, "adapter_type": i.adapter_type}


def adapter_id(dev) -> str:
    """A file-system-safe id for the adapter: readable name + hash of every field."""
    f = adapter_fields(dev)
    text = "|".join(f[k] or "" for k in ("vendor", "architecture", "driver", "device", "backend"))
    name = re.sub(r"[^A-Za-z0-9]+", "-", f"{f['vendor']}-{f['device'] or f['driver']}").strip("-")[:48]
    return f"{name or 'adapter'}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def shape_key(qtype: str, n: int, k: int, T: int, row_invariant: bool) -> str:
    """The profile key of one matmul: weight type and shape, and the row class — "prefill" (row-
    invariant, any T: one kernel for every T), "t1" / "t2" / "t4" / "t8" (decode rows, bucketed) or
    "tn" (more than 8 rows that need not be row-invariant: embedders' batches)."""
    if row_invariant:
        rows = "prefill"
    elif T <= MAX_DECODE_T:
        rows = f"t{1 << (T - 1).bit_length()}"
    else:
        rows = "tn"
    return f"{qtype}|{n}|{k}|{rows}"


def path(dev, root=None) -> Path:
    return model_dir(SCOPE, adapter_id(dev), root) / FILE


def load(dev, root=None) -> dict:
    """The stored choices for this adapter ({} when none), read once per process and adapter."""
    key = (str(cache_root(root)), adapter_id(dev))
    got = _loaded.get(key)
    if got is None:
        try:
            got = dict(json.loads(path(dev, root).read_text()).get("choices", {}))
        except (OSError, ValueError, AttributeError):
            got = {}
        _loaded[key] = got
    return got


def has_profile(dev, root=None) -> bool:
    return bool(load(dev, root))


def choice(dev, qtype: str, n: int, k: int, T: int, row_invariant: bool) -> str | None:
    """The stored choice for this matmul (a variant key or BASE), None when it was not measured."""
    return load(dev).get(shape_key(qtype, n, k, T, row_invariant))


def save(dev, choices: dict, timings: dict | None = None, root=None) -> Path:
    """Store (merge into) this adapter's profile, atomically; later loads in this process see it."""
    p = path(dev, root)
    try:
        old = json.loads(p.read_text())
    except (OSError, ValueError):
        old = {}
    doc = {"adapter": adapter_fields(dev), "choices": {**old.get("choices", {}), **choices},
           "timings": {**old.get("timings", {}), **(timings or {})}}
    _write(p, doc)
    _loaded[(str(cache_root(root)), adapter_id(dev))] = dict(doc["choices"])
    return p


WIDTH_FILE = "batch.json"    # beside matmul.json: the decode width measured for this adapter


def width_path(dev, root=None) -> Path:
    return model_dir(SCOPE, adapter_id(dev), root) / WIDTH_FILE


def load_width(dev, root=None) -> int | None:
    """The batch width (`max_num_sequences` 0) measured for this adapter (bench/batch_width.py
    --store), None when none is stored; read once per process and adapter."""
    key = ("width", str(cache_root(root)), adapter_id(dev))
    if key not in _loaded:
        try:
            w = json.loads(width_path(dev, root).read_text()).get("width")
        except (OSError, ValueError, AttributeError):
            w = None
        _loaded[key] = w if isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= 256 else None
    return _loaded[key]


def save_width(dev, width: int, timings: dict | None = None, root=None) -> Path:
    """Store this adapter's measured batch width (and the step timings it was chosen from)."""
    p = width_path(dev, root)
    _write(p, {"adapter": adapter_fields(dev), "width": int(width), "timings": timings or {}})
    _loaded[("width", str(cache_root(root)), adapter_id(dev))] = int(width)
    return p


def _write(p: Path, doc: dict) -> None:
    """Write `doc` as JSON to `p` atomically (a reader sees the old file or the whole new one)."""
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.stem}-", suffix=".json", dir=p.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, p)


def forget() -> None:
    """Drop what this process has read (tests that switch cache roots)."""
    _loaded.clear()


__all__ = ["SCOPE", "FILE", "BASE", "adapter_fields", "adapter_id", "shape_key", "path", "load", "has_profile",
           "choice", "save", "WIDTH_FILE", "width_path", "load_width", "save_width", "forget"]
