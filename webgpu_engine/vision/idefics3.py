"""Idefics3 (SmolVLM)'s image path on the host: its config, Idefics3ImageProcessor (the picture resized
to a longest edge, then to whole tiles of the tower's square, split into rows x cols tiles plus the
whole picture as the global tile; Pillow's filter on uint8 at each resize) and its processor's prompt
text for an image (per tile `<fake_token_around_image><row_r_col_c>` + the tile's `<image>` tokens,
a newline after each row, then the global tile between `<fake_token_around_image>`s).

Pillow and numpy only (both in Pyodide).
"""
from __future__ import annotations

import math
from pathlib import Path

from ..errors import UnsupportedModelError
from .config import VisionConfig, normalisation, pixels, processor_settings, tower_config

FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
MAX_IMAGE_SIZE = 4096                    # transformers' absolute bound on a resized side


def read_config(folder: Path, c: dict, v: dict) -> VisionConfig:
    p = processor_settings(folder)
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if p.get(flag) is False:
            raise UnsupportedModelError(f"{folder}: an image processor with {flag} false is not implemented")
    scale = int(c.get("scale_factor", 2))
    side = int(v["image_size"]) // int(v["patch_size"])
    if side % scale:
        raise UnsupportedModelError(f"{folder}: a {side}x{side} patch grid does not shuffle by {scale}")
    tile = int((p.get("max_image_size") or {}).get("longest_edge", v["image_size"]))
    if tile != int(v["image_size"]):
        raise UnsupportedModelError(f"{folder}: tiles of {tile} pixels for a tower of {v['image_size']}")
    return tower_config(folder, c, v, tokens_per_image=(side // scale) ** 2, image_token_id=int(c["image_token_id"]),
                        marker=IMAGE, scale=scale, longest_edge=int((p.get("size") or {}).get("longest_edge", 4 * tile)),
                        splitting=bool(p.get("do_image_splitting", True)),
                        **{"resample": 1, **normalisation(p)})


def _rescale_to_max_len(h: int, w: int, max_len: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h:
        w = max_len
        h = int(w / aspect)
        h += h % 2
    else:
        h = max_len
        w = int(h * aspect)
        w += w % 2
    return max(h, 1), max(w, 1)


def _below_upper_bound(h: int, w: int, max_len: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h and w > max_len:
        w = max_len
        h = int(w / aspect)
    elif h > w and h > max_len:
        h = max_len
        w = int(h * aspect)
    return max(h, 1), max(w, 1)


def _for_tiles(h: int, w: int, tile: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w


def layout(cfg: VisionConfig, image) -> tuple[int, int, tuple, tuple]:
    """(rows, cols, first resize (h, w), tile-multiple resize (h, w)) of a picture."""
    h, w = _rescale_to_max_len(image.height, image.width, cfg.longest_edge)
    h, w = _below_upper_bound(h, w, MAX_IMAGE_SIZE)
    if not cfg.splitting:
        return 0, 0, (h, w), (cfg.image_size, cfg.image_size)
    th, tw = _for_tiles(h, w, cfg.image_size)
    if th > cfg.image_size or tw > cfg.image_size:
        return th // cfg.image_size, tw // cfg.image_size, (h, w), (th, tw)
    return 0, 0, (h, w), (th, tw)


def n_tiles(cfg: VisionConfig, image) -> int:
    rows, cols, _, _ = layout(cfg, image)
    return rows * cols + 1 if rows else 1


def max_tiles(cfg: VisionConfig) -> int:
    """The most tiles one picture makes: its longest edge in whole tiles, squared, and the global one."""
    side = -(-cfg.longest_edge // cfg.image_size) if cfg.splitting else 0
    return side * side + 1 if side > 1 else 1


def tiles(cfg: VisionConfig, image) -> list:
    """pixel_values (3, S, S) of each tile, row by row, then the global tile (as the processor does)."""
    rows, cols, (h, w), (th, tw) = layout(cfg, image)
    f, S = cfg.resample, cfg.image_size
    first = image.resize((w, h), resample=f, reducing_gap=None)
    big = first.resize((tw, th), resample=f, reducing_gap=None)
    if not rows:
        return [pixels(cfg, big)]
    out = [pixels(cfg, big.crop((c * S, r * S, (c + 1) * S, (r + 1) * S))) for r in range(rows) for c in range(cols)]
    return out + [pixels(cfg, big.resize((S, S), resample=f, reducing_gap=None))]


def full_image_sequence(cfg: VisionConfig, image) -> str:
    """What one image's `<image>` becomes in the prompt text (Idefics3Processor's)."""
    rows, cols, _, _ = layout(cfg, image)
    run = IMAGE * cfg.tokens_per_image
    if not rows:
        return f"{FAKE}{GLOBAL}{run}{FAKE}"
    grid = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows))
    return f"{grid}\n{FAKE}{GLOBAL}{run}{FAKE}"
