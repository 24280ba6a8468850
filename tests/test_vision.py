"""Images in: the vision kernels against numpy (tests/ref_vision.py), Gemma 3's preprocessing, vision
tower and greedy tokens against transformers (tests/fixtures/make_gemma3_vision.py), and the image
parts of the APIs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ref_vision
from _nn_util import TOL, empty, get, put, rounded, run, step_buf
from webgpu_engine.kernels import vision as kv
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.vision.gemma3 import patches, preprocess, read_vision_config
from webgpu_engine.vision.images import decode_bytes


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_splice_rows(device, dtype):
    rng = np.random.default_rng(1)
    x, feats = rng.standard_normal((9, 12)), rng.standard_normal((5, 12))
    rows = np.full((9, 2), kv.NONE, np.uint32)
    rows[2:6, 0] = [3, 0, 4, 1]
    xt = put(device, x, dtype, lead=4)
    run(device, kv.splice_rows(device, xt, put(device, feats, lead=2), put(device, rows, "u32")))
    want = ref_vision.splice_rows(rounded(x, dtype), rounded(feats, dtype), rows)
    assert np.abs(want - rounded(x, dtype)).max() > 0.5
    np.testing.assert_allclose(get(device, xt), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("window", [0, 5])
def test_attn_image_rows(device, dtype, window):
    """Rows 3..7 of a chunk at positions 10.. form an image (keys up to position 17); the other rows
    keep what was there (here NaN stands for the causal attention's output)."""
    rng = np.random.default_rng(2 + window)
    T, hq, hkv, d, ctx, pos0 = 9, 4, 2, 8, 32, 10
    qkv = rng.standard_normal((T, hq + 2 * hkv, d))
    k, v = rng.standard_normal((hkv, ctx, d)), rng.standard_normal((hkv, ctx, d))
    rows = np.zeros((T, 2), np.uint32)
    rows[3:8, 1] = pos0 + 8
    out = empty(device, (T, hq * d), dtype, lead=4, fill=0.25)
    run(device, kv.attn_image_rows(device, put(device, qkv, dtype), put(device, k, dtype), put(device, v, dtype),
                                   out, step_buf(device, pos0, T), put(device, rows, "u32"), n_q_heads=hq,
                                   n_kv_heads=hkv, head_dim=d, ctx=ctx, scale=d ** -0.5, window=window))
    want = ref_vision.attn_image_rows(np.full((T, hq * d), 0.25), rounded(qkv, dtype), rounded(k, dtype),
                                      rounded(v, dtype), rows, pos0, hq, hkv, d ** -0.5, window)
    assert np.abs(want[3:8] - 0.25).max() > 0.1 and np.all(want[:3] == 0.25)
    np.testing.assert_allclose(get(device, out), want, **TOL[dtype])


def test_avg_pool(device):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 12))
    y = empty(device, (16, 12))
    run(device, kv.avg_pool(device, put(device, x), y, side=8, kernel=2))
    np.testing.assert_allclose(get(device, y), ref_vision.avg_pool(x, 8, 2), **TOL["f32"])


# ----------------------------------------------------------------------------- Gemma 3 against transformers
FIXTURES = Path(__file__).parent / "fixtures"
FOLDER, IMAGES = FIXTURES / "tiny_gemma3_vision", FIXTURES / "vision_images"


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURES / "gemma3_vision_transformers.json").read_text())


def _image(name):
    return decode_bytes((IMAGES / name).read_bytes(), name)


def test_preprocessing_equals_the_processor(ref):
    cfg = read_vision_config(FOLDER)
    assert cfg.size == (32, 32) and cfg.tokens_per_image == 16 and cfg.pool == 2
    for name, r in ref["images"].items():
        want = np.array(r["pixel_values"], np.float32)
        got = preprocess(cfg, _image(name).image)
        assert got.shape == want.shape == (3, 32, 32)
        np.testing.assert_allclose(got, want, atol=2e-6)
    assert read_vision_config(FIXTURES / "tiny_xlmr") is None          # a text-only folder


def test_vision_tower_matches_transformers(device, ref):
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.models.siglip import SiglipTower
    cfg = read_vision_config(FOLDER)
    files = SafetensorsFolder(FOLDER)
    try:
        tower = SiglipTower(device, cfg, files.tensors, owner="test:vision")
    finally:
        files.close()
    try:
        names = sorted(ref["images"])
        out = Tensor(device.buffer(len(names) * 16 * 64 * 4, owner="test:vision"), (len(names) * 16, 64), "f32")
        for i, name in enumerate(names):
            tower.write_patches(patches(cfg, preprocess(cfg, _image(name).image)))
            device.submit(tower.record(device.batch(), out, i))
        got = get(device, out).reshape(len(names), 16, 64)
        for i, name in enumerate(names):
            want = np.array(ref["images"][name]["features"], np.float32)
            assert np.abs(want).max() > 0.5
            np.testing.assert_allclose(got[i], want, atol=2e-4, rtol=1e-4)
    finally:
        tower.dispose()
