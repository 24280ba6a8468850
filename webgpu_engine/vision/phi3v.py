"""Phi-3.5-vision from WebLLM's MLC artifacts (mlc-chat-config.json model_type `phi3_v`): its image
side as MLC defines it (mlc-llm's model/phi3v: phi3v_model.py image_preprocess / image_embed,
phi3v_image.py Phi3ImageEmbedding) and as WebLLM drives it (llm_chat.ts calculateResizeShape /
calculateCropShape / getImageEmbeddings, conversation.ts getPromptArray).

    resize     ratio = W / H; scale = the largest s with s * ceil(s / ratio) <= 16 (hd_num);
               to (floor(336 s / ratio), 336 s), bilinear (TVM's resize2d "linear", half_pixel),
               on the u32 pixels (the result truncated back to integers)
    pad        the height to a multiple of 336 with 255 (top (pad) // 2 rows, the rest below)
    normalise  x / 255, minus CLIP's mean, over its std (f32)
    crops      the global image (the normalised picture resized to 336 x 336, bilinear, in f32) and
               the h x w crops of 336 x 336, row-major
    tower      CLIP ViT (class row first, pre-layernorm, quick_gelu), the output of its second to
               last layer, the class row dropped: (P*P, C) per crop
    HD layout  2 x 2 patches merged into one row of 4C ([(0,0), (0,1), (1,0), (1,1)]); the crops'
               merged grids side by side ((h P/2) x (w P/2)), each grid row ended by sub_GN; then
               glb_GN; then the global image's (P/2) x (P/2) grid, each row ended by sub_GN
    projector  linear_2(gelu(linear_1(x))) (erf GELU), into the text model's width

An image's rows replace its run of image tokens in the prompt: WebLLM places each image of a user
message after the role prefix, followed by "\\n", before the message's text; here the template
writes an image token run there (its length: h (P/2) (w P/2 + 1) + 1 + (P/2) (P/2 + 1)). The rows
stay causal (MLC's prefill is the text model's). Pillow and numpy natively; in the page (neither)
vision/pure.py's picture through the same f32 arithmetic in pure Python (`_preprocess_pure`).
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from operator import add, itemgetter, mul
from typing import TYPE_CHECKING

from ..errors import InvalidRequestError, ModelFormatError, UnsupportedModelError
from . import pure
from .config import VisionConfig

if TYPE_CHECKING:
    import numpy as np

MODEL_TYPE = "phi3_v"
CROP = 336                               # MLC's and WebLLM's crop size (pad_num), fixed
HD_NUM = 16                              # WebLLM's hdNum (MLC's num_crops)
MEAN = (0.48145466, 0.4578275, 0.40821073)          # CLIP's, as MLC's normalize kernel holds them
STD = (0.26862954, 0.26130258, 0.27577711)
MARKER = "<|image|>"                     # what the template writes for an image part
# the first of these in the vocabulary stands for image rows (their embeddings are replaced): Phi-3's
# tokenizer has added tokens <|placeholder1|> .. and <unk> (MLC's prompt has no image token at all)
IMAGE_TOKENS = ("<|image|>", "<|placeholder1|>", "<unk>")
# MLC's CLIPVISION_DEFAULT_CONFIG: what a phi3_v model_config without vision_config means (ViT-L/14-336)
CLIP_DEFAULT = {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "num_attention_heads": 16,
                "num_hidden_layers": 24, "patch_size": 14, "layer_norm_eps": 1e-5}
VISION_PREFIX = "vision_embed_tokens."
TOWER_PREFIX = VISION_PREFIX + "img_processor.vision_model."


def read_config(where: str, model_config: dict, tokenizer) -> VisionConfig:
    """The image side of a phi3_v artifact's model_config (mlc-chat-config.json), the image token
    from the artifact's `tokenizer` (None: sizes only, image_token_id -1)."""
    v = {**CLIP_DEFAULT, **(model_config.get("vision_config") or {})}
    v = {**v, **(v.pop("kwargs", None) or {})}
    if int(v["image_size"]) != CROP:
        raise UnsupportedModelError(f"{where}: a phi3_v tower of image_size {v['image_size']}; MLC's "
                                    f"preprocessing crops {CROP} x {CROP}")
    side = CROP // int(v["patch_size"])
    if side % 2 or CROP % int(v["patch_size"]):
        raise ModelFormatError(f"{where}: patch_size {v['patch_size']} does not make an even patch grid of {CROP}")
    dim_out = int((model_config.get("img_processor") or {}).get("image_dim_out", v["hidden_size"]))
    if dim_out != int(v["hidden_size"]):
        raise ModelFormatError(f"{where}: img_processor.image_dim_out {dim_out} is not the tower's width "
                               f"{v['hidden_size']}")
    token = next((t for t in IMAGE_TOKENS if tokenizer is not None and tokenizer.token_to_id(t) is not None), None)
    if tokenizer is None:                # sizes only (the memory estimate): no image token
        token = IMAGE_TOKENS[0]
    elif token is None:
        raise ModelFormatError(f"{where}: the vocabulary has none of {IMAGE_TOKENS}, whose id stands for "
                               f"an image's rows")
    n_layers = int(v["num_hidden_layers"])
    if n_layers < 2:
        raise ModelFormatError(f"{where}: MLC's phi3_v reads its tower's second to last layer: {n_layers} layers")
    half = side // 2
    return VisionConfig(
        kind="phi3v", hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        n_layers=n_layers - 1, n_heads=int(v["num_attention_heads"]), image_size=CROP,
        patch_size=int(v["patch_size"]), eps=float(v["layer_norm_eps"]), text_hidden=int(model_config["hidden_size"]),
        tokens_per_image=(HD_NUM + 1) * half * (half + 1) + 1,
        image_token_id=int(tokenizer.token_to_id(token)) if tokenizer is not None else -1,
        marker=token, size=(CROP, CROP), resample=2, mean=MEAN, std=STD, act="quick_gelu",
        class_token=True, pre_norm=True, post_norm=False)


# ---------------------------------------------------------------------- shapes (WebLLM's)
def resize_shape(height: int, width: int) -> tuple[int, int]:
    """(height, width) of the resized picture (llm_chat.ts calculateResizeShape)."""
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= HD_NUM:
        scale += 1
    scale -= 1
    new_w = scale * CROP
    return math.floor(new_w / ratio), new_w


def crop_shape(height: int, width: int) -> tuple[int, int]:
    """(rows, columns) of 336 x 336 crops (calculateCropShape)."""
    h, w = resize_shape(height, width)
    return math.ceil(h / CROP), w // CROP


def n_tokens(cfg: VisionConfig, image) -> int:
    """The image's rows (computeImageEmbedSize)."""
    return token_count(cfg, *crop_shape(image.size[1], image.size[0]))


def token_count(cfg: VisionConfig, rows: int, cols: int) -> int:
    """The rows of a picture of rows x cols crops: its grid's rows, each with sub_GN, glb_GN, the global grid's."""
    half = cfg.patches_per_side // 2
    return rows * half * (cols * half + 1) + 1 + half * (half + 1)


def full_image_sequence(cfg: VisionConfig, image=None) -> str:
    return cfg.marker * n_tokens(cfg, image)


def n_tiles(cfg: VisionConfig, image) -> int:
    return 1                             # one image: one run of rows (its crops inside)


def max_tiles(cfg: VisionConfig) -> int:
    return 1


# ---------------------------------------------------------------------- preprocessing (MLC's)
def _axis(n_in: int, n_out: int):
    """TVM's half_pixel source coordinates: (lower index, upper index, weight of the upper), f32."""
    import numpy as np
    scale = np.float32(n_in) / np.float32(n_out)
    x = (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    lo = np.floor(x).astype(np.int64)
    t = (x - lo.astype(np.float32)).astype(np.float32)
    return np.clip(lo, 0, n_in - 1), np.clip(lo + 1, 0, n_in - 1), t


def resize_linear(a: "np.ndarray", height: int, width: int) -> "np.ndarray":
    """TVM's resize2d (method linear, half_pixel) of a (C, H, W) array, in f32: lerp(lerp(p00, p01, x),
    lerp(p10, p11, x), y) with lerp(A, B, t) = A (1 - t) + B t, indices clamped to the picture."""
    import numpy as np
    a = a.astype(np.float32)
    y0, y1, ty = _axis(a.shape[1], height)
    x0, x1, tx = _axis(a.shape[2], width)
    one = np.float32(1)

    def lerp(p, q, t):
        return p * (one - t) + q * t
    top = lerp(a[:, y0][:, :, x0], a[:, y0][:, :, x1], tx)
    bottom = lerp(a[:, y1][:, :, x0], a[:, y1][:, :, x1], tx)
    return lerp(top, bottom, ty[None, :, None])


@dataclass
class Crops:
    """One picture's crops (1 + rows * cols, 3, 336, 336) f32, the global image first (the page's: a
    list of pure.PixelValues; once unfolded, an array of patch rows)."""
    pixels: object
    rows: int
    cols: int


def preprocess(cfg: VisionConfig, image) -> Crops:
    """MLC's image_preprocess of one RGB PIL image at WebLLM's sizes."""
    w, h = image.size
    new_h, new_w = resize_shape(h, w)
    if new_h < 1:
        raise InvalidRequestError(f"An image of {w} x {h} is too wide for Phi-3.5-vision's crops", param="messages")
    if isinstance(image, pure.RGBImage):
        return _preprocess_pure(cfg, image, new_h, new_w)
    import numpy as np
    u = np.asarray(image.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1)
    x = np.trunc(resize_linear(u, new_h, new_w))           # cast back to the u32 input's dtype
    pad = -(-new_h // CROP) * CROP
    top = (pad - new_h) // 2
    padded = np.full((3, pad, new_w), 255, np.float32)
    padded[:, top:top + new_h] = x
    mean, std = np.asarray(cfg.mean, np.float32)[:, None, None], np.asarray(cfg.std, np.float32)[:, None, None]
    x = (padded * np.float32(1 / 255.0) - mean) / std
    rows, cols = pad // CROP, new_w // CROP
    glb = resize_linear(x, CROP, CROP)
    sub = x.reshape(3, rows, CROP, cols, CROP).transpose(1, 3, 0, 2, 4).reshape(-1, 3, CROP, CROP)
    return Crops(np.concatenate([glb[None], sub]).astype(np.float32), rows, cols)


# the page's: the same f32 arithmetic on planes of rows (array("f") rounds each value to f32; a product
# or sum of two f32 values rounded once in doubles, then to f32, is the f32 operation's result)
def _axis_pure(n_in: int, n_out: int) -> tuple[list, list, array, array]:
    """_axis's (lower, upper, t) and 1 - t, in f32."""
    f = pure.f32
    scale, lo, hi, t = f(n_in / n_out), [], [], array("f")
    for i in range(n_out):
        x = f(f(f(i + 0.5) * scale) - 0.5)
        k = math.floor(x)
        lo.append(min(max(k, 0), n_in - 1))
        hi.append(min(max(k + 1, 0), n_in - 1))
        t.append(f(x - k))
    return lo, hi, t, array("f", [1.0 - v for v in t])


def _take(row, idx: list) -> tuple:
    return tuple(row[i] for i in idx) if len(idx) == 1 else itemgetter(*idx)(row)


def _lerp(p, q, one_minus_t, t) -> array:
    return array("f", map(add, array("f", map(mul, p, one_minus_t)), array("f", map(mul, q, t))))


def _resize_pure(plane: list, height: int, width: int) -> list:
    """resize_linear of one channel (a list of rows) in f32: each source row's horizontal lerp once."""
    y0, y1, ty, sy = _axis_pure(len(plane), height)
    x0, x1, tx, sx = _axis_pure(len(plane[0]), width)
    rows = {}
    for y in sorted(set(y0) | set(y1)):
        rows[y] = _lerp(_take(plane[y], x0), _take(plane[y], x1), sx, tx)
    return [_lerp(rows[a], rows[b], [s] * width, [t] * width) for a, b, s, t in zip(y0, y1, sy, ty)]


def _preprocess_pure(cfg: VisionConfig, image, new_h: int, new_w: int) -> Crops:
    """preprocess of a pure.RGBImage: the same values without numpy."""
    f, w = pure.f32, image.width
    pad = -(-new_h // CROP) * CROP
    top = (pad - new_h) // 2
    planes = []
    for c in range(3):
        src = image.data[c::3]
        plane = _resize_pure([array("f", list(src[y * w:(y + 1) * w])) for y in range(image.height)], new_h, new_w)
        m, s = f(cfg.mean[c]), f(cfg.std[c])
        table = [f(f(f(v * f(1 / 255.0)) - m) / s) for v in range(256)]
        blank = array("f", [table[255]]) * new_w                       # the pad's 255
        rows = [blank] * top + [array("f", [table[int(v)] for v in r]) for r in plane]
        planes.append(rows + [blank] * (pad - top - new_h))

    def crop(rows_of, y: int, x: int) -> pure.PixelValues:
        v = array("f")
        for c in range(3):
            for r in rows_of[c][y:y + CROP]:
                v.extend(r[x:x + CROP])
        return pure.PixelValues(v, CROP, CROP)
    glb = [_resize_pure(p, CROP, CROP) for p in planes]
    rows, cols = pad // CROP, new_w // CROP
    return Crops([crop(glb, 0, 0)] + [crop(planes, r * CROP, c * CROP) for r in range(rows) for c in range(cols)],
                 rows, cols)


def tiles(cfg: VisionConfig, image) -> list:
    return [preprocess(cfg, image)]


def patches(cfg: VisionConfig, crops: Crops) -> Crops:
    """The crops' unfolded patches ((1 + rows * cols) * P * P, 3 p p), the layout's shape kept."""
    if isinstance(crops.pixels, list):   # the page's
        rows = array("f")
        for c in crops.pixels:
            rows.extend(pure.patches(cfg, c))
        return Crops(rows, crops.rows, crops.cols)
    p, P = cfg.patch_size, cfg.patches_per_side
    a = crops.pixels.reshape(-1, 3, P, p, P, p).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 3 * p * p)
    return Crops(a, crops.rows, crops.cols)


def layout(cfg: VisionConfig, rows: int, cols: int, table_rows: int) -> array:
    """The HD layout as rows of a table of C-wide rows: crop k's patch (r, c) at k P*P + r P + c (the
    global image is crop 0), sub_GN at table_rows - 8 .. - 5, glb_GN at table_rows - 4 ..; one entry
    per C-wide quarter of each merged 4C row: (n_tokens * 4,) u32."""
    P = cfg.patches_per_side
    half, N = P // 2, P * P
    out = array("I")

    def grid(first_crop: int, nr: int, nc: int) -> None:
        for R in range(nr * half):
            for Cc in range(nc * half):
                at = (first_crop + (R // half) * nc + Cc // half) * N + 2 * (R % half) * P + 2 * (Cc % half)
                out.extend((at, at + 1, at + P, at + P + 1))      # (0,0), (0,1), (1,0), (1,1)
            out.extend(range(table_rows - 8, table_rows - 4))     # sub_GN
    grid(1, rows, cols)
    out.extend(range(table_rows - 4, table_rows))                 # glb_GN
    grid(0, 1, 1)
    return out


# ---------------------------------------------------------------------- the template (WebLLM's)
def template(inner, cfg: VisionConfig, conv: dict | None):
    """The conv_template WebLLM renders (its images after the role prefix, each followed by "\\n"),
    each image written as its run of image tokens; `inner` when the artifact has no conv_template."""
    from ..loaders.mlc import ConvTemplate
    from .requests import images_of
    if not isinstance(conv, dict):
        return inner

    class Phi3vTemplate(ConvTemplate):
        def _text(self, content) -> str:
            if not isinstance(content, list):
                return super()._text(content)
            images = [p for p in content if isinstance(p, dict) and p.get("type") == "image"]
            return "".join(MARKER + "\n" for _ in images) + super()._text(
                [p for p in content if isinstance(p, dict) and p.get("type") == "text"])

        def render(self, messages, **kwargs) -> str:
            out, images = super().render(messages, **kwargs), iter(images_of(messages))
            pieces = out.split(MARKER)
            text = pieces[0]
            for piece in pieces[1:]:
                im = next(images, None)
                text += (full_image_sequence(cfg, im.image) if im is not None else MARKER) + piece
            return text
    return Phi3vTemplate(conv)
