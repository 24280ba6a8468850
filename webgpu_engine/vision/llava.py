"""LLaVA 1.5's and 1.6's (LLaVA-NeXT's) image path on the host (an HF LlavaForConditionalGeneration or
LlavaNextForConditionalGeneration folder, or a GGUF with its projector of type "mlp": vision/mmproj.py,
LLaVA-NeXT's with clip.vision.image_grid_pinpoints): its config (config.json's CLIP `vision_config`, the
selected layer and strategy), its image processor (CLIPImageProcessor: the shortest side resized to the tower's size, bicubic, then a
centre crop to the tower's square, rescale, CLIP's mean and std) and the prompt expansion its
processor does (each `<image>` the chat template writes becomes N `<image>` tokens, one per patch:
576 for a 336 px tower in 14 px patches; the class row is dropped).

LLaVA-NeXT (any resolution, LlavaNextImageProcessor and LlavaNextProcessor): the grid pinpoint that
best fits the picture (select_best_resolution), the picture resized into it keeping its aspect and
padded with black to it, cut into tiles of the tower's square; the picture itself resized to the square
goes first. Each tile runs through the tower and the projector; the image's rows are the global tile's
patches, then the tiles' patch grid (the tiles side by side) with its padding cut off (unpad_image),
each grid row ended by the learned image_newline (vision/llava_gpu.py gathers them).

The tower itself runs on the GPU (models/siglip.py with VisionConfig's CLIP settings). Pillow and
numpy natively; in the page (neither) vision/pure.py's picture, the same values.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelFormatError, UnsupportedModelError
from . import pure
from .config import VisionConfig, normalisation, pixels, processor_settings, single_tile, tower_config
from .config import patches as square_patches

if TYPE_CHECKING:
    import numpy as np

IMAGE = "<image>"
BICUBIC = 3
NEWLINE = 0xFFFFFFFF                     # a layout's image_newline row (vision/llava_gpu.py's table's last)


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
    cfg = replace(cfg, n_layers=n)
    if "LlavaNextForConditionalGeneration" in (c.get("architectures") or []):
        pins = c.get("image_grid_pinpoints") or p.get("image_grid_pinpoints")
        if not pins:
            raise ModelFormatError(f"{folder}: a LlavaNextForConditionalGeneration config without image_grid_pinpoints")
        return any_resolution(cfg, pins, str(folder))
    return cfg


def any_resolution(cfg: VisionConfig, pinpoints, where: str) -> VisionConfig:
    """LLaVA-NeXT's config: `cfg` (one tile's) with its grid pinpoints ([[height, width], ..] or
    llama.cpp's flat list), tokens_per_image the most rows an image may take (no padding cut off)."""
    flat = [int(x) for pin in pinpoints for x in (pin if isinstance(pin, (list, tuple)) else [pin])]
    pins = tuple(zip(flat[0::2], flat[1::2]))
    S = cfg.image_size
    if not pins or len(flat) % 2 or any(h % S or w % S or h < S or w < S for h, w in pins):
        raise ModelFormatError(f"{where}: image_grid_pinpoints {pinpoints} are not multiples of the tile {S}")
    P = cfg.patches_per_side
    most = max(P * P + (h // S * P) * (w // S * P + 1) for h, w in pins)
    return replace(cfg, pinpoints=pins, tokens_per_image=most)


def best_resolution(cfg: VisionConfig, height: int, width: int) -> tuple[int, int]:
    """select_best_resolution: the pinpoint (height, width) keeping most of the picture, then wasting least."""
    best, most, least = None, 0, float("inf")
    for h, w in cfg.pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (h, w), effective, wasted
    return best


def grid(cfg: VisionConfig, height: int, width: int) -> tuple[int, int, int, int]:
    """(tile rows, tile columns, first kept patch row, first kept patch column) of a picture: its
    tiles' patch grid with the padding cut off as unpad_image (and the processor's count) do."""
    H, W = best_resolution(cfg, height, width)
    S, P = cfg.image_size, cfg.patches_per_side
    rows, cols = H // S * P, W // S * P
    top = left = 0
    if width / height > cols / rows:
        top = (rows - int(round(height * (cols / width), 7))) // 2
    else:
        left = (cols - int(round(width * (rows / height), 7))) // 2
    return H // S, W // S, top, left


def n_tokens(cfg: VisionConfig, image) -> int:
    """The rows one image takes: LLaVA 1.5's tokens_per_image; LLaVA-NeXT's global tile's patches and
    the kept patch grid's rows, each ended by a newline row."""
    if not cfg.pinpoints:
        return cfg.tokens_per_image
    w, h = image.size
    gh, gw, top, left = grid(cfg, h, w)
    P = cfg.patches_per_side
    return P * P + (gh * P - 2 * top) * (gw * P - 2 * left + 1)


def full_image_sequence(cfg: VisionConfig, image=None) -> str:
    """What one image's `<image>` becomes in the prompt text (LlavaProcessor's, LlavaNextProcessor's)."""
    return IMAGE * n_tokens(cfg, image)


n_tiles = max_tiles = single_tile            # a picture is one run of rows (LLaVA-NeXT's tiles inside)


@dataclass
class Tiles:
    """LLaVA-NeXT's tiles of one picture: pixels, one (3, S, S) pixel_values per tile (numpy's stacked
    into (1 + rows * cols, 3, S, S); the page's a list of pure.PixelValues), the global tile first; once
    unfolded (`patches`), their patch rows (.. * P * P, 3 p p) one tile after another. `layout`: each of
    the image's rows as a row of the tiles' features (vision/llava_gpu.py's table; NEWLINE: the
    image_newline), an array of u32."""
    pixels: object
    layout: array


def layout(cfg: VisionConfig, height: int, width: int, newline: int) -> array:
    """The image's rows as feature rows: tile k's patch (r, c) at k P*P + r P + c (the global tile is
    k = 0), each kept grid row followed by `newline`: (n_tokens,) u32."""
    gh, gw, top, left = grid(cfg, height, width)
    P = cfg.patches_per_side
    out = array("I", range(P * P))
    for R in range(top, gh * P - top):
        base = (1 + R // P * gw) * P * P + R % P * P
        out.extend(base + C // P * (P * P - P) + C for C in range(left, gw * P - left))
        out.append(newline)
    return out


def tiles(cfg: VisionConfig, image) -> list:
    """One image's tiles: LLaVA 1.5's centre square resized to the tower's; LLaVA-NeXT's `Tiles`: the
    picture resized to the square, then the padded picture's tiles (each cropped, then normalised:
    pixels are per pixel, so a tile's values are the padded picture's values there)."""
    if not cfg.pinpoints:
        return [preprocess(cfg, image)]
    w, h = image.size
    H, W = best_resolution(cfg, h, w)
    if W / w < H / h:                    # get_patch_output_size
        size = (W, min(math.ceil(h * W / w), H))
    else:
        size = (min(math.ceil(w * H / h), W), H)
    canvas = _padded(image.resize(size, resample=cfg.resample, reducing_gap=None), W, H)
    S = cfg.image_size
    out = [pixels(cfg, image.resize((S, S), resample=cfg.resample, reducing_gap=None))]
    out += [pixels(cfg, canvas.crop((x, y, x + S, y + S))) for y in range(0, H, S) for x in range(0, W, S)]
    if not isinstance(image, pure.RGBImage):
        import numpy as np
        out = np.stack(out)
    return [Tiles(out, layout(cfg, h, w, NEWLINE))]


def _padded(image, W: int, H: int):
    """`image` centred on a black W x H picture (the processor's pad)."""
    x, y = (W - image.width) // 2, (H - image.height) // 2
    if isinstance(image, pure.RGBImage):
        return pure.padded(image, W, H, x, y)
    from PIL import Image
    canvas = Image.new("RGB", (W, H))
    canvas.paste(image, (x, y))
    return canvas


def patches(cfg: VisionConfig, tile):
    """The patch rows the tower reads: LLaVA 1.5's tile's; each of LLaVA-NeXT's tiles', one after another."""
    if not isinstance(tile, Tiles):
        return square_patches(cfg, tile)
    if isinstance(tile.pixels, list):    # the page's
        rows = array("f")
        for t in tile.pixels:
            rows.extend(square_patches(cfg, t))
        return Tiles(rows, tile.layout)
    p, P = cfg.patch_size, cfg.patches_per_side
    a = tile.pixels.reshape(-1, 3, P, p, P, p).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 3 * p * p)
    return Tiles(a, tile.layout)


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
