"""Images in through every API, for every image family: one server holding a tiny checkpoint of each
(LLaVA 1.5 and 1.6 from GGUF + mmproj, Qwen2.5-VL from its HF folder, Phi-3.5-vision from an MLC
artifact, SmolVLM from its HF folder), asked about one picture by the official openai client (chat
completions with an image_url part, the Responses API with an input_image), the official ollama client
(chat and generate with base64 `images`) and MLCEngine over the server's own engine: every answer is
the family's greedy reference (transformers' tokens committed by tests/fixtures/make_*.py; for
Phi-3.5-vision, tests/ref_phi3v.py's model written from mlc-llm's code). Gemma 3's APIs: test_vision."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from test_phi3v import N_NEW, _expected, _picture
from tinyphi3v import write_tiny_phi3v_mlc

from webgpu_engine.vision.images import image_data_url

FIXTURES = Path(__file__).parent / "fixtures"
IMAGES = FIXTURES / "vision_images"
ASK = "What is in the picture?"
# compile_at_load off: each model compiles only what its requests use; chunks of 64 cut the pictures
OPTS = {"dtype": "f32", "context_window_size": 512, "prefill_chunk_size": 64, "compile_at_load": False}
# family: (what is served, its reference, the folder of its tokenizer, whether the text skips special tokens)
REFERENCES = {"llava": ("llava_gguf", "llava_transformers.json", "tiny_llava", False),
              "llava_next": ("llava_next_gguf", "llava_next_transformers.json", "tiny_llava_next", False),
              "qwen25vl": ("tiny_qwen25vl", "qwen25vl_transformers.json", "tiny_qwen25vl", True),
              "idefics3": ("tiny_idefics3", "idefics3_transformers.json", "tiny_idefics3", False)}
APIS = ["chat", "responses", "ollama_chat", "ollama_generate", "engine"]


def _reference(family: str) -> tuple[str, Path, str, int]:
    """(the model's path, its picture, transformers' greedy answer about it, its token count)."""
    from tokenizers import Tokenizer
    source, name, tokens, skip = REFERENCES[family]
    want = json.loads((FIXTURES / name).read_text())["prompts"]["one"]
    assert want["messages"][0]["content"][1]["text"] == ASK and len(want["images"]) == 1
    text = Tokenizer.from_file(str(FIXTURES / tokens / "tokenizer.json")).decode(want["greedy"],
                                                                                 skip_special_tokens=skip)
    return str(FIXTURES / source), IMAGES / want["images"][0], text, len(want["greedy"])


@pytest.fixture(scope="module")
def served(tmp_path_factory, device):
    """(server, {family: (model id, picture, answer, max tokens)}, MLCEngine over the server's engine)."""
    from webgpu_engine import MLCEngine
    from webgpu_engine.server.app import ServerOptions, ServerThread
    root = tmp_path_factory.mktemp("phi3v")
    art = write_tiny_phi3v_mlc(root / "tiny-phi3v", "q4f32_1")
    png = root / "picture.png"
    png.write_bytes(_picture(400, 300))
    cases = {f: _reference(f) for f in REFERENCES}
    cases["phi3v"] = (str(art["folder"]), png, _expected(art, png)[1], N_NEW)
    s = ServerThread(ServerOptions(models=[c[0] for c in cases.values()], chat_opts=[OPTS] * len(cases), port=0))
    try:
        ids = list(s.engine.models)                     # in the order loaded
        assert len(ids) == len(cases), ids
        yield s, {f: (i, *c[1:]) for f, i, c in zip(cases, ids, cases.values())}, MLCEngine(engine=s.engine, loop=s.loop)
    finally:
        s.stop()


def _ask(api: str, server, engine, model: str, picture: Path, n: int) -> str:
    """The answer `api` gives about `picture` (ASK after it), greedy, at most `n` tokens."""
    import ollama
    import openai
    url, b64 = image_data_url(picture), base64.b64encode(picture.read_bytes()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": ASK}]
    if api in ("chat", "responses"):
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        if api == "chat":
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                               max_tokens=n, temperature=0.0)
            return r.choices[0].message.content
        return client.responses.create(model=model, max_output_tokens=n, temperature=0.0, input=[{
            "role": "user", "content": [{"type": "input_image", "image_url": url},
                                        {"type": "input_text", "text": ASK}]}]).output_text
    if api == "engine":
        r = engine.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                           max_tokens=n, temperature=0.0)
        return r.choices[0].message.content
    oc, opts = ollama.Client(host=server.base), {"temperature": 0.0, "num_predict": n}
    if api == "ollama_chat":
        return oc.chat(model=model, messages=[{"role": "user", "content": ASK, "images": [b64]}],
                       options=opts).message.content
    return oc.generate(model=model, prompt=ASK, images=[b64], options=opts).response


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("family", [*REFERENCES, "phi3v"])
def test_every_api_gets_the_reference_answer(served, family, api):
    server, cases, engine = served
    model, picture, answer, n = cases[family]
    assert answer.strip()
    assert _ask(api, server, engine, model, picture, n) == answer


def test_the_answers_are_about_the_picture(served):
    """Another picture gets another answer from each family (the matrix above could not pass with
    the image dropped on the way)."""
    server, cases, engine = served
    for family, (model, picture, answer, n) in cases.items():
        other = IMAGES / ("shapes.png" if picture.name != "shapes.png" else "wide.png")
        assert _ask("chat", server, engine, model, other, n) != answer, family
