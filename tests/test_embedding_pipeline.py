"""EmbeddingPipeline on the real adapter: all-MiniLM-L6-v2 vs sentence-transformers golden vectors,
batching/order invariance, OpenAI input forms, truncation, errors, and freeing GPU memory."""
from __future__ import annotations

import random

import numpy as np
import pytest

import ref_bert as R
from tinymodels import write_tiny_bert
from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import InvalidRequestError
from webgpu_engine.pipelines.embedding import EmbeddingPipeline


@pytest.fixture(scope="module")
async def minilm(device, minilm_dir):
    pipe = await EmbeddingPipeline.load(device, minilm_dir, ChatConfig(dtype="f32", max_batch_size=8))
    yield pipe
    pipe.dispose()


def _cos(a, b) -> float:
    return R.cosine(a, b)


# --------------------------------------------------------------------------- golden data
async def test_minilm_matches_sentence_transformers(minilm, minilm_reference):
    items = minilm_reference["items"]
    L = minilm_reference["max_seq_length"]
    assert minilm.max_seq_length == L
    ids = minilm.tokenize([it["text"] for it in items])
    for got, it in zip(ids, items):
        assert got == R.reference_ids(it, L), it["text"][:40]
    res = await minilm.embed_step([it["text"] for it in items])
    assert res.prompt_tokens == sum(len(i) for i in ids)
    assert res.prefill_tokens_per_s > 0
    for v, it in zip(res.embeddings, items):
        assert len(v) == 384
        assert _cos(v, it["embedding"]) >= 0.9999, it["text"][:40]
        assert abs(np.linalg.norm(v) - 1.0) < 1e-4


async def test_minilm_f16_activations(device, minilm_dir, minilm_reference):
    if not device.has_f16:
        pytest.fail("this adapter lacks shader-f16; the f16 variant cannot be tested here")
    pipe = await EmbeddingPipeline.load(device, minilm_dir, ChatConfig(dtype="f16"))
    try:
        assert pipe.model.act_dtype == "f16"
        L = pipe.model.layers[0]          # an f32 file's matrices as f16 beside f16 activations
        assert [w.qtype for w in (L.qkv, L.o, L.ff1, L.ff2)] == ["f16"] * 4 and pipe.model.word.qtype == "f32"
        items = minilm_reference["items"]
        res = await pipe.embed_step([it["text"] for it in items])
        for v, it in zip(res.embeddings, items):
            assert _cos(v, it["embedding"]) >= 0.999, it["text"][:40]
    finally:
        pipe.dispose()
    assert device.allocated_bytes(pipe.owner) == 0


async def test_batch_size_and_order_do_not_change_vectors(device, minilm, minilm_dir):
    texts = ["a short one", "The quick brown fox jumps over the lazy dog near the river bank.", "",
             "GPUs", "Embeddings map text to vectors so that similar meanings end up close together.",
             "naïve café", "one two three four five six seven", "x"]
    ref = np.asarray((await minilm.embed_step(texts)).embeddings)
    single = await EmbeddingPipeline.load(device, minilm_dir, ChatConfig(dtype="f32", max_batch_size=1))
    try:
        perm = list(range(len(texts)))
        random.Random(0).shuffle(perm)
        one = np.asarray((await single.embed_step([texts[i] for i in perm])).embeddings)
    finally:
        single.dispose()
    assert np.abs(one - ref[perm]).max() <= 1e-5
    shuffled = np.asarray((await minilm.embed_step([texts[i] for i in perm])).embeddings)
    assert np.abs(shuffled - ref[perm]).max() <= 1e-5


def test_plan_pads_to_multiples_of_2_from_16(minilm):
    """Every sequence in a batch of its plan, none longer than its batch's S: S a multiple of 2, at
    least 16 (so every forward runs the same matmul kernels) and at most max_seq_length."""
    L = minilm.max_seq_length
    lengths = [min(n, L) for n in (300, 256, 255, 100, 41, 40, 33, 25, 24, 17, 17, 9, 3)]
    plan = minilm.plan_batches(lengths)
    assert plan[0][0] == 0 and plan[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    for start, end, B, S in plan:               # lengths[start]: the batch's longest
        assert end - start <= B <= 8 and S == min(L, max(16, -(-lengths[start] // 2) * 2))


# --------------------------------------------------------------------------- input forms
async def test_openai_input_forms(minilm):
    text = "Token ids and text give the same vector."
    ids = minilm.tokenize([text])[0]
    by_text = (await minilm.embed_step(text)).embeddings
    by_list = (await minilm.embed_step([text])).embeddings
    by_ids = await minilm.embed_step(ids)                    # list[int]: one sequence, taken as is
    by_id_lists = (await minilm.embed_step([ids, ids[:3]])).embeddings
    assert len(by_text) == len(by_list) == len(by_ids.embeddings) == 1 and len(by_id_lists) == 2
    assert by_ids.prompt_tokens == len(ids)
    for v in (by_list[0], by_ids.embeddings[0], by_id_lists[0]):
        assert np.abs(np.asarray(v) - by_text[0]).max() <= 1e-5
    assert _cos(by_id_lists[1], by_text[0]) < 0.999              # a different sequence, a different vector


async def test_empty_non_ascii_and_overlong_inputs(minilm):
    long_text = "lorem ipsum dolor " * 400
    res = await minilm.embed_step(["", "Ünïcödé ✓ 漢字 🙂", long_text])
    ids = minilm.tokenize(["", long_text])
    assert len(ids[0]) == 2 and len(ids[1]) == minilm.max_seq_length and ids[1][-1] == 102
    assert res.prompt_tokens == 2 + len(minilm.tokenize(["Ünïcödé ✓ 漢字 🙂"])[0]) + minilm.max_seq_length
    for v in res.embeddings:
        assert np.all(np.isfinite(v)) and abs(np.linalg.norm(v) - 1.0) < 1e-4


@pytest.mark.parametrize("bad", [[], [[]], ["a", 1], [1, "a"], [-1], [10 ** 9], [[1, 2], "x"], None, 5])
async def test_invalid_inputs_raise_invalid_request(minilm, bad):
    with pytest.raises(InvalidRequestError):
        await minilm.embed_step(bad)


# --------------------------------------------------------------------------- tiny models, config
@pytest.mark.parametrize("pooling,normalize,wdtype", [("mean", True, "f32"), ("cls", False, "f16"),
                                                      ("max", True, "f32")])
async def test_tiny_pipeline_matches_numpy(device, tmp_path, pooling, normalize, wdtype):
    write_tiny_bert(tmp_path, pooling=pooling, normalize=normalize, dtype=wdtype, max_seq_length=20)
    pipe = await EmbeddingPipeline.load(device, tmp_path, ChatConfig(dtype="f32", max_batch_size=4))
    try:
        texts = ["the cat sat on the mat", "hello world", "", "the quick brown fox is fast and the dog "
                 "was at the web gpu engine in paris france capital of it all"]
        res = await pipe.embed_step(texts)
        ids = pipe.tokenize(texts)
        assert len(ids[3]) == 20 and ids[3][-1] == 3           # truncated at max_seq_length, [SEP] kept
        W, cfg = R.load_weights(tmp_path), R.load_config(tmp_path)
        for s, v in zip(ids, res.embeddings):
            ref = R.embed(W, cfg, s, pooling=pooling, normalize=normalize)
            assert np.abs(np.asarray(v) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
    finally:
        pipe.dispose()
    assert device.allocated_bytes(pipe.owner) == 0


async def test_bare_folder_and_chat_opts_max_seq_length(device, tmp_path):
    write_tiny_bert(tmp_path, pooling="cls", normalize=True, max_seq_length=20)
    (tmp_path / "modules.json").unlink()                       # plain HF folder: mean, no normalize
    pipe = await EmbeddingPipeline.load(device, tmp_path, ChatConfig(max_seq_length=8))
    try:
        assert pipe.max_seq_length == 8 and pipe.st_config.pooling == "mean" and not pipe.st_config.normalize
        res = await pipe.embed_step("the cat sat on the mat and the dog sat on the rug")
        ids = pipe.tokenize(["the cat sat on the mat and the dog sat on the rug"])[0]
        assert len(ids) == 8 and res.prompt_tokens == 8
        ref = R.embed(R.load_weights(tmp_path), R.load_config(tmp_path), ids, pooling="mean")
        assert np.abs(np.asarray(res.embeddings[0]) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
        assert abs(np.linalg.norm(ref) - 1.0) > 1e-2            # really not normalised
        over = await pipe.embed_step([list(range(5, 25))])       # token ids are truncated too
        assert over.prompt_tokens == 8
    finally:
        pipe.dispose()


async def test_dispose_frees_all_gpu_memory(device, tmp_path):
    write_tiny_bert(tmp_path)
    progress = []
    pipe = await EmbeddingPipeline.load(device, tmp_path, ChatConfig(), progress=lambda f, t: progress.append(f))
    assert progress and progress[-1] == 1.0 and progress == sorted(progress)
    await pipe.embed_step(["hello world"] * 5 + ["the cat"] * 40)          # several buckets
    assert device.allocated_bytes(pipe.owner) > 0
    pipe.dispose()
    assert device.allocated_bytes(pipe.owner) == 0


async def test_bad_chat_config_is_rejected_before_allocating(device, tmp_path):
    write_tiny_bert(tmp_path)
    before = device.allocated_bytes()
    for cc in (ChatConfig(max_batch_size=0), ChatConfig(max_seq_length=1), ChatConfig(dtype="int8")):
        with pytest.raises(InvalidRequestError):
            await EmbeddingPipeline.load(device, tmp_path, cc)
    assert device.allocated_bytes() == before


# --------------------------------------------------------------------------- result buffer, limits, the event loop
TEXTS = ["the cat sat on the mat", "hello world", "a dog", "the quick brown fox is fast",
         "paris is the capital of france", "web gpu engine", "cat", "the dog was at the mat with a cat"]


@pytest.fixture
async def tiny(device, tmp_path):
    write_tiny_bert(tmp_path / "tiny", max_seq_length=32)
    pipe = await EmbeddingPipeline.load(device, tmp_path / "tiny", ChatConfig(dtype="f32", max_batch_size=2))
    yield pipe
    pipe.dispose()
    assert device.allocated_bytes(pipe.owner) == 0


def _count_runs(pipe) -> list:
    runs, orig = [], pipe.model.run

    def run(seqs, B, S, dst, off=0):
        runs.append((len(seqs), B, S))
        return orig(seqs, B, S, dst, off)
    pipe.model.run = run
    return runs


async def test_result_buffer_allocates_before_release_and_caps_growth(tiny, device, monkeypatch):
    from webgpu_engine.errors import GPUOutOfMemoryError
    row = tiny.dim * 4
    want = {t: v for t, v in zip(TEXTS, (await tiny.embed_step(TEXTS)).embeddings)}
    tiny._dst.release()
    tiny._dst = None
    await tiny.embed_step(TEXTS[:2])
    assert tiny._dst.size == 2 * row
    tiny._max_result_bytes = 5 * row                 # as if the device's largest buffer were 5 rows
    old, alive_at_allocation = tiny._dst, []
    real_buffer = device.buffer

    def logged_buffer(*a, **kw):
        if kw.get("label") == "embeddings":          # the result buffer (buckets allocate their own)
            alive_at_allocation.append(old.alive)
        return real_buffer(*a, **kw)
    monkeypatch.setattr(device, "buffer", logged_buffer)
    await tiny.embed_step(TEXTS[:3])                 # doubles: 4 rows
    assert alive_at_allocation == [True] and tiny._dst.size == 4 * row and not old.alive
    res = await tiny.embed_step(TEXTS[:5])           # doubling (8 rows) is over the limit: exactly 5
    assert tiny._dst.size == 5 * row
    assert np.allclose(res.embeddings, [want[t] for t in TEXTS[:5]], atol=1e-5)
    kept = tiny._dst
    with pytest.raises(InvalidRequestError) as ei:   # 6 rows cannot fit on this "device"
        await tiny.embed_step(TEXTS[:6])
    assert ei.value.param == "input" and tiny._dst is kept and kept.alive

    # A failed allocation leaves the old buffer in place and working.
    tiny._max_result_bytes = device.max_buffer_size

    def failing_buffer(*a, **kw):
        if kw.get("label") == "embeddings":
            raise GPUOutOfMemoryError("no memory left (test)")
        return real_buffer(*a, **kw)
    monkeypatch.setattr(device, "buffer", failing_buffer)
    with pytest.raises(GPUOutOfMemoryError):
        await tiny.embed_step(TEXTS)
    assert tiny._dst is kept and kept.alive
    res = await tiny.embed_step(TEXTS[3:5])
    assert np.allclose(res.embeddings, [want[t] for t in TEXTS[3:5]], atol=1e-5)


async def test_oversized_result_buffer_is_given_back(tiny, device):
    row = tiny.dim * 4
    tiny._keep_result_bytes = 4 * row
    await tiny.embed_step(TEXTS[:3])
    kept = device.allocated_bytes(tiny.owner)
    assert tiny._dst is not None and tiny._dst.size == 3 * row
    res = await tiny.embed_step(TEXTS)               # 8 rows: over what the pipeline keeps
    assert len(res.embeddings) == 8 and tiny._dst is None
    assert device.allocated_bytes(tiny.owner) == kept - 3 * row
    await tiny.embed_step(TEXTS[:2])                 # small again: a small buffer, kept
    assert tiny._dst is not None and tiny._dst.size == 2 * row


async def test_total_token_budget(tiny):
    from webgpu_engine.errors import EmbeddingTokenLimitError
    total = sum(len(s) for s in tiny.tokenize(TEXTS))
    runs = _count_runs(tiny)
    assert (await tiny.embed_step(TEXTS, max_total_tokens=total)).prompt_tokens == total
    n_runs = len(runs)
    for kw, inp in (({"max_total_tokens": total - 1}, TEXTS), ({"max_total_tokens": 5}, [[5, 6, 7]] * 2),
                    ({"max_total_tokens": 10}, ["x"] * 6)):                # 6 texts need 12 tokens at least
        with pytest.raises(EmbeddingTokenLimitError) as ei:
            await tiny.embed_step(inp, **kw)
        assert ei.value.http_status == 400 and ei.value.param == "input"
    assert len(runs) == n_runs                       # refused before any GPU work
    tiny.max_total_tokens = total - 1                # the pipeline's own default applies too
    with pytest.raises(EmbeddingTokenLimitError):
        await tiny.embed_step(TEXTS)


async def test_deadline_stops_at_the_next_batch(tiny):
    import asyncio
    import time

    from webgpu_engine.errors import RequestTimeoutError
    loop = asyncio.get_running_loop()
    runs = _count_runs(tiny)
    with pytest.raises(RequestTimeoutError):         # already past: nothing runs
        await tiny.embed_step(TEXTS, deadline=loop.time() - 1, timeout_s=1)
    assert runs == []
    orig = tiny.model.run
    deadline = loop.time() + 0.5

    def slow_run(*a):                                # the first batch lasts past the deadline
        while loop.time() < deadline:
            time.sleep(0.01)
        return orig(*a)
    tiny.model.run = slow_run
    with pytest.raises(RequestTimeoutError, match="batch 2 of"):
        await tiny.embed_step(TEXTS, deadline=deadline, timeout_s=0.5)
    assert len(runs) == 1                            # 4 batches planned, 1 ran


async def test_cancelled_caller_stops_the_shielded_step(tiny):
    """The engine runs a step shielded from its caller's cancellation (finishing a readback it began);
    the step polls the caller and stops at the next batch boundary instead of embedding everything."""
    import asyncio
    runs = _count_runs(tiny)
    started = asyncio.Event()
    orig = tiny.model.run

    def run(*a):
        started.set()
        return orig(*a)
    tiny.model.run = run

    async def caller():
        me = asyncio.current_task()
        step = asyncio.ensure_future(tiny.embed_step(TEXTS * 4, cancelled=lambda: me.cancelling() > 0))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            await asyncio.wait([step])
            assert step.cancelled()
            raise
    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 1 <= len(runs) <= 2 < 16                  # 16 batches planned
    assert len((await tiny.embed_step(TEXTS)).embeddings) == 8     # and the pipeline still works


@pytest.mark.serial
async def test_event_loop_keeps_running_during_a_request(minilm):
    """Tokenising runs in a worker thread and the loop is free while each batch computes: a ticker on
    the loop never waits long, however long the request takes."""
    import asyncio
    import time
    texts = [f"sentence {i} about the weather, cats and dogs " * (1 + i % 4) for i in range(40)]
    await minilm.embed_step(texts[:16])              # buckets compiled
    gaps, done = [], False

    async def ticker():
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    t = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    res = await minilm.embed_step(texts)
    took = time.perf_counter() - t0
    done = True
    await t
    assert len(res.embeddings) == 40
    assert len(gaps) >= took / 0.5 - 1, (len(gaps), took)     # the loop ran throughout
    assert max(gaps) < 0.5, (max(gaps), took)


async def test_without_threads_the_step_runs_inline_and_yields(tiny, monkeypatch):
    """Pyodide has no worker threads: the same work runs inline, chunk by chunk, yielding to the loop
    between chunks, with the same vectors."""
    import asyncio

    from webgpu_engine.pipelines import embedding
    texts = TEXTS * 40                               # 320 inputs: 3 tokenising chunks
    want = (await tiny.embed_step(texts)).embeddings

    real_to_thread = asyncio.to_thread

    async def no_pipeline_threads(fn, *a, **kw):     # (the native device's own waits may use one)
        assert getattr(fn, "__module__", None) != embedding.__name__, f"{fn} sent to a thread"
        return await real_to_thread(fn, *a, **kw)
    monkeypatch.setattr(embedding, "IN_BROWSER", True)      # as in the page: no worker threads
    monkeypatch.setattr(asyncio, "to_thread", no_pipeline_threads)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1
    t = asyncio.create_task(ticker())
    try:
        got = (await tiny.embed_step(texts)).embeddings
    finally:
        t.cancel()
    assert np.allclose(got, want, atol=1e-6)
    assert ticks >= 3 + 160                          # yielded between chunks and during each of 160 batches
