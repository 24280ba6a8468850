"""Structured output on the real adapter with a tiny random-weight model (unconstrained it writes
noise, so every valid answer is the grammar's doing): 20 JSON Schemas validated with `jsonschema`,
greedy and sampled; JSON mode; GBNF, Lark and regex grammars re-parsed; typed errors before the
lock; forced tool calls whose arguments validate; the grammar times in usage.extra."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.engine import EngineConfig, create_mlc_engine
from webgpu_engine.protocol import structured as S

U = [{"role": "user", "content": "Answer in JSON."}]
STR = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    obj({"a": INT}),
    obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"colour": {"enum": ["red", "green", "blue"]}}),
    obj({"x": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    obj({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}}),
    obj({"pair": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}}),
    obj({"inner": obj({"v": INT, "w": {"enum": [1, 2, 3]}})}),
    obj({"outer": obj({"mid": obj({"leaf": {"type": "boolean"}})})}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"id": {"anyOf": [INT, {"type": "string", "pattern": "^id[0-9]$"}]}}),
    obj({"a": INT, "b": STR, "c": {"type": "boolean"}}, required=["a"]),
    obj({"kind": {"const": "point"}, "xy": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}}),
    obj({"items": {"type": "array", "items": obj({"k": {"enum": ["p", "q"]}, "n": INT}), "maxItems": 2}}),
    obj({"maybe": {"anyOf": [{"type": "null"}, INT]}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"}}),
    obj({"level": {"type": "integer", "minimum": 1, "maximum": 5}, "label": {"enum": ["lo", "hi"]}}),
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 4},
    obj({"score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.125},
         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}, required=["score"]),
    obj({"user": obj({"name": STR, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]},
                                             "minItems": 1, "maxItems": 2}}),
         "active": {"type": "boolean"}}),
]


@pytest.fixture(scope="module")
async def engine(device, tmp_path_factory):
    path = tmp_path_factory.mktemp("structured") / "tiny-structured.gguf"
    write_tiny_llama_gguf(path, context_length=1024)
    eng = await create_mlc_engine(str(path), EngineConfig(device=device))
    yield eng
    await eng.unload()


async def chat(engine, **kw):
    kw.setdefault("max_tokens", 80)
    return await engine.chat.completions.create(messages=kw.pop("messages", U), **kw)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
async def test_json_schema_output_validates(engine, i):
    schema = SCHEMAS[i]
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=i), dict(temperature=1.5, top_p=0.9, seed=i)):
        r = await chat(engine, response_format=rf, **kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (kw, text)
        jsonschema.validate(json.loads(text), schema)


async def test_properties_come_in_the_schema_order(engine):
    for props in (["zeta", "alpha", "mid"], ["alpha", "mid", "zeta"]):
        schema = obj({k: {"enum": [1, 2]} for k in props})
        r = await chat(engine, response_format={"type": "json_object", "schema": schema}, temperature=0)
        assert list(json.loads(r.choices[0].message.content)) == props


async def test_unconstrained_tiny_model_writes_no_json(engine):
    r = await chat(engine, temperature=0, max_tokens=30)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


async def test_json_mode_and_webllm_schema_form(engine):
    r = await chat(engine, response_format={"type": "json_object"}, temperature=1.0, seed=5, max_tokens=150)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                          # a long random object: still a valid prefix of one
        assert r.choices[0].message.content.startswith("{")
    schema = SCHEMAS[3]
    r = await chat(engine, response_format={"type": "json_object", "schema": json.dumps(schema)},
                   temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    extra = r.usage.extra
    assert extra.grammar_init_s >= 0 and 0 < extra.grammar_per_token_s < 1


async def test_gbnf_lark_and_regex_constrain_exactly(engine):
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9] [0-9]?'
    lark = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[1-9][0-9]?/'
    regex = r"[a-c]{2,5}@[0-9]{3}\.(com|org)"
    seen = set()
    for seed in range(4):
        kw = dict(temperature=1.0, seed=seed)
        a = (await chat(engine, response_format={"type": "grammar", "grammar": gbnf}, **kw)).choices[0]
        assert re.fullmatch(r"yes|no|maybe [0-9][0-9]?", a.message.content) and a.finish_reason == "stop"
        b = (await chat(engine, response_format={"type": "grammar", "grammar": lark}, max_tokens=40,
                        **kw)).choices[0]
        if b.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", b.message.content), b.message.content
        else:
            assert re.match(r"\([1-9][0-9]?(,[1-9][0-9]?)*,?[0-9]*$", b.message.content), b.message.content
        c = (await chat(engine, response_format={"type": "regex", "regex": regex}, **kw)).choices[0]
        assert re.fullmatch(regex, c.message.content) and c.finish_reason == "stop"
        seen.add((a.message.content, c.message.content))
    assert len(seen) > 1               # sampling still samples inside the grammar


@pytest.mark.parametrize("rf,err", [
    ({"type": "grammar", "grammar": "root ::= undefined_rule"}, S.InvalidResponseFormatGrammarError),
    ({"type": "grammar", "grammar": 'root ::= "a'}, S.InvalidResponseFormatGrammarError),
    ({"type": "regex", "regex": "a(b"}, S.InvalidResponseFormatRegexError),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectt"}}},
     S.InvalidResponseFormatError),
    ({"type": "json_object", "schema": {"$ref": "#/nowhere"}}, S.InvalidResponseFormatError),
])
async def test_invalid_grammars_fail_before_the_lock_and_engine_stays_usable(engine, rf, err):
    lm = next(iter(engine.models.values()))
    async with lm.lock:                # the model is busy: a bad grammar fails without waiting for it
        with pytest.raises(err) as e:
            await asyncio.wait_for(chat(engine, response_format=rf), 10)
    assert e.value.http_status == 400 and not lm.lock.locked
    r = await chat(engine, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMAS[2]}},
                   temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[2])


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": obj({"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}})}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": obj({"tz": INT})}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_forced_tool_calls_validate(engine, choice):
    for seed in range(3):
        r = await chat(engine, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=seed,
                       max_tokens=120, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        spec = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
        if isinstance(choice, dict):
            assert call["function"]["name"] == "get_time"
        jsonschema.validate(json.loads(call["function"]["arguments"]), spec["function"]["parameters"])
        assert call["id"].startswith("call_") and call["type"] == "function"


async def test_tool_calls_stream_as_deltas_and_results_feed_back(engine):
    s = await chat(engine, tools=[WEATHER], tool_choice="required", temperature=0, stream=True,
                   parallel_tool_calls=False, max_tokens=120)
    chunks = [c async for c in s]
    deltas = [c.choices[0].delta.to_dict() for c in chunks if c.choices]
    assert deltas[0]["role"] == "assistant"
    head = deltas[0]["tool_calls"][0]
    assert head["function"]["name"] == "get_weather" and head["function"]["arguments"] == "" and head["id"]
    # then the arguments, in fragments as they are generated
    frags = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:] if d.get("tool_calls")]
    assert len(frags) > 1 and all(d["tool_calls"][0]["index"] == 0 for d in deltas[1:] if d.get("tool_calls"))
    args = "".join(frags)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back in; the model answers (here: a constrained text)
    call = {"id": head["id"], "type": "function", "function": {"name": "get_weather", "arguments": args}}
    msgs = [*U, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": head["id"], "content": "{\"temp\": 21}"}]
    r = await chat(engine, messages=msgs, tools=[WEATHER], tool_choice="none",
                   response_format={"type": "regex", "regex": "It is [0-9]{2} degrees"}, temperature=0)
    assert re.fullmatch("It is [0-9]{2} degrees", r.choices[0].message.content)


# --------------------------------------------------------------------------- tool formats (no GPU)
from webgpu_engine.engine import tools as T  # noqa: E402
from webgpu_engine.loaders.chat_template import ChatTemplate  # noqa: E402

NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("fmt,text,content,calls", [
    (T.HERMES, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": 1}}\n</tool_call>', "Sure.",
     [("get_weather", {"city": "Rome"}), ("get_time", {"tz": 1})]),
    (T.HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"tz": 2}}\n</tool_call>\n<tool_call>\n{"na',
     None, [("get_time", {"tz": 2})]),                                    # cut short: the whole calls
    (T.LLAMA3, '{"name": "get_time", "parameters": {"tz": 3}}; {"name": "get_weather", "parameters": {}}',
     None, [("get_time", {"tz": 3}), ("get_weather", {})]),
    (T.LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": "{\\"tz\\": 4}"}', None,
     [("get_time", {"tz": 4})]),
    (T.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {"tz": 5}}]', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": 5})]),
    (T.HERMES, "No tools needed: 42.", "No tools needed: 42.", []),
    (T.LLAMA3, '{"answer": 42}', '{"answer": 42}', []),                   # JSON, but not a call
    (T.HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),   # unknown function
    (T.MISTRAL, "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
])
def test_tool_call_parsing(fmt, text, content, calls):
    got_content, got = T.parse_tool_calls(text, fmt, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert len({c["id"] for c in got}) == len(got)


def test_tool_grammars_of_every_format_constrain_the_text(engine):
    pipe = next(iter(engine.models.values())).pipeline
    tools = [WEATHER, TIME]
    for fmt, good, bad in [
        (T.HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"tz": 3}}\n</tool_call>',
         '<tool_call>\n{"name": "get_time", "arguments": {"tz": 99}}\n</tool_call>'),
        (T.LLAMA3, '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}; '
                   '{"name": "get_time", "parameters": {"tz": 0}}',
         '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}'),
        (T.MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": -4}}]',
         '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "x"}}]'),
    ]:
        g = pipe.grammars.compile(T.tool_grammar(tools, "required", fmt, parallel=True))
        tok = pipe.tokenizer
        for text, ok in ((good, True), (bad, False)):
            m = g.matcher()
            accepted = all(m.consume(t) for t in tok.encode(text, parse_special=False))
            assert (accepted and m.accepting) == ok, (fmt, text)


def test_templates_that_render_tools_get_them_and_others_get_a_system_prompt():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "windy"}]
    aware = ChatTemplate("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                         "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}")
    out, kw = T.prepare_messages(msgs, [WEATHER], aware)
    assert out == msgs and kw == {"tools": [WEATHER]}
    assert aware.render(out, **kw).startswith("get_weather;user:weather?|")
    plain = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}")
    out, kw = T.prepare_messages(msgs, [WEATHER], plain)
    assert kw == {} and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
                                 '\n</tool_call>')
    assert out[3]["content"].count("<tool_response>") == 2 and "sunny" in out[3]["content"]


def test_page_modules_import_without_compiled_dependencies():
    """The browser constraint: the structured-output code imports with llguidance, numpy, pydantic
    and wgpu unimportable (a constrained request then fails with FeatureSupportError)."""
    from page_imports import run_without_compiled
    r = run_without_compiled("""
from webgpu_engine.pipelines import grammar, llm
from webgpu_engine.engine import tools, requests
from webgpu_engine.protocol import structured, rules
from webgpu_engine.kernels import logit_mask
from webgpu_engine.errors import FeatureSupportError
try:
    grammar.GrammarCompiler(None, 8, [0]).compile({'type': 'regex', 'regex': 'a+'})
except FeatureSupportError as e:
    print('refused', e.feature)
""")
    assert r.returncode == 0 and r.stdout.strip() == "refused llguidance", r.stderr[-2000:]


async def test_bad_tool_definitions_are_400_naming_tools(engine):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(Exception) as e:
        await chat(engine, tools=[bad], tool_choice="required")
    assert e.value.http_status == 400 and e.value.param == "tools" and "parameters" in str(e.value)
    for name in ("", "has space", "x" * 65):
        with pytest.raises(S.FieldTypeError):
            await chat(engine, tools=[{"type": "function", "function": {"name": name}}])
    with pytest.raises(S.FieldTypeError, match="JSON Schema object") as e:
        await chat(engine, tools=[{"type": "function", "function": {"name": "g", "parameters": [1]}}])
    assert e.value.param == "tools[0].function.parameters"
    with pytest.raises(S.FieldTypeError, match="unique"):
        await chat(engine, tools=[WEATHER, WEATHER])


@pytest.mark.parametrize("fmt,text,safe", [
    (T.HERMES, "Let me check.", 13),
    (T.HERMES, "Let me check. <tool", 14),                 # a tail that may become the marker
    (T.HERMES, "Let me check. <tool_call>\n{\"na", 14),
    (T.HERMES, "a < b", 5),
    (T.MISTRAL, "[TOOL_CALLS][{", 0),
    (T.MISTRAL, "Sure [TOOL", 5),
    (T.LLAMA3, "  {\"name\"", 0),
    (T.LLAMA3, "<|python", 0),
    (T.LLAMA3, "The answer", 10),
])
def test_streaming_holds_back_only_what_may_be_a_call(fmt, text, safe):
    assert T.ToolContext(fmt, NAMES, False).safe_prefix(text) == safe
