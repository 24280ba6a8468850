"""Images in the browser page: the tiny Gemma 3 vision-language fixture (tests/fixtures/
make_gemma3_vision.py) loads in headless Chromium as a Hugging Face folder, takes a picture attached
with the page's button (one pasted into the prompt shows as a thumbnail) and answers with
transformers' greedy tokens for that picture; so do the tiny SmolVLM (make_idefics3.py) and LLaVA 1.6
(make_llava_next.py: any-resolution tiles, image_newline rows). The page
decodes the picture in JavaScript, vision/pure.py preprocesses it without numpy or Pillow, the
SigLIP tower runs on the browser's WebGPU (SwiftShader, f32 kernels). Served by tests/test_browser.py's
server fixture."""
from __future__ import annotations

import base64
import json

import pytest
from PIL import Image

from test_browser import ARTIFACTS, ROOT, _console, _open_demo, browser_env, chromium, server  # noqa: F401
from test_vision import _text
from webgpu_engine.vision.images import decode_bytes, load_image

pytestmark = pytest.mark.browser

FOLDER = ROOT / "tests" / "fixtures" / "tiny_gemma3_vision"
IMAGES = ROOT / "tests" / "fixtures" / "vision_images"
REFERENCE = ROOT / "tests" / "fixtures" / "gemma3_vision_transformers.json"
SMOL = ROOT / "tests" / "fixtures" / "tiny_idefics3"
SMOL_REFERENCE = ROOT / "tests" / "fixtures" / "idefics3_transformers.json"
NEXT = ROOT / "tests" / "fixtures" / "tiny_llava_next"
NEXT_REFERENCE = ROOT / "tests" / "fixtures" / "llava_next_transformers.json"
OPTS = {"temperature": 0.0, "top_p": 1.0, "context_window_size": 256, "prefill_chunk_size": 32}


async def test_page_answers_about_an_attached_picture(server, tmp_path):
    base, log = server
    logs: list[str] = []
    want = json.loads(REFERENCE.read_text())["prompts"]["one"]
    [image] = want["images"]
    prompt = want["messages"][0]["content"][1]["text"]
    files = sorted(f.name for f in FOLDER.iterdir())
    async with chromium(tmp_path / "profile") as ctx:
        page = await _open_demo(ctx, base, logs, "&models=")
        try:
            r = await page.evaluate(f"window.demo.loadFolder({json.dumps(base + 'fixtures/' + FOLDER.name + '/')}, "
                                    f"{json.dumps(files)}, 'tiny-gemma3-vision', {json.dumps(OPTS)})")
            assert r["model_id"] == "tiny-gemma3-vision" and r["fetch"][r["model_id"]]["fetched_files"] == len(files)

            # the page's decoding of each fixture picture: the RGB it composites to is Pillow's (the RGBA
            # bytes themselves where the picture is opaque; the canvas keeps colours premultiplied by alpha)
            for png in sorted(IMAGES.glob("*.png")):
                part = await page.evaluate(f"window.demo.imagePart({json.dumps(base + 'fixtures/vision_images/' + png.name)})")
                page_im, file_im = load_image(part["image_url"]["url"], png.name), decode_bytes(png.read_bytes(), png.name)
                assert page_im.image.size == file_im.image.size, png.name
                assert page_im.image.tobytes() == file_im.image.tobytes(), png.name
                rgba = Image.open(png).convert("RGBA")
                if rgba.getextrema()[3][0] == 255:
                    assert base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == rgba.tobytes(), png.name

            # a pasted picture waits as a thumbnail for the next message; a click takes it off
            await page.evaluate("""async (src) => {
                const blob = await (await fetch(src)).blob();
                const dt = new DataTransfer();
                dt.items.add(new File([blob], "pasted.png", { type: "image/png" }));
                document.getElementById("prompt").dispatchEvent(new ClipboardEvent("paste", { clipboardData: dt }));
            }""", base + "fixtures/vision_images/tall.png")
            assert len(await page.query_selector_all("#attached img")) == 1
            await page.click("#attached img")
            assert len(await page.query_selector_all("#attached img")) == 0

            # the attach button's picture goes with the typed prompt; the answer is transformers' greedy one
            await page.fill("#prompt", prompt)
            await page.set_input_files("#attach", str(IMAGES / image))
            assert len(await page.query_selector_all("#attached img")) == 1
            got = await page.evaluate("window.demo.chat(document.getElementById('prompt').value, {max_tokens: 12})")
            print(f"\nbrowser Gemma 3: loaded in {r['load_seconds']:.2f} s, answered in {got['seconds']:.2f} s")
            assert got["text"] == _text(want["greedy"]), got
            assert got["usage"]["prompt_tokens"] == len(want["input_ids"])       # the image's tokens count
            assert len(await page.query_selector_all("#message img")) == 1        # sent: shown with the message
            assert len(await page.query_selector_all("#attached img")) == 0
            # the answer is about the picture: another one (given by URL) changes it
            other = await page.evaluate(f"window.demo.chat({json.dumps(prompt)}, {{max_tokens: 12}}, "
                                        f"[{json.dumps(base + 'fixtures/vision_images/tall.png')}])")
            assert other["text"] != got["text"] and other["usage"]["prompt_tokens"] == len(want["input_ids"])

            # SmolVLM (Idefics3: LANCZOS resizes into tiles, pixel shuffle) and LLaVA 1.6 (bicubic resize
            # into a pinpoint, black pad, tiles, the layout's gather) in the same page
            for label, folder, reference in (("SmolVLM", SMOL, SMOL_REFERENCE), ("LLaVA 1.6", NEXT, NEXT_REFERENCE)):
                other = json.loads(reference.read_text())["prompts"]["one"]
                assert other["messages"] == want["messages"]
                files = sorted(f.name for f in folder.iterdir())
                r = await page.evaluate(f"window.demo.loadFolder({json.dumps(base + 'fixtures/' + folder.name + '/')}, "
                                        f"{json.dumps(files)}, {json.dumps(folder.name)}, {json.dumps(OPTS)})")
                got = await page.evaluate(f"window.demo.chat({json.dumps(prompt)}, {{max_tokens: 12}}, "
                                          f"[{json.dumps(base + 'fixtures/vision_images/' + other['images'][0])}])")
                print(f"browser {label}: loaded in {r['load_seconds']:.2f} s, answered in {got['seconds']:.2f} s")
                assert got["text"] == _text(other["greedy"], folder), (label, got)
                assert got["usage"]["prompt_tokens"] == len(other["input_ids"]), label
        except BaseException:
            print("\n".join(logs[-40:]))
            raise
        finally:
            await page.screenshot(path=str(ARTIFACTS / "browser_vision.png"), full_page=True)
