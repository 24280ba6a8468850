"""LoRA adapter files, read host side (models/lora.py puts them on the GPU): PEFT folders
(adapter_config.json + adapter_model.safetensors) and llama.cpp's GGUF LoRA files
(convert_lora_to_gguf.py's), as LoraAdapter: rank, scale and per (layer, target) its A and B.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidRequestError

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# fused projections (Phi-3's qkv_proj, gate_up_proj; GGUF attn_qkv, an ffn_up of 2 x ffn rows): one
# A over the input, B over the whole fused output; split on registering into its parts' targets,
# each with the same A and its own rows of B (models/lora.py split_fused)
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
_PEFT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj"
                        r"\.lora_(A|B)\.weight$")
_MODULES = "q/k/v/o/gate/up/down (or fused qkv / gate_up)"


class LoraAdapterError(InvalidRequestError):
    """An adapter that does not fit the loaded model, or one this engine cannot read; the message
    names the file part (tensor, config key) and what was expected."""


@dataclass
class LoraAdapter:
    """One adapter, host side: rank, scale, and per (layer, target) its A (r, K) and B (N, r) f32
    numpy arrays (B not yet scaled)."""

    name: str
    rank: int
    scale: float
    weights: dict = field(default_factory=dict)       # (layer, target) -> (A, B)
    source: str = ""
    names: dict = field(default_factory=dict)         # (layer, target) -> A's name in the file
    arch: str = ""                                     # a GGUF adapter's architecture (its base's)
    qk_permuted: bool = False                          # B's q / k rows in llama.cpp's permuted order

    @property
    def targets(self) -> set:
        return {t for _, t in self.weights}


def bf16_values(h):
    """bf16 bits (uint16) as the f32 values they are (exact)."""
    import numpy as np
    return (np.asarray(h, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _decode(t):
    """A TensorInfo's values as an f32 numpy array of its shape."""
    import numpy as np
    raw = bytes(t.data)
    if t.qtype == "f32":
        v = np.frombuffer(raw, np.float32)
    elif t.qtype == "f16":
        v = np.frombuffer(raw, np.float16).astype(np.float32)
    elif t.qtype == "bf16":
        v = bf16_values(np.frombuffer(raw, np.uint16))
    elif t.qtype == "q8_0":                # convert_lora_to_gguf.py --outtype q8_0: blocks of f16 d, 32 int8
        blocks = np.frombuffer(raw, np.dtype([("d", "<f2"), ("q", "i1", (32,))]))
        v = blocks["q"].astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
    else:
        raise LoraAdapterError(f"LoRA tensor {t.name!r} is {t.qtype}; adapters must be f32, f16, bf16 or q8_0.")
    return v.reshape(t.shape).astype(np.float32)


def load_peft(path, name: str | None = None) -> LoraAdapter:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) as a LoraAdapter."""
    from ..loaders.safetensors import SafetensorsFile
    folder = Path(path)
    conf_path, st_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not conf_path.is_file() or not st_path.is_file():
        raise LoraAdapterError(f"{folder} is not a PEFT LoRA folder: it needs adapter_config.json and "
                               f"adapter_model.safetensors.", param="lora_path")
    try:
        conf = json.loads(conf_path.read_text())
    except ValueError as e:
        raise LoraAdapterError(f"{conf_path}: not JSON ({e}).", param="lora_path") from None
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{conf_path}: peft_type {conf.get('peft_type')!r} is not LORA.", param="lora_path")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if conf.get(key) == bad:
            raise LoraAdapterError(f"{conf_path}: {key} {bad} is not supported.", param="lora_path")
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key):
            raise LoraAdapterError(f"{conf_path}: per-module {key} is not supported.", param="lora_path")
    if conf.get("bias", "none") != "none" or conf.get("modules_to_save"):
        raise LoraAdapterError(f"{conf_path}: adapters that train biases or whole modules (bias, "
                               f"modules_to_save) are not supported.", param="lora_path")
    r, alpha = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    ad = LoraAdapter(name or folder.name, r, scale, source=str(folder))
    f = SafetensorsFile(st_path)
    try:
        parts: dict = {}
        for tname, t in f.tensors.items():
            m = _PEFT_NAME.search(tname)
            if m is None:
                raise LoraAdapterError(f"{st_path.name}: tensor {tname!r} is not a LoRA A/B of a {_MODULES}"
                                       f"_proj of a decoder layer (*.self_attn.* / *.mlp.*): adapters "
                                       f"of other modules are not supported.", param="lora_path")
            parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = (tname, _decode(t))
    finally:
        f.close()
    _pair(ad, parts, st_path.name)
    return ad


_GGUF_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_(a|b)$")


def load_gguf(path, name: str | None = None) -> LoraAdapter:
    """A llama.cpp GGUF LoRA file (convert_lora_to_gguf.py's) as a LoraAdapter."""
    from ..loaders.decoder_config import FAMILIES
    from ..loaders.gguf import GGUFFile, our_name
    g = GGUFFile(path)
    try:
        meta = g.metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise LoraAdapterError(f"{path}: not a GGUF LoRA adapter (general.type {meta.get('general.type')!r}, "
                                   f"adapter.type {meta.get('adapter.type')!r}).", param="lora_path")
        parts: dict = {}
        for tname, t in g.tensors.items():
            m = _GGUF_NAME.match(tname)
            ours = our_name(f"blk.{m.group(1)}.{m.group(2)}.weight") if m else None
            target = ours.rsplit(".", 1)[1] if ours else None
            if target not in TARGETS and target not in FUSED:
                raise LoraAdapterError(f"{Path(path).name}: tensor {tname!r} is not a LoRA a/b of a {_MODULES} "
                                       f"projection of a decoder layer: adapters of other tensors are not "
                                       f"supported.", param="lora_path")
            parts.setdefault((int(m.group(1)), target), {})[m.group(3)] = (tname, _decode(t))
        arch = g.architecture
    finally:
        g.close()
    ranks = {ab["b"][1].shape[1] for ab in parts.values() if "b" in ab}
    if len(ranks) != 1:
        raise LoraAdapterError(f"{path}: its lora_b tensors have ranks {sorted(ranks)}; one rank is needed.",
                               param="lora_path")
    r = ranks.pop()
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    fam = FAMILIES.get(arch)
    ad = LoraAdapter(name or Path(path).stem, r, alpha / r if alpha else 1.0, source=str(path), arch=arch,
                     qk_permuted=fam is not None and not fam.gguf_neox)
    _pair(ad, {k: {ab.upper(): v for ab, v in d.items()} for k, d in parts.items()}, Path(path).name)
    return ad


def _pair(ad: LoraAdapter, parts: dict, where: str) -> None:
    """ad.weights from {(layer, target): {"A": (name, array), "B": (name, array)}}, checked."""
    for key, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            tname = next(iter(ab.values()))[0]
            raise LoraAdapterError(f"{where}: tensor {tname!r} has no lora_{'B' if 'A' in ab else 'A'} "
                                   f"beside it.", param="lora_path")
        (an, a), (bn, b) = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != ad.rank or b.shape[1] != ad.rank:
            raise LoraAdapterError(f"{where}: tensor {an!r} {a.shape} / {bn!r} {b.shape} do not have "
                                   f"the rank r = {ad.rank} of the adapter.", param="lora_path")
        ad.weights[key], ad.names[key] = (a, b), an
    if not ad.weights:
        raise LoraAdapterError(f"{where}: no LoRA tensors.", param="lora_path")


def _is_gguf(p: Path) -> bool:
    """Whether `p` is a GGUF file, by its magic (an Ollama blob has no .gguf suffix)."""
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def load_adapter(path, name: str | None = None) -> LoraAdapter:
    """An adapter from `path`: a PEFT folder (or a file inside one), or a GGUF LoRA file."""
    p = Path(path)
    if _is_gguf(p):
        return load_gguf(p, name)
    if p.is_file() and p.name in ("adapter_config.json", "adapter_model.safetensors"):
        p = p.parent
    if p.is_dir():
        return load_peft(p, name)
    raise LoraAdapterError(f"LoRA adapter {path!r} not found: give a PEFT adapter folder or a GGUF LoRA "
                           f"file.", param="lora_path")
