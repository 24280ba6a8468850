"""Anthropic's Messages API (/v1/messages) on the real server with the default chat model, through the
official anthropic client: the same greedy text as the OpenAI chat route, a stream that assembles to
it, count_tokens equal to usage.input_tokens, stop sequences, a forced tool and a tool_result round
trip, an agent-style loop of tool turns, x-api-key, errors in Anthropic's shape, and the engine's
event stream for thinking and for an error after the start."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from webgpu_engine.engine import EngineConfig
from webgpu_engine.errors import RequestTimeoutError
from webgpu_engine.protocol import anthropic as ap
from webgpu_engine.protocol.errors import FieldTypeError, UnsupportedFieldsError
from page_imports import run_without_compiled
from stub_pipelines import StubChatStream
from webgpu_engine.server.app import ServerOptions, ServerThread

LLM_ID = "SmolLM2-135M-Instruct-Q4_1"
KEY = "sk-test-anthropic"
Q = "What is the capital of France?"        # SmolLM2 answers it greedily in 8 tokens
GREEDY = {"temperature": 0}    # the SDK's create has no sampling fields now: they go as extra_body
WEATHER = {"name": "get_weather", "description": "Current weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def server(device, smollm2_gguf):
    s = ServerThread(ServerOptions(models=[LLM_ID], port=0, api_key=KEY,
                                   chat_opts=[{"context_window_size": 1024, "compile_at_load": False}],
                                   engine_config=EngineConfig(device=device)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def post(server, path: str, body, headers=None) -> tuple[int, dict]:
    h = {"Content-Type": "application/json", "x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_create_equals_chat_route(client, oa):
    m = client.messages.create(model=LLM_ID, max_tokens=16, extra_body=GREEDY,
                               messages=[{"role": "user", "content": Q}], metadata={"user_id": "u1"})
    c = oa.chat.completions.create(model=LLM_ID, max_tokens=16, temperature=0,
                                   messages=[{"role": "user", "content": Q}])
    text = c.choices[0].message.content
    assert text and m.content[0].type == "text" and m.content[0].text == text
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == LLM_ID
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    n = client.messages.count_tokens(model=LLM_ID, messages=[{"role": "user", "content": Q}])
    assert n.input_tokens == m.usage.input_tokens


def test_system_and_blocks_and_max_tokens(client, oa):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in one word."}]
    m = client.messages.create(model=LLM_ID, max_tokens=3, extra_body=GREEDY, system=system,
                               messages=[{"role": "user", "content": [{"type": "text", "text": Q}]}])
    c = oa.chat.completions.create(model=LLM_ID, max_tokens=3, temperature=0, messages=[
        {"role": "system", "content": "You are terse.\n\nAnswer in one word."}, {"role": "user", "content": Q}])
    assert m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    n = client.messages.count_tokens(model=LLM_ID, system=system,
                                     messages=[{"role": "user", "content": [{"type": "text", "text": Q}]}])
    assert n.input_tokens == m.usage.input_tokens


def test_stop_sequence(client):
    full = client.messages.create(model=LLM_ID, max_tokens=16, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": Q}]).content[0].text
    word = full.split()[2]                  # a word inside the answer ends it there
    m = client.messages.create(model=LLM_ID, max_tokens=16, extra_body=GREEDY, stop_sequences=[word],
                               messages=[{"role": "user", "content": Q}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == full[:full.index(word)]
    with client.messages.stream(model=LLM_ID, max_tokens=16, extra_body=GREEDY, stop_sequences=[word],
                                messages=[{"role": "user", "content": Q}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    assert final.content[0].text == m.content[0].text


def test_stream_assembles_the_same_text(client):
    m = client.messages.create(model=LLM_ID, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": Q}])
    with client.messages.stream(model=LLM_ID, max_tokens=16, extra_body=GREEDY,
                                messages=[{"role": "user", "content": Q}]) as s:
        events = list(s)
        final = s.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "content_block_start" in types and "content_block_stop" in types and "message_delta" in types
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == m.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == m.usage.output_tokens
    assert events[0].message.usage.input_tokens == m.usage.input_tokens


def test_forced_tool_and_tool_result_round_trip(client):
    with client.messages.stream(model=LLM_ID, max_tokens=48, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "What is the weather in Paris?"}]) as s:
        events = list(s)
        first = s.get_final_message()
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    fragments = [e.delta.partial_json for e in events
                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert fragments and json.loads("".join(fragments)) == uses[0].input
    plain = client.messages.create(model=LLM_ID, max_tokens=48, extra_body=GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert [b.model_dump() for b in plain.content] == [b.model_dump() | {"id": plain.content[i].id}
                                                        for i, b in enumerate(first.content)]
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                           "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    second = client.messages.create(model=LLM_ID, max_tokens=12, extra_body=GREEDY, tools=[WEATHER], messages=turns)
    assert second.content and second.content[0].type == "text" and second.content[0].text
    assert second.usage.input_tokens > first.usage.input_tokens
    n = client.messages.count_tokens(model=LLM_ID, tools=[WEATHER], messages=turns)
    assert n.input_tokens == second.usage.input_tokens


def test_agent_loop_of_tool_turns(client):
    """An agent's loop: call tools while the model asks (tool_choice any for two turns), answer each
    call, then let it write the answer (tool_choice none); every turn is a valid conversation."""
    calc = {"name": "add", "description": "Add two integers.",
            "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                             "required": ["a", "b"]}}
    msgs = [{"role": "user", "content": "Add 2 and 3, then add 4 to the result."}]
    calls = 0
    for choice in ({"type": "any"}, {"type": "any"}, {"type": "none"}):
        m = client.messages.create(model=LLM_ID, max_tokens=40, extra_body=GREEDY, tools=[calc, WEATHER],
                                   tool_choice=choice, messages=msgs)
        msgs.append({"role": "assistant", "content": [b.model_dump() for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        if choice["type"] == "none":
            assert not uses and m.stop_reason in ("end_turn", "max_tokens") and m.content[0].text
            break
        assert uses and m.stop_reason == "tool_use"
        results = []
        for u in uses:
            calls += 1
            assert u.name in ("add", "get_weather")
            schema = calc if u.name == "add" else WEATHER
            jsonschema.validate(u.input, schema["input_schema"])
            out = str(u.input["a"] + u.input["b"]) if u.name == "add" else "sunny"
            results.append({"type": "tool_result", "tool_use_id": u.id, "content": out})
        msgs.append({"role": "user", "content": results})
    assert calls >= 2


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [LLM_ID] and models.data[0].type == "model"
    assert client.models.retrieve(LLM_ID).display_name == LLM_ID


def test_x_api_key_and_bearer(server):
    assert post(server, "/v1/messages/count_tokens", {"model": LLM_ID, "messages": [{"role": "user",
                                                                                     "content": "Hi"}]})[0] == 200
    st, body = post(server, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]},
                    headers={"x-api-key": "", "Authorization": f"Bearer {KEY}"})
    assert st == 200 and body["input_tokens"] > 0
    st, body = post(server, "/v1/messages", {"model": LLM_ID, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}]}, headers={"x-api-key": "wrong"})
    assert st == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body,etype,status", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "invalid_request_error", 400),      # no max_tokens
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}, "invalid_request_error", 400),
    ({"max_tokens": 4}, "invalid_request_error", 400),
    ({"max_tokens": 4, "messages": []}, "invalid_request_error", 400),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "Hi"}]}, "invalid_request_error", 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 7}]}, "invalid_request_error", 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "invalid_request_error", 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "invalid_request_error", 400),
    ({"max_tokens": 4, "temperature": 9, "messages": [{"role": "user", "content": "Hi"}]},
     "invalid_request_error", 400),
    ({"max_tokens": 4, "stop_sequences": "x", "messages": [{"role": "user", "content": "Hi"}]},
     "invalid_request_error", 400),
    ({"max_tokens": 4, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "Hi"}]},
     "invalid_request_error", 400),
    ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "Hi"}]}, "invalid_request_error", 400),
    ({"max_tokens": 4, "tool_choice": {"type": "tool", "name": "f"}, "messages": [{"role": "user", "content": "Hi"}]},
     "invalid_request_error", 400),
    ({"max_tokens": 4, "thinking": {"type": "on"}, "messages": [{"role": "user", "content": "Hi"}]},
     "invalid_request_error", 400),
    ({"max_tokens": 4, "model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]},
     "not_found_error", 404),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 50_000}]}, "invalid_request_error", 400),
])
def test_bad_requests_are_anthropic_errors(server, body, etype, status):
    st, got = post(server, "/v1/messages", {"model": LLM_ID, **body} if "model" not in body else body)
    assert st == status and got["type"] == "error" and got["error"]["type"] == etype, got
    assert isinstance(got["error"]["message"], str) and got["error"]["message"]


def test_client_raises_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=LLM_ID, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert LLM_ID in e.value.message and "image" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    # the engine is usable afterwards
    assert client.messages.create(model=LLM_ID, max_tokens=1, messages=[{"role": "user", "content": "Hi"}]).usage.output_tokens == 1


def test_body_errors_and_unknown_route_are_anthropic_errors(server):
    req = urllib.request.Request(server.base + "/v1/messages", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json", "x-api-key": KEY})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    got = json.loads(e.value.read())
    assert e.value.code == 400 and got["error"]["type"] == "invalid_request_error"


def test_translation():
    """No GPU: blocks to chat messages, tools and tool_choice, thinking, stop reasons."""
    chat = ap.chat_request({
        "model": "m", "max_tokens": 5, "system": "Be brief.", "stop_sequences": ["END"], "top_k": 3,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sun"},
                {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "rain"}],
                 "is_error": True},
                {"type": "text", "text": "Thanks. Ünïcödé ok?"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": t, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
            for t, c in (("t1", "Paris"), ("t2", "Oslo"))]},
        {"role": "tool", "tool_call_id": "t1", "content": "sun", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: rain", "name": "get_weather"},
        {"role": "user", "content": "Thanks. Ünïcödé ok?"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters":
                                                               WEATHER["input_schema"],
                                                               "description": WEATHER["description"]}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["enable_thinking"] is True and chat["stop"] == ["END"] and chat["top_k"] == 3
    assert ap.chat_request({"max_tokens": 1, "thinking": {"type": "disabled"},
                            "messages": [{"role": "user", "content": "x"}]})["enable_thinking"] is False
    forced = ap.chat_request({"max_tokens": 1, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
                              "messages": [{"role": "user", "content": "x"}]})
    assert forced["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert ap.stop_reason("stop", "END", ["END"]) == ("stop_sequence", "END")
    assert ap.stop_reason("stop", "<|im_end|>", ["END"]) == ("end_turn", None)
    assert ap.stop_reason("length", None, []) == ("max_tokens", None)
    assert ap.stop_reason("tool_calls", None, []) == ("tool_use", None)
    blocks = ap.content_blocks({"reasoning_content": "hm", "content": "Hi", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]})
    assert blocks == [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Hi"},
                      {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]
    with pytest.raises(FieldTypeError):
        ap.chat_request({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(UnsupportedFieldsError) as e:        # count_tokens takes no sampling fields
        ap.chat_request({"max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": "x"}]},
                        count_only=True)
    assert e.value.param == "max_tokens"


async def _events(chat) -> list[dict]:
    from webgpu_engine.engine.messages import MessageEventStream
    from webgpu_engine.protocol.objects import to_dict
    stream = MessageEventStream(chat, "msg_x", LLM_ID, [])
    events = [to_dict(e) async for e in stream]
    await stream.aclose()
    return events


async def test_stream_thinking_text_and_tool_blocks():
    """No GPU: reasoning_content, content and a tool call's argument fragments become three blocks
    in order, each started, filled and stopped; the thinking block gets its signature delta."""
    events = await _events(StubChatStream([
        {"reasoning_content": "Think"}, {"reasoning_content": "ing."}, {"content": "Let me check."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}], finish="tool_calls"))
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["thinking", "text", "tool_use"]
    assert starts[2]["id"] == "call_1" and starts[2]["name"] == "get_weather" and starts[2]["input"] == {}
    deltas = [(e["index"], e["delta"]) for e in events if e["type"] == "content_block_delta"]
    assert "".join(d["thinking"] for i, d in deltas if d["type"] == "thinking_delta") == "Thinking."
    assert [d["type"] for i, d in deltas if i == 0][-1] == "signature_delta"
    assert "".join(d["partial_json"] for i, d in deltas if d["type"] == "input_json_delta") == '{"city": "Paris"}'
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 6
    assert events[0]["message"]["usage"]["input_tokens"] == 5


async def test_error_after_start_is_an_error_event():
    chat = StubChatStream([{"content": "Par"}], RequestTimeoutError(1.0, "decode"))
    events = await _events(chat)
    assert [e["type"] for e in events][-1] == "error" and chat.closed
    assert events[-1]["error"]["type"] == "timeout_error" and events[-1]["error"]["message"]


def test_python_engine(server):
    m = server.call(server.engine.messages.create(model=LLM_ID, max_tokens=2, temperature=0,
                                                  messages=[{"role": "user", "content": "Hi"}]))
    assert m.usage.output_tokens <= 2 and m.content[0].type == "text"
    n = server.call(server.engine.messages.count_tokens(messages=[{"role": "user", "content": "Hi"}]))
    assert n == {"input_tokens": m.usage.input_tokens}


async def test_keep_alive_pings_while_the_model_is_quiet():
    """No GPU: a stream with 0.25 s between events gets pings between them; its own events arrive
    whole and in order, and closing it closes the stream under it."""
    import asyncio

    from webgpu_engine.server.messages import _KeepAlive

    class Slow:
        usage, closed = None, False

        def __init__(self):
            self._it = self._gen()

        async def _gen(self):
            for i in range(3):
                await asyncio.sleep(0.25)
                yield {"type": "content_block_delta", "i": i}

        def __aiter__(self):
            return self

        async def __anext__(self):
            return await self._it.__anext__()

        async def aclose(self):
            self.closed = True

    s = Slow()
    ka = _KeepAlive(s, 0.1)
    got = [e async for e in ka]
    await ka.aclose()
    assert [e["i"] for e in got if e["type"] != "ping"] == [0, 1, 2]
    assert sum(e["type"] == "ping" for e in got) >= 3 and s.closed


def test_page_imports_without_pydantic():
    """The browser constraint: the Messages engine and protocol import and translate with pydantic,
    aiohttp, numpy and wgpu unimportable (messages are attribute dicts there)."""
    r = run_without_compiled("""
from webgpu_engine.engine import messages
from webgpu_engine.protocol import anthropic as ap
from webgpu_engine.protocol.objects import to_object
chat = ap.chat_request({'max_tokens': 3, 'system': 'Be brief.', 'messages': [{'role': 'user', 'content': 'Hi'}]})
m = to_object(ap.message('msg_x', 'm', ap.content_blocks({'content': 'Hello'}), 'end_turn', None, ap.usage(3, 1)))
print(len(chat['messages']), m.content[0].text, m.usage.input_tokens)
""")
    assert r.returncode == 0 and r.stdout.strip() == "2 Hello 3", r.stderr[-2000:]
