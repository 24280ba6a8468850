"""LLaVA 1.5's image path on the host (a GGUF with its projector of type "mlp", vision/mmproj.py): its
image processor (CLIPImageProcessor: the shortest side resized to the tower's size, bicubic, then a
centre crop to the tower's square, rescale, CLIP's mean and std) and the prompt expansion its
processor does (each `<image>` the chat template writes becomes N `<image>` tokens, one per patch:
576 for a 336 px tower in 14 px patches; the class row is dropped).

The tower itself runs on the GPU (models/siglip.py with VisionConfig's CLIP settings). Pillow and
numpy only (both in Pyodide).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import VisionConfig, pixels

if TYPE_CHECKING:
    import numpy as np

IMAGE = "<image>"
BICUBIC = 3


def full_image_sequence(cfg: VisionConfig, image=None) -> str:
    """What one image's `<image>` becomes in the prompt text (LlavaProcessor's)."""
    return IMAGE * cfg.tokens_per_image


def n_tiles(cfg: VisionConfig, image) -> int:
    return 1


def max_tiles(cfg: VisionConfig) -> int:
    return 1


def tiles(cfg: VisionConfig, image) -> list:
    """One image's tiles: the picture's centre square, resized to the tower's."""
    return [preprocess(cfg, image)]


def preprocess(cfg: VisionConfig, image) -> "np.ndarray":
    """pixel_values (3, S, S) f32 of one RGB PIL image, as CLIPImageProcessor computes them: the
    shortest side resized to S (the longer one to int(S * long / short)) by Pillow, the centre S x S
    cropped (the top-left corner rounded down), rescaled and normalised."""
    S, (w, h) = cfg.image_size, image.size
    if w <= h:
        size = (S, int(S * h / w))
    else:
        size = (int(S * w / h), S)
    img = image.resize(size, resample=cfg.resample, reducing_gap=None)
    left, top = (size[0] - S) // 2, (size[1] - S) // 2
    return pixels(cfg, img.crop((left, top, left + S, top + S)))
