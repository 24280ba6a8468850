"""What images were once refused with and now run: a projector GGUF quantised whole (its position
table and Gemma 3's projection, read on the host, dequantised as ggml does); context_overflow "shift"
(an image the shift would cut dropped whole, the kept ones through the tower again); Gemma 3's
pictures over a q8_0 / q4_0 KV cache (the paged prefill's image spans over the quantised pool) and
in a sliding window's ring (the spans in the ring's prefill attention)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from _nn_util import get
from webgpu_engine.errors import UnsupportedModelError
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.vision import gemma3
from webgpu_engine.vision.config import patches
from webgpu_engine.vision.images import decode_bytes
from webgpu_engine.vision.mmproj import MmprojFile

FIXTURES = Path(__file__).parent / "fixtures"
PAIR, IMAGES = FIXTURES / "mmproj_gguf", FIXTURES / "vision_images"
TEXT, PROJ = PAIR / "tiny-gemma3.gguf", PAIR / "mmproj-tiny-gemma3.gguf"
HOST_TABLES = ("v.position_embd.weight", "mm.input_projection.weight")


def rewrite_gguf(src: Path, dst: Path, tensor=None, *, meta: dict | None = None, extra=(),
                 drop_keys=frozenset()) -> Path:
    """A copy of GGUF `src` at `dst`: each tensor as `tensor(name, data, type)` returns it ((data, type)
    for gguf-py's writer, None: dropped), metadata values replaced by `meta`, keys `drop_keys` left
    out, then the GGUFs `extra`'s metadata and tensors added (the gguf package)."""
    import gguf
    readers = [gguf.GGUFReader(str(src))] + [gguf.GGUFReader(str(e)) for e in extra]
    arch = str(bytes(readers[0].fields["general.architecture"].parts[-1]), "utf-8")
    w, seen = gguf.GGUFWriter(str(dst), arch), set(drop_keys)
    for r in readers:
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name in seen or name in ("general.architecture", "general.alignment"):
                continue
            seen.add(name)
            vtype, value = f.types[0], (meta or {}).get(name, f.contents())
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(name, value, vtype, sub_type=f.types[-1])
            else:
                w.add_key_value(name, value, vtype)
    for key, value in (meta or {}).items():       # new keys: ints as u32, floats as f32
        if key not in seen:
            w.add_key_value(key, value, gguf.GGUFValueType.UINT32 if isinstance(value, int) else
                            gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.STRING)
    for r in readers:
        for t in r.tensors:
            got = tensor(t.name, t.data, t.tensor_type) if tensor else (t.data, t.tensor_type)
            if got is not None:
                w.add_tensor(t.name, got[0], raw_dtype=got[1])
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return dst


def _as_floats(data, t):
    import gguf
    return np.asarray(gguf.quants.dequantize(data, t), np.float32)


def _features(device, proj: Path) -> np.ndarray:
    """The tower's projected features for each fixture picture, from projector file `proj`."""
    from webgpu_engine.models.siglip import SiglipTower
    with GGUFFile(TEXT) as g:
        f = MmprojFile(proj, g.tokenizer())
    try:
        cfg, tower = f.cfg, SiglipTower(device, f.cfg, f.tensors, owner="test:refusals")
    finally:
        f.close()
    try:
        names, n = sorted(p.name for p in IMAGES.glob("*.png")), cfg.tokens_per_image
        out = Tensor(device.buffer(len(names) * n * cfg.text_hidden * 4, owner="test:refusals"),
                     (len(names) * n, cfg.text_hidden), "f32")
        for i, name in enumerate(names):
            picture = decode_bytes((IMAGES / name).read_bytes(), name).image
            tower.write_patches(patches(cfg, gemma3.preprocess(cfg, picture)))
            device.submit(tower.record(device.batch(), out, i))
        return get(device, out)
    finally:
        tower.dispose()
        device.release_owner("test:refusals")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_quantised_host_tables_read_as_their_values(device, tmp_path, qtype):
    """An mmproj whose position table and Gemma 3 projection are stored as Q8_0 / Q4_0 / F16 (gguf-py's
    quantiser, ggml's blocks) gives the features of a file holding the same values in f32, and
    stays near the original file's."""
    import gguf
    T = gguf.GGMLQuantizationType

    def stored(name, data, t):
        if name in HOST_TABLES:
            return gguf.quants.quantize(_as_floats(data, t), T[qtype]), T[qtype]
        return data, t

    def as_f32(name, data, t):
        if name in HOST_TABLES:
            return _as_floats(gguf.quants.quantize(_as_floats(data, t), T[qtype]), T[qtype]), T.F32
        return data, t

    quantised = rewrite_gguf(PROJ, tmp_path / f"mmproj-{qtype}.gguf", stored)
    with GGUFFile(quantised) as g:
        assert {g.tensors[n].qtype for n in HOST_TABLES} == {qtype.lower()}
    got = _features(device, quantised)
    want = _features(device, rewrite_gguf(PROJ, tmp_path / "mmproj-f32.gguf", as_f32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    original = _features(device, PROJ)
    assert 0 < np.abs(got - original).max() < (0.2 if qtype == "Q4_0" else 0.02) * np.abs(original).max()


def test_a_host_table_in_a_type_not_dequantised_is_refused_by_name(device):
    """A position table in a type the engine has no dequantiser for: a typed error naming the tensor."""
    from webgpu_engine.models.siglip import SiglipTower
    with GGUFFile(TEXT) as g:
        f = MmprojFile(PROJ, g.tokenizer())
    try:
        name = "vision_tower.embeddings.position_embedding.weight"
        f.tensors[name] = replace(f.tensors[name], qtype="tq1_0")
        with pytest.raises(UnsupportedModelError, match="v.position_embd.weight is tq1_0, which this engine"):
            SiglipTower(device, f.cfg, f.tensors, owner="test:refusals")
    finally:
        f.close()
        device.release_owner("test:refusals")


# ----------------------------------------------------------------------------- context shift with images
def test_a_shift_drops_the_images_it_would_cut_whole():
    """VisionInputs.shift: an image (all its tiles, the rows between them too) cut by either edge of
    the dropped rows goes whole; the images after them move with their rows."""
    from webgpu_engine.vision.runner import VisionInputs
    a = [(10, 20, "a", None, 0), (22, 32, "a", None, 1), (34, 44, "a", None, 2)]     # three tiles of one image
    b = [(50, 60, "b", None, 0)]
    assert VisionInputs.shift(a + b, 25, 10) == (10, 34, [(16, 26, "b", None, 0)])   # both edges in a
    assert VisionInputs.shift(a + b, 5, 50) == (5, 55, [])                          # a whole, b cut at its end
    assert VisionInputs.shift(a + b, 44, 6) == (44, 6, a + [(44, 54, "b", None, 0)])  # between them: a stays, b moves
    assert VisionInputs.shift(a + b, 2, 8) == (2, 8, [(t[0] - 8, t[1] - 8, *t[2:]) for t in a + b])


# the tiny Gemma 3's "two" prompt (73 tokens) holds its pictures' 16 soft tokens at rows 15 .. 30 and 39 .. 54
SHIFTS = {  # case: (context window, n_keep, the rows the shift keeps, the kept picture's rows after it)
    "first_dropped_second_moved": (74, 4, (4, 39), (4, 20)),        # 35 rows dropped: the first picture's
    "second_dropped_first_kept": (96, 34, (34, 65), (15, 31)),      # the second inside the dropped rows
    "first_cut_by_n_keep": (96, 20, (15, 58), None),                # n_keep 20 cuts the first: kept from 15
    "second_cut_by_the_drop": (80, 4, (4, 55), None),               # rows 4 .. 41 would cut the second
}


@pytest.fixture(scope="module")
def gemma3_ref():
    import json
    return json.loads((FIXTURES / "gemma3_vision_transformers.json").read_text())


@pytest.fixture(scope="module")
async def cold(device):
    """The same model without a shift and a wider window: what a prompt of the kept tokens gives."""
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    pipe = await LLMChatPipeline.load(device, FIXTURES / "tiny_gemma3_vision", ChatConfig(
        dtype="f32", context_window_size=256, prefill_chunk_size=32, compile_at_load=False))
    yield pipe
    pipe.dispose()


@pytest.mark.parametrize("case", sorted(SHIFTS))
async def test_a_context_shift_keeps_its_images(device, gemma3_ref, cold, case):
    """context_overflow "shift" on a prompt with two pictures (Gemma 3: image rows attend each other
    both ways): the shift keeps n_keep tokens and the newer half of the rest, widened so that it cuts
    no picture (one it would cut goes whole); a kept picture's rows are computed again with the
    picture (the tower runs again) at their new place, so the token sampled after the shift is the
    one a cold cache of the kept tokens and their pictures gives."""
    from test_vision import _messages
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    from webgpu_engine.vision.requests import images_of, resolve_images
    ctx, n_keep, (lo, hi), moved = SHIFTS[case]
    pipe = await LLMChatPipeline.load(device, FIXTURES / "tiny_gemma3_vision", ChatConfig(
        dtype="f32", context_window_size=ctx, prefill_chunk_size=32, compile_at_load=False,
        context_overflow="shift", n_keep=n_keep))
    try:
        messages = await resolve_images("m", pipe.vision, [{**m, "content": [   # as protocol/rules.py passes them
            {"type": "image", "url": p["image_url"]["url"], "where": "m"} if p["type"] == "image_url" else p
            for p in m["content"]]} for m in _messages(gemma3_ref, "two")])
        await pipe.prefill_step(messages, GenerationConfig(temperature=0.0, max_tokens=2 * ctx, ignore_eos=True))
        assert pipe.kv_ids[:73] == gemma3_ref["prompts"]["two"]["input_ids"]
        runs = pipe.vision.tower_runs
        while pipe._req.context_shifts == 0:
            before = list(pipe.kv_ids)
            await pipe.decode_step()
        assert len(before) == ctx and pipe.kv_ids[:-1] == before[:lo] + before[hi:]
        tiles, got, ids = pipe._turn.tiles, pipe.output_ids[-1], list(pipe.kv_ids)
        assert [t[:2] for t in tiles] == ([moved] if moved else [])
        assert pipe.vision.tower_runs - runs == len(tiles)          # the kept picture through the tower again
    finally:
        pipe.dispose()
    kept = {t[2] for t in tiles}
    turn = cold._new_turn()
    turn.tiles = await cold.vision.batch_tiles(ids, [im for im in images_of(messages) if im.sha256 in kept])
    await turn.prefill_ids(ids, GenerationConfig(temperature=0.0, max_tokens=1), raw=True)
    assert turn.output_ids == [got]


# ----------------------------------------------------------------------------- Gemma 3's images over a quantised KV cache
def _wide_heads(dst: Path) -> Path:
    """The tiny Gemma 3 vision folder with 32-wide attention heads (q8_0 / q4_0 KV blocks are 32
    values of a head): its text attention weights drawn again (seeded), the rest as it is."""
    import shutil

    from safetensors.numpy import load_file, save_file
    shutil.copytree(FIXTURES / "tiny_gemma3_vision", dst)
    cfg = json.loads((dst / "config.json").read_text())
    t, D = cfg["text_config"], 32
    t["head_dim"] = t["query_pre_attn_scalar"] = D
    (dst / "config.json").write_text(json.dumps(cfg))
    w, rng = load_file(str(dst / "model.safetensors")), np.random.default_rng(5)
    C, H, Hkv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    shapes = {"q_proj": (H * D, C), "k_proj": (Hkv * D, C), "v_proj": (Hkv * D, C), "o_proj": (C, H * D),
              "q_norm": (D,), "k_norm": (D,)}
    for name in list(w):
        part = name.rsplit(".", 2)[-2]
        if ".self_attn." in name and "language_model" in name and part in shapes:
            shape = shapes[part]
            w[name] = (rng.standard_normal(shape) * (0.2 if len(shape) == 1 else shape[-1] ** -0.5)).astype(np.float32)
    save_file(w, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return _wide_heads(tmp_path_factory.mktemp("wide") / "gemma3")


async def _wide_answer(ref, wide, kv: str) -> tuple:
    """(the last prompt row's logits, 12 greedy tokens, the prompt ids) of the wide-headed Gemma 3 asked
    about two pictures with kv_cache_dtype `kv`."""
    from test_vision import _messages
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(wide), chat_opts={"dtype": "f32", "context_window_size": 256, "prefill_chunk_size": 32,
                                           "compile_at_load": False, "kv_cache_dtype": kv})
    try:
        model = next(iter(eng.models))
        pipe = eng.models[model].pipeline
        await eng.chat.completions.create(model=model, messages=_messages(ref, "two"), max_tokens=1, temperature=0.0)
        logits = get(pipe.dev, pipe.scheduler.fwd.logits_row(0))
        await eng.chat.completions.create(model=model, messages=_messages(ref, "two"), max_tokens=12,
                                          temperature=0.0, ignore_eos=True)
        return logits, list(pipe.output_ids), pipe.kv_ids[:73]
    finally:
        await eng.unload()


@pytest.fixture(scope="module")
async def wide_f32(device, gemma3_ref, wide):
    """The f32 cache's answer, and the last row's logits with the image rows causal (what an image
    attention without the spans would give)."""
    from webgpu_engine.vision.config import VisionConfig
    exact = await _wide_answer(gemma3_ref, wide, "auto")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(VisionConfig, "bidirectional", property(lambda self: False))
        causal = await _wide_answer(gemma3_ref, wide, "auto")
    return exact, causal[0]


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
async def test_gemma3_images_over_a_quantised_kv_cache(gemma3_ref, wide, wide_f32, kv):
    """kv_cache_dtype q8_0 / q4_0 with Gemma 3's pictures (their rows attend each other both ways: the
    paged prefill's image spans over the quantised pool), asked about two pictures: the last prompt
    row's logits nearer the f32 cache's than to causal image rows' (q8_0: within a tenth of the
    distance between those two, and the f32 cache's 12 greedy tokens)."""
    (exact, ids, prompt), causal = wide_f32
    logits, q_ids, q_prompt = await _wide_answer(gemma3_ref, wide, kv)
    assert prompt == q_prompt == gemma3_ref["prompts"]["two"]["input_ids"]
    err, off, gap = (np.abs(a - b).max() for a, b in ((logits, exact), (logits, causal), (causal, exact)))
    assert 0 < err < off and (kv == "q4_0" or (err < 0.1 * gap and q_ids == ids)), (err, off, gap)


async def test_a_context_shift_moves_a_qwen25vl_picture(device):
    """Qwen2.5-VL (M-RoPE: a prompt row's rotation depends on the pictures before it) shifted so that a
    picture moves to earlier rows: its tiles move with them and the token sampled after the shift is
    the one a cold cache of the kept tokens and picture gives."""
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    from webgpu_engine.vision.images import image_data_url
    from webgpu_engine.vision.requests import images_of, resolve_images
    folder = FIXTURES / "tiny_qwen25vl"
    messages = [{"role": "user", "content": "Tell me about the sea and the wind and the rain, " * 3},
                {"role": "assistant", "content": "The sea is wide."},
                {"role": "user", "content": [{"type": "image", "url": image_data_url(IMAGES / "gradient.png"), "where": "m"},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    gen = GenerationConfig(temperature=0.0, max_tokens=1)
    cold = await LLMChatPipeline.load(device, folder, ChatConfig(dtype="f32", context_window_size=256,
                                                                  prefill_chunk_size=32, compile_at_load=False))
    try:
        resolved = await resolve_images("m", cold.vision, messages)
        n = len(await cold.prompt_tokens(resolved, gen))
        pipe = await LLMChatPipeline.load(device, folder, ChatConfig(
            dtype="f32", context_window_size=n + 2, prefill_chunk_size=32, compile_at_load=False,
            context_overflow="shift", n_keep=4))
        try:
            await pipe.prefill_step(await resolve_images("m", pipe.vision, messages),
                                    GenerationConfig(temperature=0.0, max_tokens=8, ignore_eos=True))
            (s, e, *_), = pipe._turn.tiles
            while pipe._req.context_shifts == 0:
                await pipe.decode_step()
            drop = (n + 2 - 4) // 2
            assert s >= 4 + drop and [t[:2] for t in pipe._turn.tiles] == [(s - drop, e - drop)]
            ids, got, logits = list(pipe.kv_ids), pipe.output_ids[-1], get(pipe.dev, pipe.scheduler.fwd.logits_row(0))
        finally:
            pipe.dispose()
        turn = cold._new_turn()
        turn.tiles = await cold.vision.batch_tiles(ids, images_of(resolved))
        await turn.prefill_ids(ids, GenerationConfig(temperature=0.0, max_tokens=1), raw=True)
        assert turn.output_ids == [got]
        np.testing.assert_allclose(logits, get(cold.dev, cold.scheduler.fwd.logits_row(0)), atol=1e-4)
    finally:
        cold.dispose()


# ----------------------------------------------------------------------------- Gemma 3's images in a ring
async def test_gemma3_images_in_a_ring(device, gemma3_ref, tmp_path):
    """Gemma 3 with a ring (context_window_size -1, sliding_window_size 128: every layer windowed by
    the ring) asked about two pictures answers as the same model whose own sliding window holds the
    whole conversation (config.json's sliding_window 512) without a ring: the same prompt ids,
    last-row logits (1e-4) and 12 greedy tokens; causal image rows would move those logits."""
    import shutil

    from test_vision import _messages
    from webgpu_engine.engine.engine import AsyncMLCEngine
    wide = tmp_path / "window"
    shutil.copytree(FIXTURES / "tiny_gemma3_vision", wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["text_config"]["sliding_window"] = 512
    (wide / "config.json").write_text(json.dumps(cfg))
    base = {"dtype": "f32", "prefill_chunk_size": 32, "compile_at_load": False}
    got = []
    for folder, opts in ((wide, {"context_window_size": 256}),
                         (FIXTURES / "tiny_gemma3_vision", {"context_window_size": -1, "sliding_window_size": 128})):
        eng = AsyncMLCEngine()
        await eng.reload(str(folder), chat_opts={**base, **opts})
        try:
            model = next(iter(eng.models))
            pipe = eng.models[model].pipeline
            assert (pipe.model.ring is not None) == ("sliding_window_size" in opts)
            await eng.chat.completions.create(model=model, messages=_messages(gemma3_ref, "two"), max_tokens=1,
                                              temperature=0.0)
            logits = get(pipe.dev, pipe.scheduler.fwd.logits_row(0))
            await eng.chat.completions.create(model=model, messages=_messages(gemma3_ref, "two"), max_tokens=12,
                                              temperature=0.0, ignore_eos=True)
            got.append((logits, list(pipe.output_ids), pipe.kv_ids[:73]))
        finally:
            await eng.unload()
    (want, ids, prompt), (logits, r_ids, r_prompt) = got
    assert prompt == r_prompt == gemma3_ref["prompts"]["two"]["input_ids"]
    np.testing.assert_allclose(logits, want, atol=1e-4)
    assert r_ids == ids
