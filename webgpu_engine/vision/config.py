"""A vision-language folder's image side, as one config: the SigLIP-style tower (config.json's
`vision_config`), the family's projector, its image tokens and its image processor's settings.
runner.py's `read_vision_config(folder)` reads any supported family (None for a text-only folder);
each family's module (gemma3.py, idefics3.py) says how its images become tiles and prompt text."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelFormatError, UnsupportedModelError
from . import pure

if TYPE_CHECKING:
    import numpy as np

FAMILIES = {"Gemma3ForConditionalGeneration": "gemma3", "Idefics3ForConditionalGeneration": "idefics3",
            "LlavaForConditionalGeneration": "llava", "LlavaNextForConditionalGeneration": "llava",
            "Qwen2_5_VLForConditionalGeneration": "qwen25vl"}
# the towers' activations (vision_config's hidden_act) -> VisionConfig.act
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "quick_gelu": "quick_gelu"}


@dataclass(frozen=True)
class VisionConfig:
    kind: str                        # "gemma3" (pooled projector, an image's rows attend both ways),
    #                                  "idefics3" (pixel shuffle + linear, causal rows, tiles) or
    #                                  "llava" (CLIP tower, linear-GELU-linear projector, causal rows)
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    image_size: int                  # a tile's square (the tower's input)
    patch_size: int
    eps: float                       # the tower's LayerNorms (and Gemma 3's projector RMSNorm)
    text_hidden: int
    tokens_per_image: int            # tokens per tile
    image_token_id: int
    marker: str                      # what the chat template writes for an image part
    scale: int = 1                   # Idefics3's pixel-shuffle factor
    size: tuple = (0, 0)             # Gemma 3: the processor's (height, width), default the tile
    pan_and_scan: tuple = ()         # Gemma 3: (min crop size, max crops, min ratio to activate) when on
    longest_edge: int = 0            # Idefics3: the picture's longest edge after its first resize
    splitting: bool = False          # Idefics3: tiles of image_size plus the global image
    resample: int = 2                # PIL's filter (2 BILINEAR, 1 LANCZOS)
    rescale: float = 1 / 255
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    act: str = "gelu_tanh"           # the tower's MLP activation (CLIP's: "quick_gelu")
    class_token: bool = False        # CLIP: a class embedding's row beside the patches (dropped at the end)
    pre_norm: bool = False           # CLIP: a LayerNorm after the embeddings (pre_layrnorm)
    post_norm: bool = True           # the LayerNorm after the last layer (LLaVA's selected layer: none)
    pinpoints: tuple = ()            # LLaVA-NeXT: image_grid_pinpoints ((height, width), ...) of its tiles
    qwen25vl: object = None          # Qwen2.5-VL's tower settings (vision/qwen25vl.py Qwen25VLVision)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """Gemma 3's average-pool kernel: patches per side over soft tokens per side."""
        return self.patches_per_side // round(self.tokens_per_image ** 0.5)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def bidirectional(self) -> bool:
        """Whether an image's token rows attend each other both ways in the decoder (Gemma 3)."""
        return self.kind == "gemma3"


def single_tile(cfg: VisionConfig, image=None) -> int:
    """n_tiles and max_tiles of the families that take a picture as one tile (Gemma 3, LLaVA 1.5)."""
    return 1


def tower_config(folder: Path, c: dict, v: dict, **fields) -> VisionConfig:
    """The tower's part of the config (vision_config) and the family's `fields`."""
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{folder}: vision hidden_act {act!r} is not implemented ({sorted(ACTIVATIONS)})")
    text = c.get("text_config") or {}
    kind = next(FAMILIES[a] for a in c.get("architectures") or [] if a in FAMILIES)
    try:
        return VisionConfig(
            kind=kind, hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            n_layers=int(v["num_hidden_layers"]), n_heads=int(v["num_attention_heads"]),
            image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
            eps=float(v.get("layer_norm_eps", 1e-6)), text_hidden=int(text["hidden_size"]),
            act=ACTIVATIONS[act], **fields)
    except KeyError as e:
        raise ModelFormatError(f"{folder}/config.json's vision_config lacks {e.args[0]}") from e


def processor_settings(folder: Path) -> dict:
    """The image processor's settings: processor_config.json's `image_processor` (transformers 5) or
    preprocessor_config.json (the hub's releases); {} when neither is there."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = folder / name
        if f.is_file():
            raw = json.loads(f.read_text(encoding="utf-8"))
            return raw.get("image_processor", raw)
    return {}


def normalisation(p: dict) -> dict:
    """VisionConfig's resample, rescale, mean and std from an image processor's settings."""
    out = {}
    if "resample" in p:
        out["resample"] = int(p["resample"])
    if "rescale_factor" in p:
        out["rescale"] = float(p["rescale_factor"])
    for key, name in (("image_mean", "mean"), ("image_std", "std")):
        if key in p:
            val = p[key]
            out[name] = tuple(float(x) for x in (val if isinstance(val, list) else [val] * 3))
    return out


def pixels(cfg: VisionConfig, image) -> "np.ndarray":
    """pixel_values (3, H, W) f32 of an RGB PIL image already resized: times rescale, minus mean,
    over std, as transformers' processors compute them (rescale in f64, normalise in f32). A picture
    decoded without Pillow (the page's, vision/pure.py) gives pure.PixelValues, the same values."""
    if isinstance(image, pure.RGBImage):
        return pure.pixels(cfg, image)
    import numpy as np
    a = np.asarray(image, dtype=np.uint8).astype(np.float64) * cfg.rescale
    a = (a.astype(np.float32) - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)
    return np.ascontiguousarray(a.transpose(2, 0, 1), dtype=np.float32)


def patches(cfg: VisionConfig, pixel_values) -> "np.ndarray":
    """The (P*P, 3 p p) rows of pixel_values (3, H, W) that the patch embedding's matmul reads: patch
    (r, c) row-major, each in the conv weight's (channel, y, x) order (an `array` of them for
    pure.PixelValues)."""
    if isinstance(pixel_values, pure.PixelValues):
        return pure.patches(cfg, pixel_values)
    p, P = cfg.patch_size, cfg.patches_per_side
    return pixel_values.reshape(3, P, p, P, p).transpose(1, 3, 0, 2, 4).reshape(P * P, 3 * p * p)
