"""ChatConfig.updated checks each chat_opts value against its field's type, and the typed error
(ChatOptionTypeError, 400, naming the field, the expected type and the value) reaches users of every
entry point: engine.reload, the server's admin load route, and the command line's --chat-opts."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from stub_pipelines import stub_config
from webgpu_engine import errors as E
from webgpu_engine.config import ChatConfig
from webgpu_engine.engine import AsyncMLCEngine
from webgpu_engine.server.app import ServerOptions, ServerThread


# --------------------------------------------------------------------------- the checks
def test_values_of_the_right_type_are_taken():
    c = ChatConfig().updated({"temperature": 0, "top_p": 0.5, "context_window_size": 512, "dtype": "f32",
                              "stop_str": ["###"], "stop_token_ids": (2, 3), "system_message": None,
                              "max_seq_length": 128, "matryoshka": False, "compile_at_load": False,
                              "max_num_sequences": 4, "kv_block_size": 32})
    assert c.temperature == 0.0 and isinstance(c.temperature, float)      # an int is a number
    assert c.stop_token_ids == [2, 3] and c.stop_str == ["###"]          # a tuple becomes a list
    assert (c.context_window_size, c.dtype, c.max_seq_length, c.matryoshka) == (512, "f32", 128, False)
    assert (c.max_num_sequences, c.kv_block_size, c.compile_at_load) == (4, 32, False)
    assert ChatConfig().updated({"system_message": "Be brief.", "max_seq_length": None}).system_message == "Be brief."
    assert ChatConfig().updated(None) == ChatConfig().updated({}) == ChatConfig()


@pytest.mark.parametrize("field, value, expected", [
    ("temperature", "hot", "a finite number"),
    ("temperature", True, "a finite number"),                # a bool is not a number
    ("top_p", float("nan"), "a finite number"),
    ("context_window_size", 4096.0, "an integer"),           # a float is not an int
    ("context_window_size", False, "an integer"),
    ("max_num_sequences", "4", "an integer"),
    ("kv_block_size", None, "an integer"),
    ("dtype", 16, "a string"),
    ("stop_str", "###", "a list of strings"),
    ("stop_str", ["a", 1], "a list of strings"),
    ("stop_token_ids", [2, True], "a list of integers"),
    ("stop_token_ids", [2.0], "a list of integers"),
    ("system_message", 3, "a string or null"),
    ("max_seq_length", "128", "an integer or null"),
    ("matryoshka", 1, "a boolean (true or false) or null"),
    ("compile_at_load", "yes", "a boolean (true or false)"),
])
def test_a_value_of_the_wrong_type_is_named(field, value, expected):
    with pytest.raises(E.ChatOptionTypeError) as ei:
        ChatConfig().updated({"temperature": 0.5, field: value})
    e = ei.value
    assert isinstance(e, E.InvalidRequestError) and e.http_status == 400
    assert (e.param, e.name, e.expected) == (field, field, expected)
    assert e.value is value or e.value == value
    assert str(e).startswith(f"chat_opts {field} must be {expected}, got {value!r} ({type(value).__name__})")


def test_unknown_fields_are_named():
    with pytest.raises(E.UnknownChatOptionError, match=r"Unknown chat_opts fields \['no_a', 'no_b'\]") as ei:
        ChatConfig().updated({"no_b": 1, "no_a": 2, "temperature": 0.1})
    assert ei.value.param == "chat_opts" and ei.value.http_status == 400
    assert "kv_block_size" in str(ei.value) and "max_num_sequences" in str(ei.value)


# --------------------------------------------------------------------------- where users meet it
async def test_reload_raises_the_typed_error_and_allocates_nothing(device):
    engine = AsyncMLCEngine(stub_config(device))
    with pytest.raises(E.ChatOptionTypeError, match="chat_opts temperature must be a finite number, got 'hot'"):
        await engine.reload("stub-llm", {"temperature": "hot"})
    with pytest.raises(E.ChatOptionTypeError, match="max_batch_size must be an integer"):
        await engine.reload(["stub-llm", "stub-emb"], [None, {"max_batch_size": 8.5}])
    assert not engine.models
    assert device.allocated_bytes("model:stub-llm") == 0 and device.allocated_bytes("model:stub-emb") == 0
    await engine.reload("stub-llm", {"temperature": 1})
    assert engine.models["stub-llm"].chat_config.temperature == 1.0
    await engine.unload()


def _post(server, path, body):
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_admin_load_route_answers_400_naming_the_field(device):
    s = ServerThread(ServerOptions(models=["stub-llm"], port=0, allow_model_management=True,
                                   engine_config=stub_config(device)))
    try:
        status, body = _post(s, "/v1/models/load", {"model": "stub-emb", "chat_opts": {"max_batch_size": "8"}})
        assert status == 400, body
        err = body["error"]
        assert (err["type"], err["param"]) == ("invalid_request_error", "max_batch_size")
        assert err["message"].startswith("chat_opts max_batch_size must be an integer, got '8' (str)")
        status, body = _post(s, "/v1/models/load", {"model": "stub-emb", "chat_opts": {"stop_str": "x"}})
        assert status == 400 and body["error"]["param"] == "stop_str"
        assert list(s.engine.models) == ["stub-llm"]                 # still serving what it served
        assert _post(s, "/v1/models/load", {"model": "stub-emb", "chat_opts": {"max_batch_size": 8}})[0] == 200
    finally:
        s.stop()


def test_the_command_line_prints_the_error_and_exits_non_zero(tmp_path):
    from test_cli import run
    from tinymodels import write_tiny_bert
    folder = write_tiny_bert(tmp_path / "tiny-bert")["folder"]
    p = run("embed", "--quiet", "--model", str(folder), "--chat-opts", '{"max_batch_size": "8"}', "hi")
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == ("error: chat_opts max_batch_size must be an integer, got '8' (str).")
    p = run("embed", "--quiet", "--model", str(folder), "--chat-opts", '{"temperature": true}', "hi")
    assert p.returncode == 1 and "chat_opts temperature must be a finite number, got True (bool)" in p.stderr
