"""Server tests: the real aiohttp server on 127.0.0.1 (free port) driven by the official openai client.

The first part runs over stub pipelines (protocol, errors, SSE, disconnects, FIFO, metrics); the
`slow` part serves the real default models on the adapter.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from stub_pipelines import StubLLM, stub_config
from webgpu_engine.server.app import ServerOptions, ServerThread

U = [{"role": "user", "content": "one two three"}]


@pytest.fixture(scope="module")
def server(device):
    StubLLM.step_delay, StubLLM.lose_device_at_step = 0.002, None
    s = ServerThread(ServerOptions(models=["stub-llm", "stub-emb"], port=0, max_body_bytes=64 << 10,
                                   engine_config=stub_config(device)))
    yield s
    s.stop()


def _client(server, **kw):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, **kw)


def _http(url, data=None, headers=None, method=None):
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _assert_openai_error(body: bytes, etype: str | None = None):
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    if etype:
        assert err["type"] == etype
    return err


# --------------------------------------------------------------------------- happy paths (stub)
def test_sync_client_chat_completions_embeddings_models(server):
    c = _client(server)
    r = c.chat.completions.create(model="stub-llm", messages=U, temperature=0)
    assert r.choices[0].message.content == "three two one alpha beta gamma delta epsilon zeta"
    assert r.choices[0].finish_reason == "stop" and r.usage.total_tokens == 3 + 9
    chunks = list(c.chat.completions.create(model="stub-llm", messages=U, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 9
    t = c.completions.create(model="stub-llm", prompt="a b", max_tokens=2, temperature=0, echo=True)
    assert t.choices[0].text == "a bb a" and t.choices[0].finish_reason == "length"
    e = c.embeddings.create(model="stub-emb", input=["ab", "abc"])           # base64 on the wire
    assert [d.embedding[0] for d in e.data] == [2.0, 3.0] and len(e.data[0].embedding) == 3
    e = c.embeddings.create(model="stub-emb", input="abcd", encoding_format="float")
    assert e.data[0].embedding == [4.0, 1.0, 0.0]
    assert sorted(m.id for m in c.models.list()) == ["stub-emb", "stub-llm"]


def test_sse_wire_format(server):
    body = json.dumps({"model": "stub-llm", "messages": U, "stream": True, "max_tokens": 2}).encode()
    st, headers, raw = _http(server.url + "/chat/completions", body, {"Content-Type": "application/json"})
    assert st == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: {")
        assert json.loads(ev[6:])["object"] == "chat.completion.chunk"


async def test_async_clients_fifo_uninterleaved_with_embeddings_between(server):
    StubLLM.step_delay = 0.01
    c = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0)
    done = []

    async def chat(i):
        s = await c.chat.completions.create(model="stub-llm", temperature=0, stream=True,
                                            messages=[{"role": "user", "content": f"req{i} z{i}"}])
        text = "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
        done.append(f"chat{i}")
        return text

    async def emb(i):
        await asyncio.sleep(0.05 * i)
        r = await c.embeddings.create(model="stub-emb", input=f"x{i}", encoding_format="float")
        done.append(f"emb{i}")
        return r
    try:
        tasks = []
        for i in range(8):
            tasks.append(asyncio.create_task(chat(i)))
            await asyncio.sleep(0.005)      # fixes the arrival order
        embs = [asyncio.create_task(emb(i)) for i in range(3)]
        outs = await asyncio.gather(*tasks)
        await asyncio.gather(*embs)
    finally:
        StubLLM.step_delay = 0.002
        await c.close()
    for i, out in enumerate(outs):
        assert out == f"z{i} req{i} alpha beta gamma delta epsilon zeta"
    assert [d for d in done if d.startswith("chat")] == [f"chat{i}" for i in range(8)]
    assert max(done.index(f"emb{i}") for i in range(3)) < done.index("chat7")


@pytest.mark.serial
async def test_disconnect_mid_stream_frees_the_model(server):
    import aiohttp
    StubLLM.step_delay = 0.05
    lm = server.engine.models["stub-llm"]
    try:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(server.url + "/chat/completions",
                                json={"model": "stub-llm", "messages": U, "stream": True})
            await resp.content.readline()           # the first event arrived: generating now
            assert lm.lock.locked
            resp.close()                            # hang up mid-stream
        t0 = time.perf_counter()
        c = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0)
        s2 = await c.chat.completions.create(model="stub-llm", messages=U, stream=True, max_tokens=1)
        first = time.perf_counter() - t0
        [x async for x in s2]
        await c.close()
    finally:
        StubLLM.step_delay = 0.002
    assert first < 1.0, f"next request waited {first:.2f}s for the lock"


def test_health_and_metrics_move(server):
    from prometheus_client.parser import text_string_to_metric_families
    st, _, body = _http(server.base + "/health")
    assert st == 200 and json.loads(body)["status"] == "ready"

    def sample(name, **labels):
        _, h, raw = _http(server.base + "/metrics")
        assert h["Content-Type"].startswith("text/plain")
        for fam in text_string_to_metric_families(raw.decode()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0
    before = sample("webgpu_engine_requests_total", endpoint="/v1/chat/completions", status="200")
    toks = sample("webgpu_engine_completion_tokens_total", model="stub-llm")
    _client(server).chat.completions.create(model="stub-llm", messages=U, max_tokens=3)
    assert sample("webgpu_engine_requests_total", endpoint="/v1/chat/completions", status="200") == before + 1
    assert sample("webgpu_engine_completion_tokens_total", model="stub-llm") == toks + 3
    assert sample("webgpu_engine_time_to_first_token_seconds_count", model="stub-llm") >= 1
    assert sample("webgpu_engine_gpu_allocated_bytes", owner="model:stub-llm") > 0
    assert sample("webgpu_engine_queue_length", model="stub-llm") == 0


# --------------------------------------------------------------------------- errors (stub)
def test_error_statuses_and_shapes(server):
    c = _client(server)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model="stub-llm", messages=U, temperature=3)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "temperature"
    assert ei.value.body["code"] == "RangeError" and "[0, 2]" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="stub-llm", messages=U, stream=True, n=2)
    with pytest.raises(openai.NotFoundError) as ei:
        c.chat.completions.create(model="no-such-model", messages=U)
    assert ei.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as ei:       # an embedder asked to chat
        c.chat.completions.create(model="stub-emb", messages=U)
    st, _, body = _http(server.url + "/chat/completions", b"{not json", {"Content-Type": "application/json"})
    assert st == 400 and "not valid JSON" in _assert_openai_error(body, "invalid_request_error")["message"]
    big = json.dumps({"model": "stub-llm", "messages": [{"role": "user", "content": "x" * (80 << 10)}]})
    st, _, body = _http(server.url + "/chat/completions", big.encode(), {"Content-Type": "application/json"})
    assert st == 413 and "limit" in _assert_openai_error(body)["message"]
    st, _, body = _http(server.url + "/nope")
    assert st == 404 and "Unknown route" in _assert_openai_error(body)["message"]
    # the server survives all of that
    assert c.chat.completions.create(model="stub-llm", messages=U, max_tokens=1).choices


def test_unexpected_error_is_500_without_internals(server, monkeypatch):
    async def boom(*a, **kw):
        raise RuntimeError("secret internal detail")
    monkeypatch.setattr(StubLLM, "prefill_step", boom)
    with pytest.raises(openai.InternalServerError) as ei:
        _client(server).chat.completions.create(model="stub-llm", messages=U)
    assert ei.value.status_code == 500 and "secret" not in json.dumps(ei.value.body)
    monkeypatch.undo()
    assert not server.engine.models["stub-llm"].lock.locked
    assert _client(server).chat.completions.create(model="stub-llm", messages=U, max_tokens=1).choices


def test_client_faults_past_validation_are_400_not_500(server, monkeypatch):
    async def bad_value(*a, **kw):
        raise ValueError("a value no rule caught")
    monkeypatch.setattr(StubLLM, "prefill_step", bad_value)
    with pytest.raises(openai.BadRequestError) as ei:
        _client(server).chat.completions.create(model="stub-llm", messages=U)
    assert ei.value.body["code"] == "invalid_request" and "ValueError" in ei.value.body["message"]
    assert "a value no rule caught" not in ei.value.body["message"]
    monkeypatch.undo()
    assert not server.engine.models["stub-llm"].lock.locked


def _preflight(s, origin):
    return _http(s.url + "/chat/completions", method="OPTIONS",
                 headers={"Origin": origin, "Access-Control-Request-Method": "POST"})


def test_cors_only_for_configured_origins(server, device):
    st, h, _ = _preflight(server, "http://example.org")       # default: no origin is allowed
    assert st != 204 and "Access-Control-Allow-Origin" not in h
    body = json.dumps({"model": "stub-llm", "messages": U, "max_tokens": 1}).encode()
    st, h, _ = _http(server.url + "/chat/completions", body,
                     {"Content-Type": "application/json", "Origin": "http://example.org"})
    assert st == 200 and "Access-Control-Allow-Origin" not in h
    s = ServerThread(ServerOptions(models=["stub-llm"], port=0, cors_origins=["http://example.org"],
                                   engine_config=stub_config(device)))
    try:
        st, h, _ = _preflight(s, "http://example.org")
        assert st == 204 and h["Access-Control-Allow-Origin"] == "http://example.org"
        assert "Authorization" in h["Access-Control-Allow-Headers"] and h["Vary"] == "Origin"
        st, h, _ = _preflight(s, "http://evil.example")
        assert st != 204 and "Access-Control-Allow-Origin" not in h
        st, h, _ = _http(s.url + "/chat/completions", body,
                         {"Content-Type": "application/json", "Origin": "http://example.org"})
        assert st == 200 and h["Access-Control-Allow-Origin"] == "http://example.org"
    finally:
        s.stop()


def test_body_parser_refuses_what_is_not_utf8_json(server):
    body = json.dumps({"model": "stub-llm", "messages": U, "max_tokens": 1}).encode()
    url = server.url + "/chat/completions"
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        st, _, raw = _http(url, body, {"Content-Type": ctype} if ctype else {})
        assert st == 415 and "application/json" in _assert_openai_error(raw)["message"], ctype
    st, _, raw = _http(url, body, {"Content-Type": "application/json; charset=bogus"})
    assert st == 400 and "charset" in _assert_openai_error(raw)["message"]
    st, _, raw = _http(url, body, {"Content-Type": "application/json; charset=latin-1"})
    assert st == 400 and "UTF-8" in _assert_openai_error(raw)["message"]
    st, _, _ = _http(url, body, {"Content-Type": "application/json; charset=UTF-8"})
    assert st == 200
    st, _, raw = _http(url, b'{"messages": "\xff\xfe"}', {"Content-Type": "application/json"})
    assert st == 400 and "UTF-8" in _assert_openai_error(raw)["message"]
    for depth in (65, 20_000):          # the deepest fits the 64 KiB body limit of this server
        deep = b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
        st, _, raw = _http(url, deep, {"Content-Type": "application/json"})
        assert st == 400 and "nested too deeply" in _assert_openai_error(raw)["message"], depth
    st, _, raw = _http(url, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                       {"Content-Type": "application/json"})
    err = _assert_openai_error(raw)
    assert st == 400 and err["param"] == "temperature" and "finite" in err["message"]
    assert _http(url, body, {"Content-Type": "application/json"})[0] == 200


def test_full_queue_is_429_with_retry_after(device):
    from webgpu_engine.engine import EngineConfig  # noqa: F401 - the stub config is one
    s = ServerThread(ServerOptions(models=["stub-llm"], port=0,
                                   engine_config=stub_config(device, max_queue_length=1)))
    StubLLM.step_delay = 0.05
    try:
        async def run():
            c = openai.AsyncOpenAI(base_url=s.url, api_key="none", max_retries=0)
            try:
                busy = [asyncio.create_task(c.chat.completions.create(model="stub-llm", messages=U))
                        for _ in range(2)]
                await asyncio.sleep(0.2)          # one generating, one waiting: the queue is full
                with pytest.raises(openai.RateLimitError) as ei:
                    await c.chat.completions.create(model="stub-llm", messages=U)
                assert [r.choices[0].finish_reason for r in await asyncio.gather(*busy)] == ["stop"] * 2
                return ei.value
            finally:
                await c.close()
        err = asyncio.run(run())
        assert err.status_code == 429 and int(err.response.headers["Retry-After"]) >= 1
        assert err.body["type"] == "rate_limit_exceeded" and err.body["code"] == "ModelBusyError"
    finally:
        StubLLM.step_delay = 0.002
        s.stop()


def test_api_key_and_device_lost(fresh_device):
    s = ServerThread(ServerOptions(models=["stub-llm"], port=0, api_key="sekret",
                                   engine_config=stub_config(fresh_device)))
    try:
        bad = openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.chat.completions.create(model="stub-llm", messages=U)
        assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
        st, _, body = _http(s.url + "/models")
        assert st == 401
        _assert_openai_error(body)
        st, _, _ = _http(s.base + "/health")             # health needs no key
        assert st == 200
        st, _, body = _http(s.base + "/metrics")         # metrics do
        assert st == 401 and _assert_openai_error(body)["code"] == "invalid_api_key"
        wrong = ("Bearer sekre", "Bearer sekrett", "sekret", "Bearer s\u00e9kret".encode().decode("latin-1"))
        for auth in wrong:
            assert _http(s.base + "/metrics", headers={"Authorization": auth})[0] == 401
        assert _http(s.base + "/metrics", headers={"Authorization": "Bearer sekret"})[0] == 200
        good = openai.OpenAI(base_url=s.url, api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model="stub-llm", messages=U, max_tokens=1).choices
        StubLLM.lose_device_at_step = 1
        with pytest.raises(openai.APIStatusError) as ei:
            good.chat.completions.create(model="stub-llm", messages=U)
        assert ei.value.status_code == 503 and ei.value.body["type"] == "device_lost"
        with pytest.raises(openai.APIStatusError) as ei:
            good.chat.completions.create(model="stub-llm", messages=U)
        assert ei.value.status_code == 503
        st, _, body = _http(s.base + "/health")
        assert st == 503 and json.loads(body)["status"] == "device_lost"
    finally:
        StubLLM.lose_device_at_step = None
        s.stop()


def test_503_while_loading(device):
    StubLLM.load_delay = 0.5
    try:
        s = ServerThread(ServerOptions(models=["stub-llm"], port=0, engine_config=stub_config(device)),
                         wait_ready=None)
        st, _, body = _http(s.base + "/health")
        assert st == 503 and json.loads(body)["status"] == "loading"
        with pytest.raises(openai.APIStatusError) as ei:
            _client(s).chat.completions.create(model="stub-llm", messages=U)
        assert ei.value.status_code == 503 and "loading" in ei.value.body["message"]
        assert ei.value.response.headers["Retry-After"] == "5"
        s.wait_ready()
        assert _http(s.base + "/health")[0] == 200
    finally:
        StubLLM.load_delay = 0.0
        s.stop()


# --------------------------------------------------------------------------- the real default models
LLM_ID, EMB_ID = "SmolLM2-135M-Instruct-Q4_1", "all-MiniLM-L6-v2"
Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_server(request, device, smollm2_gguf, minilm_dir):
    from webgpu_engine.engine import EngineConfig
    # every pipeline compiled at load (test_correctness checks it) only where the test that times
    # /health during a generation runs in this session (make test's serial phase); elsewhere the
    # requests compile what they use
    timed = any(item.name == "test_real_health_answers_during_generation_and_disconnect_frees"
                for item in request.session.items)
    load = {"compile_at_load": timed}
    s = ServerThread(ServerOptions(models=[LLM_ID, EMB_ID], port=0, engine_config=EngineConfig(device=device),
                                   chat_opts=[load, load]))
    yield s
    s.stop()


@pytest.mark.slow
def test_real_models_over_http(real_server):
    c = _client(real_server, timeout=300)
    r = c.chat.completions.create(model=LLM_ID, messages=Q, temperature=0, max_tokens=8)
    assert "Paris" in r.choices[0].message.content and r.usage.completion_tokens <= 8
    s = c.chat.completions.create(model=LLM_ID, messages=Q, temperature=0, max_tokens=8, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == r.choices[0].message.content
    t = c.completions.create(model=LLM_ID, prompt="One, two, three,", temperature=0, max_tokens=3)
    assert t.choices[0].text and t.usage.completion_tokens == 3 and t.choices[0].finish_reason == "length"
    e = c.embeddings.create(model=EMB_ID, input=["a cat", "a kitten", "tax law"])
    v = [d.embedding for d in e.data]
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert len(v[0]) == 384 and dot(v[0], v[1]) > dot(v[0], v[2])
    assert sorted(m.id for m in c.models.list()) == sorted([LLM_ID, EMB_ID])


@pytest.mark.slow
@pytest.mark.serial
def test_real_health_answers_during_generation_and_disconnect_frees(real_server):
    c = _client(real_server, timeout=300)
    lm = real_server.engine.models[LLM_ID]
    stream = c.chat.completions.create(model=LLM_ID, messages=Q, temperature=0, max_tokens=64,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)                                   # generating now
    worst = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        assert _http(real_server.base + "/health")[0] == 200
        worst = max(worst, time.perf_counter() - t0)
    assert lm.lock.locked
    stream.close()                             # the client hangs up mid-generation
    t0 = time.perf_counter()
    while lm.lock.locked and time.perf_counter() - t0 < 5:
        time.sleep(0.01)
    freed = time.perf_counter() - t0
    assert freed < 1.0, f"lock held {freed:.2f}s after the disconnect"
    assert worst < 1.0, f"/health took {worst:.2f}s during a generation"


@pytest.mark.slow
async def test_real_concurrent_streams_fifo_with_embeddings(real_server):
    c = openai.AsyncOpenAI(base_url=real_server.url, api_key="none", max_retries=0, timeout=300)
    prompts = ["Name a fruit.", "Name a color."]
    refs = []
    for p in prompts:
        r = await c.chat.completions.create(model=LLM_ID, messages=[{"role": "user", "content": p}],
                                            temperature=0, max_tokens=3)
        refs.append(r.choices[0].message.content)
    done = []

    async def chat(i):
        s = await c.chat.completions.create(model=LLM_ID, temperature=0, max_tokens=3, stream=True,
                                            messages=[{"role": "user", "content": prompts[i % 2]}])
        text = "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
        done.append(f"chat{i}")
        return text

    async def emb(i):
        r = await c.embeddings.create(model=EMB_ID, input=f"passage {i}")
        done.append(f"emb{i}")
        return r
    tasks = []
    for i in range(8):
        tasks.append(asyncio.create_task(chat(i)))
        await asyncio.sleep(0.02)
    embs = [asyncio.create_task(emb(i)) for i in range(2)]
    outs = await asyncio.gather(*tasks)
    await asyncio.gather(*embs)
    await c.close()
    assert outs == [refs[i % 2] for i in range(8)]
    assert [d for d in done if d.startswith("chat")] == [f"chat{i}" for i in range(8)]
    assert max(done.index("emb0"), done.index("emb1")) < done.index("chat7")


@pytest.mark.slow
async def test_real_batched_streams_over_http(device, smollm2_gguf, minilm_dir):
    """The server with continuous batching (serve's default): concurrent streams each get the text
    they get alone, and /v1/models shows the batch."""
    from webgpu_engine.engine import EngineConfig
    s = ServerThread(ServerOptions(models=[LLM_ID], port=0, engine_config=EngineConfig(device=device),
                                   chat_opts=[{"max_num_sequences": 4, "context_window_size": 512,
                                               "compile_at_load": False}]))
    try:
        c = openai.AsyncOpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=300)
        prompts = ["Name a fruit.", "Name a color.", "What is 2+2?", "Say hi."]

        async def ask(p, stream):
            kw = dict(model=LLM_ID, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=8)
            if not stream:
                return (await c.chat.completions.create(**kw)).choices[0].message.content
            st = await c.chat.completions.create(**kw, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in st if ch.choices])
        alone = [await ask(p, False) for p in prompts]
        assert await asyncio.gather(*[ask(p, True) for p in prompts]) == alone
        (m,) = (await c.models.list()).data
        batching = m.model_extra["batching"]
        assert batching["max_num_sequences"] == 4 and batching["running"] == 0
        assert batching["decode_rows"] > batching["iterations"] > 0     # rows shared iterations
        await c.close()
    finally:
        s.stop()


# --------------------------------------------------------------------------- SIGTERM (stub)
_SERVE = """
import sys
sys.path.insert(0, {tests!r})
from stub_pipelines import StubLLM, stub_config
from webgpu_engine.gpu import request_device_sync
from webgpu_engine.server.app import ServerOptions, run_server
StubLLM.step_delay = {step}
run_server(ServerOptions(models=["stub-llm"], port={port}, shutdown_grace_s={grace}, log_level="WARNING",
                         engine_config=stub_config(request_device_sync())))
"""


def _serve_stub(step: float, grace: float):
    import socket
    import subprocess
    import sys
    from pathlib import Path
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = _SERVE.format(tests=str(Path(__file__).parent), step=step, port=port, grace=grace)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        try:
            if _http(base + "/health")[0] == 200:
                return proc, base
        except OSError:
            pass
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() - t0 < 60, "stub server did not start"
        time.sleep(0.1)


def _stream_then_sigterm(proc, base):
    """Start a stream, SIGTERM the server after its first event; (events, seconds until exit)."""
    import signal
    body = json.dumps({"model": "stub-llm", "messages": U, "stream": True}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=30) as r:
        events.append(r.readline())
        proc.send_signal(signal.SIGTERM)
        t0 = time.perf_counter()
        try:
            for line in r:
                if line.strip():
                    events.append(line)
        except (ConnectionError, http.client.IncompleteRead):
            pass                              # cut off at the end of the grace period
    proc.wait(timeout=30)
    return events, time.perf_counter() - t0


def test_sigterm_drains_in_flight_requests_then_exits():
    # 9 words at 0.15 s each finish well inside a 10 s grace: the stream completes, then the exit
    proc, base = _serve_stub(step=0.15, grace=10)
    try:
        events, took = _stream_then_sigterm(proc, base)
    finally:
        proc.kill()
    assert events[-1].strip() == b"data: [DONE]"
    assert b'"finish_reason":"stop"' in events[-2]
    assert proc.returncode == 0 and took < 5, (proc.returncode, took)
    # 9 words at 1 s each outlast a 1 s grace: the server exits soon after it, cutting the stream
    proc, base = _serve_stub(step=1.0, grace=1.0)
    try:
        events, took = _stream_then_sigterm(proc, base)
    finally:
        proc.kill()
    assert b"data: [DONE]" not in b"".join(events)
    assert took < 5, took
