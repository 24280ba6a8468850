"""Per-request LoRA adapter scales (llama.cpp's `lora`: [{"id": N, "scale": S}], issue 52) against
transformers + peft with the adapter's scaling multiplied (tests/fixtures/make_lora.py --scaled):
alone and two adapters at once, rows of different scales in one batch, scale 0 as the base, bad input
refused by field."""
from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request

import pytest

from webgpu_engine.engine.engine import AsyncMLCEngine
from webgpu_engine.engine.lora import UnknownLoraAdapterError
from webgpu_engine.protocol.errors import FieldTypeError, RangeError, UnsupportedFieldsError

from test_lora import ADAPTERS, FIXTURES, OPTS, REF, base_path  # noqa: F401  (ids: a 0, b 1; a fixture)

SCALED_REF = json.loads((FIXTURES / "lora_scaled_transformers.json").read_text())
SCALED, COMBINED = SCALED_REF["scaled"], SCALED_REF["combined"]


@pytest.fixture(scope="module")
async def engine(device, base_path):
    eng = AsyncMLCEngine()
    await eng.reload(str(base_path), chat_opts=OPTS)
    for name, path in ADAPTERS.items():             # a pool of rank 16: room for a (8) and b (4) at once
        await eng.load_lora_adapter(name, path, max_rank=16)
    yield eng
    await eng.unload()


def _base(engine) -> str:
    (mid,) = engine.models
    return mid


async def _greedy(engine, i: int, model: str | None = None, **kw):
    r = await engine.completions.create(model=model or _base(engine), prompt=REF["prompts"][i], temperature=0.0,
                                        max_tokens=len(REF["base"]["greedy"][i]), ignore_eos=True, logprobs=1, **kw)
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("k", range(len(SCALED)))
async def test_a_scale_equals_transformers_with_peft_scaled(engine, k):
    ref = SCALED[k]
    for i in range(len(REF["prompts"])):
        text, _ = await _greedy(engine, i, lora=[{"name": ref["adapter"], "scale": ref["scale"]}])
        assert text == ref["text"][i]
    if ref["scale"] == 1.0:        # a scale of 1 is the adapter `model` names: one slot, the same bits
        by_id = await _greedy(engine, 0, lora=[{"id": list(ADAPTERS).index(ref["adapter"]), "scale": 1}])
        assert by_id == await _greedy(engine, 0, model=ref["adapter"])


@pytest.mark.parametrize("k", range(len(COMBINED)))
async def test_two_adapters_at_once_equal_transformers_with_both_active(engine, k):
    ref = COMBINED[k]
    lora = [{"id": list(ADAPTERS).index(n), "scale": s} for n, s in ref["scales"].items()]
    got = await asyncio.gather(*[_greedy(engine, i, lora=lora) for i in range(2)],
                               *[_greedy(engine, i, lora=lora[::-1]) for i in range(2)])     # one entry
    assert [t for t, _ in got] == ref["text"] * 2


async def test_adapters_whose_ranks_exceed_the_pool_together_are_refused(engine):
    from webgpu_engine.errors import InvalidRequestError
    await engine.load_lora_adapter("c", ADAPTERS["a"])             # rank 8: a 8 + b 4 + c 8 > 16
    try:
        with pytest.raises(InvalidRequestError, match=r"need rank 20, more than the pool's 16") as e:
            await _greedy(engine, 0, lora=[{"name": n, "scale": 1} for n in ("a", "b", "c")])
        assert e.value.param == "lora"
        a_and_c = await _greedy(engine, 0, lora=[{"name": "a", "scale": 0.5}, {"name": "c", "scale": 1.5}])
        a2 = next(r for r in SCALED if (r["adapter"], r["scale"]) == ("a", 2.0))
        assert a_and_c[0] == a2["text"][0]                          # 0.5 B A x + 1.5 B A x
    finally:
        await engine.unload_lora_adapter("c")


async def test_scale_zero_and_an_empty_list_are_the_base(engine):
    base = [await _greedy(engine, i) for i in range(2)]
    assert [t for t, _ in base] == REF["base"]["text"]
    assert await _greedy(engine, 0, lora=[{"id": 0, "scale": 0}, {"name": "b", "scale": 0.0}]) == base[0]
    assert await _greedy(engine, 1, model="a", lora=[]) == base[1]      # `lora` decides over `model`


async def test_rows_of_different_scales_in_one_batch_each_equal_alone(engine):
    jobs = [(k, i) for k in range(len(SCALED)) for i in range(2)][::-1] + [(None, 0), (None, 1)]
    alone = [await _greedy(engine, i, **_lora(k)) for k, i in jobs]
    together = await asyncio.gather(*[_greedy(engine, i, **_lora(k)) for k, i in jobs])
    assert together == alone
    assert [t for t, _ in alone] == [(REF["base"] if k is None else SCALED[k])["text"][i] for k, i in jobs]
    assert len(engine.models[_base(engine)].pipeline.lora.resident()) == len(SCALED)    # an entry a scale


def _lora(k) -> dict:
    return {} if k is None else {"lora": [{"name": SCALED[k]["adapter"], "scale": SCALED[k]["scale"]}]}


@pytest.mark.parametrize("lora,error,param", [
    ([{"id": 2, "scale": 1}], UnknownLoraAdapterError, "lora[0].id"),
    ([{"id": True}], FieldTypeError, "lora[0].id"),
    ([{"name": 0}], FieldTypeError, "lora[0].name"),
    ([{"scale": 1}, ], FieldTypeError, "lora[0]"),
    ([{"name": "c", "scale": 1}], UnknownLoraAdapterError, "lora[0].name"),
    ([{"id": 0, "scale": -0.5}], RangeError, "lora[0].scale"),
    ([{"id": 0, "scale": math.nan}], RangeError, "lora[0].scale"),
    ([{"id": 0, "scale": math.inf}], RangeError, "lora[0].scale"),
    ([{"id": 0, "scale": "1"}], FieldTypeError, "lora[0].scale"),
    ([{"id": 0, "name": "a"}], FieldTypeError, "lora[0]"),
    ([{"id": 0, "weight": 1}], FieldTypeError, "lora[0]"),
    (["a"], FieldTypeError, "lora[0]"),
    ({"id": 0}, FieldTypeError, "lora"),
    ([{"id": 0}, {"name": "a", "scale": 0}], UnsupportedFieldsError, "lora"),
])
async def test_bad_lora_is_refused_by_field(engine, lora, error, param):
    with pytest.raises(error) as e:
        await _greedy(engine, 0, lora=lora)
    assert e.value.param == param


# ---------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(device, base_path):
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.server.app import ServerOptions, ServerThread
    s = ServerThread(ServerOptions(models=[str(base_path)], chat_opts=[OPTS], port=0, lora_adapters=ADAPTERS,
                                   lora_max_rank=16, max_loras=3, engine_config=EngineConfig(device=device)))
    yield s
    s.stop()


def test_serve_takes_lora_scales_from_the_openai_client_and_lists_adapters(server):
    import openai
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    base = next(m.id for m in c.models.list().data if "parent" not in m.to_dict())
    ref = next(s for s in SCALED if s["scale"] == 2.0)
    r = c.completions.create(model=base, prompt=REF["prompts"][1], temperature=0.0, max_tokens=12,
                             extra_body={"ignore_eos": True, "lora": [{"name": ref["adapter"], "scale": 2.0}]})
    assert r.choices[0].text == ref["text"][1]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=base, prompt="hi", max_tokens=1, extra_body={"lora": [{"id": 7, "scale": 1}]})
    assert e.value.body["param"] == "lora[0].id" and "0: 'a', 1: 'b'" in e.value.body["message"]
    with urllib.request.urlopen(server.base + "/lora-adapters", timeout=60) as resp:
        assert json.loads(resp.read()) == [{"id": i, "name": n, "path": p, "model": base}
                                           for i, (n, p) in enumerate(ADAPTERS.items())]


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_every_route_takes_lora_scales(server):
    """Responses, Anthropic Messages and Ollama's /api/chat and /api/generate take `lora` as the
    chat route does: the same answer as chat completions with it, another without it; /api/generate's
    raw prompt equals transformers + peft scaled."""
    with urllib.request.urlopen(server.url + "/models", timeout=60) as resp:
        base = next(m["id"] for m in json.loads(resp.read())["data"] if "parent" not in m)
    ref = next(s for s in SCALED if s["scale"] == 2.0)
    lora = [{"name": ref["adapter"], "scale": 2.0}]
    msgs = [{"role": "user", "content": REF["prompts"][1]}]

    def chat(**kw) -> str:
        r = _post(server, "/v1/chat/completions", {"model": base, "messages": msgs, "temperature": 0, "max_tokens": 8,
                                                   **kw})
        return r["choices"][0]["message"]["content"]
    want = chat(lora=lora)
    assert want != chat()
    r = _post(server, "/v1/responses", {"model": base, "input": REF["prompts"][1], "temperature": 0,
                                         "max_output_tokens": 8, "lora": lora})
    assert r["output"][-1]["content"][0]["text"] == want
    r = _post(server, "/v1/messages", {"model": base, "messages": msgs, "temperature": 0, "max_tokens": 8, "lora": lora})
    assert r["content"][0]["text"] == want
    n = _post(server, "/v1/messages/count_tokens", {"model": base, "messages": msgs, "lora": lora})
    assert n["input_tokens"] == r["usage"]["input_tokens"]        # the body as sent for the message
    opts = {"temperature": 0, "num_predict": 8}
    r = _post(server, "/api/chat", {"model": base, "messages": msgs, "stream": False, "options": opts, "lora": lora})
    assert r["message"]["content"] == want
    r = _post(server, "/api/generate", {"model": base, "prompt": REF["prompts"][1], "raw": True, "stream": False,
                                         "options": {"temperature": 0, "num_predict": 12}, "lora": lora})
    assert r["response"] == ref["text"][1]
    # an adapter picked by `model` (its name) on each route
    by_name = chat(model="b")
    assert by_name not in (want, chat())
    r = _post(server, "/v1/responses", {"model": "b", "input": REF["prompts"][1], "temperature": 0, "max_output_tokens": 8})
    assert r["output"][-1]["content"][0]["text"] == by_name
    r = _post(server, "/v1/messages", {"model": "b", "messages": msgs, "temperature": 0, "max_tokens": 8})
    assert r["content"][0]["text"] == by_name
    r = _post(server, "/api/chat", {"model": "b", "messages": msgs, "stream": False, "options": opts})
    assert r["message"]["content"] == by_name
    both = COMBINED[0]                   # a (8) and b (4) at once: the pool's rank 16 (--max-lora-rank)
    r = _post(server, "/v1/completions", {"model": base, "prompt": REF["prompts"][0], "temperature": 0, "max_tokens": 12,
                                           "ignore_eos": True, "lora": [{"name": n, "scale": v} for n, v in both["scales"].items()]})
    assert r["choices"][0]["text"] == both["text"][0]
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server, "/api/chat", {"model": base, "messages": msgs, "stream": False, "lora": [{"id": 9}]})
    assert e.value.code == 400 and "lora[0].id" in e.value.read().decode()


async def test_the_pools_rank_and_bound_from_reload_and_serves_flags(device, base_path):
    """reload(lora_max_rank=, max_loras=) (serve --max-lora-rank / --max-loras): a pool of rank 16
    takes a (8) and b (4) in one request, which the adapters' own largest rank (8) refuses; an
    adapter above the rank is refused at load; bad values are typed errors."""
    from webgpu_engine.cli.parser import build_parser
    from webgpu_engine.errors import InvalidRequestError
    from webgpu_engine.models.lora import LoraAdapterError
    ref = COMBINED[0]
    lora = [{"name": n, "scale": s} for n, s in ref["scales"].items()]
    eng = AsyncMLCEngine()
    try:
        await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters=ADAPTERS)
        with pytest.raises(InvalidRequestError, match="need rank 12, more than the pool's 8"):
            await _greedy(eng, 0, lora=lora)
        await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters=ADAPTERS, lora_max_rank=16, max_loras=2)
        pool = eng.models[_base(eng)].pipeline.lora
        assert (pool.max_rank, pool.slots) == (16, 2)
        got = await asyncio.gather(*[_greedy(eng, i, lora=lora) for i in range(2)])
        assert [t for t, _ in got] == ref["text"]
        with pytest.raises(LoraAdapterError, match="rank 8, more than the pool's max_lora_rank 4"):
            await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters=ADAPTERS, lora_max_rank=4)
        with pytest.raises(FieldTypeError, match="max_loras"):
            await eng.reload(str(base_path), chat_opts=OPTS, lora_adapters=ADAPTERS, max_loras=0)
    finally:
        await eng.unload()
    args = build_parser().parse_args(["serve", "--lora", "a=x", "--lora-max-rank", "32", "--max-loras", "6"])
    assert (args.max_lora_rank, args.max_loras) == (32, 6)


async def test_the_pools_rank_and_bound_outlive_a_device_loss_with_no_adapter_loaded(base_path):
    """reload(lora_max_rank=, max_loras=) with no adapter yet, then a device loss: the recovered
    engine's first adapter makes the pool reload() asked for (rank 12, 3 entries), not the default
    rank and bound (16, 4)."""
    from webgpu_engine import gpu
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.errors import DeviceLostError
    eng = AsyncMLCEngine(EngineConfig(device=await gpu.request_device(), auto_recover=True))
    await eng.reload(str(base_path), chat_opts=OPTS, lora_max_rank=12, max_loras=3)
    try:
        stream = await eng.completions.create(prompt=REF["prompts"][0], max_tokens=8, stream=True,
                                              temperature=0.0, ignore_eos=True)
        with pytest.raises(DeviceLostError):
            async for _ in stream:
                eng.device.destroy()
        await eng.completions.create(prompt=REF["prompts"][0], max_tokens=1)        # recovers
        await eng.load_lora_adapter("a", ADAPTERS["a"])
        pool = eng.models[_base(eng)].pipeline.lora
        assert (pool.max_rank, pool.slots) == (12, 3)
    finally:
        await eng.unload()
        eng.device.close()
