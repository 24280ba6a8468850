"""A GGUF model with its multimodal projector GGUF (llama.cpp's --mmproj; vision/mmproj.py): the tiny
Gemma 3 vision checkpoint as llama.cpp's own converter writes it (tests/fixtures/make_mmproj.py) gives
transformers' image features and greedy tokens (tests/fixtures/make_gemma3_vision.py), given as a
pair of options, as a folder holding both, as an Ollama manifest with a projector layer, through the
engine, the OpenAI client and the command line's flags (and SmolVLM's pair likewise); a tiny LLaVA 1.5 (CLIP tower, MLP projector, Llama;
tests/fixtures/make_llava.py) gives transformers' preprocessing, features and greedy tokens, from its
GGUF pair and from its HF folder."""
from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from _nn_util import TOL, get, put, rounded, run
from test_vision import _engine_of
from webgpu_engine.errors import ModelFormatError, UnsupportedChatOptionError
from webgpu_engine.kernels import nn_ref
from webgpu_engine.kernels.elementwise import quick_gelu
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.vision.config import patches
from webgpu_engine.vision import gemma3, llava
from webgpu_engine.vision.images import decode_bytes, image_data_url
from webgpu_engine.vision.mmproj import MmprojFile
from webgpu_engine.vision.runner import read_vision_config

FIXTURES = Path(__file__).parent / "fixtures"
PAIR, IMAGES, FOLDER = FIXTURES / "mmproj_gguf", FIXTURES / "vision_images", FIXTURES / "tiny_gemma3_vision"
TEXT, PROJ = PAIR / "tiny-gemma3.gguf", PAIR / "mmproj-tiny-gemma3.gguf"
LLAVA = FIXTURES / "llava_gguf"
# compile_at_load off: each load compiles only the kernels its requests use (a lean test file)
OPTS = {"dtype": "f32", "context_window_size": 256, "prefill_chunk_size": 32, "compile_at_load": False}


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURES / "gemma3_vision_transformers.json").read_text())


@pytest.fixture(scope="module")
def llava_ref():
    return json.loads((FIXTURES / "llava_transformers.json").read_text())


def _tokenizer(path):
    with GGUFFile(path) as g:
        return g.tokenizer()


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer(TEXT)


def _image(name):
    return decode_bytes((IMAGES / name).read_bytes(), name).image


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_quick_gelu(device, dtype):
    """CLIP's activation, in place, finite far out in both tails."""
    rng = np.random.default_rng(9)
    x = np.concatenate([rng.standard_normal(3000) * 4, [-100.0, 100.0, 0.0, -30.0]])
    xt = put(device, x, dtype, lead=4)
    run(device, quick_gelu(device, xt, xt))
    out = get(device, xt)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, nn_ref.quick_gelu(rounded(x, dtype)), **TOL[dtype])
    device.release_owner("test:nn")


def _messages(ref, key: str) -> list[dict]:
    images = iter(ref["prompts"][key]["images"])
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [{"type": "image_url", "image_url": {"url": image_data_url(IMAGES / next(images))}}
              if p["type"] == "image" else p for p in m["content"]]} for m in ref["prompts"][key]["messages"]]


def _text(ids, folder=FOLDER) -> str:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids, skip_special_tokens=False)


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
    with pytest.raises(ModelFormatError, match="has no <image> token.*converted from llava-hf's"):
        MmprojFile(LLAVA / "mmproj-tiny-llava.gguf", tokenizer)     # Gemma's vocabulary, LLaVA's projector


def test_llava_preprocessing_equals_the_processor(llava_ref):
    """CLIPImageProcessor: shortest side to 32 (bicubic), centre crop, CLIP's mean and std, for a wide,
    a square and a tall picture."""
    f = MmprojFile(LLAVA / "mmproj-tiny-llava.gguf", _tokenizer(LLAVA / "tiny-llava.gguf"))
    f.close()
    assert (f.cfg.kind, f.cfg.tokens_per_image, f.cfg.n_layers, f.cfg.act) == ("llava", 64, 2, "quick_gelu")
    assert f.cfg.class_token and f.cfg.pre_norm and not f.cfg.post_norm
    for name, r in llava_ref["images"].items():
        want = np.array(r["pixel_values"], np.float32)
        got = llava.preprocess(f.cfg, _image(name))
        assert got.shape == want.shape == (3, 32, 32)
        np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("pair", ["gemma3", "llava"])
def test_mmproj_tower_gives_transformers_features(device, ref, llava_ref, pair):
    """The converters' tensors (Gemma 3's projector norm stored as 1 + w; the projections and the
    legacy LLaVA converter's patch convolution in f16, its fc1 / fc2 named the other way round) give
    get_image_features' output for each fixture image."""
    from webgpu_engine.models.siglip import SiglipTower
    text, proj, want, family = (TEXT, PROJ, ref, gemma3) if pair == "gemma3" else \
        (LLAVA / "tiny-llava.gguf", LLAVA / "mmproj-tiny-llava.gguf", llava_ref, llava)
    f = MmprojFile(proj, _tokenizer(text))
    try:
        cfg, tower = f.cfg, SiglipTower(device, f.cfg, f.tensors, owner="test:mmproj")
    finally:
        f.close()
    try:
        names, n, width = sorted(want["images"]), cfg.tokens_per_image, cfg.text_hidden
        out = Tensor(device.buffer(len(names) * n * width * 4, owner="test:mmproj"), (len(names) * n, width), "f32")
        for i, name in enumerate(names):
            tower.write_patches(patches(cfg, family.preprocess(cfg, _image(name))))
            device.submit(tower.record(device.batch(), out, i))
        got = get(device, out).reshape(len(names), n, width)
        for i, name in enumerate(names):     # the f16 weights: a few 1e-3 off
            expect = np.array(want["images"][name]["features"])
            assert np.abs(expect).max() > 0.5
            np.testing.assert_allclose(got[i], expect, atol=5e-3, rtol=1e-3)
    finally:
        tower.dispose()
        device.release_owner("test:mmproj")


# ----------------------------------------------------------------------------- end to end
# the folder holding both GGUFs, as a model reference (its projector found by its architecture)
engine = _engine_of(PAIR, OPTS)


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


async def test_smolvlm_pair_gives_transformers_tokens(device):
    """SmolVLM's text GGUF and mmproj (projector type idefics3: pixel shuffle, tiles of a picture
    resized to clip.vision.preproc_image_size) from their folder: the prompt ids (each tile's tokens
    and markers) and 12 greedy tokens for one and two images equal transformers'."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    want = json.loads((FIXTURES / "idefics3_transformers.json").read_text())
    eng = AsyncMLCEngine()
    await eng.reload(str(FIXTURES / "smolvlm_gguf"), chat_opts=OPTS)
    try:
        model = next(iter(eng.models))
        pipe = eng.models[model].pipeline
        assert (pipe.vision.cfg.kind, pipe.vision.cfg.longest_edge, pipe.vision.cfg.scale) == ("idefics3", 64, 2)
        for key in ("one", "two"):
            r = await eng.chat.completions.create(model=model, messages=_messages(want, key), max_tokens=12,
                                                  temperature=0.0)
            assert pipe.kv_ids[:len(want["prompts"][key]["input_ids"])] == want["prompts"][key]["input_ids"]
            assert pipe.output_ids == want["prompts"][key]["greedy"]
            assert r.choices[0].message.content == _text(want["prompts"][key]["greedy"], FIXTURES / "tiny_idefics3")
    finally:
        await eng.unload()


def test_mlc_engine_takes_the_mmproj_option(device, ref):
    """MLCEngine.reload(text.gguf, chat_opts={"mmproj": ...}) as llama.cpp's --mmproj; a text GGUF
    given as the projector, a missing file and a projector of another model fail the load by name."""
    from webgpu_engine import MLCEngine
    eng = MLCEngine()
    try:
        eng.reload(str(TEXT), chat_opts={**OPTS, "mmproj": str(PROJ)})
        r = eng.chat.completions.create(messages=_messages(ref, "one"), max_tokens=12, temperature=0.0)
        assert r.choices[0].message.content == _text(ref["prompts"]["one"]["greedy"])
        with pytest.raises(ModelFormatError, match="general.architecture 'gemma3', not 'clip'"):
            eng.reload(str(TEXT), chat_opts={**OPTS, "mmproj": str(TEXT)})
        with pytest.raises(UnsupportedChatOptionError, match="mmproj.*no file there"):
            eng.reload(str(TEXT), chat_opts={**OPTS, "mmproj": str(PAIR / "missing.gguf")})
        with pytest.raises(ModelFormatError, match="vocabulary has no <image_soft_token> token"):
            eng.reload(str(FIXTURES / "llava_gguf" / "tiny-llava.gguf"), chat_opts={**OPTS, "mmproj": str(PROJ)})
    finally:
        eng.unload()


def _blob(root: Path, kind: str, src: Path) -> dict:
    data = src.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}", "size": len(data)}


def test_ollama_projector_layer_and_openai_client(tmp_path, monkeypatch, ref, device):
    """An Ollama manifest with model and projector layers resolves into the GGUF and its mmproj; a
    server of it answers the OpenAI client about two images and shows Ollama's "vision" capability."""
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
        import ollama
        assert "vision" in ollama.Client(host=s.url.removesuffix("/v1")).show("tiny-vision:latest").capabilities
    finally:
        s.stop()


def test_cli_mmproj_flag():
    """`--model text.gguf --mmproj proj.gguf` (llama.cpp's flags) load the pair: chat_opts mmproj, once
    for every model or once per model (the CLI's image path itself: test_vision)."""
    from webgpu_engine.cli.models import chat_opts_for
    from webgpu_engine.cli.parser import build_parser
    args = build_parser().parse_args(["chat", "--model", str(TEXT), "--mmproj", str(PROJ), "Hi"])
    assert chat_opts_for(args, 1) == [{"mmproj": str(PROJ)}]
    args = build_parser().parse_args(["serve", "--model", "a", "--model", "b", "--mmproj", "p1", "--mmproj", "p2"])
    assert chat_opts_for(args, 2) == [{"mmproj": "p1"}, {"mmproj": "p2"}]


@pytest.mark.parametrize("source, atol", [("llava_gguf", 5e-3), ("tiny_llava", 1e-4)])
async def test_llava_greedy_tokens_and_logits_equal_transformers(device, llava_ref, source, atol):
    """LLaVA 1.5 from its folder of GGUFs (the f16 projector: logits within 5e-3) and from its HF
    folder: 64 `<image>` tokens for the picture (causal rows), the last prompt row's logits and 12
    greedy tokens."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(FIXTURES / source), chat_opts={**OPTS, "prefill_chunk_size": 64})
    try:
        model = next(iter(eng.models))
        pipe, want = eng.models[model].pipeline, llava_ref["prompts"]["one"]
        await eng.chat.completions.create(model=model, messages=_messages(llava_ref, "one"), max_tokens=1,
                                          temperature=0.0)
        assert pipe.kv_ids[:len(want["input_ids"])] == want["input_ids"]
        logits = get(pipe.dev, pipe.scheduler.fwd.logits_row(0))        # the prompt's last row
        np.testing.assert_allclose(logits, want["logits"], atol=atol)
        r = await eng.chat.completions.create(model=model, messages=_messages(llava_ref, "one"), max_tokens=12,
                                              temperature=0.0)
        assert pipe.output_ids == want["greedy"]
        assert r.choices[0].message.content == _text(want["greedy"], FIXTURES / "tiny_llava")
    finally:
        await eng.unload()


def test_llava_settings_not_implemented_are_refused_by_name(tmp_path):
    """A LLaVA folder whose tower or processor differs from LLaVA 1.5's is refused, naming the setting."""
    import shutil

    from webgpu_engine.errors import UnsupportedModelError
    folder = tmp_path / "llava"
    shutil.copytree(FIXTURES / "tiny_llava", folder)
    base = json.loads((folder / "config.json").read_text())
    for change, says in [({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy 'full'"),
                         ({"vision_feature_layer": [-2, -1]}, "several layers"),
                         ({"projector_hidden_act": "relu"}, "a projector other than"),
                         ({"vision_feature_layer": -5}, "vision_feature_layer -5 of 3 layers")]:
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(UnsupportedModelError, match=says):
            read_vision_config(folder)


def test_memory_estimate_counts_the_projector(device):
    """The load's memory check counts the projector's tower (its weights, at least their bytes in the
    file, and the features buffer) when chat_opts name an mmproj."""
    from dataclasses import replace

    from webgpu_engine.config import ChatConfig
    from webgpu_engine.engine.memory import estimate_for
    cc = ChatConfig().updated(OPTS)
    text, pair = estimate_for("llm", TEXT, cc, device), estimate_for("llm", TEXT, replace(cc, mmproj=str(PROJ)), device)
    with GGUFFile(PROJ) as g:
        stored = sum(t.nbytes for t in g.tensors.values())
    assert stored <= pair.weights - text.weights < 2 * stored
    assert pair.activations - text.activations >= 16 * 64 * 4          # at least one image's features


def test_hugging_face_gguf_repo_brings_its_mmproj(tmp_path, monkeypatch):
    """A GGUF repo with mmproj files (ggml-org's layout): the model's GGUF and its f16 projector are
    downloaded, the projector as the record's mmproj."""
    from hf_hub_server import HubServer

    from webgpu_engine.engine.references import resolve_model_reference
    with HubServer() as hub:
        hub.add_repo("hub-org/tiny-gemma3-GGUF", {"tiny-gemma3-F32.gguf": TEXT.read_bytes(),
                                                  "mmproj-tiny-gemma3-f16.gguf": PROJ.read_bytes(),
                                                  "mmproj-tiny-gemma3-Q8_0.gguf": b"not this one"})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        rec = resolve_model_reference("hub-org/tiny-gemma3-GGUF")
        assert Path(rec.model).read_bytes() == TEXT.read_bytes()
        assert Path(rec.overrides["mmproj"]).read_bytes() == PROJ.read_bytes()
        assert hub.downloads("hub-org/tiny-gemma3-GGUF", "mmproj-tiny-gemma3-Q8_0.gguf") == 0


async def test_gguf_pair_in_a_batch_answers_as_transformers(device, ref):
    """Under continuous batching (chunks of 24 rows: images cross chunk edges), Gemma 3's pair (an
    image's rows attend each other both ways) with one and two images beside a text request, all sent
    at once: each gives transformers' greedy tokens. (LLaVA's causal rows batch as SmolVLM's do.)"""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(PAIR), chat_opts={**OPTS, "prefill_chunk_size": 24, "max_num_sequences": 4})
    try:
        assert next(iter(eng.models.values())).pipeline.scheduler is not None

        async def ask(key):
            r = await eng.chat.completions.create(messages=_messages(ref, key), max_tokens=12, temperature=0.0)
            return r.choices[0].message.content
        keys = ["one", "two", "text"]
        assert await asyncio.gather(*[ask(k) for k in keys]) == [_text(ref["prompts"][k]["greedy"]) for k in keys]
    finally:
        await eng.unload()
