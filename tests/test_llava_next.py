"""LLaVA 1.6 (LLaVA-NeXT: any-resolution tiles): a tiny LlavaNextForConditionalGeneration
(tests/fixtures/make_llava_next.py: a CLIP tower of 32 px tiles, grid pinpoints 32x64, 64x32 and
64x64) gives transformers' tiles, image token counts, packed image features (global tile first, the
tiles unpadded, a newline row after each grid row) and greedy tokens, from its HF folder and from its
GGUF + mmproj (llama.cpp's converters)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from _nn_util import get
from webgpu_engine.errors import ModelFormatError
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.vision import llava
from webgpu_engine.vision.images import decode_bytes, image_data_url
from webgpu_engine.vision.mmproj import MmprojFile
from webgpu_engine.vision.runner import read_vision_config

FIXTURES = Path(__file__).parent / "fixtures"
FOLDER, IMAGES, PAIR = FIXTURES / "tiny_llava_next", FIXTURES / "vision_images", FIXTURES / "llava_next_gguf"
TEXT, PROJ = PAIR / "tiny-llava-next.gguf", PAIR / "mmproj-tiny-llava-next.gguf"
OPTS = {"dtype": "f32", "context_window_size": 256, "prefill_chunk_size": 128, "compile_at_load": False}


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


def test_token_counts_at_the_hubs_sizes_equal_the_processors(ref, cfg):
    """llava-v1.6's 336 px tiles of 14 px patches and its five pinpoints: LlavaNextProcessor's counts
    for photos, a tall, a very wide and a one-pixel picture (and the most, 2928, the load's slot)."""
    from dataclasses import replace

    from PIL import Image
    hub = llava.any_resolution(replace(cfg, image_size=336, patch_size=14),
                               [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], "hub")
    assert hub.tokens_per_image == max(ref["hub_counts"].values()) == 2928
    for size, want in ref["hub_counts"].items():
        h, w = map(int, size.split("x"))
        im = Image.new("RGB", (w, h))
        assert llava.n_tokens(hub, im) == len(llava.layout(hub, h, w, llava.NEWLINE)) == want, size


def test_pinpoints_not_of_the_tile_are_refused_and_thin_pictures_tile(cfg):
    """Pinpoints that are not whole tiles: a typed error. A picture a pixel wide or high: its tiles
    (the grid's padding cut down to a row or none) and as many rows as the prompt gets."""
    from PIL import Image
    with pytest.raises(ModelFormatError, match="not multiples of the tile 32"):
        llava.any_resolution(cfg, [[48, 64]], "here")
    for size in ((1, 200), (200, 1), (3, 1000), (1, 1)):
        im = Image.new("RGB", size)
        (t,) = llava.tiles(cfg, im)
        assert llava.n_tokens(cfg, im) == len(t.layout) >= 16 and t.pixels.shape[1:] == (3, 32, 32)


def _mmproj():
    with GGUFFile(TEXT) as g:
        return MmprojFile(PROJ, g.tokenizer())


def test_mmproj_reads_as_the_folders_config(cfg):
    """llama.cpp's legacy LLaVA-NeXT converter's clip.vision.image_grid_pinpoints (flat) and
    model.image_newline give the folder's config and tensors; patches merged other than spatial_unpad
    (the padding cut off) are refused by name."""
    f = _mmproj()
    assert set(f.tensors) >= {"image_newline", "multi_modal_projector.linear_2.weight"}
    f.close()
    for field in ("pinpoints", "tokens_per_image", "image_token_id", "image_size", "patch_size", "n_layers",
                  "class_token", "pre_norm", "post_norm", "act", "text_hidden"):
        assert getattr(f.cfg, field) == getattr(cfg, field), field
    from webgpu_engine.errors import UnsupportedModelError
    from webgpu_engine.vision.mmproj import read_config
    with GGUFFile(PROJ) as g:
        g.metadata["clip.vision.mm_patch_merge_type"] = "flat"
        with pytest.raises(UnsupportedModelError, match="mm_patch_merge_type 'flat' is not implemented"):
            read_config(g, None)


@pytest.mark.parametrize("source", ["folder", "mmproj"])
def test_tower_gives_the_packed_features(device, ref, cfg, source):
    """Each tile through the CLIP tower and the projector, the rows gathered (global tile first, the
    tiles' grid unpadded, image_newline after each row): get_image_features' output per image (the
    legacy converter's patch convolution in f16: a few 1e-3 off)."""
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.vision.llava_gpu import LlavaNextTower
    files = SafetensorsFolder(FOLDER) if source == "folder" else _mmproj()
    try:
        tower = LlavaNextTower(device, cfg if source == "folder" else files.cfg, files.tensors, owner="test:llava_next")
    finally:
        files.close()
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.engine.memory import estimate_for
    opts = OPTS if source == "folder" else {**OPTS, "mmproj": str(PROJ)}
    text, full = (estimate_for("llm", p, ChatConfig(**o), device) for p, o in ((TEXT, OPTS), (FOLDER if source == "folder" else TEXT, opts)))
    features = 2 * cfg.tokens_per_image * cfg.text_hidden * 4          # a load's two pictures' rows
    try:                                 # the pre-load estimate counts the tower, its tiles' table and the features
        assert full.weights + full.activations - text.weights - text.activations >= \
            device.allocated_bytes("test:llava_next") + features
        names, n, width = sorted(ref["images"]), cfg.tokens_per_image, cfg.text_hidden
        out = Tensor(device.buffer(len(names) * n * width * 4, owner="test:llava_next"), (len(names) * n, width), "f32")
        for i, name in enumerate(names):
            tower.write_patches(llava.patches(cfg, llava.tiles(cfg, _image(name))[0]))
            device.submit(tower.record(device.batch(), out, i))
        got = get(device, out).reshape(len(names), n, width)
        for i, name in enumerate(names):
            expect = np.array(ref["images"][name]["features"])
            assert np.abs(expect).max() > 0.5
            tol = {"atol": 1e-4} if source == "folder" else {"atol": 5e-3, "rtol": 1e-3}   # the mmproj's f16 convolution
            np.testing.assert_allclose(got[i, :len(expect)], expect, **tol)
    finally:
        tower.dispose()
        device.release_owner("test:llava_next")


def _text(ids) -> str:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(FOLDER / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def _messages(ref, key: str) -> list[dict]:
    images = iter(ref["prompts"][key]["images"])
    return [{"role": m["role"], "content": [{"type": "image_url", "image_url": {"url": image_data_url(IMAGES / next(images))}}
                                            if p["type"] == "image" else p for p in m["content"]]}
            for m in ref["prompts"][key]["messages"]]


@pytest.mark.parametrize("source, atol, chunk", [("tiny_llava_next", 1e-4, 32), ("llava_next_gguf", 5e-3, 128)])
async def test_greedy_tokens_and_logits_equal_transformers(device, ref, source, atol, chunk):
    """From the HF folder and from the folder of GGUFs: one wide picture (four tiles, 70 rows) and two
    pictures (tall and small) in one prompt: transformers' input ids, last prompt row's logits and 12
    greedy tokens; in prefill chunks of 32 rows (an image's rows span up to three chunks: its tower
    runs once, its features kept for the next chunks) and of 128; both prompts at once in the batch
    answer as alone."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(FIXTURES / source), chat_opts={**OPTS, "prefill_chunk_size": chunk, "max_num_sequences": 2})
    try:
        model = next(iter(eng.models))
        pipe = eng.models[model].pipeline
        for key in ("one", "two"):
            want = ref["prompts"][key]
            runs = pipe.vision.tower_runs
            await eng.chat.completions.create(model=model, messages=_messages(ref, key), max_tokens=1, temperature=0.0)
            assert pipe.vision.tower_runs - runs == len(want["images"]), key       # once per picture
            assert not pipe.vision.kept                                           # none left kept
            assert pipe.kv_ids[:len(want["input_ids"])] == want["input_ids"], key
            logits = get(pipe.dev, pipe.scheduler.fwd.logits_row(0))        # the prompt's last row
            np.testing.assert_allclose(logits, want["logits"], atol=atol)
            r = await eng.chat.completions.create(model=model, messages=_messages(ref, key), max_tokens=12,
                                                  temperature=0.0)
            assert pipe.output_ids == want["greedy"], key
            assert r.choices[0].message.content == _text(want["greedy"])
        both = await asyncio.gather(*[eng.chat.completions.create(model=model, messages=_messages(ref, key), max_tokens=12,
                                                                  temperature=0.0) for key in ("one", "two")])
        assert [r.choices[0].message.content for r in both] == [_text(ref["prompts"][k]["greedy"]) for k in ("one", "two")]
    finally:
        await eng.unload()
