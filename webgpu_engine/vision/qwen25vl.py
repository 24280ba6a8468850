"""Qwen2.5-VL's image path on the host: its vision config (config.json's `vision_config`, the image
token and the processor's settings), its image processor (Qwen2VLImageProcessor: the picture resized
to multiples of patch x merge pixels within min / max pixels, bicubic, CLIP's mean and std, patches in
2x2 merge blocks, each repeated over the temporal patch), the prompt expansion its processor does
(each `<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>` becomes one per merged patch:
grid_h * grid_w / 4) and the window layout and 2D positions of the tower (vision/qwen25vl_gpu.py).

An image's tokens are as many as its size makes, so `n_tokens` gives each image's and the config's
`tokens_per_image` is the most one image may bring (max_pixels'). Pillow and numpy natively; in the
page (neither) vision/pure.py's picture gives the same rows, and the layout and positions are pure Python.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidRequestError, ModelFormatError, UnsupportedModelError
from . import pure
from .config import VisionConfig, normalisation, pixels, processor_settings

if TYPE_CHECKING:
    import numpy as np

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
START, IMAGE, END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
MARKER = START + IMAGE + END             # what the chat template writes for an image part
BICUBIC = 3
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Qwen25VLVision:
    """What Qwen2.5-VL's tower adds to VisionConfig (its `qwen25vl` field)."""
    temporal_patch: int                  # frames per patch (a picture is repeated over them)
    merge: int                           # the merger's s x s patches per token
    window: int                          # a window's side in pixels (window attention)
    full_layers: tuple                   # layers attending the whole image
    min_pixels: int
    max_pixels: int
    rope_theta: float                    # the tower's 2D RoPE base


@dataclass(frozen=True)
class Grid:
    """One image's patch rows (processor order) and its grid of patches."""
    rows: "np.ndarray | array"           # (gh * gw, 3 * temporal * p * p) f32 (the page's: an array)
    gh: int
    gw: int


def read_config(folder: Path, c: dict, v: dict) -> VisionConfig:
    """The vision config of a Qwen2_5_VLForConditionalGeneration folder (config.json `c`, its vision_config `v`)."""
    if v.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{folder}: a Qwen2.5-VL tower with {v.get('hidden_act')!r} is not implemented")
    p = processor_settings(folder)
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if p.get(flag) is False:
            raise UnsupportedModelError(f"{folder}: an image processor with {flag} false is not implemented")
    size = p.get("size") or {}
    try:
        patch, merge = int(v["patch_size"]), int(v.get("spatial_merge_size", 2))
        if int(p.get("patch_size", patch)) != patch or int(p.get("merge_size", merge)) != merge:
            raise ModelFormatError(f"{folder}: the processor's patches ({p.get('patch_size')}, merge "
                                   f"{p.get('merge_size')}) are not the tower's ({patch}, {merge})")
        extra = Qwen25VLVision(
            temporal_patch=int(v.get("temporal_patch_size", 2)), merge=merge, window=int(v.get("window_size", 112)),
            full_layers=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
            min_pixels=int(p.get("min_pixels", size.get("shortest_edge", 56 * 56))),
            max_pixels=int(p.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))),
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        text = c.get("text_config") or c
        heads = int(v["num_heads"])
        return VisionConfig(
            kind="qwen25vl", hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            n_layers=int(v["depth"]), n_heads=heads, image_size=0, patch_size=patch, eps=1e-6,
            text_hidden=int(v.get("out_hidden_size", text["hidden_size"])),
            tokens_per_image=extra.max_pixels // (patch * merge) ** 2,
            image_token_id=int(c.get("image_token_id", 151655)), marker=MARKER,
            **{"resample": BICUBIC, "mean": CLIP_MEAN, "std": CLIP_STD, **normalisation(p)}, act="silu", post_norm=False,
            qwen25vl=extra)
    except KeyError as e:
        raise ModelFormatError(f"{folder}/config.json's vision_config lacks {e.args[0]}") from e


MAX_TOKENS = 4096                        # an image's tokens at most, whatever max_pixels allows


def fit_chunk(cfg: VisionConfig, chunk: int) -> VisionConfig:
    """`cfg` with images of at most `chunk` tokens: max_pixels lowered to chunk merged patches where it
    allows more, min_pixels no more than that. A load caps at MAX_TOKENS (the tower's buffers are sized
    for the largest image; the hub's 12845056 px would be 16384 tokens, llama.cpp's default is 4096);
    an image's rows may span prefill chunks (vision/runner.py keeps its features between them)."""
    from dataclasses import replace
    q, area = cfg.qwen25vl, (cfg.patch_size * cfg.qwen25vl.merge) ** 2
    if cfg.tokens_per_image <= chunk:
        return cfg
    most = chunk * area
    return replace(cfg, tokens_per_image=chunk,
                   qwen25vl=replace(q, max_pixels=most, min_pixels=min(q.min_pixels, most)))


def smart_resize(cfg: VisionConfig, height: int, width: int) -> tuple[int, int]:
    """(height, width) of the resized picture: multiples of patch x merge pixels, close to the
    picture's aspect, within min / max pixels (Qwen2VLImageProcessor's smart_resize)."""
    q, f = cfg.qwen25vl, cfg.patch_size * cfg.qwen25vl.merge
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError(f"An image of {width}x{height} pixels: its aspect ratio must be below 200.",
                                  param="messages")
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > q.max_pixels:
        beta = math.sqrt(height * width / q.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < q.min_pixels:
        beta = math.sqrt(q.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def preprocess(cfg: VisionConfig, image) -> Grid:
    """The patch rows of one RGB PIL image as Qwen2VLImageProcessor makes them: resized by Pillow
    (smart_resize, the processor's resample), rescaled and normalised, cut into p x p patches in
    merge x merge blocks (block row-major, then the patches inside a block), each patch's row
    (channel, frame, y, x) with the picture repeated over the temporal patch's frames."""
    h, w = smart_resize(cfg, image.size[1], image.size[0])
    px = pixels(cfg, image.resize((w, h), resample=cfg.resample, reducing_gap=None))     # (3, h, w)
    p, m, tp = cfg.patch_size, cfg.qwen25vl.merge, cfg.qwen25vl.temporal_patch
    gh, gw = h // p, w // p
    if isinstance(px, pure.PixelValues):
        return Grid(pure.grid_patches(px, p, gh, gw, merge=m, frames=tp), gh, gw)
    import numpy as np
    x = px.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)   # (bh, bw, mh, mw, 3, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    return Grid(np.ascontiguousarray(x.reshape(gh * gw, 3 * tp * p * p), dtype=np.float32), gh, gw)


def grid(cfg: VisionConfig, image) -> Grid:
    """An image's grid of patches (no rows: M-RoPE's positions need only the grid)."""
    h, w = smart_resize(cfg, image.size[1], image.size[0])
    return Grid(None, h // cfg.patch_size, w // cfg.patch_size)


def n_tokens(cfg: VisionConfig, image) -> int:
    """An image's tokens: its merged patches."""
    g = grid(cfg, image)
    return g.gh * g.gw // cfg.qwen25vl.merge ** 2


def full_image_sequence(cfg: VisionConfig, image=None) -> str:
    """What one image's marker becomes in the prompt text (Qwen2_5_VLProcessor's)."""
    return START + IMAGE * n_tokens(cfg, image) + END


def n_tiles(cfg: VisionConfig, image) -> int:
    return 1


def max_tiles(cfg: VisionConfig) -> int:
    return 1


def tiles(cfg: VisionConfig, image) -> list:
    return [preprocess(cfg, image)]


def patches(cfg: VisionConfig, tile: Grid) -> Grid:
    return tile


# ---------------------------------------------------------------------------- the tower's layout
def window_order(cfg: VisionConfig, gh: int, gw: int) -> tuple[array, list[int]]:
    """The merged patches in window order (windows of window / patch / merge merged patches a side,
    row-major, cut at the grid's edges; row-major inside each) and each window's patch count:
    transformers' get_vision_window_index for one image."""
    m = cfg.qwen25vl.merge
    side = cfg.qwen25vl.window // m // cfg.patch_size
    bh, bw = gh // m, gw // m
    order, sizes = array("I"), []
    for r in range(0, bh, side):
        for c in range(0, bw, side):
            rows, cols = range(r, min(r + side, bh)), range(c, min(c + side, bw))
            order.extend(y * bw + x for y in rows for x in cols)
            sizes.append(len(rows) * len(cols) * m * m)
    return order, sizes


def rope_positions(cfg: VisionConfig, gh: int, gw: int) -> list[tuple[int, int, int]]:
    """The (0, row, column) positions of the patches in processor order (merge blocks row-major, the
    patches inside a block row-major)."""
    m = cfg.qwen25vl.merge
    return [(0, r, c) for br in range(0, gh, m) for bc in range(0, gw, m)
            for r in range(br, br + m) for c in range(bc, bc + m)]


# ---------------------------------------------------------------------------- M-RoPE's positions
def positions(cfg: VisionConfig, images: list, n: int) -> list[tuple[int, int, int]]:
    """The positions (t, h, w) of a sequence's first n rows whose image token runs are `images`
    ((start, end, Grid) each, in order): text rows count on from the previous row's largest position
    + 1, an image's merged patch (row r, column c) takes (p, p + r, p + c) from its first row's p
    (transformers' get_rope_index)."""
    m, out = cfg.qwen25vl.merge, []
    behind, row = 0, 0                   # how far positions fall behind rows; the next row to fill
    for s, e, g in list(images) + [(n, n, None)]:
        out.extend((r - behind,) * 3 for r in range(row, min(s, n)))
        if g is None or s >= n:
            break
        p, w = s - behind, g.gw // m
        out.extend((p, p + k // w, p + k % w) for k in range(min(e, n) - s))
        behind += (e - s) - max(g.gh, g.gw) // m
        row = e
    return out


def offsets(cfg: VisionConfig, images: list, start: int, end: int) -> list:
    """Each of rows start .. end-1's rotation before RoPE at its cache row: its position, shifted by
    how far the sequence's text falls behind past its last image (so that from there on, decode rows
    included, a row's position is its cache row), minus its row."""
    pos = positions(cfg, images, end)
    behind = sum((e - s) - max(g.gh, g.gw) // cfg.qwen25vl.merge for s, e, g in images)
    return [tuple(v + behind - r for v in p) for r, p in enumerate(pos[start:end], start)]


# ---------------------------------------------------------------------------- from a GGUF pair
def mmproj_config(g, tokenizer) -> VisionConfig:
    """The vision config of llama.cpp's mmproj (clip.projector_type qwen2.5vl_merger): the tower's sizes
    from clip.vision.*, full attention every n_wa_pattern-th layer (clip.cpp's (i + 1) % n == 0),
    windows of clip.vision.window_size pixels (llama.cpp: 112), images of image_min_pixels ..
    image_max_pixels (llama.cpp: 8 .. 4096 tokens), the image token from the text model's `tokenizer`
    (None: -1, the header alone)."""
    def meta(key: str, default=None):
        v = g.metadata.get("clip.vision." + key, default)
        if v is None:
            raise ModelFormatError(f"{g.where}: mmproj metadata lacks clip.vision.{key}")
        return v
    patch, merge, layers = int(meta("patch_size")), int(meta("spatial_merge_size", 2)), int(meta("block_count"))
    n_wa = int(meta("n_wa_pattern", 0))
    area = (patch * merge) ** 2
    extra = Qwen25VLVision(
        temporal_patch=2, merge=merge, window=int(meta("window_size", 112)),
        full_layers=tuple(i for i in range(layers) if not n_wa or (i + 1) % n_wa == 0),
        min_pixels=int(meta("image_min_pixels", 8 * area)), max_pixels=int(meta("image_max_pixels", 4096 * area)),
        rope_theta=10000.0)
    token_id = tokenizer.token_to_id(IMAGE) if tokenizer is not None else -1
    if token_id is None:
        raise ModelFormatError(f"{g.where}: the text model's vocabulary has no {IMAGE} token, which Qwen2.5-VL's "
                               f"images take: the text GGUF and the projector do not belong together")
    return VisionConfig(
        kind="qwen25vl", hidden_size=int(meta("embedding_length")), intermediate_size=int(meta("feed_forward_length")),
        n_layers=layers, n_heads=int(meta("attention.head_count")), image_size=0, patch_size=patch,
        eps=float(meta("attention.layer_norm_epsilon", 1e-6)), text_hidden=int(meta("projection_dim")),
        tokens_per_image=extra.max_pixels // area, image_token_id=int(token_id), marker=MARKER, resample=BICUBIC,
        mean=tuple(float(x) for x in meta("image_mean", list(CLIP_MEAN))),
        std=tuple(float(x) for x in meta("image_std", list(CLIP_STD))), act="silu", post_norm=False, qwen25vl=extra)
