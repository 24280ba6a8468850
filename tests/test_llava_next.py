"""LLaVA 1.6 (LLaVA-NeXT: any-resolution tiles): a tiny LlavaNextForConditionalGeneration
(tests/fixtures/make_llava_next.py: a CLIP tower of 32 px tiles, grid pinpoints 32x64, 64x32 and
64x64) gives transformers' tiles, image token counts, packed image features and greedy tokens."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.errors import ModelFormatError
from webgpu_engine.vision import llava
from webgpu_engine.vision.images import decode_bytes
from webgpu_engine.vision.runner import read_vision_config

FIXTURES = Path(__file__).parent / "fixtures"
FOLDER, IMAGES = FIXTURES / "tiny_llava_next", FIXTURES / "vision_images"


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURES / "llava_next_transformers.json").read_text())


@pytest.fixture(scope="module")
def cfg():
    return read_vision_config(FOLDER)


def _image(name):
    return decode_bytes((IMAGES / name).read_bytes(), name).image


def test_tiles_and_token_counts_equal_the_processors(ref, cfg):
    """LlavaNextImageProcessor's pixel_values (the global tile, then the best pinpoint's tiles) and
    LlavaNextProcessor's image token count, for a wide, a tall, a small square and a 70x50 picture
    (its 64x64 pinpoint: four tiles)."""
    assert cfg.pinpoints == ((32, 64), (64, 32), (64, 64)) and cfg.tokens_per_image == 16 + 8 * 9
    tiles = {}
    for name, r in ref["images"].items():
        im = _image(name)
        assert [im.height, im.width] == r["image_sizes"]
        (t,) = llava.tiles(cfg, im)
        want = np.array(r["pixel_values"], np.float32)
        assert t.pixels.shape == want.shape
        np.testing.assert_allclose(t.pixels, want, atol=1e-5)
        assert llava.n_tokens(cfg, im) == len(t.layout) == r["tokens"]
        assert llava.full_image_sequence(cfg, im) == "<image>" * r["tokens"]
        tiles[name] = len(t.pixels)
    assert tiles == {"gradient.png": 3, "shapes.png": 3, "tall.png": 3, "wide.png": 5}


def test_pinpoints_not_of_the_tile_are_refused(cfg):
    with pytest.raises(ModelFormatError, match="not multiples of the tile 32"):
        llava.any_resolution(cfg, [[48, 64]], "here")
