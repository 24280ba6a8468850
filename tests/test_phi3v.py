"""Phi-3.5-vision from WebLLM's MLC artifacts (model_type phi3_v, vision/phi3v.py + phi3v_gpu.py):
WebLLM's sizes, MLC's preprocessing and HD layout against a numpy reference written from mlc-llm's
code (tests/ref_phi3v.py), the CLIP tower against transformers' CLIPVisionModel
(tests/fixtures/make_phi3v.py), and greedy tokens for a prompt with one image from tiny artifacts
(tests/tinyphi3v.py) in q0f32, q4f16_1 and q4f32_1 equal to the reference's."""
from __future__ import annotations

import io

import numpy as np
import pytest
import ref_phi3v as ref
from _nn_util import get
from PIL import Image
from ref_llama import RefLlama
from test_mlc import _values
from tinyphi3v import CONV, tower_fixture, write_tiny_phi3v_mlc

from webgpu_engine.errors import InvalidRequestError
from webgpu_engine.loaders.mlc import refusal
from webgpu_engine.models.registry import open_model
from webgpu_engine.vision import phi3v
from webgpu_engine.vision.images import decode_bytes

OPTS = {"dtype": "f32", "context_window_size": 512, "prefill_chunk_size": 256}
N_NEW = 8


def _picture(w: int, h: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    a = np.stack([xx * 255 // max(1, w - 1), yy * 255 // max(1, h - 1), (xx + yy) % 256], -1)
    a = np.clip(a + rng.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def _cfg():
    tcfg, _, _ = tower_fixture()

    class Tok:
        def token_to_id(self, t):
            return 300 if t == "<|image|>" else None
    return phi3v.read_config("tiny", {"hidden_size": 64, "vision_config": tcfg,
                                      "img_processor": {"image_dim_out": 32}}, Tok())


@pytest.mark.parametrize("size", [(400, 300), (500, 300), (1000, 90)])
def test_sizes_and_preprocessing_are_mlcs(size):
    """WebLLM's resize / crop shapes and token count; MLC's resize (u32 truncation), pad (255),
    normalisation, global image and crops equal the reference's (padding included: 500 x 300
    resizes to 1007 rows)."""
    w, h = size
    cfg, image = _cfg(), decode_bytes(_picture(w, h), "p.png").image
    assert phi3v.resize_shape(h, w) == ref.resize_shape(h, w)
    crops = phi3v.preprocess(cfg, image)
    want, hc, wc = ref.image_preprocess(np.asarray(image))
    assert (crops.rows, crops.cols) == (hc, wc) == phi3v.crop_shape(h, w) and crops.pixels.shape == want.shape
    np.testing.assert_allclose(crops.pixels, want, atol=1e-5)
    assert phi3v.n_tokens(cfg, image) == ref.n_rows(h, w, 3) == len(phi3v.layout(cfg, hc, wc, 17 * 36 + 8)) // 4


def test_webllm_sizes_of_the_real_tower():
    """ViT-L/14-336 (12 x 12 merged rows per crop): WebLLM's computeImageEmbedSize; at most 2653 rows."""
    assert ref.n_rows(300, 400, 12) == 3 * 12 * 49 + 1 + 156
    assert phi3v.HD_NUM == 16 and (phi3v.HD_NUM + 1) * 12 * 13 + 1 == 2653


def test_too_wide_a_picture_is_refused():
    image = Image.new("RGB", (8000, 1))
    with pytest.raises(InvalidRequestError, match="too wide"):
        phi3v.preprocess(_cfg(), image)


def test_reference_tower_equals_transformers():
    """ref_phi3v's CLIP tower (MLC's: class row first, pre-layernorm, quick_gelu, the second to last
    layer, the class row dropped) equals transformers' CLIPVisionModel on the fixture."""
    tcfg, tw, feats = tower_fixture()
    px = np.random.default_rng(7).standard_normal((2, 3, 336, 336)).astype(np.float32)
    np.testing.assert_allclose(ref.clip_tower(px, tw, tcfg), feats, atol=2e-4)


def test_the_layout_is_mlcs_reshapes():
    """The engine's gather rows of the HD layout equal MLC's reshape / permute / concat steps."""
    cfg = _cfg()
    rng = np.random.default_rng(1)
    h, w, N, C = 2, 3, 36, 32
    feats = rng.standard_normal((1 + h * w, N, C))
    sub_gn, glb_gn = rng.standard_normal(4 * C), rng.standard_normal(4 * C)
    table = np.concatenate([feats.reshape(-1, C), np.zeros((17 * N - len(feats) * N, C)),
                            sub_gn.reshape(4, C), glb_gn.reshape(4, C)])
    got = table[phi3v.layout(cfg, h, w, len(table))].reshape(-1, 4 * C)
    want = np.concatenate([ref._newline(ref._merge(feats[1:], h, w), sub_gn), glb_gn.reshape(1, 1, -1),
                           ref._newline(ref._merge(feats[:1], 1, 1), sub_gn)], axis=1)[0]
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3v")
    return {q: write_tiny_phi3v_mlc(root / q, q) for q in ("q0f32", "q4f16_1", "q4f32_1")}


@pytest.mark.parametrize("quant", ["q4f16_1"])
def test_gpu_image_rows_equal_the_reference(device, artifacts, quant):
    """vision/phi3v_gpu.py's rows of a 300 x 400 picture (4 x 3 crops: 133 rows; the tower in the
    artifact's dtype, the projector q4 in q4f16_1) equal ref_phi3v's image_embed."""
    from webgpu_engine.kernels.common import new_tensor
    from webgpu_engine.loaders.mlc import MLCArtifact
    from webgpu_engine.vision.phi3v_gpu import Phi3vTower
    art, image = artifacts[quant], decode_bytes(_picture(300, 400, seed=2), "p.png").image
    cfg = _cfg()
    mlc = MLCArtifact(art["folder"])
    try:
        tower = Phi3vTower(device, cfg, mlc, owner="phi3v-test")
    finally:
        mlc.close()
    try:
        dst = new_tensor(device, (2 * cfg.tokens_per_image, cfg.text_hidden), "f32", owner="phi3v-test")
        tower.write_patches(phi3v.patches(cfg, phi3v.preprocess(cfg, image)))
        device.submit(tower.record(device.batch(), dst, 1))
        n = phi3v.n_tokens(cfg, image)
        got = get(device, dst).reshape(-1, cfg.text_hidden)[cfg.tokens_per_image:cfg.tokens_per_image + n]
        tcfg, tw = art["tower"]
        want = ref.image_embed(np.asarray(image), tw, tcfg, art["proj"])
        assert n == len(want) == 133
        np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
    finally:
        tower.dispose()
        device.release_owner("phi3v-test")


def _reference(art: dict, ids: list[int], images: list) -> list[int]:
    """Greedy tokens of MLC's definition: each picture's rows from ref_phi3v in place of its run of
    image tokens, in order."""
    tcfg, tw = art["tower"]
    rows = [ref.image_embed(np.asarray(im), tw, tcfg, art["proj"]) for im in images]
    m = open_model(art["folder"])
    try:
        cfg, w = m.config, _values(m, m.config)
    finally:
        m.close()
    V = w["embed"].shape[0]
    w = {**w, "embed": np.concatenate([w["embed"], *rows])}
    pos = [p for p, t in enumerate(ids) if t == art["image_id"]]
    assert len(pos) == sum(map(len, rows))
    feed = [V + pos.index(p) if p in pos else t for p, t in enumerate(ids)]
    r = RefLlama(cfg, w)
    out = [int(np.argmax(r.forward(feed)[-1]))]
    for _ in range(N_NEW - 1):
        out.append(int(np.argmax(r.forward([out[-1]])[-1])))
    return out


def _messages(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": "What is in the picture?"}]}]


def _expected(art: dict, *pngs) -> tuple[list[int], str]:
    """(prompt ids, the reference's greedy answer) for the pictures `pngs` and _messages' text:
    WebLLM's prompt (each picture's rows after "<|user|>\\n", then "\\n"; then the text)."""
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    tok = load_tokenizer(art["folder"])
    images = [decode_bytes(png.read_bytes(), "p.png") for png in pngs]
    user = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": "What is in the picture?"}]}]
    cfg = phi3v.read_config("tiny", {"hidden_size": 64, "vision_config": art["tower"][0]}, tok)
    prompt = phi3v.template(None, cfg, CONV).encode(tok, user)
    first, n = prompt.index(art["image_id"]), [phi3v.n_tokens(cfg, im.image) for im in images]
    assert prompt[:first] == [1, *tok.encode("<|user|>\n")] and prompt.count(art["image_id"]) == sum(n)
    assert tok.decode(prompt[first + n[0]:first + n[0] + 1]) == "\n"
    want = _reference(art, prompt, [im.image for im in images])
    return prompt, tok.decode(want[:next((i for i, t in enumerate(want) if t == 2), len(want))])


@pytest.mark.parametrize("quant,chunk", [("q0f32", 64), ("q4f16_1", 256)])
async def test_greedy_tokens_equal_the_reference(device, artifacts, quant, chunk):
    """A 400 x 300 picture (3 x 4 crops + the global image: 130 rows) in a user turn through
    AsyncMLCEngine: the prompt's length and 8 greedy tokens equal the reference's; in prefill chunks
    of 64 the picture's rows span three (as the real model's up to 2653 rows span WebLLM's 2048) and
    its tower runs once;
    q4f16_1 also with a second, taller picture (4 x 3 crops, 133 rows) in the same turn."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    from webgpu_engine.vision.images import image_data_url
    art = artifacts[quant]
    png = art["folder"].parent / f"{quant}.png"
    png.write_bytes(_picture(400, 300))
    eng = AsyncMLCEngine()
    await eng.reload(str(art["folder"]), chat_opts={**OPTS, "prefill_chunk_size": chunk})
    try:
        model = next(iter(eng.models))
        vision = eng.models[model].pipeline.vision
        r = await eng.chat.completions.create(model=model, messages=_messages(image_data_url(png)),
                                              max_tokens=N_NEW, temperature=0.0)
        prompt, answer = _expected(art, png)
        assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == answer
        assert vision.tower_runs == 1 and not vision.kept
        if quant == "q4f16_1":           # two pictures (130 + 133 rows) in one turn
            tall = art["folder"].parent / "tall.png"
            tall.write_bytes(_picture(300, 400, seed=4))
            r = await eng.chat.completions.create(model=model, messages=_messages(image_data_url(png),
                                                                                  image_data_url(tall)),
                                                  max_tokens=N_NEW, temperature=0.0)
            prompt, answer = _expected(art, png, tall)
            assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == answer
    finally:
        await eng.unload()


async def test_a_first_image_request_compiles_nothing(fresh_device, artifacts):
    """compile_at_load builds the tower's op lists at load (the projector over the most rows) beside the
    decoder's: on a device with no pipelines before the load, the first request with a picture (130
    rows) creates no pipeline and answers as the reference."""
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.engine.engine import AsyncMLCEngine
    from webgpu_engine.vision.images import image_data_url
    art = artifacts["q4f16_1"]
    png = art["folder"].parent / "first.png"
    png.write_bytes(_picture(400, 300))
    eng = AsyncMLCEngine(EngineConfig(device=fresh_device))
    await eng.reload(str(art["folder"]), chat_opts={**OPTS, "compile_at_load": True})
    try:
        model = next(iter(eng.models))
        await fresh_device.compiled()
        loaded = fresh_device.compile_count
        r = await eng.chat.completions.create(model=model, messages=_messages(image_data_url(png)),
                                              max_tokens=N_NEW, temperature=0.0)
        assert r.choices[0].message.content == _expected(art, png)[1]
        assert fresh_device.compile_count == loaded
    finally:
        await eng.unload()


def test_openai_client_gets_the_reference_answer(device, artifacts):
    """The q4f32_1 artifact served: the OpenAI client's chat completion about the picture is the
    reference's greedy answer."""
    import openai

    from webgpu_engine.server.app import ServerOptions, ServerThread
    from webgpu_engine.vision.images import image_data_url
    art = artifacts["q4f32_1"]
    png = art["folder"].parent / "served.png"
    png.write_bytes(_picture(400, 300))
    s = ServerThread(ServerOptions(models=[str(art["folder"])], chat_opts=[OPTS], port=0))
    try:
        client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
        r = client.chat.completions.create(model=art["folder"].name, messages=_messages(image_data_url(png)),
                                           max_tokens=N_NEW, temperature=0.0)
        prompt, answer = _expected(art, png)
        assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == answer
    finally:
        s.stop()


def test_memory_estimate_counts_the_image_side(device, artifacts):
    """The pre-load estimate of a phi3_v artifact adds its vision_embed_tokens.* bytes, the tower's and
    projector's activations and the features a load's images take."""
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.engine.memory import estimate_for
    from webgpu_engine.loaders.mlc import MLCArtifact
    from webgpu_engine.vision import runner
    folder = artifacts["q4f16_1"]["folder"]
    full = estimate_for("llm", folder, ChatConfig(**OPTS), device)
    text = runner.memory(folder.parent / "none", full, 512)         # no artifact there: unchanged
    assert text == full
    art = MLCArtifact(folder)
    try:
        vision = sum(t.data.nbytes for n, t in art.tensors.items() if n.startswith("vision_embed_tokens."))
    finally:
        art.close()
    base = type(full)(weights=0)
    more = runner.memory(folder, base, 512)
    assert more.weights >= vision > 0 and more.activations >= 2 * 205 * 64 * 4       # 2 pictures' rows


def test_the_catalogue_loads_both_ids():
    assert refusal("phi3_v", "q4f16_1", "vlm") == "" and refusal("phi3_v", "q4f32_1", "vlm") == ""
    assert refusal("llava", "q4f16_1", "vlm") == "vlm models of MLC's are not loaded"


def test_the_page_imports_phi3v_without_numpy():
    """The browser constraint: the phi3_v modules import with numpy and Pillow unimportable."""
    from page_imports import run_without_compiled
    r = run_without_compiled("import webgpu_engine.vision.phi3v, webgpu_engine.vision.phi3v_gpu\nprint('ok')\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok"]
