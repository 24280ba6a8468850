"""Gemma 3's image path on the host: its vision config (config.json's `vision_config` and image
tokens), its image processor (resize to the tower's square, rescale, normalise: Gemma3ImageProcessor,
with its pan-and-scan crops where the processor's config turns them on) and the prompt expansion its
processor does (each `<start_of_image>` the chat template writes becomes "\\n\\n<start_of_image>" + N
soft tokens + "<end_of_image>\\n\\n"; with crops, Gemma3Processor's sentence holding one such sequence
for the picture and one for each crop).

The tower itself runs on the GPU (models/siglip.py). Pillow and numpy only (both in Pyodide).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelFormatError, UnsupportedModelError
from .config import VisionConfig, normalisation, pixels, processor_settings, tower_config

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
    one = f"\n\n{BOI}{IMAGE * cfg.tokens_per_image}{EOI}\n\n"
    crops = 0 if image is None else len(crop_boxes(cfg, *image.size))
    if not crops:
        return one
    return f"Here is the original image {one} and here are some crops to help you see better " + " ".join([one] * crops)


def crop_boxes(cfg: VisionConfig, width: int, height: int) -> list[tuple[int, int, int, int]]:
    """Gemma3ImageProcessor's pan-and-scan crops of a width x height picture, (left, top, right,
    bottom) row-major: none unless pan-and-scan is on and the picture is longer than min ratio times
    its other side; else 2 .. max crops along its long side (its aspect ratio rounded half up, no
    crop under the min size)."""
    if not cfg.pan_and_scan:
        return []
    min_crop, max_crops, min_ratio = cfg.pan_and_scan
    long, short = max(width, height), min(width, height)
    if long / short < min_ratio:
        return []
    n = min(max_crops, max(2, min(int(math.floor(long / short + 0.5)), int(math.floor(long / min_crop)))))
    cols, rows = (n, 1) if width >= height else (1, n)
    w, h = math.ceil(width / cols), math.ceil(height / rows)
    if min(w, h) < min_crop:
        return []
    return [(x, y, min(x + w, width), min(y + h, height)) for y in range(0, rows * h, h) for x in range(0, cols * w, w)]


def n_tiles(cfg: VisionConfig, image) -> int:
    """The picture and its pan-and-scan crops."""
    return 1 + len(crop_boxes(cfg, *image.size))


def max_tiles(cfg: VisionConfig) -> int:
    return 1 + (cfg.pan_and_scan[1] if cfg.pan_and_scan else 0)


def tiles(cfg: VisionConfig, image) -> list:
    """One image's tiles: the whole picture, then each pan-and-scan crop, each resized to the tower's
    square."""
    return [preprocess(cfg, im) for im in (image, *(image.crop(b) for b in crop_boxes(cfg, *image.size)))]


def _processor(folder: Path) -> dict:
    """Gemma3ImageProcessor's settings: processor_config.json's `image_processor` (transformers 5) or
    preprocessor_config.json (the hub's releases); pan-and-scan's where do_pan_and_scan is true (its
    settings null or missing: Gemma3Processor's defaults), as the image processor reads them (the
    hub's configs leave it null: off; Gemma3Processor's own call passes its defaults over the config
    unless its caller asks for pan-and-scan, as vLLM's do_pan_and_scan processor option does)."""
    p = processor_settings(folder)
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if p.get(flag) is False:
            raise UnsupportedModelError(f"{folder}: an image processor with {flag} false is not implemented")
    out = normalisation(p)
    size = p.get("size") or {}
    if "height" in size and "width" in size:
        out["size"] = (int(size["height"]), int(size["width"]))
    if p.get("do_pan_and_scan"):
        out["pan_and_scan"] = tuple(kind(p[key]) if p.get(key) is not None else default for key, kind, default in (
            ("pan_and_scan_min_crop_size", int, 256), ("pan_and_scan_max_num_crops", int, 4),
            ("pan_and_scan_min_ratio_to_activate", float, 1.2)))
        if out["pan_and_scan"][0] < 1 or out["pan_and_scan"][1] < 2:
            raise ModelFormatError(f"{folder}: pan-and-scan needs a min crop size of 1 or more and at least 2 crops, "
                                   f"not {out['pan_and_scan'][:2]}")
    return out


def preprocess(cfg: VisionConfig, image) -> "np.ndarray":
    """pixel_values (3, H, W) f32 of one RGB PIL image, as Gemma3ImageProcessor computes them: resized
    by Pillow (uint8, the processor's resample), times rescale, minus mean, over std."""
    h, w = cfg.size
    return pixels(cfg, image.resize((w, h), resample=cfg.resample, reducing_gap=None))
