"""Request fields clients send, on the real server through the official openai client: top_k and
min_p (a scheduler of one slot and of several), 20 top logprobs, the end-of-turn token never listed in
logprobs, the developer role, a final assistant message continued, reasoning output split from the
answer (a tiny model with a thinking template; Ollama's `think` and Anthropic's `thinking` too),
tool-call arguments streamed in fragments. The
answer parser (engine/output.py) is also checked alone on fixed texts cut at every point."""
from __future__ import annotations

import json
import random

import openai
import pytest

from tinymodels import EOS_ID, write_tiny_llama_gguf
from webgpu_engine.engine import EngineConfig, ModelRecord, default_app_config
from webgpu_engine.engine.output import OutputParser
from webgpu_engine.engine.tools import HERMES, LLAMA3, MISTRAL, ToolContext
from webgpu_engine.server.app import ServerOptions, ServerThread

LLM_ID, THINK = "SmolLM2-135M-Instruct-Q4_1", "tiny-think"
# DeepSeek-R1's way: the generation prompt opens the thinking; enable_thinking=false closes it empty
THINK_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")
Q = [{"role": "user", "content": "Name the capital of France."}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city", "unit"]}}}]


@pytest.fixture(scope="module")
def server(device, smollm2_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("fields")
    think = write_tiny_llama_gguf(d / "think.gguf", arch="qwen3", qtype="q8_0", context_length=256,
                                  chat_template=THINK_TEMPLATE)["path"]
    app = default_app_config().with_records(ModelRecord(THINK, str(think), "llm"))
    # no load-time compile of every pipeline (test_correctness checks it): requests compile what they use
    fast = {"compile_at_load": False}
    s = ServerThread(ServerOptions(models=[LLM_ID, THINK], port=0, chat_opts=[fast, {**fast, "max_num_sequences": 2}],
                                   engine_config=EngineConfig(device=device, app_config=app)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def ask(client, model=LLM_ID, messages=Q, **kw):
    kw.setdefault("max_tokens", 6)
    return client.chat.completions.create(model=model, messages=messages, **kw)


@pytest.mark.parametrize("model", [LLM_ID, THINK])
def test_top_k_1_and_min_p_1_are_greedy(client, model):
    """top_k=1 and min_p=1 leave only the best token: at temperature 1.5 they answer as greedy
    decoding does, for several seeds (a scheduler of one slot and of several); without them
    the same seeds sample something else."""
    def answer(**kw):
        m = ask(client, model, max_tokens=4, **kw).choices[0].message
        return m.content, (m.model_extra or {}).get("reasoning_content")
    greedy = answer(temperature=0)
    plain = set()
    seeds, extras = ((1, 2), ({"top_k": 1}, {"min_p": 1.0})) if model == LLM_ID else \
        ((1, 2, 3), ({"top_k": 1}, {"min_p": 1.0}, {"top_k": 40, "min_p": 1.0}))
    for seed in seeds:
        for extra in extras:
            assert answer(temperature=1.5, seed=seed, extra_body=extra) == greedy, (seed, extra)
        plain.add(answer(temperature=1.5, seed=seed))
    assert plain != {greedy}


def test_twenty_top_logprobs(client):
    r = ask(client, temperature=0, max_tokens=3, logprobs=True, top_logprobs=20)
    for e in r.choices[0].logprobs.content:
        top = e.top_logprobs
        assert len(top) == 20 and top[0].token == e.token and top[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert len({t.token for t in top}) == 20
    with pytest.raises(openai.BadRequestError):
        ask(client, logprobs=True, top_logprobs=21)


@pytest.mark.parametrize("stream", [False, True])
def test_end_of_turn_token_is_counted_not_listed(client, stream):
    """The answer ends on <|im_end|> at once (a logit_bias pushes it): usage counts it, logprobs do
    not list it, the content holds no text of it."""
    kw = dict(temperature=0, logprobs=True, extra_body={"logit_bias": {str(EOS_ID): 100}})
    if not stream:
        r = ask(client, THINK, **kw)
        c = r.choices[0]
        assert c.finish_reason == "stop" and c.message.content == "" and c.logprobs.content == []
        assert r.usage.completion_tokens == 1
        return
    chunks = list(ask(client, THINK, stream=True, stream_options={"include_usage": True}, **kw))
    listed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
              for e in ch.choices[0].logprobs.content or []]
    assert listed == [] and chunks[-1].usage.completion_tokens == 1
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""


def test_developer_message_is_a_system_message(client):
    sys_ = [{"role": "system", "content": "Answer in one word."}, *Q]
    dev = [{"role": "developer", "content": "Answer in one word."}, *Q]
    a, b = (ask(client, messages=m, temperature=0) for m in (sys_, dev))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_system_message_past_the_first_where_the_template_takes_it(client):
    """ChatML renders a system turn anywhere: a late system message is part of the prompt."""
    late = [*Q, {"role": "assistant", "content": "Paris."}, {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "And of Italy?"}]
    r = ask(client, messages=late, temperature=0, max_tokens=2)
    without = ask(client, messages=late[:2] + late[3:], temperature=0, max_tokens=2)
    assert r.usage.prompt_tokens > without.usage.prompt_tokens


def test_final_assistant_message_is_continued(client, server):
    """An assistant message last is a prefill: the answer continues its text, exactly as a raw
    completion of the conversation cut after that text."""
    msgs = [{"role": "user", "content": "Count from one to ten."}, {"role": "assistant", "content": "One, two,"}]
    r = ask(client, messages=msgs, temperature=0, max_tokens=5)
    tpl = server.engine.models[LLM_ID].pipeline.template
    text = tpl.render(msgs, add_generation_prompt=False)
    prompt = text[:text.rindex("One, two,") + len("One, two,")]
    c = client.completions.create(model=LLM_ID, prompt=prompt, temperature=0, max_tokens=5)
    assert r.choices[0].message.content == c.choices[0].text
    assert r.usage.prompt_tokens == c.usage.prompt_tokens


def test_reasoning_split_from_content(client):
    """The template opens <think>: what the model writes up to </think> is reasoning_content, the rest
    content (streamed deltas add up to the same); reasoning_effort "none" closes the thinking in
    the prompt, so everything is content. A regex format makes the tiny model write the tags."""
    fmt = {"type": "regex", "regex": "[a-z]{3,6}</think>[a-z]{2,5}"}
    r = ask(client, THINK, temperature=0, max_tokens=40, response_format=fmt)
    m = r.choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning.isalpha() and m.content.isalpha() and "think" not in m.content
    chunks = list(ask(client, THINK, temperature=0, max_tokens=40, response_format=fmt, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == m.content
    off = ask(client, THINK, temperature=0, max_tokens=40, reasoning_effort="none",
              response_format={"type": "regex", "regex": "[a-z]{3,6}"}).choices[0].message
    assert off.content.isalpha() and "reasoning_content" not in (off.model_extra or {})


def test_thinking_through_ollama_and_anthropic(server, client):
    """The same thinking template through Ollama's `think` (true or a level: `thinking` beside the
    content, streamed too; false: none) and Anthropic's `thinking` (a thinking block before the text,
    streamed as thinking_delta): each equal to the OpenAI route's reasoning_content and content."""
    import anthropic
    import ollama
    want = ask(client, THINK, temperature=0, max_tokens=8).choices[0].message
    reasoning = want.model_extra["reasoning_content"]
    assert reasoning
    oc = ollama.Client(host=server.base, timeout=300)
    opts = {"temperature": 0, "num_predict": 8}
    for think in (True, "high"):
        r = oc.chat(model=THINK, messages=Q, think=think, options=opts)
        assert r.message.thinking == reasoning and r.message.content == (want.content or "")
    parts = list(oc.chat(model=THINK, messages=Q, think=True, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reasoning
    g = oc.generate(model=THINK, prompt=Q[0]["content"], think="low", options=opts)
    assert g.thinking == reasoning
    off = ask(client, THINK, temperature=0, max_tokens=8, reasoning_effort="none").choices[0].message
    r = oc.chat(model=THINK, messages=Q, think=False, options=opts)
    assert r.message.thinking is None and r.message.content == off.content
    ac = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=300)
    kw = dict(model=THINK, max_tokens=8, messages=Q, extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": 1024})
    m = ac.messages.create(**kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking == reasoning
    with ac.messages.stream(**kw) as st:
        events = list(st)
        final = st.get_final_message()
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == reasoning
    assert final.content[0].thinking == reasoning
    m = ac.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == off.content


def test_tool_arguments_stream_in_fragments(client):
    kw = dict(temperature=0, max_tokens=40, tools=WEATHER,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    whole = ask(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    want = whole.message.tool_calls[0].function
    chunks = list(ask(client, stream=True, **kw))
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == want.name == "get_weather"
    frags = [tc.function.arguments for tc in calls[1:] if tc.function and tc.function.arguments]
    assert len(frags) > 1
    args = "".join(frags)
    assert json.loads(args) == json.loads(want.arguments) and set(json.loads(args)) == {"city", "unit"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_completions_take_response_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = client.completions.create(model=LLM_ID, prompt="The capital of France as JSON:", temperature=0,
                                  max_tokens=20, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert set(json.loads(r.choices[0].text)) == {"city"} and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=LLM_ID, prompt="x", max_tokens=2,
                                  extra_body={"response_format": {"type": "xml"}})


def test_unknown_fields_are_ignored_and_logged_once(caplog):
    import logging

    from webgpu_engine.protocol import rules
    body = {"messages": Q, "verbosity": "low", "prompt_cache_key": "k", "temperature": 0.5}
    with caplog.at_level(logging.DEBUG, logger="webgpu_engine.protocol"):
        for _ in range(3):
            out = rules.check_chat_request(dict(body))
    named = [r.getMessage() for r in caplog.records if "unknown chat request field" in r.getMessage()]
    assert len([m for m in named if "'verbosity'" in m]) == 1 and len([m for m in named if "prompt_cache_key" in m]) == 1
    assert not any("'temperature'" in m or "'messages'" in m for m in named)
    assert out["temperature"] == 0.5


# --------------------------------------------------------------------------- the parser alone
PARSER_CASES = [
    ("<think>\nLet me think.\n</think>\n\nParis is the capital.", False, None,
     ("Paris is the capital.", "Let me think.", [])),
    ("Hmm, thinking\n</think>\n\nAnswer.", True, None, ("Answer.", "Hmm, thinking", [])),
    ("Still thinking at the cut", True, None, ("", "Still thinking at the cut", [])),
    ("Plain <think> in an answer", False, None, ("Plain <think> in an answer", None, [])),
    ('<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>', None, HERMES,
     (None, None, [("f", '{"city": "Paris", "days": [1, 2]}')])),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"q": "a\\"}b"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "f", "arguments": {"q": "c"}}\n</tool_call>', None, HERMES,
     ("Sure.", None, [("f", '{"q": "a\\"}b"}'), ("f", '{"q": "c"}')])),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"q": 1}}, {"name": "f", "arguments": {"q": 2}}]', None, MISTRAL,
     (None, None, [("f", '{"q": 1}'), ("f", '{"q": 2}')])),
    ('{"name": "f", "parameters": {"q": "x"}}', None, LLAMA3, (None, None, [("f", '{"q": "x"}')])),
    ('<tool_call>\n{"arguments": {"q": "x"}, "name": "f"}\n</tool_call>', None, HERMES,     # sent whole
     (None, None, [("f", '{"q": "x"}')])),
    ("Just text.", None, HERMES, ("Just text.", None, [])),
    ('<think>plan</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', False, HERMES,
     (None, "plan", [("f", "{}")])),
]


@pytest.mark.parametrize("text,reasoning,fmt,want", PARSER_CASES)
def test_output_parser_streams_what_it_returns(text, reasoning, fmt, want):
    """Whatever the cuts of the text into deltas, the deltas add up to the finished message, which
    is the same for every cut; arguments stream in fragments where the call is written name first."""
    rng = random.Random(len(text))
    cut_sets = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1)))) for _ in range(20)]
    for cuts in cut_sets:
        p = OutputParser(reasoning, ToolContext(fmt, {"f"}, False) if fmt else None)
        deltas, i = [], 0
        for c in cuts + [len(text)]:
            deltas += p.feed(text[i:c])
            i = c
        last, msg, finish = p.finish("stop")
        deltas += last
        content = "".join(d.get("content", "") for d in deltas)
        reasoning_text = "".join(d.get("reasoning_content", "") for d in deltas)
        streamed: dict[int, list] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                s = streamed.setdefault(tc["index"], [None, ""])
                s[0] = tc["function"].get("name") or s[0]
                s[1] += tc["function"].get("arguments", "")
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        assert (msg["content"], msg.get("reasoning_content"), calls) == want
        assert content == (msg["content"] or "") and reasoning_text == (msg.get("reasoning_content") or "")
        assert [tuple(streamed[k]) for k in sorted(streamed)] == calls
        assert finish == ("tool_calls" if calls else "stop")
    key = '"parameters"' if fmt == LLAMA3 else '"arguments"'
    if want[2] and text.find('"name"') < text.find(key):          # name first: arguments stream
        one_char = OutputParser(reasoning, ToolContext(fmt, {"f"}, False))
        frags = [d for ch in text for d in one_char.feed(ch) if d.get("tool_calls")
                 and "id" not in d["tool_calls"][0]]
        assert len(frags) > 1


# Qwen3's way: the model writes <think> itself; enable_thinking=false puts an empty one in the prompt
QWEN3_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}{% endif %}")


async def test_reasoning_the_model_opens_itself(device, tmp_path):
    """A Qwen3-style template (the model writes <think> itself): the thinking is split off, streamed
    and not; with enable_thinking false the empty think block is the prompt's, the answer all content."""
    from webgpu_engine.engine import AsyncMLCEngine
    path = write_tiny_llama_gguf(tmp_path / "q3.gguf", arch="qwen3", qtype="q8_0", context_length=256,
                                 chat_template=QWEN3_TEMPLATE)["path"]
    app = default_app_config().with_records(ModelRecord("tiny-qwen3", str(path), "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny-qwen3", {"compile_at_load": False})
    try:
        fmt = {"type": "regex", "regex": "<think>[a-z]{3,6}</think>[a-z]{2,5}"}
        kw = dict(messages=Q, temperature=0, max_tokens=40, response_format=fmt)
        m = (await eng.chat.completions.create(**kw)).choices[0].message
        reasoning = m.model_extra["reasoning_content"]
        assert reasoning.isalpha() and m.content.isalpha()
        deltas = [c.choices[0].delta async for c in await eng.chat.completions.create(stream=True, **kw)
                  if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
        assert "".join(d.content or "" for d in deltas) == m.content
        off = (await eng.chat.completions.create(
            messages=Q, temperature=0, max_tokens=40, extra_body={"enable_thinking": False},
            response_format={"type": "regex", "regex": "[a-z]{3,6}"})).choices[0].message
        assert off.content.isalpha() and "reasoning_content" not in (off.model_extra or {})
    finally:
        await eng.unload()
