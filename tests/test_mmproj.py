"""A GGUF model with its multimodal projector GGUF (llama.cpp's --mmproj; vision/mmproj.py): the tiny
Gemma 3 vision checkpoint as llama.cpp's own converter writes it (tests/fixtures/make_mmproj.py) gives
transformers' image features and greedy tokens (tests/fixtures/make_gemma3_vision.py), given as a
pair of options, as a folder holding both, as an Ollama manifest with a projector layer, through the
engine, the OpenAI client and the command line."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _nn_util import get
from webgpu_engine.errors import ModelFormatError
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.vision.config import patches
from webgpu_engine.vision.gemma3 import preprocess
from webgpu_engine.vision.images import decode_bytes, image_data_url
from webgpu_engine.vision.mmproj import MmprojFile
from webgpu_engine.vision.runner import read_vision_config

FIXTURES = Path(__file__).parent / "fixtures"
PAIR, IMAGES, FOLDER = FIXTURES / "mmproj_gguf", FIXTURES / "vision_images", FIXTURES / "tiny_gemma3_vision"
TEXT, PROJ = PAIR / "tiny-gemma3.gguf", PAIR / "mmproj-tiny-gemma3.gguf"
OPTS = {"dtype": "f32", "context_window_size": 256, "prefill_chunk_size": 32}


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURES / "gemma3_vision_transformers.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    with GGUFFile(TEXT) as g:
        return g.tokenizer()


def _messages(ref, key: str) -> list[dict]:
    images = iter(ref["prompts"][key]["images"])
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [{"type": "image_url", "image_url": {"url": image_data_url(IMAGES / next(images))}}
              if p["type"] == "image" else p for p in m["content"]]} for m in ref["prompts"][key]["messages"]]


def _text(ids) -> str:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(FOLDER / "tokenizer.json")).decode(ids, skip_special_tokens=False)


# ----------------------------------------------------------------------------- the projector file
def test_mmproj_reads_as_the_folders_vision_config(tokenizer):
    """clip.* metadata gives the folder's tower, preprocessing and image tokens; every tensor of the
    file has a Hugging Face name; a text GGUF given as the projector is a typed error."""
    want = read_vision_config(FOLDER)
    f = MmprojFile(PROJ, tokenizer)
    try:
        for field in ("kind", "hidden_size", "intermediate_size", "n_layers", "n_heads", "image_size",
                      "patch_size", "text_hidden", "tokens_per_image", "image_token_id", "marker", "size",
                      "mean", "std", "rescale", "resample"):
            assert getattr(f.cfg, field) == getattr(want, field), field
        assert f.cfg.eps == pytest.approx(want.eps) and f.cfg.pool == 2
        with GGUFFile(PROJ) as g:
            assert len(f.tensors) == len(g.tensors) == 39
    finally:
        f.close()
    with pytest.raises(ModelFormatError, match="not a multimodal projector GGUF"):
        MmprojFile(TEXT, tokenizer)
    with pytest.raises(ModelFormatError, match="no multimodal projector GGUF at"):
        MmprojFile(PAIR / "missing.gguf", tokenizer)


def test_mmproj_tower_gives_transformers_features(device, ref, tokenizer):
    """The converter's tensors (the projector's norm stored as 1 + w, its projection in f16) give
    get_image_features' output for each fixture image."""
    from webgpu_engine.models.siglip import SiglipTower
    f = MmprojFile(PROJ, tokenizer)
    try:
        cfg, tower = f.cfg, SiglipTower(device, f.cfg, f.tensors, owner="test:mmproj")
    finally:
        f.close()
    try:
        names = sorted(ref["images"])
        out = Tensor(device.buffer(len(names) * 16 * 64 * 4, owner="test:mmproj"), (len(names) * 16, 64), "f32")
        for i, name in enumerate(names):
            image = decode_bytes((IMAGES / name).read_bytes(), name).image
            tower.write_patches(patches(cfg, preprocess(cfg, image)))
            device.submit(tower.record(device.batch(), out, i))
        got = get(device, out).reshape(len(names), 16, 64)
        for i, name in enumerate(names):     # the projection's f16 weights: a few 1e-3 off
            np.testing.assert_allclose(got[i], np.array(ref["images"][name]["features"]), atol=5e-3, rtol=1e-3)
    finally:
        tower.dispose()
        device.release_owner("test:mmproj")


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
async def engine(device):
    """The folder holding both GGUFs, as a model reference (its projector found by its architecture)."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(PAIR), chat_opts=OPTS)
    yield eng
    await eng.unload()


@pytest.mark.parametrize("key", ["one", "two"])
async def test_greedy_tokens_equal_transformers(engine, ref, key):
    model = next(iter(engine.models))
    pipe = engine.models[model].pipeline
    want = ref["prompts"][key]
    r = await engine.chat.completions.create(model=model, messages=_messages(ref, key), max_tokens=12,
                                             temperature=0.0)
    assert pipe.kv_ids[:len(want["input_ids"])] == want["input_ids"]         # 16 image tokens each
    assert pipe.output_ids == want["greedy"]
    assert r.choices[0].message.content == _text(want["greedy"])


def test_mlc_engine_takes_the_mmproj_option(device, ref):
    """MLCEngine.reload(text.gguf, chat_opts={"mmproj": ...}) as llama.cpp's --mmproj; a text GGUF
    given as the projector fails the load by name."""
    from webgpu_engine import MLCEngine
    eng = MLCEngine()
    try:
        eng.reload(str(TEXT), chat_opts={**OPTS, "mmproj": str(PROJ)})
        r = eng.chat.completions.create(messages=_messages(ref, "one"), max_tokens=12, temperature=0.0)
        assert r.choices[0].message.content == _text(ref["prompts"]["one"]["greedy"])
        with pytest.raises(ModelFormatError, match="general.architecture 'gemma3', not 'clip'"):
            eng.reload(str(TEXT), chat_opts={**OPTS, "mmproj": str(TEXT)})
    finally:
        eng.unload()


def _blob(root: Path, kind: str, src: Path) -> dict:
    data = src.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}", "size": len(data)}


def test_ollama_projector_layer_and_openai_client(tmp_path, monkeypatch, ref, device):
    """An Ollama manifest with model and projector layers resolves into the GGUF and its mmproj, and
    a server of it answers the OpenAI client about two images."""
    import openai

    from webgpu_engine.engine.references import resolve_model_reference
    from webgpu_engine.server.app import ServerOptions, ServerThread
    root = tmp_path / "ollama"
    path = root / "manifests" / "registry.ollama.ai" / "library" / "tiny-vision" / "latest"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schemaVersion": 2, "layers": [_blob(root, "model", TEXT),
                                                               _blob(root, "projector", PROJ)]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    rec = resolve_model_reference("ollama:tiny-vision")
    assert Path(rec.overrides["mmproj"]).read_bytes() == PROJ.read_bytes()
    s = ServerThread(ServerOptions(models=["ollama:tiny-vision"], chat_opts=[OPTS], port=0))
    try:
        client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
        r = client.chat.completions.create(model="tiny-vision:latest", messages=_messages(ref, "two"),
                                           max_tokens=12, temperature=0.0)
        assert r.choices[0].message.content == _text(ref["prompts"]["two"]["greedy"])
    finally:
        s.stop()


def test_cli_model_and_mmproj_flags(ref):
    """`chat --model text.gguf --mmproj proj.gguf --image PATH PROMPT`, as llama.cpp's flags."""
    opts = json.dumps({**OPTS, "compile_at_load": False})
    p = subprocess.run([sys.executable, "-m", "webgpu_engine", "chat", "--quiet", "--model", str(TEXT),
                        "--mmproj", str(PROJ), "--chat-opts", opts, "--max-tokens", "12", "--temperature", "0",
                        "--image", str(IMAGES / "gradient.png"), "What is in the picture?"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _text(ref["prompts"]["one"]["greedy"]) in p.stdout
