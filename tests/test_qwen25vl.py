"""Qwen2.5-VL (issue 50): a tiny random Qwen2_5_VLForConditionalGeneration and what transformers
computes from the fixture images (tests/fixtures/make_qwen25vl.py): the processor's patch rows and
grids, the prompt's image tokens, rope_sections (M-RoPE's and the tower's 2D RoPE kernel) against its
numpy reference, and the tower's features."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _nn_util import TOL, get, put, rounded, run
from webgpu_engine.kernels import nn_ref
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.kernels.rope import rope_sections
from webgpu_engine.vision import qwen25vl
from webgpu_engine.vision.images import decode_bytes

FIXTURES = Path(__file__).parent / "fixtures"
FOLDER, IMAGES = FIXTURES / "tiny_qwen25vl", FIXTURES / "vision_images"
PAIR, PROJ = FIXTURES / "qwen25vl_gguf", "mmproj-tiny-qwen25vl.gguf"


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURES / "qwen25vl_transformers.json").read_text())


@pytest.fixture(scope="module")
def cfg():
    c = json.loads((FOLDER / "config.json").read_text())
    return qwen25vl.read_config(FOLDER, c, c["vision_config"])


def _image(name):
    return decode_bytes((IMAGES / name).read_bytes(), name).image


# ----------------------------------------------------------------------------- the host side
def test_preprocessing_equals_the_processor(ref, cfg):
    """smart_resize (wide.png scaled down past max_pixels), bicubic, CLIP's mean / std, the patch rows in
    merge blocks repeated over the temporal patch: Qwen2VLImageProcessor's (PIL backend) within 2e-6."""
    assert cfg.tokens_per_image == 1536 // 64 and cfg.qwen25vl.full_layers == (1,)
    for name, r in ref["images"].items():
        grid = qwen25vl.preprocess(cfg, _image(name))
        want = np.array(r["pixel_values"], np.float32)
        assert [1, grid.gh, grid.gw] == r["grid_thw"] and grid.rows.shape == want.shape
        np.testing.assert_allclose(grid.rows, want, atol=2e-6)
        assert qwen25vl.n_tokens(cfg, _image(name)) == len(r["features"])


def test_prompt_holds_a_token_per_merged_patch(ref, cfg):
    """Each image marker becomes <|vision_start|> + grid_h * grid_w / 4 <|image_pad|> + <|vision_end|>:
    the processor's input ids."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    for key, r in ref["prompts"].items():
        images = iter(r["images"])
        parts = r["text"].split(qwen25vl.MARKER)
        text = parts[0] + "".join(qwen25vl.full_image_sequence(cfg, _image(next(images))) + p for p in parts[1:])
        assert tok.encode(text, add_special_tokens=False).ids == r["input_ids"]


def test_window_order_is_transformers(cfg):
    """Windows of 2x2 merged patches, row-major, cut at the grid's edges (a 3x5 grid: 6 windows)."""
    order, sizes = qwen25vl.window_order(cfg, 6, 10)
    assert order.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    assert sizes == [16, 16, 8, 8, 8, 4]


# ----------------------------------------------------------------------------- rope_sections
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_rope_sections(device, dtype):
    """M-RoPE's sections (pairs 0-1 by axis 0, 2-4 by axis 1, 5-7 by axis 2) on the q and k heads, v
    untouched, positions negative too (a rotation by a difference), at an offset; and the tower's 2D
    form (sections (0, D/4))."""
    rng = np.random.default_rng(1)
    T, H, D = 7, 3 + 2 * 2, 16
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = rng.integers(-40, 300, (T, 3)).astype(np.int32)
    freq = (1.0 / 10000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    for sections, n_rot in (((2, 5), 5), ((0, D // 4), 7)):
        xt = put(device, x, dtype, lead=6)
        pt = Tensor(device.upload(np.concatenate([np.zeros(3, np.int32), pos.ravel()]).tobytes(), owner="test:nn"),
                    (T, 3), "i32", 12)
        ft = put(device, freq)
        run(device, rope_sections(device, xt, pt, ft, n_rot=n_rot, head_dim=D, sections=sections))
        want = nn_ref.rope_sections(rounded(x, dtype), pos, freq, n_rot=n_rot, sections=sections)
        got = get(device, xt)
        np.testing.assert_allclose(got, want, **TOL[dtype])
        assert np.array_equal(got[:, n_rot:], rounded(x, dtype)[:, n_rot:])
        assert np.abs(want - x).max() > 0.1
    device.release_owner("test:nn")


# ----------------------------------------------------------------------------- the tower
@pytest.mark.parametrize("source", ["folder", "mmproj"])
def test_tower_matches_transformers(device, ref, cfg, source):
    """Patch embedding, 2D RoPE, window (layers 0, 2) and full (layer 1) attention, SwiGLU, the merger:
    get_image_features' rows within 2e-4 for grids of 6x10 (windows cut at the edges), 4x4, 12x4 and 8x10,
    each image written into its slot of one features buffer; from the folder's safetensors and from
    llama.cpp's mmproj (q / k / v and the Conv3d's frames split, the merger's norm v.post_ln)."""
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.vision.mmproj import MmprojFile
    from webgpu_engine.vision.qwen25vl_gpu import Qwen25VLTower
    files = SafetensorsFolder(FOLDER) if source == "folder" else MmprojFile(PAIR / PROJ, None)
    if source == "mmproj":               # the pair's config is the folder's
        assert files.cfg.image_token_id == -1 and files.cfg.qwen25vl == cfg.qwen25vl
        assert (files.cfg.hidden_size, files.cfg.n_layers, files.cfg.text_hidden) == (cfg.hidden_size, cfg.n_layers, cfg.text_hidden)
        assert np.allclose(files.cfg.mean, cfg.mean) and np.allclose(files.cfg.std, cfg.std)
    try:
        tower = Qwen25VLTower(device, cfg, files.tensors, owner="test:qwen25vl")
    finally:
        files.close()
    n, T = cfg.tokens_per_image, cfg.text_hidden
    try:
        names = sorted(ref["images"])
        out = Tensor(device.buffer(len(names) * n * T * 4, owner="test:qwen25vl"), (len(names) * n, T), "f32")
        for i, name in enumerate(names):
            tower.write_patches(qwen25vl.preprocess(cfg, _image(name)))
            device.submit(tower.record(device.batch(), out, i))
        got = get(device, out).reshape(len(names), n, T)
        for i, name in enumerate(names):
            want = np.array(ref["images"][name]["features"], np.float32)
            assert np.abs(want).max() > 0.5
            np.testing.assert_allclose(got[i, :len(want)], want, atol=2e-4, rtol=1e-4)
    finally:
        tower.dispose()


def test_positions_are_get_rope_index(ref, cfg):
    """Text rows count on, an image's tokens take (p, p + row, p + column), the text after it goes on
    from the largest + 1; the offsets make every row from the last image on sit at its cache row."""
    from webgpu_engine.vision.runner import VisionInputs
    for key, r in ref["prompts"].items():
        ids = r["input_ids"]
        spans = VisionInputs.blocks(type("V", (), {"cfg": cfg})(), ids)
        grids = [qwen25vl.preprocess(cfg, _image(n)) for n in r["images"]]
        images = [(s, e, g) for (s, e), g in zip(spans, grids)]
        assert np.array_equal(np.array(qwen25vl.positions(cfg, images, len(ids))).T, np.array(r["positions"]))
        offs = np.array(qwen25vl.offsets(cfg, images, 0, len(ids) + 5))
        assert not offs[spans[-1][1]:].any() and offs[:spans[0][0]].min() > 0


# ----------------------------------------------------------------------------- end to end
OPTS = {"dtype": "f32", "context_window_size": 256, "prefill_chunk_size": 32}     # chunks cut the prompts


def _messages(r) -> list[dict]:
    from webgpu_engine.vision.images import image_data_url
    images = iter(r["images"])
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [{"type": "image_url", "image_url": {"url": image_data_url(IMAGES / next(images))}}
              if p["type"] == "image" else p for p in m["content"]]} for m in r["messages"]]


def _answers_as_transformers(r, want: dict, key: str) -> None:
    """A response to prompt `key` alone (12 tokens, top-5 log-probabilities): its token count, the first
    step's top-5 log-probabilities within 1e-4 of transformers' (by value: two byte tokens print
    alike) and its 12 greedy tokens' text."""
    assert r.usage.prompt_tokens == len(want["input_ids"]), key
    got = sorted((t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs), reverse=True)
    logits = np.array(want["logits"], np.float64)
    lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    np.testing.assert_allclose(got, np.sort(lp)[::-1][:5], atol=1e-4)
    assert r.choices[0].message.content == _text(want["greedy"]), key


def _text(ids) -> str:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(FOLDER / "tokenizer.json")).decode(ids, skip_special_tokens=True)


ASK = dict(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=5)


async def test_folder_answers_as_transformers_alone_and_in_a_batch(device, ref):
    """The HF folder through the engine: a prompt with one image and one with two (chunks of 32 rows
    cutting them) answer as transformers; then both at once in the continuous batch (their prefill
    chunks and decode rows side by side; only prompt rows take M-RoPE's offsets) answer alike."""
    import asyncio

    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(FOLDER), chat_opts={**OPTS, "max_num_sequences": 2})
    try:
        model, prompts = next(iter(eng.models)), ref["prompts"]
        for key, want in prompts.items():
            _answers_as_transformers(await eng.chat.completions.create(model=model, messages=_messages(want), **ASK),
                                     want, key)
        rs = await asyncio.gather(*(eng.chat.completions.create(model=model, messages=_messages(w), max_tokens=12,
                                                                temperature=0.0) for w in prompts.values()))
        assert [r.choices[0].message.content for r in rs] == [_text(w["greedy"]) for w in prompts.values()]
    finally:
        await eng.unload()


async def test_an_image_spanning_chunks_runs_the_tower_once(device, ref):
    """In prefill chunks of 8 rows each image spans two or three (wide.png's 20 tokens, not scaled down
    to a chunk): the answers are transformers' and each image ran through the tower once, its features
    kept for its next chunks and none left kept after."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(FOLDER), chat_opts={**OPTS, "prefill_chunk_size": 8})
    try:
        model = next(iter(eng.models))
        vision = eng.models[model].pipeline.vision
        assert vision.cfg.tokens_per_image > 8
        for key, want in ref["prompts"].items():
            runs = vision.tower_runs
            _answers_as_transformers(await eng.chat.completions.create(model=model, messages=_messages(want), **ASK),
                                     want, key)
            assert vision.tower_runs - runs == len(want["images"]) and not vision.kept, key
    finally:
        await eng.unload()


async def test_a_first_image_request_compiles_nothing(fresh_device, ref):
    """compile_at_load builds the tower's op lists at load (a 448 x 448 picture's grid) beside the
    decoder's: on a device with no pipelines before the load, the first requests with pictures (grids
    of other sizes) create no pipeline."""
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine(EngineConfig(device=fresh_device))
    await eng.reload(str(FOLDER), chat_opts={**OPTS, "compile_at_load": True})
    try:
        model = next(iter(eng.models))
        assert eng.models[model].pipeline.vision.tower_runs == 0
        await fresh_device.compiled()
        loaded = fresh_device.compile_count
        for want in ref["prompts"].values():
            r = await eng.chat.completions.create(model=model, messages=_messages(want), max_tokens=2, temperature=0.0)
            assert r.choices[0].message.content == _text(want["greedy"][:2])
        assert fresh_device.compile_count == loaded
    finally:
        await eng.unload()


def test_gguf_and_mmproj_serve_the_openai_client(device, ref):
    """The text GGUF and its mmproj from llama.cpp's converter, served as --model text.gguf --mmproj
    proj.gguf (the mmproj chat option): the OpenAI client gets transformers' answers to both prompts."""
    import openai

    from webgpu_engine.server.app import ServerOptions, ServerThread
    s = ServerThread(ServerOptions(models=[str(PAIR / "tiny-qwen25vl.gguf")],
                                   chat_opts=[{**OPTS, "mmproj": str(PAIR / PROJ)}], port=0))
    try:
        client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        for key, want in ref["prompts"].items():
            _answers_as_transformers(client.chat.completions.create(model=model, messages=_messages(want), **ASK),
                                     want, key)
    finally:
        s.stop()


def test_other_layouts_read_alike(tmp_path):
    """config.json as the hub's releases have it (transformers 4: the text model's keys at the top level,
    rope_scaling {"type": "mrope", "mrope_section"}) and the weights under the names transformers 5's
    model holds (model.language_model., model.visual.; the fixture's are model. and visual., as the hub's
    and transformers 5's save_pretrained write them): the same text and vision configs, every weight
    found under the same name of ours, the tower's tensors under the same names."""
    from safetensors.numpy import load_file, save_file

    from webgpu_engine.loaders.hf_config import load_llama_config, map_hf_names
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.models import registry  # noqa: F401  (registers the families)
    from webgpu_engine.models.family_qwen25vl import HF_QWEN25VL_TO_OURS
    from webgpu_engine.vision.qwen25vl_gpu import _PREFIX
    from webgpu_engine.vision.runner import read_vision_config
    folder = tmp_path / "hub"
    folder.mkdir()
    for f in FOLDER.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (folder / f.name).write_bytes(f.read_bytes())
    c = json.loads((FOLDER / "config.json").read_text())
    text = c.pop("text_config")
    rope = text.pop("rope_parameters")
    c.update({k: v for k, v in text.items() if k != "model_type"}, rope_theta=rope["rope_theta"],
             rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (folder / "config.json").write_text(json.dumps(c))
    save_file({k.replace("model.", "model.language_model.", 1).replace("visual.", "model.visual.", 1): v
               for k, v in load_file(FOLDER / "model.safetensors").items()}, folder / "model.safetensors")
    assert load_llama_config(folder) == load_llama_config(FOLDER)
    assert read_vision_config(folder) == read_vision_config(FOLDER)
    names = []
    for f in (FOLDER, folder):
        files = SafetensorsFolder(f)
        try:
            names.append((sorted(map_hf_names(files.tensors, HF_QWEN25VL_TO_OURS)),
                          sorted(_PREFIX.sub("", n) for n in files.tensors if _PREFIX.match(n))))
        finally:
            files.close()
    assert names[0] == names[1] and len(names[0][0]) == 3 + 2 * 12 and len(names[0][1]) == 1 + 3 * 12 + 5


def test_images_fit_a_prefill_chunk_and_the_estimate_counts_the_tower(device, cfg):
    """Pictures scaled down to a token ceiling (wide.png: 20 tokens, 16 under a ceiling of 16; a load
    caps at qwen25vl.MAX_TOKENS, not at its prefill chunk); the pre-load estimate adds the tower's weights (f32,
    from the folder or the mmproj), its activations for the largest image and the features."""
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.engine.memory import estimate_for
    from webgpu_engine.vision import runner
    small = qwen25vl.fit_chunk(cfg, 16)
    assert small.tokens_per_image == 16 and qwen25vl.fit_chunk(cfg, 32) == cfg
    assert qwen25vl.n_tokens(cfg, _image("wide.png")) == 20 and qwen25vl.n_tokens(small, _image("wide.png")) <= 16
    assert qwen25vl.n_tokens(small, _image("gradient.png")) == 15
    cc = ChatConfig(**OPTS)
    text = estimate_for("llm", PAIR / "tiny-qwen25vl.gguf", cc, device)
    tower = (FOLDER / "model.safetensors").stat().st_size - text.weights          # the visual.* tensors, about
    for path, opts in ((FOLDER, OPTS), (PAIR / "tiny-qwen25vl.gguf", {**OPTS, "mmproj": str(PAIR / PROJ)})):
        full = estimate_for("llm", path, ChatConfig(**opts), device)
        assert full.weights - text.weights >= 0.9 * tower > 0
        assert full.activations - text.activations >= 24 * 4 * 3 * 32 * 4 + 24 * 64 * 4 * 9   # qkv rows, features
