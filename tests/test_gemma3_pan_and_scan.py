"""Gemma 3's pan-and-scan (vision/gemma3.py): the tiny Gemma 3 vision checkpoint with a processor config
that turns it on (crops of at least 16 px, at most 3, for pictures 1.2 times longer one way), against
transformers' Gemma3ImageProcessor and Gemma3Processor (tests/fixtures/make_gemma3_vision.py
--pan-and-scan): the crops' count and pixel_values, and the prompt (the picture's and each crop's
image sequence in the processor's sentence) with its last row's logits and greedy tokens."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _nn_util import get
from test_vision import FOLDER, OPTS, _image, _messages, _text

from webgpu_engine.errors import ModelFormatError
from webgpu_engine.vision import gemma3, pure
from webgpu_engine.vision.runner import read_vision_config

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURES / "gemma3_pan_and_scan_transformers.json").read_text())


def _folder(root: Path, image_processor: dict) -> Path:
    """The tiny Gemma 3 vision folder (linked) with `image_processor` as its processor config's."""
    root.mkdir()
    for f in FOLDER.iterdir():
        if f.name != "processor_config.json":
            (root / f.name).symlink_to(f)
    (root / "processor_config.json").write_text(json.dumps({"image_processor": image_processor,
                                                            "processor_class": "Gemma3Processor"}))
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory, ref):
    return _folder(tmp_path_factory.mktemp("pas") / "tiny-gemma3-pas", ref["processor"])


def test_crops_and_pixels_equal_the_processor(ref, folder, tmp_path):
    """Two crops of the wide picture, three of the tall one, two of the 40 x 24 gradient, none of the
    square: the picture and its crops resized as the processor does (pixel_values within 2e-6, from a
    Pillow image and from the page's pure-Python one); with
    do_pan_and_scan off (the fixture folder) one tile; nonsense settings are a typed error."""
    cfg = read_vision_config(folder)
    assert cfg.pan_and_scan == (16, 3, 1.2) and gemma3.max_tiles(cfg) == 4
    for name, r in ref["images"].items():
        image = _image(name).image
        assert gemma3.n_tiles(cfg, image) == 1 + r["num_crops"], name
        if r["pixel_values"] is not None:
            want = np.array(r["pixel_values"], np.float32)
            assert want.shape == (1 + r["num_crops"], 3, 32, 32)
            np.testing.assert_allclose(np.stack(gemma3.tiles(cfg, image)), want, atol=2e-6)
            w, h = image.size                            # the page's picture (no Pillow): the same
            page = pure.from_rgba(image.convert("RGBA").tobytes(), w, h)
            got = np.array([t.tolist() for t in gemma3.tiles(cfg, page)], np.float32).reshape(want.shape)
            np.testing.assert_allclose(got, want, atol=2e-6)
    assert [r["num_crops"] for r in ref["images"].values()] == [2, 0, 3, 2]
    plain = read_vision_config(FOLDER)
    assert plain.pan_and_scan == () and gemma3.n_tiles(plain, _image("wide.png").image) == 1
    bad = _folder(tmp_path / "bad", {**ref["processor"], "pan_and_scan_max_num_crops": 1})
    with pytest.raises(ModelFormatError, match="at least 2 crops"):
        read_vision_config(bad)


@pytest.fixture(scope="module")
async def engine(device, folder):
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(folder), chat_opts={**OPTS, "compile_at_load": False})
    yield eng
    await eng.unload()


@pytest.mark.parametrize("key", ["wide", "two"])
async def test_greedy_tokens_and_logits_equal_transformers(engine, ref, key):
    """The wide picture (itself and two crops: three runs of 16 soft tokens, each attending itself both
    ways) and the tall picture (three crops) beside the square one (none): transformers' input ids,
    the last prompt row's logits (1e-4) and 12 greedy tokens, in prefill chunks of 32 rows."""
    pipe = next(iter(engine.models.values())).pipeline
    want = ref["prompts"][key]
    await engine.chat.completions.create(messages=_messages(ref, key), max_tokens=1, temperature=0.0)
    assert pipe.kv_ids[:len(want["input_ids"])] == want["input_ids"]
    assert len(pipe.vision.blocks(want["input_ids"])) == sum(1 + ref["images"][n]["num_crops"] for n in want["images"])
    np.testing.assert_allclose(get(pipe.dev, pipe.scheduler.fwd.logits_row(0)), want["logits"], atol=1e-4)
    r = await engine.chat.completions.create(messages=_messages(ref, key), max_tokens=12, temperature=0.0)
    assert pipe.output_ids == want["greedy"]
    assert r.choices[0].message.content == _text(want["greedy"])
    assert r.usage.prompt_tokens == len(want["input_ids"])
