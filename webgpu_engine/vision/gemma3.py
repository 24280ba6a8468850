"""Gemma 3's image path on the host: its vision config (config.json's `vision_config` and image
tokens), its image processor (resize to the tower's square, rescale, normalise: Gemma3ImageProcessor
without pan-and-scan) and the prompt expansion its processor does (each `<start_of_image>` the chat
template writes becomes "\\n\\n<start_of_image>" + N soft tokens + "<end_of_image>\\n\\n").

The tower itself runs on the GPU (models/siglip.py). Pillow and numpy only (both in Pyodide).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFormatError, UnsupportedModelError

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


@dataclass(frozen=True)
class VisionConfig:
    """A SigLIP tower and Gemma 3's projector, from config.json, and its image processor's settings."""

    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    image_size: int                  # the square the processor resizes to
    patch_size: int
    eps: float                       # the tower's LayerNorms and the projector's RMSNorm
    text_hidden: int
    tokens_per_image: int            # soft tokens per image (a square number)
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    size: tuple = (0, 0)             # processor's (height, width); defaults to image_size
    resample: int = 2                # PIL's BILINEAR
    rescale: float = 1 / 255
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """The projector's average-pool kernel: patches per side over soft tokens per side."""
        return self.patches_per_side // round(self.tokens_per_image ** 0.5)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def full_image_sequence(self) -> str:
        """What one image's `<start_of_image>` becomes in the prompt text (Gemma3Processor's)."""
        return f"\n\n{BOI}{IMAGE * self.tokens_per_image}{EOI}\n\n"


def read_vision_config(folder) -> VisionConfig | None:
    """The vision config of a Gemma3ForConditionalGeneration folder; None for a text-only folder."""
    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    v = c.get("vision_config")
    if not isinstance(v, dict):
        return None
    archs = c.get("architectures") or []
    if "Gemma3ForConditionalGeneration" not in archs:
        raise UnsupportedModelError(f"{folder}: images run for Gemma3ForConditionalGeneration only, not {archs}")
    if v.get("vision_use_head"):
        raise UnsupportedModelError(f"{folder}: a SigLIP tower with its pooling head is not read (Gemma 3 has none)")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise UnsupportedModelError(f"{folder}: vision hidden_act {act!r} is not implemented (GELU-tanh only)")
    text = c.get("text_config") or {}
    try:
        cfg = VisionConfig(
            hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            n_layers=int(v["num_hidden_layers"]), n_heads=int(v["num_attention_heads"]),
            image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
            eps=float(v.get("layer_norm_eps", 1e-6)), text_hidden=int(text["hidden_size"]),
            tokens_per_image=int(c.get("mm_tokens_per_image", 256)),
            image_token_id=int(c.get("image_token_index", c.get("image_token_id", 262144))),
            boi_token_id=int(c.get("boi_token_index", 255999)), eoi_token_id=int(c.get("eoi_token_index", 256000)),
            **_processor(folder))
    except KeyError as e:
        raise ModelFormatError(f"{folder}/config.json's vision_config lacks {e.args[0]}") from e
    side = round(cfg.tokens_per_image ** 0.5)
    if side * side != cfg.tokens_per_image or cfg.patches_per_side % side:
        raise ModelFormatError(f"{folder}: mm_tokens_per_image {cfg.tokens_per_image} does not pool a "
                               f"{cfg.patches_per_side}x{cfg.patches_per_side} patch grid")
    if not cfg.size[0]:
        cfg = VisionConfig(**{**cfg.__dict__, "size": (cfg.image_size, cfg.image_size)})
    return cfg


def _processor(folder: Path) -> dict:
    """Gemma3ImageProcessor's settings: processor_config.json's `image_processor` (transformers 5) or
    preprocessor_config.json (the hub's releases); pan-and-scan is refused by name."""
    p = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = folder / name
        if f.is_file():
            raw = json.loads(f.read_text(encoding="utf-8"))
            p = raw.get("image_processor", raw)
            break
    if p.get("do_pan_and_scan"):
        raise UnsupportedModelError(f"{folder}: the image processor's pan-and-scan crops are not implemented")
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if p.get(flag) is False:
            raise UnsupportedModelError(f"{folder}: an image processor with {flag} false is not implemented")
    out = {}
    size = p.get("size") or {}
    if "height" in size and "width" in size:
        out["size"] = (int(size["height"]), int(size["width"]))
    if "resample" in p:
        out["resample"] = int(p["resample"])
    if "rescale_factor" in p:
        out["rescale"] = float(p["rescale_factor"])
    for key, name in (("image_mean", "mean"), ("image_std", "std")):
        if key in p:
            val = p[key]
            out[name] = tuple(float(x) for x in (val if isinstance(val, list) else [val] * 3))
    return out


def preprocess(cfg: VisionConfig, image) -> "np.ndarray":
    """pixel_values (3, H, W) f32 of one RGB PIL image, as Gemma3ImageProcessor computes them: resized
    by Pillow (uint8, the processor's resample), times rescale, minus mean, over std."""
    import numpy as np
    h, w = cfg.size
    im = image.resize((w, h), resample=cfg.resample, reducing_gap=None)
    a = np.asarray(im, dtype=np.uint8).astype(np.float64) * cfg.rescale
    a = ((a.astype(np.float32) - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32))
    return np.ascontiguousarray(a.transpose(2, 0, 1), dtype=np.float32)


def patches(cfg: VisionConfig, pixels) -> "np.ndarray":
    """The (P*P, 3 p p) rows of pixel_values (3, H, W) that the patch embedding's matmul reads: patch
    (r, c) row-major, each in the conv weight's (channel, y, x) order."""
    p, P = cfg.patch_size, cfg.patches_per_side
    return pixels.reshape(3, P, p, P, p).transpose(1, 3, 0, 2, 4).reshape(P * P, 3 * p * p)
