"""The page's image path (vision/pure.py: no numpy, no Pillow) against the native one: Pillow's resize
of uint8 pictures (every filter, odd sizes, non-square, up and down, both pass orders), its alpha
composite on white, the numpy pixel_values and patch rows, the tower's f32 tables, Gemma 3's and
SmolVLM's and LLaVA 1.5 / 1.6's preprocessing of the fixture pictures (LLaVA-NeXT's tiles, layout and
tower rows too), and all of it running with numpy and Pillow unimportable."""
from __future__ import annotations

from array import array

import numpy as np
import pytest
from PIL import Image

from webgpu_engine.vision import llava, pure
from webgpu_engine.vision.config import patches, pixels
from webgpu_engine.vision.images import InvalidImageError, decode_bytes, load_image
from webgpu_engine.vision.runner import FAMILY_MODULES, read_vision_config

from test_vision import FIXTURES, FOLDER, IMAGES

SIZES = [(1, 1, 5, 3), (7, 5, 32, 32), (40, 24, 32, 32), (33, 17, 9, 41), (9, 35, 35, 18), (50, 13, 11, 12),
         (18, 48, 18, 20), (31, 29, 64, 3)]


def _rgb(img: Image.Image) -> pure.RGBImage:
    return pure.RGBImage(img.width, img.height, img.tobytes())


def _array(img: pure.RGBImage) -> np.ndarray:
    return np.frombuffer(img.data, np.uint8).reshape(img.height, img.width, 3)


@pytest.mark.parametrize("resample", [1, 2, 3, 4, 5])
def test_resize_equals_pillows(resample):
    rng = np.random.default_rng(resample)
    for w, h, W, H in SIZES:
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(a, "RGB").resize((W, H), resample=resample, reducing_gap=None))
        got = _array(pure.RGBImage(w, h, a.tobytes()).resize((W, H), resample=resample))
        np.testing.assert_array_equal(got, want, err_msg=f"{w}x{h} -> {W}x{H}, filter {resample}")
    for _ in range(30):                  # and random sizes, up to 4x up or down either way
        w, h, W, H = (int(v) for v in rng.integers(1, 80, 4))
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(a, "RGB").resize((W, H), resample=resample, reducing_gap=None))
        got = _array(pure.RGBImage(w, h, a.tobytes()).resize((W, H), resample=resample))
        np.testing.assert_array_equal(got, want, err_msg=f"{w}x{h} -> {W}x{H}, filter {resample}")
    with pytest.raises(ValueError, match="resample 0"):
        pure.RGBImage(2, 2, bytes(12)).resize((3, 3), resample=0)


def test_crop_and_alpha_composite_equal_pillows():
    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, (13, 21, 3), dtype=np.uint8)
    got = pure.RGBImage(21, 13, a.tobytes()).crop((3, 2, 17, 11))
    np.testing.assert_array_equal(_array(got), np.asarray(Image.fromarray(a, "RGB").crop((3, 2, 17, 11))))
    # every (value, alpha) pair over white, as transformers' convert_rgb composites through Pillow
    v, al = np.meshgrid(np.arange(256), np.arange(256))
    rgba = np.stack([v, 255 - v, v // 2, al], -1).astype(np.uint8)
    white = Image.new("RGBA", (256, 256), (255, 255, 255))
    want = np.asarray(Image.alpha_composite(white, Image.fromarray(rgba, "RGBA")).convert("RGB"))
    np.testing.assert_array_equal(_array(pure.from_rgba(rgba.tobytes(), 256, 256)), want)
    with pytest.raises(ValueError, match="RGBA"):
        pure.from_rgba(bytes(7), 1, 2)


def test_pixels_patches_and_tables_equal_numpys():
    cfg = read_vision_config(FOLDER)
    rng = np.random.default_rng(3)
    img = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "RGB")
    want = pixels(cfg, img)
    got = pixels(cfg, _rgb(img))
    assert isinstance(got, pure.PixelValues) and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.values, np.float32).reshape(want.shape), want)
    rows = patches(cfg, got)
    assert isinstance(rows, array)
    np.testing.assert_array_equal(np.asarray(rows, np.float32).reshape(-1, 48), patches(cfg, want))
    x = rng.standard_normal((6, 5)).astype(np.float32)
    for qtype, raw in (("f32", x.tobytes()), ("f16", x.astype(np.float16).tobytes()),
                       ("bf16", (x.view(np.uint32) >> 16).astype(np.uint16).tobytes())):
        ref = {"f32": x, "f16": x.astype(np.float16).astype(np.float32),
               "bf16": ((x.view(np.uint32) >> 16) << 16).view(np.float32)}[qtype]
        np.testing.assert_array_equal(np.asarray(pure.f32_values(raw, qtype)), ref.reshape(-1))
    np.testing.assert_array_equal(np.asarray(pure.transposed(array("f", x.tobytes()), 6, 5)), x.T.reshape(-1))


FAMILY_FOLDERS = {"gemma3": FOLDER, "idefics3": FIXTURES / "tiny_idefics3", "llava": FIXTURES / "tiny_llava",
                  "llava_next": FIXTURES / "tiny_llava_next", "qwen25vl": FIXTURES / "tiny_qwen25vl"}


@pytest.mark.parametrize("family", list(FAMILY_FOLDERS))
def test_family_tiles_equal_the_native_path(family):
    """Each fixture picture (an RGBA one among them) through the family's own tiles(): the page's
    decoded RGBA bytes give the pixel values the Pillow-decoded file gives (LLaVA-NeXT's: each tile's,
    its patch rows and its layout; Qwen2.5-VL's: its grid and its patch rows in merge order)."""
    cfg = read_vision_config(FAMILY_FOLDERS[family])
    fam = FAMILY_MODULES[cfg.kind]
    for name in sorted(p.name for p in IMAGES.glob("*.png")):
        native = decode_bytes((IMAGES / name).read_bytes(), name).image
        rgba = Image.open(IMAGES / name).convert("RGBA")
        page = pure.from_rgba(rgba.tobytes(), rgba.width, rgba.height)
        want, got = fam.tiles(cfg, native), fam.tiles(cfg, page)
        assert len(got) == len(want) >= 1
        if family == "llava_next":
            (want,), (got,) = want, got
            assert list(got.layout) == list(want.layout) and len(got.layout) == llava.n_tokens(cfg, page), name
            want_rows, got_rows = llava.patches(cfg, want), llava.patches(cfg, got)
            assert isinstance(got_rows.pixels, array)
            np.testing.assert_array_equal(np.asarray(got_rows.pixels, np.float32).reshape(want_rows.pixels.shape),
                                          want_rows.pixels, err_msg=name)
            got, want = got.pixels, want.pixels
        elif family == "qwen25vl":
            (want,), (got,) = want, got
            assert (got.gh, got.gw) == (want.gh, want.gw) and isinstance(got.rows, array)
            np.testing.assert_array_equal(np.asarray(got.rows, np.float32).reshape(want.rows.shape), want.rows,
                                          err_msg=name)
            continue
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g.values, np.float32).reshape(w.shape), w, err_msg=name)


def test_llava_next_layout_and_padding_equal_numpys():
    """The pure layout (each kept grid row of tile patches, then the newline) against its numpy
    statement, for every picture shape up to 5 tiles wide or high; the pure pad against Pillow's paste."""
    cfg = read_vision_config(FAMILY_FOLDERS["llava_next"])
    cfg = llava.any_resolution(cfg, [[32, 64], [64, 32], [64, 64], [96, 32], [32, 160]], "test")
    P = cfg.patches_per_side
    for h, w in ((1, 1), (1, 200), (200, 1), (20, 70), (33, 31), (50, 70), (90, 20), (13, 160), (64, 64)):
        gh, gw, top, left = llava.grid(cfg, h, w)
        R, C = np.arange(top, gh * P - top), np.arange(left, gw * P - left)
        k = 1 + (R[:, None] // P) * gw + C[None, :] // P
        rows = k * P * P + (R[:, None] % P) * P + C[None, :] % P
        rows = np.concatenate([rows, np.full((len(R), 1), llava.NEWLINE)], axis=1)
        want = np.concatenate([np.arange(P * P), rows.reshape(-1)]).astype(np.uint32)
        np.testing.assert_array_equal(np.asarray(llava.layout(cfg, h, w, llava.NEWLINE), np.uint32), want)
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (7, 11, 3), dtype=np.uint8)
    canvas = Image.new("RGB", (16, 9))
    canvas.paste(Image.fromarray(a, "RGB"), (2, 1))
    np.testing.assert_array_equal(_array(pure.padded(pure.RGBImage(11, 7, a.tobytes()), 16, 9, 2, 1)),
                                  np.asarray(canvas))
    with pytest.raises(ValueError, match="outside 16x9"):
        pure.padded(pure.RGBImage(11, 7, a.tobytes()), 16, 9, 6, 1)


def test_qwen25vl_layout_and_positions_equal_numpys():
    """Qwen2.5-VL's window order, its tower's 2D positions and M-RoPE's positions (pure Python, for the
    page) against their numpy statements, over grids cut at the windows' edges or not."""
    from webgpu_engine.vision import qwen25vl
    cfg = read_vision_config(FAMILY_FOLDERS["qwen25vl"])
    m = cfg.qwen25vl.merge
    side = cfg.qwen25vl.window // m // cfg.patch_size
    for gh, gw in ((2, 2), (6, 10), (10, 6), (4, 16), (14, 8), (2, 30)):
        bh, bw = gh // m, gw // m
        idx = np.arange(bh * bw).reshape(bh, bw)
        wins = [idx[r:r + side, c:c + side].reshape(-1) for r in range(0, bh, side) for c in range(0, bw, side)]
        order, sizes = qwen25vl.window_order(cfg, gh, gw)
        assert order.tolist() == np.concatenate(wins).tolist() and sizes == [w.size * m * m for w in wins]
        hh, ww = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        hh, ww = (a.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1) for a in (hh, ww))
        want = np.stack([np.zeros_like(hh), hh, ww], axis=1)
        np.testing.assert_array_equal(np.array(qwen25vl.rope_positions(cfg, gh, gw)), want)

    def reference(images, n):            # the numpy statement of get_rope_index
        out, behind, row = np.zeros((n, 3), np.int64), 0, 0
        for s, e, g in list(images) + [(n, n, None)]:
            out[row:min(s, n)] = (np.arange(row, min(s, n)) - behind)[:, None]
            if g is None or s >= n:
                break
            p, w, k = s - behind, g.gw // m, np.arange(e - s)
            out[s:min(e, n)] = np.stack([np.full(e - s, p), p + k // w, p + k % w], 1)[:min(e, n) - s]
            behind += (e - s) - max(g.gh, g.gw) // m
            row = e
        return out
    a, b = qwen25vl.Grid(None, 4, 6), qwen25vl.Grid(None, 8, 2)
    for images, n in (([], 5), ([(3, 9, a)], 14), ([(3, 9, a)], 6), ([(2, 8, a), (10, 14, b)], 20),
                      ([(0, 4, b), (4, 10, a)], 12), ([(1, 7, a)], 1)):
        np.testing.assert_array_equal(np.array(qwen25vl.positions(cfg, images, n)).reshape(-1, 3),
                                      reference(images, n), err_msg=str((images, n)))


@pytest.mark.parametrize("family", ["llava_next", "qwen25vl"])
def test_tower_takes_the_pages_rows(device, family):
    """LlavaNextTower and Qwen25VLTower given the page's patch rows (an `array`; LLaVA-NeXT's layout
    too) write the features they write for numpy's rows of the same picture."""
    from _nn_util import get
    from webgpu_engine.kernels.common import Tensor
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.vision import qwen25vl
    from webgpu_engine.vision.llava_gpu import LlavaNextTower
    from webgpu_engine.vision.qwen25vl_gpu import Qwen25VLTower
    folder, owner = FAMILY_FOLDERS[family], "test:pure_" + family
    cfg = read_vision_config(folder)
    fam, Tower = (llava, LlavaNextTower) if family == "llava_next" else (qwen25vl, Qwen25VLTower)
    files = SafetensorsFolder(folder)
    try:
        tower = Tower(device, cfg, files.tensors, owner=owner)
    finally:
        files.close()
    try:
        n, width = cfg.tokens_per_image, cfg.text_hidden
        out = Tensor(device.buffer(2 * n * width * 4, owner=owner), (2 * n, width), "f32")
        rgba = Image.open(IMAGES / "wide.png").convert("RGBA")
        native = decode_bytes((IMAGES / "wide.png").read_bytes(), "wide.png").image
        for i, image in enumerate((native, pure.from_rgba(rgba.tobytes(), rgba.width, rgba.height))):
            tower.write_patches(fam.patches(cfg, fam.tiles(cfg, image)[0]))
            device.submit(tower.record(device.batch(), out, i))
        got = get(device, out).reshape(2, n, width)
        m = fam.n_tokens(cfg, native)
        assert m > 4 and np.abs(got[0, :m]).max() > 0
        np.testing.assert_array_equal(got[1, :m], got[0, :m])
    finally:
        tower.dispose()
        device.release_owner(owner)


def _phi3v_cfg():
    from webgpu_engine.vision import phi3v
    return phi3v.read_config("tiny", {"hidden_size": 64, "vision_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}}, None)


def test_phi3v_crops_equal_the_native_path():
    """Phi-3.5-vision's MLC preprocessing (TVM's f32 bilinear resize truncated, the 255 pad, the
    normalisation, the global image's f32 resize, the crops) of the page's picture: numpy's values
    exactly, for a tall picture (one crop wide, six high, padded: the fewest crops a picture resizes
    to, as each takes seconds in pure Python)."""
    from webgpu_engine.vision import phi3v
    cfg = _phi3v_cfg()
    a = np.random.default_rng(11).integers(0, 256, (500, 90, 3), dtype=np.uint8)
    for native, page in ((Image.fromarray(a, "RGB"), pure.RGBImage(90, 500, a.tobytes())),):
        want, got = phi3v.preprocess(cfg, native), phi3v.preprocess(cfg, page)
        assert (got.rows, got.cols) == (want.rows, want.cols) and len(got.pixels) == len(want.pixels) >= 2
        for g, w in zip(got.pixels, want.pixels):
            np.testing.assert_array_equal(np.asarray(g.values, np.float32).reshape(w.shape), w)
        rows = phi3v.patches(cfg, got).pixels
        assert isinstance(rows, array)
        np.testing.assert_array_equal(np.asarray(rows, np.float32).reshape(-1, 3 * 14 * 14),
                                      phi3v.patches(cfg, want).pixels)


def _rgba_url(path, width=None) -> str:
    import base64
    img = Image.open(path).convert("RGBA")
    return (f"data:image/x-rgba;width={width or img.width};height={img.height};base64,"
            + base64.b64encode(img.tobytes()).decode())


def test_rgba_data_urls_decode_as_the_encoded_file():
    """The page's form of a picture (its RGBA pixels) decodes natively to what the PNG decodes to; a
    malformed one is a 400 naming the part."""
    for name in ("gradient.png", "shapes.png"):
        got = load_image(_rgba_url(IMAGES / name), "messages[0].content[0]")
        want = decode_bytes((IMAGES / name).read_bytes(), name)
        assert (got.width, got.height) == (want.width, want.height)
        np.testing.assert_array_equal(np.asarray(got.image), np.asarray(want.image))
    with pytest.raises(InvalidImageError, match=r"messages\[0\].content\[1\]: .*bytes for an RGBA picture"):
        load_image(_rgba_url(IMAGES / "shapes.png", width=21), "messages[0].content[1]")
    with pytest.raises(InvalidImageError, match="width=W;height=H"):
        load_image("data:image/x-rgba;width=2;base64,AAAA", "x")


def test_the_page_path_runs_without_numpy_and_pillow():
    from page_imports import run_without_compiled
    r = run_without_compiled("""
class NoPIL:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'PIL':
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, NoPIL())
import base64
from pathlib import Path
from webgpu_engine.vision import pure, gemma3
from webgpu_engine.vision.config import patches
from webgpu_engine.vision.runner import read_vision_config
from webgpu_engine.models.siglip import position_ids
assert len(position_ids(27)) == 27 * 27
cfg = read_vision_config(Path("tests/fixtures/tiny_gemma3_vision"))
from webgpu_engine.vision.images import InvalidImageError, load_image
im = load_image("data:image/x-rgba;width=40;height=24;base64," + base64.b64encode(bytes(range(256)) * 15).decode(), "p")
rows = patches(cfg, gemma3.tiles(cfg, im.image)[0])
print(type(im.image).__name__, type(rows).__name__, len(rows))
from webgpu_engine.vision import llava
one = read_vision_config(Path("tests/fixtures/tiny_llava"))
print(len(llava.patches(one, llava.tiles(one, im.image)[0])) // 192)
nxt = read_vision_config(Path("tests/fixtures/tiny_llava_next"))
t = llava.patches(nxt, llava.tiles(nxt, im.image)[0])
print(type(t.pixels).__name__, len(t.pixels) // 192, len(t.layout) == llava.n_tokens(nxt, im.image) == 16 + 4 * 7)
from webgpu_engine.vision import qwen25vl
qc = read_vision_config(Path("tests/fixtures/tiny_qwen25vl"))
g = qwen25vl.preprocess(qc, im.image)
order, sizes = qwen25vl.window_order(qc, g.gh, g.gw)
offs = qwen25vl.offsets(qc, [(2, 2 + qwen25vl.n_tokens(qc, im.image), g)], 0, 40)
print(type(g.rows).__name__, len(g.rows) == g.gh * g.gw * 3 * 2 * qc.patch_size ** 2, sum(sizes) == g.gh * g.gw,
      len(offs), len(qwen25vl.rope_positions(qc, g.gh, g.gw)) == g.gh * g.gw)
from webgpu_engine.vision import phi3v
pc = phi3v.read_config("t", {"hidden_size": 64, "vision_config": {"num_hidden_layers": 2}}, None)
tall = pure.RGBImage(30, 170, bytes(range(256)) * 59 + bytes(196))
crops = phi3v.patches(pc, phi3v.preprocess(pc, tall))
print(type(crops.pixels).__name__, len(crops.pixels) // (3 * 14 * 14 * 24 * 24), len(phi3v.layout(pc, crops.rows, crops.cols, 99)) // 4 == phi3v.n_tokens(pc, tall))
try:
    load_image("data:image/png;base64,AAAA", "messages[0].content[0]")
except InvalidImageError as e:
    print("x-rgba" in str(e))
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["RGBImage", "array", str(64 * 48), "16", "array", str(3 * 16), "True",
                                 "array", "True", "True", "40", "True",
                                 "array", "7", "True", "True"]


def test_idefics3_position_ids_equal_numpys_f32_bucketing():
    """models/siglip.py's position_ids (pure Python, for the page) against the f32 numpy computation of
    Idefics3's embeddings, for every tile side up to 129 patches (the identity where 1/side is exact)."""
    from webgpu_engine.models.siglip import position_ids

    def reference(side):
        step = np.float32(1.0) / np.float32(side)
        frac = np.minimum(np.arange(side, dtype=np.float32) * step, np.float32(1.0 - 1e-6))
        b = np.searchsorted(np.arange(1 / side, 1.0, 1 / side, dtype=np.float32), frac, side="right")
        return (b[:, None] * side + b[None, :]).reshape(-1).tolist()
    assert [s for s in range(1, 130) if position_ids(s) != reference(s)] == []
    assert position_ids(27) != list(range(27 * 27)) and position_ids(32) == list(range(32 * 32))
