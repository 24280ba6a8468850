"""OpenAI's Responses API (/v1/responses) on the real server with the default chat model, through the
official openai client: the same greedy answer as the chat route, streamed events, a tool-call round
trip, previous_response_id, the bounded store, responses.parse, refusals by name and bad input."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from pydantic import BaseModel

from webgpu_engine.engine import EngineConfig
from webgpu_engine.errors import RequestTimeoutError
from webgpu_engine.protocol.errors import UnsupportedFieldsError
from webgpu_engine.protocol.responses import (
    ResponseCreateRequest,
    chat_request,
    check_responses_request,
    new_response,
    to_chat_messages,
)
from page_imports import run_without_compiled
from stub_pipelines import StubChatStream
from webgpu_engine.server.app import ServerOptions, ServerThread

LLM_ID = "SmolLM2-135M-Instruct-Q4_1"
STORE = 2
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def server(device, smollm2_gguf):
    s = ServerThread(ServerOptions(models=[LLM_ID], port=0, chat_opts=[{"context_window_size": 1024, "compile_at_load": False}],
                                   engine_config=EngineConfig(device=device, responses_store_size=STORE)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def post(server, body) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + "/responses", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_answer(client, messages, max_tokens):
    return client.chat.completions.create(model=LLM_ID, messages=messages, temperature=0, max_tokens=max_tokens)


Q = "What is the capital of France?"        # SmolLM2 answers it greedily in 8 tokens


def test_create_equals_chat_route(client):
    r = client.responses.create(input=Q, temperature=0, max_output_tokens=12, metadata={"k": "v"})
    c = chat_answer(client, [{"role": "user", "content": Q}], 12)
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert r.id.startswith("resp_") and r.object == "response" and r.model == LLM_ID
    msg = r.output[0]
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == "completed" and c.choices[0].finish_reason == "stop"
    assert r.max_output_tokens == 12 and r.temperature == 0 and r.metadata == {"k": "v"} and r.store is True


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(input=Q, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3


def test_stream_assembles_to_chat_answer(client):
    chat = chat_answer(client, [{"role": "user", "content": Q}], 12).choices[0].message.content
    with client.responses.stream(model=LLM_ID, input=Q, temperature=0, max_output_tokens=12) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == chat == final.output_text
    for t in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert t in types
    assert client.responses.retrieve(final.id).output_text == chat     # streamed responses are stored


def test_tool_call_round_trip(client):
    """A forced call, streamed: function_call events -> its call_id answered with a
    function_call_output continuing the stored response -> a message."""
    with client.responses.stream(model=LLM_ID, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0, max_output_tokens=48) as s:
        events = list(s)
        first = s.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("fc_")
    args = json.loads(calls[0].arguments)
    assert isinstance(args.get("city"), str)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments
    second = client.responses.create(
        previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert second.output and second.output[0].type == "message" and second.output_text
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    # the same turn with the full input instead of previous_response_id: the same answer
    again = client.responses.create(
        tools=[WEATHER], temperature=0, max_output_tokens=6, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert again.output_text == second.output_text


def test_previous_response_id_continues(client):
    first = client.responses.create(input="My name is Ada. Greet me.", temperature=0, max_output_tokens=8)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)
    history = [{"role": "user", "content": "My name is Ada. Greet me."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    c = chat_answer(client, history, 8)
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens > first.usage.input_tokens
    # the input items it answered, newest first (the chain's earlier turns included), paged
    listed = client.responses.input_items.list(second.id)
    texts = [(it.role, it.content[0].text) for it in listed.data]
    assert texts == [(m["role"], m["content"]) for m in reversed(history)] and not listed.has_more
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [it.content[0].text for it in page.data] == [history[0]["content"], first.output_text]
    assert page.has_more and page.data[0].id == listed.data[-1].id
    rest = client.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert [it.content[0].text for it in rest.data] == [history[2]["content"]]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, limit=101)


def test_store_retrieve_delete_and_eviction(client):
    r = client.responses.create(input="Hi", temperature=0, max_output_tokens=2)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    unstored = client.responses.create(input="Hi", temperature=0, max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Hi", previous_response_id=unstored.id, max_output_tokens=1)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    a, b = (client.responses.create(input="Hi", temperature=0, max_output_tokens=1).id for _ in range(STORE))
    client.responses.retrieve(a)                        # used: b is now the least recently used
    c = client.responses.create(input="Hi", temperature=0, max_output_tokens=1).id
    with pytest.raises(openai.NotFoundError):           # evicted from the store of STORE responses
        client.responses.retrieve(b)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Hi", previous_response_id=b, max_output_tokens=1)
    assert [client.responses.retrieve(i).id for i in (a, c)] == [a, c]


class City(BaseModel):
    city: str
    country: str


def test_parse_with_pydantic_model(client):
    r = client.responses.parse(model=LLM_ID, input="Name the capital of France and its country as JSON.", text_format=City,
                               temperature=0, max_output_tokens=40)
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, City) and r.output_parsed.city
    assert r.text.format.type == "json_schema"


def test_items_to_chat_messages():
    """No GPU: Responses items -> the chat messages the chat route gets, and the pydantic model runs
    the same rules."""
    req = check_responses_request({"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sun"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "developer", "content": "Now in French."}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    msgs = to_chat_messages(req["input"], "Answer in English.")
    assert msgs == [{"role": "system", "content": "Answer in English.\n\nBe brief."},
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Checking.", "tool_calls": [
                        {"id": c, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                        for c in ("c1", "c2")]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sun"},
                    {"role": "system", "content": "Now in French."}]
    chat = chat_request(req, msgs)
    assert chat["tools"][0]["function"]["name"] == "get_weather" and "type" not in chat["tools"][0]["function"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    off = check_responses_request({"input": "Hi", "reasoning": {"effort": "none"}})
    assert chat_request(off, to_chat_messages(off["input"]))["reasoning_effort"] == "none"
    assert ResponseCreateRequest(input="Hi").input == "Hi"
    with pytest.raises(UnsupportedFieldsError) as e:
        ResponseCreateRequest(input="Hi", background=True)
    assert e.value.param == "background"


async def _events(chat):
    from webgpu_engine.engine.responses import ResponseEventStream
    kept = []
    stream = ResponseEventStream(chat, new_response(check_responses_request({"input": "Hi"}), "resp_x", LLM_ID,
                                                    0, {}), keep=kept.append)
    events = [e async for e in stream]
    await stream.aclose()
    return events, kept


async def test_stream_reasoning_items():
    """No GPU: a thinking template's reasoning_content deltas become a reasoning item before the message."""
    events, kept = await _events(StubChatStream([{"reasoning_content": "Think"}, {"reasoning_content": "ing."},
                                              {"content": "Paris"}]))
    types = [e.type for e in events]
    assert types.count("response.reasoning_text.delta") == 2 and types[-1] == "response.completed"
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0].text == "Thinking." and done[0].output_index == 0
    out = kept[0]["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"] and out[0]["id"].startswith("rs_")
    assert out[1]["content"][0]["text"] == "Paris" and kept[0]["usage"]["output_tokens"] == 3


async def test_error_after_start_is_response_failed():
    """No GPU: an engine error after the first events ends the stream with response.failed."""
    chat = StubChatStream([{"role": "assistant", "content": "Par"}], RequestTimeoutError(1.0, "decode"))
    events, kept = await _events(chat)
    assert kept == []                                    # a failed response is not stored
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.failed"
    assert "response.output_text.delta" in types and chat.closed
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.output[0].content[0].text == "Par"


def test_page_imports_without_pydantic():
    """The browser constraint: the Responses engine and protocol import and translate with pydantic,
    aiohttp, numpy and wgpu unimportable (responses are attribute dicts there)."""
    r = run_without_compiled("""
from webgpu_engine.engine import responses
from webgpu_engine.protocol import responses as rp
req = rp.check_responses_request({'input': 'Hi', 'instructions': 'Be brief.'})
msgs = rp.to_chat_messages(req['input'], req['instructions'])
done = rp.finish(rp.new_response(req, 'resp_x', 'm', 0, {}), rp.output_items({'content': 'Hello'}, 'stop'), None, 'stop')
print(len(msgs), rp.response_object(done).output_text, hasattr(rp, 'ResponseCreateRequest'))
""")
    assert r.returncode == 0 and r.stdout.strip() == "2 Hello False", r.stderr[-2000:]


def test_python_engine(server):
    r = server.call(server.engine.responses.create(input="Hi", temperature=0, max_output_tokens=2))
    assert r.output_text == r.output[0].content[0].text and r.usage.output_tokens <= 2
    assert server.call(server.engine.responses.retrieve(r.id)).id == r.id


def test_sync_engine(device, tmp_path):
    """The blocking MLCEngine's responses (a tiny model): create, a stream of events, retrieve, delete."""
    from tinymodels import write_tiny_llama_gguf

    from webgpu_engine.engine import MLCEngine, ModelRecord, default_app_config
    from webgpu_engine.engine.responses import ResponseNotFoundError
    path = write_tiny_llama_gguf(tmp_path / "chat.gguf", qtype="q8_0", context_length=256)["path"]
    app = default_app_config().with_records(ModelRecord("tiny-chat", str(path), "llm"))
    with MLCEngine(EngineConfig(device=device, app_config=app)) as eng:
        eng.reload("tiny-chat", {"compile_at_load": False})
        r = eng.responses.create(input="Hi", temperature=0, max_output_tokens=3)
        assert r.usage.output_tokens == 3 and r.status == "incomplete"
        events = list(eng.responses.create(input="Hi", temperature=0, max_output_tokens=3, stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        assert eng.responses.retrieve(r.id).output_text == r.output_text
        eng.responses.delete(r.id)
        with pytest.raises(ResponseNotFoundError):
            eng.responses.retrieve(r.id)


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
])
def test_refused_by_name(server, extra, param):
    status, body = post(server, {"input": "Hi", "max_output_tokens": 1, **extra})
    assert status == 400 and body["error"]["param"] == param, body


@pytest.mark.parametrize("body,param", [
    ({"input": 42}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [{"type": "bogus"}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "Hi", "tools": {"a": 1}}, "tools"),
    ({"input": "Hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "Hi", "max_output_tokens": "x"}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": 5}, "temperature"),
    ({"input": "Hi", "metadata": {"k": 1}}, "metadata"),
    ({"input": "Hi", "store": "yes"}, "store"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "Hi", "model": "no-such-model"}, "model"),
])
def test_bad_input_is_a_typed_4xx(server, body, param):
    status, got = post(server, {"max_output_tokens": 1, **body})
    assert 400 <= status < 500 and got["error"]["param"] == param, got


def test_usable_after_bad_requests(client):
    assert client.responses.create(input="Hi", max_output_tokens=1).usage.output_tokens == 1
