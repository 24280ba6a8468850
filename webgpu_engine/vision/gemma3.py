"""Gemma 3's image path on the host: its vision config (config.json's `vision_config` and image
tokens), its image processor (resize to the tower's square, rescale, normalise: Gemma3ImageProcessor
without pan-and-scan) and the prompt expansion its processor does (each `<start_of_image>` the chat
template writes becomes "\\n\\n<start_of_image>" + N soft tokens + "<end_of_image>\\n\\n").

The tower itself runs on the GPU (models/siglip.py). Pillow and numpy only (both in Pyodide).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelFormatError, UnsupportedModelError
from .config import VisionConfig, normalisation, pixels, processor_settings, single_tile, tower_config

if TYPE_CHECKING:
    import numpy as np

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


def read_config(folder: Path, c: dict, v: dict) -> VisionConfig:
    """The vision config of a Gemma3ForConditionalGeneration folder (config.json `c`, its vision_config `v`)."""
    if v.get("vision_use_head"):
        raise UnsupportedModelError(f"{folder}: a SigLIP tower with its pooling head is not read (Gemma 3 has none)")
    cfg = tower_config(folder, c, v, tokens_per_image=int(c.get("mm_tokens_per_image", 256)),
                       image_token_id=int(c.get("image_token_index", c.get("image_token_id", 262144))),
                       marker=BOI, **_processor(folder))
    side = round(cfg.tokens_per_image ** 0.5)
    if side * side != cfg.tokens_per_image or cfg.patches_per_side % side:
        raise ModelFormatError(f"{folder}: mm_tokens_per_image {cfg.tokens_per_image} does not pool a "
                               f"{cfg.patches_per_side}x{cfg.patches_per_side} patch grid")
    return cfg if cfg.size[0] else replace(cfg, size=(cfg.image_size, cfg.image_size))


def full_image_sequence(cfg: VisionConfig, image=None) -> str:
    """What one image's `<start_of_image>` becomes in the prompt text (Gemma3Processor's)."""
    return f"\n\n{BOI}{IMAGE * cfg.tokens_per_image}{EOI}\n\n"


n_tiles = max_tiles = single_tile            # a picture is one tile


def tiles(cfg: VisionConfig, image) -> list:
    """One image's tiles: the whole picture, resized to the tower's square."""
    return [preprocess(cfg, image)]


def _processor(folder: Path) -> dict:
    """Gemma3ImageProcessor's settings: processor_config.json's `image_processor` (transformers 5) or
    preprocessor_config.json (the hub's releases); pan-and-scan is refused by name."""
    p = processor_settings(folder)
    if p.get("do_pan_and_scan"):
        raise UnsupportedModelError(f"{folder}: the image processor's pan-and-scan crops are not implemented")
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if p.get(flag) is False:
            raise UnsupportedModelError(f"{folder}: an image processor with {flag} false is not implemented")
    out = normalisation(p)
    size = p.get("size") or {}
    if "height" in size and "width" in size:
        out["size"] = (int(size["height"]), int(size["width"]))
    return out


def preprocess(cfg: VisionConfig, image) -> "np.ndarray":
    """pixel_values (3, H, W) f32 of one RGB PIL image, as Gemma3ImageProcessor computes them: resized
    by Pillow (uint8, the processor's resample), times rescale, minus mean, over std."""
    h, w = cfg.size
    return pixels(cfg, image.resize((w, h), resample=cfg.resample, reducing_gap=None))
