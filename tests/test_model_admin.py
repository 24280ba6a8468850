"""Admin routes (server/admin.py, engine/manage.py): load and unload models on a running server, off
unless allowed, behind the API key; typed 4xx errors leave the loaded models serving. Stub pipelines
(the routes and the engine's bookkeeping), then a tiny BERT for a real load and the memory check."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from stub_pipelines import stub_config
from tinymodels import write_tiny_bert
from webgpu_engine.engine import EngineConfig
from webgpu_engine.server.app import ServerOptions, ServerThread

KEY = "admin-key"


def _post(server, path, body, key=KEY):
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(device):
    s = ServerThread(ServerOptions(models=["stub-llm"], port=0, api_key=KEY, allow_model_management=True,
                                   engine_config=stub_config(device)))
    yield s
    s.stop()


def _ids(server):
    c = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    return [m.id for m in c.models.list().data]


def test_load_and_unload_a_model_while_serving(server):
    c = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    status, body = _post(server, "/v1/models/load", {"model": "stub-emb"})
    assert status == 200 and body["id"] == "stub-emb" and body["model_type"] == "embedding", body
    assert _ids(server) == ["stub-llm", "stub-emb"]
    assert len(c.embeddings.create(model="stub-emb", input=["a", "bb"]).data) == 2
    assert c.chat.completions.create(model="stub-llm", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2).choices[0].message.content is not None
    # loaded twice: 409, and both keep serving
    status, body = _post(server, "/v1/models/load", {"model": "stub-emb"})
    assert status == 409 and "loaded already" in body["error"]["message"]
    status, body = _post(server, "/v1/models/unload", {"model": "stub-llm"})
    assert (status, body) == (200, {"id": "stub-llm", "object": "model", "deleted": True})
    assert _ids(server) == ["stub-emb"]
    assert server.engine.held.last_reload[0] == ["stub-emb"]      # what auto_recover would reload
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="stub-llm", messages=[{"role": "user", "content": "hi"}])
    assert len(c.embeddings.create(model="stub-emb", input="a").data) == 1
    status, body = _post(server, "/v1/models/load", {"model": "stub-llm", "model_id": "chatty",
                                                     "chat_opts": {"temperature": 0.0}})
    assert status == 200 and body["id"] == "chatty", body
    assert _ids(server) == ["stub-emb", "chatty"]
    assert c.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2).model == "chatty"


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/models/load", {}, 400, "model"),
    ("/v1/models/load", {"model": ""}, 400, "model"),
    ("/v1/models/load", {"model": "stub-emb", "chat_opts": "x"}, 400, "chat_opts"),
    ("/v1/models/load", {"model": "stub-emb", "extra": 1}, 400, "extra"),
    ("/v1/models/load", {"model": "stub-llm-2", "chat_opts": {"no_such_option": 1}}, 400, "chat_opts"),
    ("/v1/models/load", {"model": "./no/such/model.gguf"}, 404, None),
    ("/v1/models/load", {"model": "stub-needs-foo"}, 400, None),
    ("/v1/models/unload", {"model": "nope"}, 404, "model"),
    ("/v1/models/unload", {"model": 3}, 400, "model"),
])
def test_bad_requests_are_typed_and_leave_the_models_serving(server, path, body, status, param):
    before = _ids(server)
    got, err = _post(server, path, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    if param:
        assert err["error"]["param"] == param
    assert _ids(server) == before


def test_needs_the_key_and_the_flag(server, device):
    status, body = _post(server, "/v1/models/unload", {"model": "stub-emb"}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    off = ServerThread(ServerOptions(models=["stub-llm"], port=0, engine_config=stub_config(device)))
    try:
        for path in ("/v1/models/load", "/v1/models/unload"):
            status, body = _post(off, path, {"model": "stub-llm"}, key=None)
            assert status == 403 and "--allow-model-management" in body["error"]["message"]
        assert _ids(off) == ["stub-llm"]
    finally:
        off.stop()


def test_a_real_model_loads_at_run_time_and_the_memory_check_applies(tmp_path, device):
    write_tiny_bert(tmp_path / "tiny-a", hidden_size=32)
    write_tiny_bert(tmp_path / "tiny-b", hidden_size=32, seed=1)
    s = ServerThread(ServerOptions(models=[str(tmp_path / "tiny-a")], port=0, allow_model_management=True,
                                   engine_config=EngineConfig(device=device)))
    try:
        c = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
        a = c.embeddings.create(model="tiny-a", input="a cat").data[0].embedding
        held = device.allocated_bytes()                         # tiny-a with its result buffer
        status, body = _post(s, "/v1/models/load", {"model": str(tmp_path / "tiny-b")}, key=None)
        assert status == 200 and body["id"] == "tiny-b" and body["memory"]["allocated_bytes"] > 0, body
        b = c.embeddings.create(model="tiny-b", input="a cat").data[0].embedding
        assert len(a) == len(b) == 32 and a != b
        assert _post(s, "/v1/models/unload", {"model": "tiny-b"}, key=None)[0] == 200
        assert device.allocated_bytes() == held                 # its buffers are freed
        # the start-up memory check, against what the loaded model holds: refused, nothing allocated
        s.engine.config.max_memory_bytes = held + 1024
        status, body = _post(s, "/v1/models/load", {"model": str(tmp_path / "tiny-b")}, key=None)
        assert status == 507 and body["error"]["code"] == "GPUOutOfMemoryError", body   # as at start-up
        assert "tiny-b needs" in body["error"]["message"]
        assert device.allocated_bytes() == held and _ids(s) == ["tiny-a"]
    finally:
        s.stop()
