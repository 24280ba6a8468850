"""LLaVA 1.5's image path on the host (an HF LlavaForConditionalGeneration folder, or a GGUF with its
projector of type "mlp": vision/mmproj.py): its config (config.json's CLIP `vision_config`, the
selected layer and strategy), its image processor (CLIPImageProcessor: the shortest side resized to the tower's size, bicubic, then a
centre crop to the tower's square, rescale, CLIP's mean and std) and the prompt expansion its
processor does (each `<image>` the chat template writes becomes N `<image>` tokens, one per patch:
576 for a 336 px tower in 14 px patches; the class row is dropped).

The tower itself runs on the GPU (models/siglip.py with VisionConfig's CLIP settings). Pillow and
numpy only (both in Pyodide).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UnsupportedModelError
from .config import VisionConfig, normalisation, pixels, processor_settings, single_tile, tower_config

if TYPE_CHECKING:
    import numpy as np

IMAGE = "<image>"
BICUBIC = 3


def read_config(folder: Path, c: dict, v: dict) -> VisionConfig:
    """The vision config of a LlavaForConditionalGeneration folder (config.json `c`, its vision_config
    `v`): the tower up to the selected layer (vision_feature_layer, an index into the hidden states:
    -2, the second to last layer's output), no post-layernorm, the class row dropped ("default")."""
    def refuse(why: str):
        raise UnsupportedModelError(f"{folder}: {why} is not implemented")
    if c.get("vision_feature_select_strategy", "default") != "default":
        refuse(f"vision_feature_select_strategy {c.get('vision_feature_select_strategy')!r} (the class row kept)")
    if c.get("projector_hidden_act", "gelu") != "gelu" or c.get("multimodal_projector_bias") is False:
        refuse("a projector other than linear (with bias), GELU, linear")
    layer = c.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        refuse(f"vision_feature_layer {layer!r} (several layers concatenated)")
    p = processor_settings(folder)
    for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"):
        if p.get(flag) is False:
            refuse(f"an image processor with {flag} false")
    size = int(v["image_size"])
    edge, crop = (p.get("size") or {}).get("shortest_edge", size), p.get("crop_size") or {}
    if edge != size or crop.get("height", size) != size or crop.get("width", size) != size:
        refuse(f"an image processor resizing to {edge} and cropping to {crop} for a tower of {size}")
    side = size // int(v["patch_size"])
    cfg = tower_config(folder, c, v, tokens_per_image=side * side, marker=IMAGE, class_token=True, pre_norm=True,
                       post_norm=False, image_token_id=int(c.get("image_token_index", c.get("image_token_id", 32000))),
                       **{"resample": BICUBIC, **normalisation(p)})
    n = cfg.n_layers + 1 + layer if layer < 0 else layer            # hidden_states[k]: after k layers
    if not 0 < n <= cfg.n_layers:
        refuse(f"vision_feature_layer {layer} of {cfg.n_layers} layers")
    return replace(cfg, n_layers=n)


def full_image_sequence(cfg: VisionConfig, image=None) -> str:
    """What one image's `<image>` becomes in the prompt text (LlavaProcessor's)."""
    return IMAGE * cfg.tokens_per_image


n_tiles = max_tiles = single_tile            # a picture is one tile


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
