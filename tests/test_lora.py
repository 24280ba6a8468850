"""LoRA adapters (issue 52): the bgmv kernel pair against numpy; PEFT adapters over a tiny decoder
against transformers + peft (tests/fixtures/make_lora.py), alone and with the base in one batch."""
from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.config import GenerationConfig
from webgpu_engine.engine.engine import AsyncMLCEngine
from webgpu_engine.errors import InvalidRequestError, SpecifiedModelNotFoundError
from webgpu_engine.kernels import lora as lk
from webgpu_engine.models.lora import HALVES

from _nn_util import empty, get, put, rounded, run

OWNER = "test:nn"
NP_W = {"f32": np.float32, "f16": np.float16}


@pytest.fixture
def _free(device):
    yield
    device.release_owner(OWNER)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("T,K,N,J,slots", [(1, 64, 96, 8, 1), (5, 72, 40, 24, 3), (9, 128, 200, 16, 4)])
def test_lora_shrink_expand(device, _free, dtype, T, K, N, J, slots):
    """Each row's delta through its own slot (rows without one untouched, bit for bit), against numpy."""
    rng = np.random.default_rng(T * K + J)
    x = rng.standard_normal((T, K))
    a = (rng.standard_normal((slots, J, K)) / np.sqrt(K)).astype(np.float32)
    b = (rng.standard_normal((slots, N, J)) / np.sqrt(J)).astype(np.float32)
    idx = np.array([lk.NONE if t % 3 == 1 else t % slots for t in range(T)], np.uint32)
    y0 = rng.standard_normal((T, N))
    xt, at, bt = put(device, x, dtype, lead=3), put(device, a), put(device, b)
    it, ut = put(device, idx, "u32"), empty(device, (T, J), fill=0)
    yt = put(device, y0, dtype, lead=5)
    run(device, lk.lora_shrink(device, xt, at, it, ut, slots=slots),
        lk.lora_expand(device, ut, bt, it, yt, slots=slots))
    u = lk.shrink_ref(rounded(x, dtype), a, idx)
    np.testing.assert_allclose(get(device, ut), u, rtol=1e-4, atol=1e-4 if dtype == "f32" else 2e-2)
    want = lk.expand_ref(u, b, idx, rounded(y0, dtype))
    got = get(device, yt)
    tol = 1e-4 if dtype == "f32" else 1e-2
    assert np.abs(got - want).max() / np.abs(want).max() < tol
    base = idx == lk.NONE
    np.testing.assert_array_equal(got[base], rounded(y0, dtype)[base])     # untouched, bit for bit


@pytest.mark.parametrize("dtype,wdtype", [("f32", "f32"), ("f16", "f32"), ("f32", "f16"), ("f16", "bf16")])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T,K,N,R,targets,slots", [(1, 64, 96, 8, 1, 1), (5, 72, 200, 16, 3, 3)])
def test_lora_delta_is_shrink_then_expand_in_one(device, _free, dtype, wdtype, norm, T, K, N, R, targets, slots):
    """lora_delta (B compact: each row only its target's R columns) equals the pair's
    references over the same A and the block-sparse B (N, J); a base row keeps its bits. A and B
    held as f16 or bf16 (wdtype) answer as the same values held as f32, bit for bit."""
    rng = np.random.default_rng(T * K + R + norm)
    J = targets * R
    x = rng.standard_normal((T, K))
    a = rounded(rng.standard_normal((slots, J, K)) / np.sqrt(K), wdtype)
    cols = (R * ((np.arange(N) // 2) % targets)).astype(np.uint32)      # targets' rows interleaved in pairs
    bc = rounded(rng.standard_normal((slots, N, R)) / np.sqrt(R), wdtype)
    b = np.zeros((slots, N, J), np.float32)                               # the same B, (N, J) with zeros
    for r in range(R):
        b[:, np.arange(N), cols + r] = bc[:, :, r]
    np.testing.assert_array_equal(lk.compact_b(b, cols, R), bc)
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    idx = np.array([lk.NONE if t % 3 == 1 else t % slots for t in range(T)], np.uint32)
    y0 = rng.standard_normal((T, N))
    yt = put(device, y0, dtype, lead=8)
    nt = (put(device, w), 1e-5) if norm else None
    run(device, lk.lora_delta(device, put(device, x, dtype, lead=4), put(device, a, wdtype),
                              put(device, bc, wdtype), put(device, cols[::2], "u32"), put(device, idx, "u32"), yt,
                              slots=slots, norm=nt))
    u = lk.shrink_ref(rounded(x, dtype), a, idx, (w, 1e-5) if norm else None)
    want, got = lk.expand_ref(u, b, idx, rounded(y0, dtype)), get(device, yt)
    assert np.abs(got - want).max() / np.abs(want).max() < (1e-4 if dtype == "f32" else 1e-2)
    base = idx == lk.NONE
    np.testing.assert_array_equal(got[base], rounded(y0, dtype)[base])
    ys = put(device, y0, dtype)                  # store: y = the delta, a base row -0.0
    run(device, lk.lora_delta(device, put(device, x, dtype), put(device, a, wdtype), put(device, bc, wdtype),
                              put(device, cols[::2], "u32"), put(device, idx, "u32"), ys, slots=slots, norm=nt, store=True))
    stored = get(device, ys)
    if wdtype != "f32":                       # the same values held as f32: the same bits
        y32, s32 = put(device, y0, dtype), put(device, y0, dtype)
        for y, store in ((y32, False), (s32, True)):
            run(device, lk.lora_delta(device, put(device, x, dtype), put(device, a), put(device, bc),
                                      put(device, cols[::2], "u32"), put(device, idx, "u32"), y, slots=slots, norm=nt,
                                      store=store))
        np.testing.assert_array_equal(get(device, y32), got)
        np.testing.assert_array_equal(get(device, s32), stored)
    assert np.abs(stored - (want - rounded(y0, dtype)))[~base].max() / np.abs(want).max() < (1e-4 if dtype == "f32" else 1e-2)
    assert (stored[base] == 0).all() and np.signbit(stored[base]).all()
    if not norm:                              # the pair's sums in the pair's order: the same bits
        yp, it = put(device, y0, dtype), put(device, idx, "u32")
        ut = empty(device, (T, J), fill=0)
        run(device, lk.lora_shrink(device, put(device, x, dtype), put(device, a), it, ut, slots=slots),
            lk.lora_expand(device, ut, put(device, b), it, yp, slots=slots))
        np.testing.assert_array_equal(got, get(device, yp))


@pytest.mark.parametrize("dtype,wdtype", [("f32", "f32"), ("f16", "f16"), ("f32", "bf16")])
@pytest.mark.parametrize("rows", [4])
@pytest.mark.parametrize("T,slots,pattern,R", [(16, 2, "one", 16), (7, 3, "mixed", 16), (5, 1, "tail", 16),
                                                (6, 2, "one", 32)])
def test_lora_rows_give_each_row_lora_deltas_bits(device, _free, dtype, wdtype, rows, T, slots, pattern, R):
    """lora_delta with `rows` a workgroup (lora_rows: A and B read once for them, R lanes) gives
    every row the one-row kernel's bits (8 lanes, each making R / 8 lanes' sums of squares), normed
    or not, added or stored: rows of one adapter (a prefill chunk's), groups whose rows' slots differ
    or lack one (a row at a time), a last group past T. K spans three of its staged chunks, the last
    not whole blocks of 32; against numpy too."""
    rng = np.random.default_rng(T + rows)
    K, N, targets = 1096, 120, 3
    J = targets * R
    x = rng.standard_normal((T, K))
    a = rounded(rng.standard_normal((slots, J, K)) / np.sqrt(K), wdtype)
    cols = (R * ((np.arange(N) // 2) % targets)).astype(np.uint32)
    bc = rounded(rng.standard_normal((slots, N, R)) / np.sqrt(R), wdtype)
    b = np.zeros((slots, N, J), np.float32)
    for r in range(R):
        b[:, np.arange(N), cols + r] = bc[:, :, r]
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    idx = {"one": np.full(T, slots - 1), "mixed": np.array([lk.NONE if t % 3 == 1 else t % slots for t in range(T)]),
           "tail": np.zeros(T)}[pattern].astype(np.uint32)
    y0 = rng.standard_normal((T, N))
    xt, at, bt, ct, it = (put(device, x, dtype), put(device, a, wdtype), put(device, bc, wdtype),
                          put(device, cols[::2], "u32"), put(device, idx, "u32"))
    for norm in (None, (put(device, w), 1e-5)):
        for store in (False, True):
            got = []
            for r in (1, rows):
                yt = put(device, y0, dtype, lead=4)
                run(device, lk.lora_delta(device, xt, at, bt, ct, it, yt, slots=slots, norm=norm, store=store, rows=r))
                got.append(get(device, yt))
            np.testing.assert_array_equal(got[1], got[0])
            u = lk.shrink_ref(rounded(x, dtype), a, idx, (w, 1e-5) if norm else None)
            want = lk.expand_ref(u, b, idx, np.zeros_like(y0) if store else rounded(y0, dtype))
            assert np.abs(got[1] - want).max() / np.abs(want).max() < (1e-4 if dtype == "f32" else 1e-2)
    with pytest.raises(ValueError, match="rows must be 1, or 4"):
        lk.lora_delta(device, xt, at, bt, ct, it, put(device, y0, dtype), slots=slots, rows=3)


@pytest.mark.parametrize("dtype,wdtype", [("f32", "f32"), ("f16", "f16")])
def test_the_shrinks_x_through_the_subgroup_gives_the_same_bits(device, _free, monkeypatch, dtype, wdtype):
    """kernels/lora.py SUBGROUP_X (x handed to the shrink's lanes by subgroup broadcasts, 32 values a
    block, the rest read by each lane) against each lane reading x itself: lora_delta, normed and
    added, bit for bit; K = 1096 (two staged chunks, the last not whole blocks of 32)."""
    if not lk.rows_ok(device):
        pytest.skip("this adapter has no subgroups of 8 lanes: the per-lane form is the only one")
    rng = np.random.default_rng(11)
    T, K, R, N, slots = 2, 1096, 16, 96, 2
    idx = np.array([1, 0], np.uint32)
    x = rng.standard_normal((T, K))
    a = (rng.standard_normal((slots, 3 * R, K)) / np.sqrt(K)).astype(NP_W[wdtype])
    b = (rng.standard_normal((slots, N, R)) / np.sqrt(R)).astype(NP_W[wdtype])
    cols = (R * ((np.arange(N) // 2) % 3)).astype(np.uint32)[::2]
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    got = []
    for sg in (False, True):
        monkeypatch.setattr(lk, "SUBGROUP_X", sg)
        yt = put(device, np.ones((T, N)), dtype)
        run(device, lk.lora_delta(device, put(device, x, dtype), put(device, a, wdtype), put(device, b, wdtype),
                                  put(device, cols, "u32"), put(device, idx, "u32"), yt, slots=slots,
                                  norm=(put(device, w), 1e-5)))
        got.append(get(device, yt))
    np.testing.assert_array_equal(got[0], got[1])
    assert np.abs(got[1] - 1).max() > 0.01          # the deltas were added


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_matmul_adds_stored_deltas_before_its_epilogue(device, _free, dtype):
    """matmul(..., add=d) with silu_out and rope_kv (a CPU adapter's LoRA deltas stored first:
    lora_delta store=True): the sums plus d go through the epilogue, as the unfused matmul, + d and
    the epilogue's own kernel make them; d = -0.0 (a base row) gives the bits of no add at all."""
    from webgpu_engine.kernels import nn, nn_ref
    from webgpu_engine.kernels import quant_ref as qr
    from webgpu_engine.kernels.matmul import RopeKV, interleave_pairs, matmul, upload_weight
    rng = np.random.default_rng(7)
    tol = 1e-4 if dtype == "f32" else 1e-2
    f, k = 64, 128
    rg, ru = qr.random_weight("q4_1", f, k, rng), qr.random_weight("q4_1", f, k, rng)
    G, U = qr.dequantize(rg, "q4_1", f, k), qr.dequantize(ru, "q4_1", f, k)
    w = upload_weight(device, interleave_pairs(rg, ru, "q4_1", k), "q4_1", 2 * f, k, owner=OWNER, label="gu")
    x = rng.standard_normal((1, k))
    d = rng.standard_normal((1, 2 * f))                      # in the weight's row order (pairs)
    gate_rows = 4 * (np.arange(f) // 2) + np.arange(f) % 2    # g0 g1 u0 u1 g2 g3 u2 u3 ...
    dg, du = d[:, gate_rows], d[:, gate_rows + 2]
    xd = rounded(x, dtype).astype(np.float64)
    ref = nn_ref.silu_mul(np.concatenate([xd @ G.T + rounded(dg, dtype), xd @ U.T + rounded(du, dtype)], axis=1))
    outs = {}
    for name, add in (("d", d), ("-0", np.full((1, 2 * f), -0.0)), (None, None)):
        y = empty(device, (1, f), dtype)
        run(device, matmul(device, put(device, x, dtype), w, y, silu_out=True,
                           add=None if add is None else put(device, add, dtype, lead=2)))
        outs[name] = get(device, y)
    assert np.abs(outs["d"] - ref).max() / np.abs(ref).max() < tol
    np.testing.assert_array_equal(outs["-0"], outs[None])
    # rope_kv: q|k|v rows of one position, rotated after the add; k and v written to the caches
    Hq, Hkv, D, ctx, pos = 4, 2, 32, 12, 9
    n = (Hq + 2 * Hkv) * D
    raw = qr.random_weight("q4_1", n, k, rng)
    wq = upload_weight(device, raw, "q4_1", n, k, owner=OWNER, label="qkv")
    step = device.upload(np.array([pos, 1, pos + 1, 0], np.uint32), owner=OWNER)
    freq = nn.rope_frequencies(device, 32, 10000.0, owner=OWNER)
    d = rng.standard_normal((1, n))
    got = {}
    for name, add in (("d", d), ("-0", np.full((1, n), -0.0)), (None, None), ("apart", d)):
        kc, vc = put(device, np.zeros((Hkv, ctx, D)), dtype), put(device, np.zeros((Hkv, ctx, D)), dtype)
        qkv, xt = empty(device, (1, n), dtype), put(device, x, dtype)
        if name == "apart":                  # the unfused form: matmul, + d, rope_kv
            qkv = put(device, d, dtype)
            run(device, matmul(device, xt, wq, qkv, accumulate=True),
                nn.rope_kv(device, qkv.view((1, Hq + 2 * Hkv, D)), kc, vc, step, n_q_heads=Hq, n_kv_heads=Hkv,
                           head_dim=D, ctx=ctx, rot_dim=32))
        else:
            run(device, matmul(device, xt, wq, qkv, rope_kv=RopeKV(step, freq, kc, vc, Hq, Hkv, D, 32, ctx),
                               add=None if add is None else put(device, add, dtype, lead=1)))
        got[name] = [get(device, t) for t in (qkv, kc, vc)]
    for a, b in zip(got["d"], got["apart"]):
        assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())
    for a, b in zip(got["-0"], got[None]):
        np.testing.assert_array_equal(a, b)
    assert np.abs(got["d"][0] - got[None][0]).max() > 0.1


def test_lora_kernels_refuse_bad_shapes(device, _free):
    x, a = put(device, np.zeros((2, 8))), put(device, np.zeros((2, 4, 8)))
    it, ut = put(device, np.zeros(2), "u32"), empty(device, (2, 4), fill=0)
    with pytest.raises(ValueError, match="lora_shrink"):
        lk.lora_shrink(device, x, a, it, ut, slots=3)
    with pytest.raises(ValueError, match="lora_expand"):
        lk.lora_expand(device, ut, put(device, np.zeros((2, 5, 6))), it, put(device, np.zeros((2, 5))), slots=2)


# ---------------------------------------------------------------------- adapters through the engine
FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "lora_transformers.json").read_text())
ADAPTERS = {name: str(FIXTURES / "lora" / name) for name in REF["adapters"]}
OPTS = {"dtype": "f32", "context_window_size": 128, "prefill_chunk_size": 32, "max_num_sequences": 4,
        "kv_block_size": 16}


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    from tinymodels import write_tiny_llama_safetensors
    return write_tiny_llama_safetensors(tmp_path_factory.mktemp("lora") / "base", seed=REF["seed"])["folder"]


@pytest.fixture(scope="module")
async def engine(device, base_path):
    eng = AsyncMLCEngine()
    await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters=ADAPTERS)
    yield eng
    await eng.unload()


def _base_id(engine) -> str:
    (mid,) = engine.models
    return mid


async def _greedy(engine, model: str, i: int, **kw) -> str:
    r = await engine.completions.create(model=model, prompt=REF["prompts"][i], max_tokens=len(REF["base"]["greedy"][i]),
                                        temperature=0.0, ignore_eos=True, **kw)
    return r.choices[0].text


def _want(name: str | None, i: int) -> str:
    return (REF["base"] if name is None else REF["adapters"][name])["text"][i]


async def test_prompt_ids_are_the_references(engine):
    pipe = engine.models[_base_id(engine)].pipeline
    for p, ids in zip(REF["prompts"], REF["prompt_ids"]):
        assert pipe.prompt_ids(None, p, pipe.template_kwargs(GenerationConfig())) == ids


@pytest.mark.parametrize("name", [None, "a", "b"])
async def test_each_alone_equals_transformers_with_peft(engine, name):
    for i in range(len(REF["prompts"])):
        assert await _greedy(engine, name or _base_id(engine), i) == _want(name, i)


async def test_base_and_two_adapters_in_one_batch(engine):
    names = [None, "a", "b", "a", None, "b"]
    got = await asyncio.gather(*[_greedy(engine, n or _base_id(engine), k % 2) for k, n in enumerate(names)])
    assert got == [_want(n, k % 2) for k, n in enumerate(names)]


async def test_shrink_and_expand_apart_answer_as_in_one(engine):
    """The GPU form (lora_shrink + lora_expand, the norm apart) gives the same tokens as the CPU
    adapter's one-dispatch lora_delta."""
    pipe = engine.models[_base_id(engine)].pipeline
    pipe.lora.use_fused(False)
    pipe.scheduler.fwd.release()                 # the op lists are built again
    try:
        names = [None, "a", "b", "a"]
        got = await asyncio.gather(*[_greedy(engine, n or _base_id(engine), k % 2) for k, n in enumerate(names)])
        assert got == [_want(n, k % 2) for k, n in enumerate(names)]
    finally:
        pipe.lora.use_fused(True)
        pipe.scheduler.fwd.release()


async def _logprobs(engine, model: str, i: int) -> list:
    r = await engine.completions.create(model=model, prompt=REF["prompts"][i], max_tokens=8, temperature=0.0,
                                        ignore_eos=True, logprobs=1)
    return r.choices[0].logprobs.token_logprobs


async def test_a_base_row_beside_adapters_is_the_base_without_adapters(engine, base_path):
    """The base's values in a batch with adapter rows are the bits of a model with no adapter."""
    plain = AsyncMLCEngine()
    await plain.reload(str(base_path), chat_opts=OPTS)
    try:
        want = [await _logprobs(plain, _base_id(plain), i) for i in range(2)]
    finally:
        await plain.unload()
    mid = _base_id(engine)
    got = await asyncio.gather(_logprobs(engine, mid, 0), _logprobs(engine, "a", 0), _logprobs(engine, "b", 1),
                               _logprobs(engine, mid, 1))
    assert [got[0], got[3]] == want
    assert got[1] != want[0]


async def test_prefix_blocks_are_shared_only_within_an_adapter(engine):
    pool = engine.models[_base_id(engine)].pipeline.scheduler.pool
    prompt = "a fresh breeze comes from the hills beyond the quiet town: " + REF["prompts"][1]

    async def run(model):
        await engine.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0.0)
        return pool.stats["hit_tokens"]
    hits = await run(_base_id(engine))
    assert await run("a") == hits and await run("b") == hits     # the base's blocks are not theirs
    assert await run("a") > hits                                  # their own are


async def test_pool_evicts_the_least_recently_used_idle_adapter(engine):
    from webgpu_engine.models.lora import LoraPool, load_adapter
    m = engine.models[_base_id(engine)].pipeline.model
    pool = LoraPool(m, slots=2, max_rank=8, owner="test:lora")
    try:
        for name in ("a", "b", "c"):
            pool.register(load_adapter(ADAPTERS["a" if name == "c" else name], name))
        assert [pool.acquire("a"), pool.acquire("b")] == [0, 1]
        pool.release("a")
        assert pool.acquire("c") == 0 and pool.resident() == ["b", "c"]        # a was idle and older
        with pytest.raises(InvalidRequestError, match="in use"):
            pool.acquire("a")                                                   # b and c both in use
        pool.release("b")
        assert pool.acquire("a") == 1
        with pytest.raises(InvalidRequestError, match="in use"):
            pool.unregister("a")
        with pytest.raises(InvalidRequestError, match="load the new version when they are done"):
            pool.register(load_adapter(ADAPTERS["b"], "a"))                     # a new version of a
    finally:
        pool.release_all()


async def test_a_request_past_max_loras_waits_for_a_slot(device, base_path):
    """max_loras 1 and two adapters' requests at once: the second waits for the first's slot (vLLM
    queues it; it was a 400 before) and both answer as transformers + peft; one whose adapter is
    unloaded while it waits is refused."""
    eng = AsyncMLCEngine()
    await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters=ADAPTERS, max_loras=1)
    try:
        pool = eng.models[_base_id(eng)].pipeline.lora
        names = list(ADAPTERS)[:2]
        assert pool.slots == 1 and len(names) == 2
        got = await asyncio.gather(*(_greedy(eng, name, i) for i, name in enumerate(names)))
        assert got == [_want(name, i) for i, name in enumerate(names)]
        assert pool.resident() == [names[1]] and not any(pool._users.values())
        # an adapter unloaded while its request waits: that request is refused, the other answers
        first = asyncio.ensure_future(_greedy(eng, names[0], 0))
        while not pool._users.get(names[0]):
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(_greedy(eng, names[1], 1))
        while pool._freed is None:
            await asyncio.sleep(0.01)
        await eng.unload_lora_adapter(names[1])
        assert await first == _want(names[0], 0)
        with pytest.raises(InvalidRequestError, match="was unloaded while the request waited"):
            await second
    finally:
        await eng.unload()


def _copy_adapter(src: str, dst: Path, config: dict | None = None, rename=None, reshape=None) -> str:
    """A copy of adapter folder `src` with config keys changed, tensors renamed or cut."""
    from webgpu_engine.loaders.safetensors import SafetensorsFile, write_safetensors
    dst.mkdir(parents=True, exist_ok=True)
    conf = json.loads((Path(src) / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**conf, **(config or {})}))
    f = SafetensorsFile(Path(src) / "adapter_model.safetensors")
    out = {}
    for n, t in f.tensors.items():
        a = np.frombuffer(bytes(t.data), np.float32).reshape(t.shape)
        a = reshape(n, a) if reshape else a
        out[rename(n) if rename else n] = ("f32", a.shape, np.ascontiguousarray(a).tobytes())
    f.close()
    write_safetensors(dst / "adapter_model.safetensors", out)
    return str(dst)


async def test_adapters_that_do_not_fit_are_refused_naming_the_tensor(engine, tmp_path):
    from webgpu_engine.models.lora import LoraAdapterError
    wide = _copy_adapter(ADAPTERS["b"], tmp_path / "wide", reshape=lambda n, a: np.concatenate([a, a], axis=1)
                         if "layers.1.mlp.down_proj.lora_A" in n else a)
    with pytest.raises(LoraAdapterError, match=r"tensor \S*layers\.1\.mlp\.down_proj\.lora_A\.weight .*another base"):
        await engine.load_lora_adapter("wide", wide)
    deep = _copy_adapter(ADAPTERS["b"], tmp_path / "deep", rename=lambda n: n.replace("layers.1.", "layers.7."))
    with pytest.raises(LoraAdapterError, match=r"layers\.7\..*lora_A\.weight is past the base model's 2 layers"):
        await engine.load_lora_adapter("deep", deep)
    big = _copy_adapter(ADAPTERS["a"], tmp_path / "big", config={"r": 32},
                        reshape=lambda n, a: np.tile(a, (4, 1)) if "lora_A" in n else np.tile(a, (1, 4)))
    with pytest.raises(LoraAdapterError, match="rank 32, more than the pool's max_lora_rank 8"):
        await engine.load_lora_adapter("big", big)
    bad_rank = _copy_adapter(ADAPTERS["b"], tmp_path / "r", config={"r": 8})
    with pytest.raises(LoraAdapterError, match="lora_A.weight.*rank r = 8"):
        await engine.load_lora_adapter("r", bad_rank)
    with pytest.raises(LoraAdapterError, match="not a PEFT LoRA folder"):
        await engine.load_lora_adapter("none", str(tmp_path))
    dora = _copy_adapter(ADAPTERS["b"], tmp_path / "dora", config={"use_dora": True})
    with pytest.raises(LoraAdapterError, match="use_dora"):
        await engine.load_lora_adapter("dora", dora)
    with pytest.raises(InvalidRequestError, match="taken"):
        await engine.load_lora_adapter(_base_id(engine), ADAPTERS["a"])
    assert sorted(engine.lora_names()) == ["a", "b"]


async def test_unknown_adapter_is_not_found_and_adapters_unload(engine):
    with pytest.raises(SpecifiedModelNotFoundError) as e:
        await _greedy(engine, "c", 0)
    assert e.value.http_status == 404
    with pytest.raises(SpecifiedModelNotFoundError):
        await engine.unload_lora_adapter("c")
    await engine.load_lora_adapter("c", ADAPTERS["b"])
    assert await _greedy(engine, "c", 0) == _want("b", 0)
    await engine.unload_lora_adapter("c")
    with pytest.raises(SpecifiedModelNotFoundError):
        await _greedy(engine, "c", 0)


# ---------------------------------------------------------------------- serve and the CLI
def _post(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(device, base_path):
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.server.app import ServerOptions, ServerThread
    s = ServerThread(ServerOptions(models=[str(base_path)], chat_opts=[OPTS], port=0, lora_adapters=ADAPTERS,
                                   allow_model_management=True, engine_config=EngineConfig(device=device)))
    yield s
    s.stop()


def test_serve_base_and_two_adapters_concurrently_with_the_openai_client(server):
    import openai
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    models = {m.id: m.to_dict() for m in c.models.list().data}
    (base,) = [k for k, m in models.items() if "parent" not in m]
    assert {k: (m["parent"], m["root"]) for k, m in models.items() if k != base} == \
        {n: (base, p) for n, p in ADAPTERS.items()}
    assert c.models.retrieve("a").to_dict()["parent"] == base

    def ask(name, i):
        r = c.completions.create(model=name or base, prompt=REF["prompts"][i], temperature=0.0,
                                 max_tokens=len(REF["base"]["greedy"][i]), extra_body={"ignore_eos": True})
        return r.choices[0].text
    jobs = [(n, i) for n in (None, "a", "b") for i in range(2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: ask(*j), jobs))
    assert got == [_want(n, i) for n, i in jobs]
    with pytest.raises(openai.NotFoundError):
        ask("c", 0)


def test_serve_loads_and_unloads_adapters_with_vllms_routes(server):
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": ADAPTERS["b"]}) == \
        (200, "Success: LoRA adapter 'c' added successfully.")
    assert "c" in server.engine.lora_names()
    status, body = _post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": "/nonexistent"})
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path"
    status, body = _post(server, "/v1/load_lora_adapter", {"lora_name": "d"})
    assert status == 400 and "lora_path" in body
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200
    status, body = _post(server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    assert "c" not in server.engine.lora_names()
    server.opts.allow_model_management = False
    try:
        assert _post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": ADAPTERS["b"]})[0] == 403
    finally:
        server.opts.allow_model_management = True


def test_complete_with_lora_on_the_command_line(device, base_path, capsys):
    from webgpu_engine.cli import main
    assert main(["complete", "--quiet", "--model", str(base_path), "--lora", ADAPTERS["b"], "--dtype", "f32",
                 "--max-tokens", str(len(REF["adapters"]["b"]["greedy"][0])), "--temperature", "0",
                 REF["prompts"][0]]) == 0
    assert capsys.readouterr().out == _want("b", 0) + "\n"
    from webgpu_engine.cli.commands import _lora_adapters
    from webgpu_engine.cli.parser import build_parser
    args = build_parser().parse_args(["serve", "--model", "m", "--lora", "a=/x/a", "--lora", "b=/x/b"])
    assert _lora_adapters(args.lora) == {"a": "/x/a", "b": "/x/b"}
    with pytest.raises(InvalidRequestError, match="NAME=PATH"):
        _lora_adapters(["nopath"])


# ---------------------------------------------------------------------- llama.cpp's GGUF LoRA files
async def test_gguf_lora_files_answer_as_their_peft_folders(engine, tmp_path):
    """lora/{a,b}.gguf (convert_lora_to_gguf.py's form: B's q / k rows permuted, alpha / r) give the
    PEFT adapters' tokens, with the PEFT ones and the base in one batch."""
    from webgpu_engine.models.lora import LoraAdapterError, load_adapter
    for name in ("a", "b"):
        g, p = load_adapter(ADAPTERS[name] + ".gguf"), load_adapter(ADAPTERS[name])
        assert g.rank == p.rank and g.qk_permuted and g.scale == pytest.approx(p.scale)
        await engine.load_lora_adapter("g" + name, ADAPTERS[name] + ".gguf")
    try:
        jobs = [("ga", 0), ("gb", 1), ("a", 1), (None, 0), ("gb", 0), ("ga", 1)]
        got = await asyncio.gather(*[_greedy(engine, n or _base_id(engine), i) for n, i in jobs])
        assert got == [_want(n and n[-1], i) for n, i in jobs]
    finally:
        for name in ("ga", "gb"):
            await engine.unload_lora_adapter(name)
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen2")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 64), np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((64, 4), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(LoraAdapterError, match="for a qwen2 model; the base is llama"):
        await engine.load_lora_adapter("q", str(tmp_path / "qwen.gguf"))
    from tinymodels import write_tiny_llama_gguf
    model = write_tiny_llama_gguf(tmp_path / "model.gguf", seed=1)["path"]
    with pytest.raises(LoraAdapterError, match="not a GGUF LoRA adapter"):
        await engine.load_lora_adapter("m", str(model))


async def test_a_q8_0_gguf_lora_answers_as_its_values_in_f32(engine, tmp_path):
    """A GGUF LoRA with q8_0 tensors (convert_lora_to_gguf.py --outtype q8_0: lora_a, whose rows are
    whole 32-value blocks) reads as gguf-py dequantizes it, and answers bit for bit as the same
    values written as f32."""
    import gguf
    from webgpu_engine.models.lora import load_adapter
    src = gguf.GGUFReader(ADAPTERS["a"] + ".gguf")
    alpha = float(src.fields["adapter.lora.alpha"].parts[-1][0])
    paths = {}
    for kind in ("q8_0", "f32"):
        paths[kind] = str(tmp_path / f"a_{kind}.gguf")
        w = gguf.GGUFWriter(paths[kind], "llama")
        w.add_type("adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", alpha)
        for t in src.tensors:
            data = np.asarray(t.data, np.float32)
            if t.name.endswith("lora_a"):
                q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
                if kind == "q8_0":
                    w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                    continue
                data = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, data)
        for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
            step()
    q8, f32 = load_adapter(paths["q8_0"]), load_adapter(paths["f32"])
    assert q8.weights.keys() == f32.weights.keys() and q8.scale == f32.scale
    for key, (a, b) in q8.weights.items():
        np.testing.assert_array_equal(a, f32.weights[key][0])
        np.testing.assert_array_equal(b, f32.weights[key][1])
    for kind in paths:
        await engine.load_lora_adapter(kind, paths[kind])
    try:
        got = await asyncio.gather(*[_logprobs(engine, kind, i) for kind in paths for i in range(2)])
        assert got[:2] == got[2:] and got[0] != await _logprobs(engine, _base_id(engine), 0)
    finally:
        for kind in paths:
            await engine.unload_lora_adapter(kind)


def _half_copy(folder: str, to: Path, dtype: str) -> str:
    """PEFT folder `folder` saved again with its tensors in `dtype`, f16 or bf16 (as PEFT saves a
    16-bit adapter); bf16: each tensor's first value 1.5 * 2^-30, which f16 does not hold (as a
    trained bf16 adapter's smallest values), so that only bf16 holds it all."""
    from webgpu_engine.loaders.safetensors import SafetensorsFile, write_safetensors
    f = SafetensorsFile(Path(folder) / "adapter_model.safetensors")
    tensors = {}
    try:
        for name, t in f.tensors.items():
            v = np.frombuffer(bytes(t.data), np.float32).copy()
            if dtype == "bf16":
                v[0] = 1.5 * 2.0 ** -30
            tensors[name] = (dtype, t.shape, HALVES[dtype][0](v).tobytes())    # rounded to nearest
    finally:
        f.close()
    to.mkdir()
    write_safetensors(to / "adapter_model.safetensors", tensors)
    (to / "adapter_config.json").write_text((Path(folder) / "adapter_config.json").read_text())
    return str(to)


@pytest.mark.parametrize("half", ["f16", "bf16"])
async def test_an_adapter_saved_in_16_bits_is_held_in_16_bits(base_path, tmp_path, half):
    """A CPU adapter's pool holds A and B in f16 while every adapter's values are f16 values, in
    bf16 while they are all bf16 values (half lora_delta's loads), and answers bit for bit as the
    same values held in f32 (the pool's layout while an adapter of f32 values is beside them); a
    base row stays the base's."""
    eng = AsyncMLCEngine()
    await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters={"h": _half_copy(ADAPTERS["a"], tmp_path / "h", half)})
    try:
        mid, pool = _base_id(eng), eng.models[_base_id(eng)].pipeline.lora
        got = {}
        for layout in (half, "f32", half):
            if layout == "f32":
                await eng.load_lora_adapter("a", ADAPTERS["a"])
            elif got:
                await eng.unload_lora_adapter("a")
            assert pool.layout[:2] == (True, layout)
            got[len(got)] = await asyncio.gather(_logprobs(eng, mid, 0), _logprobs(eng, "h", 0), _logprobs(eng, "h", 1))
        assert got[0] == got[1] == got[2] and got[0][1] != got[0][0]
        assert got[0][0] == await _logprobs(eng, mid, 0)
    finally:
        await eng.unload()


# ---------------------------------------------------------------------- speculation and grammars
async def test_speculation_and_grammars_with_adapters(engine, base_path):
    """Prompt-lookup speculation checks an adapter row's guesses with the adapter (answers equal those
    without speculation, guesses accepted); a grammar constrains an adapter's answer as the base's."""
    spec = AsyncMLCEngine()
    await spec.reload(str(base_path), chat_opts={**OPTS, "speculation": {"method": "ngram", "k": 3, "n_min": 1,
                                                                           "auto_off": False}},
                      lora_adapters=ADAPTERS)
    prompt = "one two three four " * 6
    fmt = {"type": "regex", "regex": "[a-z]+( [a-z]+){3}"}
    stats = []
    try:
        for name in ("a", "b"):
            kw = dict(model=name, prompt=prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
            want = (await engine.completions.create(**kw)).choices[0].text
            got = await asyncio.gather(*[spec.completions.create(**kw) for _ in range(2)])
            assert [r.choices[0].text for r in got] == [want, want]
            stats += [r.usage.extra.model_dump() for r in got]
            constrained = await spec.completions.create(**{**kw, "max_tokens": 40}, response_format=fmt)
            text = constrained.choices[0].text
            assert re.fullmatch(fmt["regex"], text), text
            assert text == (await engine.completions.create(**{**kw, "max_tokens": 40}, response_format=fmt)
                            ).choices[0].text
    finally:
        await spec.unload()
    assert all(x["speculation_proposed_tokens"] > 0 for x in stats)      # guess rows with the adapter
    assert sum(x["speculation_accepted_tokens"] for x in stats) > 0


async def test_only_the_projections_some_adapter_targets_get_deltas(engine):
    """With only b (q, v, gate, down) registered, a step adds no delta to o: 3 of the 4 a layer, and
    the answers are b's."""
    pipe = engine.models[_base_id(engine)].pipeline
    await engine.unload_lora_adapter("a")
    try:
        assert pipe.lora.targeted() == ("qkv", "gate_up", "down")
        assert await _greedy(engine, "b", 1) == _want("b", 1)
        names = [op.name for op in pipe.scheduler.fwd.ops("decode", 1, True)]
        n_layers = pipe.model.cfg.n_layers
        # a group's delta an op each, or made by its matmul (kernels/lora.py Delta: "+lora")
        deltas = {"lora_delta": 1, "lora_shrink": 1}
        inside = [n for n in names if n.endswith("+lora")]
        assert sum(deltas.get(n, 0) for n in names) + len(inside) == 3 * n_layers
        assert inside == [f"matmul[layers.{i}.{g}]+lora" for i in range(n_layers) for g in ("gate_up", "down")]
        # the fused act(gate) * up stays: the deltas are the only ops added
        base = [op.name for op in pipe.scheduler.fwd.ops("decode", 1, False)]
        assert [n.removesuffix("+lora") for n in names if n not in deltas] == base
    finally:
        await engine.load_lora_adapter("a", ADAPTERS["a"])
    assert pipe.lora.targeted() == ("qkv", "o", "gate_up", "down")
    assert await _greedy(engine, "a", 0) == _want("a", 0)


async def test_adapters_come_back_after_a_device_loss(base_path):
    """auto_recover reloads the base on a new device and serves its adapters again."""
    from webgpu_engine import gpu
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.errors import DeviceLostError
    eng = AsyncMLCEngine(EngineConfig(device=await gpu.request_device(), auto_recover=True))
    await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters=ADAPTERS)
    try:
        await eng.load_lora_adapter("c", ADAPTERS["b"] + ".gguf")
        stream = await eng.completions.create(model="a", prompt=REF["prompts"][0], max_tokens=8, stream=True,
                                              temperature=0.0, ignore_eos=True)
        with pytest.raises(DeviceLostError):
            async for _ in stream:
                eng.device.destroy()
        assert await _greedy(eng, "a", 0) == _want("a", 0)              # the next request recovers
        assert sorted(eng.lora_names()) == ["a", "b", "c"]
        assert await _greedy(eng, "c", 1) == _want("b", 1)
    finally:
        await eng.unload()
        eng.device.close()


def _ollama_store(root: Path, name: str, files: dict) -> None:
    """An Ollama store at `root` with manifest `name`:latest of the layers {media type: file}."""
    import hashlib
    layers = []
    for kind, path in files.items():
        data = Path(path).read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / digest.replace(":", "-")).write_bytes(data)
        layers.append({"mediaType": "application/vnd.ollama.image." + kind, "digest": digest, "size": len(data)})
    folder = root / "manifests" / "registry.ollama.ai" / "library" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "latest").write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


async def test_an_ollama_adapter_layer_applies_to_every_request_of_its_model(device, tmp_path, monkeypatch):
    """Ollama's ADAPTER (a GGUF LoRA layer) over a GGUF base (q / k rows permuted as llama.cpp writes
    them): the model's requests answer as transformers + peft with the adapter; a PEFT adapter loaded
    beside it (rows permuted into the base's order) answers as its own."""
    from tinymodels import write_tiny_llama_gguf
    from webgpu_engine.engine import EngineConfig
    base = write_tiny_llama_gguf(tmp_path / "base.gguf", seed=REF["seed"])["path"]
    _ollama_store(tmp_path / "ollama", "tinylora", {"model": base, "adapter": ADAPTERS["a"] + ".gguf"})
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    eng = AsyncMLCEngine(EngineConfig(device=device))
    await eng.reload("ollama:tinylora", chat_opts={"dtype": "f32", "prefill_chunk_size": 32})
    try:
        assert list(eng.models) == ["tinylora:latest"] and eng.lora_names() == []
        await eng.load_lora_adapter("b", ADAPTERS["b"])
        jobs = [(None, 0), ("b", 1), (None, 1), ("b", 0)]
        got = await asyncio.gather(*[_greedy(eng, n or "tinylora:latest", i) for n, i in jobs])
        assert got == [_want(n or "a", i) for n, i in jobs]
        # a GGUF base's decode step (fused RoPE + KV write): every group's deltas made by its matmul
        # (kernels/lora.py Delta), no dispatch of their own
        names = [op.name for op in eng.models["tinylora:latest"].pipeline.scheduler.fwd.ops("decode", 1, True)]
        n_layers = eng.models["tinylora:latest"].pipeline.model.cfg.n_layers
        assert [n for n in names if n.startswith("lora")] == []
        assert [n for n in names if n.endswith("+lora")] == [
            f"matmul[layers.{i}.{g}]+lora" for i in range(n_layers) for g in ("qkv", "o", "gate_up", "down")]
    finally:
        await eng.unload()


async def test_a_mixture_of_experts_ffn_takes_no_adapter(device, tmp_path):
    from tinymoe import write_tiny_moe_safetensors
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.models.lora import LoraAdapterError
    folder = write_tiny_moe_safetensors("qwen3moe", tmp_path / "moe")["folder"]
    eng = AsyncMLCEngine(EngineConfig(device=device))
    await eng.reload(str(folder), chat_opts={"dtype": "f32", "max_num_sequences": 2, "context_window_size": 64})
    try:
        with pytest.raises(LoraAdapterError, match=r"layers\.0\.mlp\.down_proj\.lora_A\.weight targets a "
                                                   r"mixture-of-experts FFN"):
            await eng.load_lora_adapter("b", ADAPTERS["b"])
    finally:
        await eng.unload()
