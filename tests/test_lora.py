"""LoRA adapters (issue 52): the bgmv kernel pair against numpy; PEFT adapters over a tiny decoder
against transformers + peft (tests/fixtures/make_lora.py), alone and with the base in one batch."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.config import GenerationConfig
from webgpu_engine.engine.engine import AsyncMLCEngine
from webgpu_engine.kernels import lora as lk

from _nn_util import empty, get, put, rounded, run

OWNER = "test:nn"


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
