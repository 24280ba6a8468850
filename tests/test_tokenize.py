"""GET /v1/models/{id} and the tokenizer routes (POST /tokenize, /detokenize) on the real server with a
tiny chat model and a tiny embedder, through the official openai client and plain HTTP."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tinymodels import write_tiny_bert, write_tiny_llama_gguf
from webgpu_engine.engine import EngineConfig, ModelRecord, default_app_config
from webgpu_engine.server.app import ServerOptions, ServerThread

TEXT = "Grüße aus Köln — 東京, naïve café 🙂"
CHAT, EMB = "tiny-chat", "tiny-emb"


@pytest.fixture(scope="module")
def server(device, tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenize")
    chat = write_tiny_llama_gguf(d / "chat.gguf", qtype="q8_0", context_length=256)["path"]
    emb = write_tiny_bert(d / "emb")["folder"]
    app = default_app_config().with_records(ModelRecord(CHAT, str(chat), "llm"),
                                            ModelRecord(EMB, str(emb), "embedding"))
    s = ServerThread(ServerOptions(models=[CHAT, EMB], port=0,
                                   chat_opts=[{"compile_at_load": False}, {"compile_at_load": False}],
                                   engine_config=EngineConfig(device=device, app_config=app)))
    yield s
    s.stop()


class Reply:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def post(server, path: str, body: dict) -> Reply:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode())


def test_models_retrieve(server):
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    listed = {m.id: m for m in c.models.list().data}
    got = c.models.retrieve(CHAT)
    assert got.id == CHAT and got.model_dump() == listed[CHAT].model_dump()
    assert got.model_dump()["context_window"] == 256 and got.model_dump()["model_type"] == "llm"
    assert c.models.retrieve(EMB).model_dump()["model_type"] == "embedding"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


def test_tokenize_round_trips_non_ascii(server):
    r = post(server, "/tokenize", {"model": CHAT, "prompt": TEXT, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256
    back = post(server, "/detokenize", {"model": CHAT, "tokens": body["tokens"]}).json()
    assert back["prompt"] == TEXT == back["content"]
    # llama.cpp's field name for the text
    assert post(server, "/tokenize", {"model": CHAT, "content": TEXT, "add_special_tokens": False}).json() == body


def test_tokenize_messages_counts_what_a_chat_request_costs(server):
    msgs = [{"role": "user", "content": TEXT}]
    r = post(server, "/tokenize", {"model": CHAT, "messages": msgs})
    assert r.status_code == 200, r.text
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    done = c.chat.completions.create(model=CHAT, messages=msgs, max_tokens=1, temperature=0)
    assert r.json()["count"] == done.usage.prompt_tokens
    without = post(server, "/tokenize", {"model": CHAT, "messages": msgs, "add_generation_prompt": False}).json()
    assert 0 < without["count"] < r.json()["count"]       # the assistant header is left out


def test_tokenize_an_embedder_input(server):
    r = post(server, "/tokenize", {"model": EMB, "prompt": "hello world"})
    assert r.status_code == 200, r.text
    with_special, plain = r.json(), post(server, "/tokenize", {"model": EMB, "prompt": "hello world",
                                                               "add_special_tokens": False}).json()
    assert with_special["count"] == plain["count"] + 2          # [CLS] ... [SEP]
    assert with_special["max_model_len"] == 64


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": CHAT, "prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {"model": CHAT}, "prompt"),
    ("/tokenize", {"model": CHAT, "prompt": 5}, "prompt"),
    ("/tokenize", {"model": CHAT, "prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"model": CHAT, "messages": "hi"}, None),
    ("/tokenize", {"model": EMB, "messages": [{"role": "user", "content": "a"}]}, "messages"),
    ("/detokenize", {"model": CHAT, "tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"model": CHAT, "tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"model": CHAT, "tokens": "1 2"}, "tokens"),
    ("/detokenize", {"model": CHAT, "tokens": [1, True]}, "tokens"),
])
def test_bad_input_gets_a_typed_400(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_unknown_model_is_refused(server):
    r = post(server, "/detokenize", {"model": "no-such-model", "tokens": [1]})
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"]


def test_a_developer_message_is_a_system_message(server):
    """OpenAI's `developer` role (what newer clients send for instructions) is the system message."""
    from webgpu_engine.protocol.rules import check_chat_request
    dev = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
    sys_ = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
    assert check_chat_request({"messages": dev})["messages"] == check_chat_request({"messages": sys_})["messages"]
    a = post(server, "/tokenize", {"model": CHAT, "messages": dev})
    assert a.status_code == 200, a.text
    assert a.json() == post(server, "/tokenize", {"model": CHAT, "messages": sys_}).json()
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    r = c.chat.completions.create(model=CHAT, messages=dev, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == a.json()["count"]
