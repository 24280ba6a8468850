"""Images in: the vision kernels against numpy (tests/ref_vision.py), Gemma 3's preprocessing, vision
tower and greedy tokens against transformers (tests/fixtures/make_gemma3_vision.py), and the image
parts of the APIs."""
from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import numpy as np
import pytest

import ref_vision
from _nn_util import TOL, empty, get, put, rounded, run, step_buf
from webgpu_engine.kernels import vision as kv
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.vision.config import patches
from webgpu_engine.vision.runner import read_vision_config
from webgpu_engine.vision.gemma3 import preprocess
from webgpu_engine.vision.images import decode_bytes, image_data_url


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


def test_pixel_shuffle(device):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 12))
    y = empty(device, (16, 48))
    run(device, kv.pixel_shuffle(device, put(device, x), y, side=8, scale=2))
    want = ref_vision.pixel_shuffle(x, 2)
    assert want[0, 12:24].tolist() == x[1].tolist() and want[0, 24:36].tolist() == x[8].tolist()
    np.testing.assert_array_equal(get(device, y), want.astype(np.float32))


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


def _tower(device, folder):
    """(config, the folder's SigLIP tower on the device, owned by test:vision)."""
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.models.siglip import SiglipTower
    cfg = read_vision_config(folder)
    files = SafetensorsFolder(folder)
    try:
        return cfg, SiglipTower(device, cfg, files.tensors, owner="test:vision")
    finally:
        files.close()


def test_vision_tower_matches_transformers(device, ref):
    cfg, tower = _tower(device, FOLDER)
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


# ----------------------------------------------------------------------------- end to end
OPTS = {"dtype": "f32", "context_window_size": 256, "prefill_chunk_size": 32}   # images cross chunk edges
VLM = FOLDER.name


def _messages(ref, key: str, url=image_data_url) -> list[dict]:
    """The fixture's messages of prompt `key` with OpenAI image_url parts (data: URLs of its images)."""
    images = iter(ref["prompts"][key]["images"])
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [{"type": "image_url", "image_url": {"url": url(IMAGES / next(images))}} if p["type"] == "image" else p
              for p in m["content"]]} for m in ref["prompts"][key]["messages"]]


def _text(ids, folder=FOLDER) -> str:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def _engine_of(folder, opts: dict | None = None):
    """A module fixture: an AsyncMLCEngine holding the model at `folder` (a model reference) with
    chat options `opts` (default OPTS)."""
    @pytest.fixture(scope="module")
    async def fixture(device):
        from webgpu_engine.engine.engine import AsyncMLCEngine
        eng = AsyncMLCEngine()
        await eng.reload(str(folder), chat_opts=OPTS if opts is None else opts)
        yield eng
        await eng.unload()
    return fixture


engine = _engine_of(FOLDER)


@pytest.mark.parametrize("key", ["text", "one", "two"])
async def test_greedy_tokens_and_logits_equal_transformers(engine, ref, key):
    """Prompt ids (each image expanded to 16 soft tokens), the last prompt row's logits (1e-4; the
    image rows' attention both ways matters: causal rows move them by 0.06) and 12 greedy tokens."""
    pipe = engine.models[VLM].pipeline
    want = ref["prompts"][key]
    await engine.chat.completions.create(model=VLM, messages=_messages(ref, key), max_tokens=1, temperature=0.0)
    assert pipe.kv_ids[:len(want["input_ids"])] == want["input_ids"]
    logits = get(pipe.dev, pipe.scheduler.fwd.logits_row(0))        # the prompt's last row
    np.testing.assert_allclose(logits, want["logits"], atol=1e-4)
    r = await engine.chat.completions.create(model=VLM, messages=_messages(ref, key), max_tokens=12, temperature=0.0)
    assert pipe.output_ids == want["greedy"]
    assert r.choices[0].message.content == _text(want["greedy"])
    assert r.usage.prompt_tokens == len(want["input_ids"])          # image tokens count


async def test_prefix_reuse_keys_images_by_content(engine, ref):
    """A follow-up turn reuses the cached rows of its image (only the new text is computed) and
    answers as the same prompt computed from scratch; the same turns about another picture (the
    same token ids) compute the image's rows again (nothing is reused: the pool's blocks are keyed
    by the images' contents), and answer as from scratch too."""
    pipe = engine.models[VLM].pipeline

    async def ask(messages):
        r = await engine.chat.completions.create(model=VLM, messages=messages, max_tokens=8, temperature=0.0)
        return r.choices[0].message.content, pipe._req.prompt_tokens, pipe._req.prefill_tokens

    async def fresh(messages):
        await engine.reset_chat(model=VLM)
        answer, n, computed = await ask(messages)
        assert computed == n
        return answer

    first = _messages(ref, "one")
    answer, _, _ = await ask(first)
    follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the colours?"}]
    got, n, computed = await ask(follow)
    start = pipe.kv_ids.index(read_vision_config(FOLDER).image_token_id)
    assert computed < n - start - 16                  # the image's rows came from the cache
    assert got == await fresh(follow)
    await ask(follow)
    other = [{"role": m["role"], "content": [{"type": "image_url", "image_url": {"url": image_data_url(IMAGES / "tall.png")}}
                                              if p["type"] == "image_url" else p for p in m["content"]]
              if isinstance(m["content"], list) else m["content"]} for m in follow]
    got, n, computed = await ask(other)
    # nothing was reused: the pool keys a sequence's blocks by its images' contents too (and the text
    # before the image is less than a block)
    assert computed == n and start < pipe.plan.kv_block_size
    assert got == await fresh(other)


# ----------------------------------------------------------------------------- Idefics3 (SmolVLM)
IDEFICS = FIXTURES / "tiny_idefics3"


@pytest.fixture(scope="module")
def idefics_ref():
    return json.loads((FIXTURES / "idefics3_transformers.json").read_text())


def test_idefics3_tiles_equal_the_processor(idefics_ref):
    """Idefics3ImageProcessor's resize to a longest edge, to whole tiles, the rows x cols split and
    the global tile (LANCZOS on uint8), and its prompt text for an image."""
    from webgpu_engine.vision import idefics3
    cfg = read_vision_config(IDEFICS)
    assert (cfg.kind, cfg.tokens_per_image, cfg.longest_edge, cfg.resample) == ("idefics3", 16, 64, 1)
    for name, r in idefics_ref["images"].items():
        image = _image(name).image
        rows, cols, _, _ = idefics3.layout(cfg, image)
        assert (rows, cols) == (r["rows"], r["cols"]) and idefics3.n_tiles(cfg, image) == len(r["features"])
        if r["pixel_values"] is not None:
            np.testing.assert_allclose(np.stack(idefics3.tiles(cfg, image)), r["pixel_values"], atol=2e-6)
    text = idefics3.full_image_sequence(cfg, _image("tall.png").image)
    assert text.count("<image>") == 3 * 16 and "<row_2_col_1>" in text and text.endswith("<fake_token_around_image>")


def test_idefics3_tower_matches_transformers(device, idefics_ref):
    """SigLIP, pixel shuffle 2x2 and the connector's projection, per tile, within 2e-4."""
    from webgpu_engine.vision import idefics3
    cfg, tower = _tower(device, IDEFICS)
    try:
        for name, r in idefics_ref["images"].items():
            cut = idefics3.tiles(cfg, _image(name).image)
            out = Tensor(device.buffer(len(cut) * 16 * 64 * 4, owner="test:vision"), (len(cut) * 16, 64), "f32")
            for i, tile in enumerate(cut):
                tower.write_patches(patches(cfg, tile))
                device.submit(tower.record(device.batch(), out, i))
            want = np.array(r["features"], np.float32).reshape(-1, 64)
            assert np.abs(want).max() > 0.5
            np.testing.assert_allclose(get(device, out), want, atol=2e-4, rtol=1e-4)
    finally:
        tower.dispose()


idefics_engine = _engine_of(IDEFICS)


@pytest.mark.parametrize("key", ["one", "two"])
async def test_idefics3_greedy_tokens_and_logits_equal_transformers(idefics_engine, idefics_ref, key):
    """Prompt ids (an image's tiles: row/column markers and 16 <image> tokens each, then the global
    tile), the last row's logits (1e-4) and 12 greedy tokens, images crossing prefill chunks (each tile
    through the tower once)."""
    eng = idefics_engine
    pipe = eng.models[IDEFICS.name].pipeline
    want = idefics_ref["prompts"][key]
    runs = pipe.vision.tower_runs
    await eng.chat.completions.create(messages=_messages(idefics_ref, key), max_tokens=1, temperature=0.0)
    assert pipe.kv_ids[:len(want["input_ids"])] == want["input_ids"]
    # each tile through the tower once, a tile cut by a chunk's edge kept for the next chunk
    assert pipe.vision.tower_runs - runs == len(pipe.vision.blocks(want["input_ids"])) and not pipe.vision.kept
    np.testing.assert_allclose(get(pipe.dev, pipe.scheduler.fwd.logits_row(0)), want["logits"], atol=1e-4)
    r = await eng.chat.completions.create(messages=_messages(idefics_ref, key), max_tokens=12, temperature=0.0)
    assert pipe.output_ids == want["greedy"]
    assert r.choices[0].message.content == _text(want["greedy"], IDEFICS)


async def test_smolvlm_in_a_batch_answers_as_alone(idefics_engine, idefics_ref):
    """Continuous batching (paged KV, chunks of 32 rows cutting tiles): six requests with one or two
    images at once give transformers' answers; then a picture whose prompt has the very token ids of
    one cached in the pool's prefix blocks (another image of the same tiles) answers as the
    picture alone from a cold cache does, not from the other picture's blocks."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    swapped = _messages(idefics_ref, "one", url=lambda p: image_data_url(IMAGES / "shapes.png"))
    alone = await idefics_engine.chat.completions.create(messages=swapped, max_tokens=12, temperature=0.0)
    eng = AsyncMLCEngine()
    await eng.reload(str(IDEFICS), chat_opts={**OPTS, "max_num_sequences": 4, "kv_block_size": 16})
    try:
        async def ask(messages):
            r = await eng.chat.completions.create(messages=messages, max_tokens=12, temperature=0.0)
            return r.choices[0].message.content
        keys = ["one", "two", "one", "two", "two", "one"]
        got = await asyncio.gather(*[ask(_messages(idefics_ref, k)) for k in keys])
        assert got == [_text(idefics_ref["prompts"][k]["greedy"], IDEFICS) for k in keys]
        assert await ask(swapped) == alone.choices[0].message.content != got[0]
    finally:
        await eng.unload()


@pytest.fixture(scope="module")
def served(tmp_path_factory, device):
    import openai

    from tinymodels import write_tiny_llama_safetensors
    from webgpu_engine.server.app import ServerOptions, ServerThread
    text = write_tiny_llama_safetensors(tmp_path_factory.mktemp("vlm") / "tiny-text")["folder"]
    # max_num_sequences 0 (as suits the device: `serve`'s default) batches a vision model too
    s = ServerThread(ServerOptions(models=[str(FOLDER), str(text), str(IDEFICS)],
                                   chat_opts=[{**OPTS, "max_num_sequences": 0}, OPTS, OPTS], port=0))
    yield s, openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
    s.stop()


def test_openai_client_gets_the_answer_about_two_images(served, ref):
    _, client = served
    r = client.chat.completions.create(model=VLM, messages=_messages(ref, "two"), max_tokens=12, temperature=0.0)
    assert r.choices[0].message.content == _text(ref["prompts"]["two"]["greedy"])


def test_openai_client_gets_smolvlms_answer(served, idefics_ref):
    _, client = served
    r = client.chat.completions.create(model=IDEFICS.name, messages=_messages(idefics_ref, "two"), max_tokens=12,
                                       temperature=0.0)
    assert r.choices[0].message.content == _text(idefics_ref["prompts"]["two"]["greedy"], IDEFICS)


def test_mlc_engine_gets_the_answer_about_an_image(device, ref):
    from webgpu_engine import MLCEngine
    eng = MLCEngine()
    eng.reload(str(FOLDER), chat_opts=OPTS)
    try:
        parts = _messages(ref, "one")[0]["content"]
        parts[0]["image_url"]["detail"] = "low"                         # accepted, one resolution
        r = eng.chat.completions.create(messages=[{"role": "user", "content": parts}], max_tokens=12,
                                        temperature=0.0)
        assert r.choices[0].message.content == _text(ref["prompts"]["one"]["greedy"])
    finally:
        eng.unload()


def _bad(client, model, content, *says):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert e.value.status_code == 400 and all(s in e.value.message for s in says), e.value.message


def test_bad_image_inputs_are_400(served):
    _, client = served
    png = image_data_url(IMAGES / "gradient.png")
    image = {"type": "image_url", "image_url": {"url": png}}
    ask = {"type": "text", "text": "What is it?"}
    _bad(client, "tiny-text", [ask, image], "tiny-text", "messages[0].content[1]", "takes no images")
    cut = base64.b64encode((IMAGES / "gradient.png").read_bytes()[:40]).decode()      # a truncated PNG
    _bad(client, VLM, [image, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + cut}}],
         "messages[0].content[1]", "not a decodable image")
    _bad(client, VLM, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "base64")
    _bad(client, VLM, [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}], "data: URL or an http(s) URL")
    _bad(client, VLM, [{"type": "image_url", "image_url": {"url": png, "detail": "ultra"}}], "detail")
    _bad(client, VLM, [image] * 12 + [ask], "12 images", "at most 11", "messages[0].content[11]")


def test_responses_and_ollama_clients_get_the_answer(served, ref):
    """The Responses API's input_image and Ollama's base64 `images` (/api/chat, /api/generate)."""
    import ollama
    server, client = served
    want = _text(ref["prompts"]["one"]["greedy"])
    url = image_data_url(IMAGES / "gradient.png")
    r = client.responses.create(model=VLM, max_output_tokens=12, temperature=0.0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url, "detail": "auto"},
        {"type": "input_text", "text": "What is in the picture?"}]}])
    assert r.output_text == want
    b64 = base64.b64encode((IMAGES / "gradient.png").read_bytes()).decode()
    oc = ollama.Client(host=server.url.removesuffix("/v1"))
    opts = {"temperature": 0.0, "num_predict": 12}
    r = oc.chat(model=VLM, messages=[{"role": "user", "content": "What is in the picture?", "images": [b64]}],
                options=opts)
    assert r.message.content == want
    assert oc.generate(model=VLM, prompt="What is in the picture?", images=[b64], options=opts).response == want
    assert "vision" in oc.show(VLM).capabilities and "vision" not in oc.show("tiny-text").capabilities
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="tiny-text", messages=[{"role": "user", "content": "x", "images": [b64]}], options=opts)
    assert e.value.status_code == 400 and "images" in str(e.value)


def test_anthropic_client_gets_the_answer(served, ref):
    """The Messages API's base64 image block in a user message."""
    import anthropic
    server, _ = served
    b64 = base64.b64encode((IMAGES / "gradient.png").read_bytes()).decode()
    client = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="none", max_retries=0)
    r = client.messages.create(model=VLM, max_tokens=12, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "What is in the picture?"}]}])
    assert r.content[0].text == _text(ref["prompts"]["one"]["greedy"])


def test_http_image_urls_are_fetched_within_limits(served, ref, monkeypatch):
    """An http(s) image_url is fetched by the server: the answer about it; a picture over the size
    limit, a slow answer and a missing one are 400s naming the part."""
    import openai
    from aiohttp import web

    from threaded_server import ThreadedServer
    from webgpu_engine.vision import images as vi
    png = (IMAGES / "gradient.png").read_bytes()

    class Pictures(ThreadedServer):
        def routes(self, app):
            async def picture(request):
                return web.Response(body=png, content_type="image/png")

            async def slow(request):
                r = web.StreamResponse()
                await r.prepare(request)
                for _ in range(40):
                    await r.write(b"x")
                    await asyncio.sleep(0.05)
                return r
            app.router.add_get("/x.png", picture)
            app.router.add_get("/slow.png", slow)
    _, client = served
    with Pictures() as pics:
        base = f"http://127.0.0.1:{pics.port}"
        url = lambda p: f"{base}/x.png"                                              # noqa: E731
        r = client.chat.completions.create(model=VLM, messages=_messages(ref, "one", url=url), max_tokens=12,
                                           temperature=0.0)
        assert r.choices[0].message.content == _text(ref["prompts"]["one"]["greedy"])
        monkeypatch.setattr(vi, "FETCH_TIMEOUT_S", 0.5)
        monkeypatch.setattr(vi, "MAX_IMAGE_BYTES", len(png) - 1)
        for path, says in (("/x.png", "more than"), ("/slow.png", "took more than"), ("/none.png", "could not fetch")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=VLM, max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": base + path}}]}])
            assert "messages[0].content[0]" in e.value.message and says in e.value.message, e.value.message


def test_cli_chat_image_option(tmp_path, ref):
    """`chat --image PATH PROMPT` answers about the picture (the first message's parts: the image,
    then the text), and a missing file is one line of error."""
    import subprocess
    import sys
    opts = json.dumps({**OPTS, "compile_at_load": False})
    run = lambda *a: subprocess.run([sys.executable, "-m", "webgpu_engine", "chat", "--quiet", "--model", str(FOLDER),  # noqa: E731
                                     "--chat-opts", opts, "--max-tokens", "12", "--temperature", "0", *a],
                                    capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    p = run("--image", str(IMAGES / "gradient.png"), "What is in the picture?")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _text(ref["prompts"]["one"]["greedy"]) in p.stdout
    p = run("--image", str(tmp_path / "missing.png"), "Hi")
    assert p.returncode != 0 and "no image file there" in p.stderr


def test_bench_vision_smoke(tmp_path):
    """bench/vision.py runs to the end with a row for each family's tiny checkpoint (its times are not
    checked; its tokens are the families' for the 640 x 480 picture)."""
    import subprocess
    import sys
    out = tmp_path / "vision.json"
    r = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "bench" / "vision.py"), "--smoke",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {r["family"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["gemma3", "idefics3", "llava", "llava_next", "phi3v", "qwen25vl"]
    assert all(r["tower_ms"] > 0 and r["preprocess_ms"] > 0 for r in rows.values())
    assert rows["gemma3"]["tokens"] == 16 and rows["phi3v"]["tokens"] == 130    # 3 x 4 crops' rows


def test_page_imports_the_image_path_without_numpy():
    """The browser constraint: the image modules import (numpy and Pillow are needed only when an
    image is decoded or preprocessed) and the protocol takes image parts with numpy unimportable."""
    from page_imports import run_without_compiled
    r = run_without_compiled("""
import webgpu_engine.vision.runner, webgpu_engine.vision.requests, webgpu_engine.vision.idefics3
import webgpu_engine.models.image_rows, webgpu_engine.models.siglip, webgpu_engine.kernels.vision
from webgpu_engine.protocol.rules import check_chat_request
req = check_chat_request({"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}, {"type": "text", "text": "hi"}]}]})
print(req["messages"][0]["content"][0]["type"], req["messages"][0]["content"][0]["where"])
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["image", "messages[0].content[0]"]


def test_memory_estimate_counts_the_vision_tower(device, monkeypatch):
    """The pre-load estimate adds the tower's weights (as uploaded) and its activations and features."""
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.engine.memory import estimate_for
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.models.siglip import vision_tensors
    from webgpu_engine.vision import runner
    cc = ChatConfig(**OPTS)
    full = estimate_for("llm", FOLDER, cc, device)
    with monkeypatch.context() as mp:
        mp.setattr(runner, "memory", lambda path, est, ctx, **_: est)
        text = estimate_for("llm", FOLDER, cc, device)
    files = SafetensorsFolder(FOLDER)
    try:
        tower = sum(t.nbytes for t in vision_tensors(files.tensors).values())
    finally:
        files.close()
    assert full.weights - text.weights >= tower > 0
    assert full.activations - text.activations >= 11 * 16 * 64 * 4        # the features of 11 images
    assert runner.memory(FIXTURES / "tiny_xlmr", text, 256) == text      # no vision_config: unchanged
