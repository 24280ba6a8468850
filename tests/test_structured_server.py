"""Structured output and tool calling through the server with the official `openai` client (tiny
random model: only the grammar makes its answers parse): response_format json_schema,
`chat.completions.parse` with a pydantic model, forced tool calls and their streamed deltas, 400s
for bad grammars; and the browser case (no llguidance) as FeatureSupportError."""
from __future__ import annotations

import json
import sys
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.engine import EngineConfig
from webgpu_engine.server.app import ServerOptions, ServerThread

U = [{"role": "user", "content": "Answer in JSON."}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather forecast",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]


class Step(BaseModel):
    action: Literal["go", "stop", "wait"]
    count: int = Field(ge=0, le=9)


class Plan(BaseModel):
    steps: list[Step] = Field(min_length=1, max_length=2)
    done: bool


@pytest.fixture(scope="module")
def server(device, tmp_path_factory):
    path = tmp_path_factory.mktemp("structured-server") / "tiny-served.gguf"
    write_tiny_llama_gguf(path, context_length=1024, seed=3)
    s = ServerThread(ServerOptions(models=[str(path)], port=0, engine_config=EngineConfig(device=device)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    return c, c.models.list().data[0].id


def test_json_schema_and_parse_with_pydantic(client):
    c, model = client
    for seed in range(3):
        r = c.chat.completions.create(model=model, messages=U, temperature=1.0, seed=seed, max_tokens=60,
                                      response_format={"type": "json_schema", "json_schema": {
                                          "name": "trip", "schema": CITY, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
        assert r.usage.model_extra["extra"]["grammar_per_token_s"] > 0
    p = c.chat.completions.parse(model=model, messages=U, response_format=Plan, temperature=1.0, seed=1,
                                 max_tokens=100)
    plan = p.choices[0].message.parsed
    assert isinstance(plan, Plan) and 1 <= len(plan.steps) <= 2


def test_forced_tool_calls_through_the_client(client):
    c, model = client
    r = c.chat.completions.create(model=model, messages=U, tools=TOOLS, tool_choice="required",
                                  temperature=0.8, seed=2, max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    named = {"type": "function", "function": {"name": "forecast"}}
    s = c.chat.completions.create(model=model, messages=U, tools=TOOLS, tool_choice=named, temperature=0,
                                  max_tokens=100, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in s:                    # accumulate deltas as OpenAI's docs show
        for tc in chunk.choices[0].delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            acc["name"] += tc.function.name or ""
            acc["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "forecast"
    jsonschema.validate(json.loads(calls[0]["arguments"]), CITY)


def test_bad_grammars_are_400(client):
    c, model = client
    for rf in ({"type": "grammar", "grammar": "root ::= nothing"},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
               {"type": "regex", "regex": "(("}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=U, response_format=rf)
        assert "response_format" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=U, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "missing"}})
    r = c.chat.completions.create(model=model, messages=U, max_tokens=3)     # still serving
    assert r.usage.completion_tokens <= 3


def test_without_llguidance_constrained_fields_are_feature_support_errors(monkeypatch):
    from webgpu_engine.errors import FeatureSupportError
    from webgpu_engine.pipelines.grammar import GrammarCompiler
    monkeypatch.setitem(sys.modules, "llguidance", None)     # as in the browser: the import fails
    with pytest.raises(FeatureSupportError) as e:
        GrammarCompiler(None, 10, [0]).compile({"type": "json_object"})
    assert "llguidance" in str(e.value) and e.value.http_status == 400 and e.value.feature == "llguidance"


# --------------------------------------------------------------------------- the default chat model
SMOL = "SmolLM2-135M-Instruct-Q4_1"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def smol(device, smollm2_gguf):
    # compile_at_load off: a faster load (the tests assert on the answers, not on compiling)
    s = ServerThread(ServerOptions(models=[SMOL], port=0, engine_config=EngineConfig(device=device),
                                   chat_opts=[{"compile_at_load": False}]))
    yield openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=300)
    s.stop()


@pytest.mark.slow
def test_smollm2_json_mode_and_tool_round_trip(smol):
    q = [{"role": "user", "content": "Give the capital of France and its population as JSON with keys "
                                     "city and population."}]
    r = smol.chat.completions.create(model=SMOL, messages=q, temperature=0, max_tokens=60,
                                     response_format={"type": "json_object"})
    answer = json.loads(r.choices[0].message.content)
    assert isinstance(answer, dict) and answer.get("city") == "Paris", answer
    # call → tool message → final answer
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = smol.chat.completions.create(model=SMOL, messages=q, tools=WEATHER, tool_choice="required",
                                     temperature=0, max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    q += [r.choices[0].message.model_dump(exclude_none=True),
          {"role": "tool", "tool_call_id": call.id,
           "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
    r = smol.chat.completions.create(model=SMOL, messages=q, tools=WEATHER, temperature=0, max_tokens=40)
    final = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not final.tool_calls
    assert "sunny" in final.content.lower() or "18" in final.content, final.content


def test_cli_json_schema_and_tool_round_trip(tmp_path_factory):
    import os
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    path = tmp_path_factory.mktemp("structured-cli") / "tiny-cli.gguf"
    write_tiny_llama_gguf(path, context_length=1024, seed=4)
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}

    def run(*args, stdin=""):
        r = subprocess.run([sys.executable, "-m", "webgpu_engine", "chat", "--quiet", "--model", str(path),
                            "--max-tokens", "150", "--temperature", "0",
                            "--chat-opts", '{"compile_at_load": false}', *args], cwd=root, env=env,
                           input=stdin, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout
    out = run("--json-schema", json.dumps(CITY), "Plan a trip.")
    jsonschema.validate(json.loads(out), CITY)
    out = run("--tools", json.dumps(TOOLS[:1]), "--tool-choice", "required", "Weather?",
              stdin='{"sky": "sunny"}\n')
    lines = out.splitlines()
    call = next(ln for ln in lines if ln.startswith("[tool call] forecast("))
    jsonschema.validate(json.loads(call[len("[tool call] forecast("):-1]), CITY)
    assert any(ln.startswith("result of forecast> ") and "sunny" in ln for ln in lines)
