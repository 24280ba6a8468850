"""Gemma 3's images under continuous batching: the paged prefill kernel's image spans (an image's rows
attend each other both ways, inside the sliding window or a ring) against numpy, and the batch's answers with
images against the same requests alone and transformers' (tests/fixtures/make_gemma3_vision.py)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ref_vision
from _nn_util import TOL, empty, get, put, rounded, run, step_buf
from webgpu_engine.kernels import attention_paged as ap
from webgpu_engine.kernels import nn_ref


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


# ----------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("window, ring", [(0, 0), (12, 0), (0, 40)], ids=["full", "window", "ring"])
def test_paged_prefill_image_spans(device, dtype, window, ring):
    """A chunk of 80 rows at positions 30.. through a shuffled block table: rows 50..69 form one image
    (across the kernel's 64-row workgroups), rows 5..8 another; their rows see their image's later
    keys too (from the window's start), as the contiguous cache's attn_image_rows computes them; every
    other row equals the kernel without spans bit for bit. `ring`: over a ring of W = 40 without
    sinks (WebLLM's sliding window: a row sees positions pos - 40 .. pos, numpy's window of 41)."""
    from webgpu_engine.kernels.common import Ring
    rng = np.random.default_rng(5 + window + ring)
    hq, hkv, d, bs, max_blocks, T, pos0 = 4, 2, 16, 16, 8, 80, 30
    n = pos0 + T
    kp, vp = (rng.standard_normal((12, bs, hkv, d)) for _ in range(2))
    table = np.zeros(max_blocks, np.uint32)
    table[:-(-n // bs)] = rng.permutation(12)[:-(-n // bs)]
    qkv = rng.standard_normal((T, hq + 2 * hkv, d))
    spans = np.zeros((T, 2), np.uint32)
    spans[50:70, 1], spans[5:9, 1] = pos0 + 70, pos0 + 9
    kt, vt = put(device, kp, dtype), put(device, vp, dtype, lead=8)
    qt, tt, step = put(device, qkv, dtype, lead=4), put(device, table, "u32"), step_buf(device, pos0, T)
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, max_blocks=max_blocks, scale=d ** -0.5, window=window)
    if ring:
        kw.update(ring=Ring(0, ring), q_sink=empty(device, (T, hq, d), dtype))
    plain, imaged = empty(device, (T, hq * d), dtype), empty(device, (T, hq * d), dtype, lead=4)
    run(device, ap.paged_prefill(device, qt, kt, vt, plain, step, tt, **kw),
        ap.paged_prefill(device, qt, kt, vt, imaged, step, tt, **kw, spans=put(device, spans, "u32", lead=6)))
    kr, vr, q = rounded(kp, dtype), rounded(vp, dtype), rounded(qkv, dtype)
    keys = [np.stack([x[table[j // bs], j % bs] for j in range(n)], 1) for x in (kr, vr)]   # (Hkv, n, D)
    seen = ring + 1 if ring else window
    causal = nn_ref.causal_attention(q[:, :hq], *keys, pos0, d ** -0.5, window=seen)
    want = ref_vision.attn_image_rows(causal, q, *keys, spans, pos0, hq, hkv, d ** -0.5, seen)
    got, text = get(device, imaged), spans[:, 1] == 0
    assert np.abs(want[50:70] - causal[50:70]).max() > 0.05
    np.testing.assert_allclose(get(device, plain), causal, **TOL[dtype])      # (the ring as that window)
    np.testing.assert_allclose(got, want, **TOL[dtype])
    assert np.array_equal(got[text], get(device, plain)[text])


# ----------------------------------------------------------------------------- Gemma 3 in the batch
from test_vision import FOLDER, OPTS, _messages, _text  # noqa: E402  (the fixture's model and prompts)


BATCH = {**OPTS, "prefill_chunk_size": 24, "max_num_sequences": 4, "kv_block_size": 16, "kv_pool_tokens": 160}


@pytest.fixture(scope="module")
def ref():
    import json
    return json.loads((FOLDER.parent / "gemma3_vision_transformers.json").read_text())


@pytest.fixture(scope="module")
async def batched(device):
    """Gemma 3 with images under continuous batching: chunks of 24 rows (prompt "two"'s first image,
    rows 15..30, would cross the first edge), blocks of 16 (10 in the pool), a sliding window of 12
    inside the 16-token images."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(FOLDER), chat_opts=BATCH)
    yield eng
    await eng.unload()


async def _ask(eng, messages, n=12):
    r = await eng.chat.completions.create(messages=messages, max_tokens=n, temperature=0.0)
    return r.choices[0].message.content


async def test_images_in_a_batch_answer_as_alone_and_as_transformers(batched, ref):
    """Two requests with images and one text request at once: each answers as it does alone and
    gives transformers' 12 greedy tokens."""
    sched = next(iter(batched.models.values())).pipeline.scheduler
    assert sched is not None
    keys = ["one", "two", "text"]
    alone = [await _ask(batched, _messages(ref, k)) for k in keys]
    assert alone == [_text(ref["prompts"][k]["greedy"]) for k in keys]
    assert await asyncio.gather(*[_ask(batched, _messages(ref, k)) for k in keys]) == alone


async def test_preempted_sequences_with_images_answer_as_alone(batched, ref):
    """Four longer answers need more blocks than the pool holds: the newest sequences are preempted and
    computed again later (their prompts' chunks again never cutting an image), each answer as alone."""
    pool = next(iter(batched.models.values())).pipeline.scheduler.pool
    keys = ["two", "one", "two", "text"]
    alone = [await _ask(batched, _messages(ref, k), 40) for k in keys]
    before = pool.stats["preemptions"]
    assert await asyncio.gather(*[_ask(batched, _messages(ref, k), 40) for k in keys]) == alone
    assert pool.stats["preemptions"] > before
    pool.check()


async def test_a_follow_up_turn_in_the_batch_reuses_its_images_rows(batched, ref, device):
    """A follow-up turn about the same picture, beside another request, takes its image's rows from
    the pool's prefix blocks (keyed by the image's content) and answers as a scheduler of one slot does."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    pool = next(iter(batched.models.values())).pipeline.scheduler.pool
    first = _messages(ref, "one")
    follow = [*first, {"role": "assistant", "content": await _ask(batched, first, 8)},
              {"role": "user", "content": "And the colours?"}]
    before = pool.stats["hit_tokens"]
    got, other = await asyncio.gather(_ask(batched, follow, 8), _ask(batched, _messages(ref, "text")))
    assert pool.stats["hit_tokens"] - before >= 32          # the blocks holding the image's 16 rows
    assert other == _text(ref["prompts"]["text"]["greedy"])
    pool.check()
    one = AsyncMLCEngine()
    await one.reload(str(FOLDER), chat_opts={**BATCH, "max_num_sequences": 1})
    try:
        assert got == await _ask(one, follow, 8)
    finally:
        await one.unload()


PAIR = FOLDER.parent / "mmproj_gguf"       # the same model as llama.cpp's converter writes it (test_mmproj.py)


@pytest.mark.parametrize("path,opts", [(FOLDER, {}), (PAIR / "tiny-gemma3.gguf",
                                                     {"mmproj": str(PAIR / "mmproj-tiny-gemma3.gguf")})],
                         ids=["folder", "gguf_mmproj"])
async def test_as_suits_the_device_a_vision_model_batches(device, ref, path, opts):
    """max_num_sequences 0 (`serve`'s default) loads Gemma 3 with its images on the batching path, from
    its folder and from a GGUF with its projector GGUF; a lone request about two images gives
    transformers' tokens there."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    eng = AsyncMLCEngine()
    await eng.reload(str(path), chat_opts={**OPTS, **opts, "max_num_sequences": 0})
    try:
        sched = next(iter(eng.models.values())).pipeline.scheduler
        assert sched is not None and sched.max_seqs > 1
        assert await _ask(eng, _messages(ref, "two")) == _text(ref["prompts"]["two"]["greedy"])
    finally:
        await eng.unload()
