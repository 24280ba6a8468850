"""Protocol tests: every validation rule raises its typed error (with param and an actionable message)
through both the plain-dict rules (what the browser runs) and the pydantic models; responses parse."""
from __future__ import annotations

import pytest

from webgpu_engine.errors import InvalidRequestError
from webgpu_engine.protocol import errors as E
from webgpu_engine.protocol import models as M
from webgpu_engine.protocol import structured as S
from webgpu_engine.protocol import rules, to_dict, to_object
from webgpu_engine.protocol.objects import AttrDict

U = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"messages": U, **kw}


def comp(**kw):
    return {"prompt": "Once upon", **kw}


# (kind, request, error type, param, a fragment of the message that says what to do)
CASES = [
    # WebLLM's rules
    ("chat", chat(stream=True, n=2), E.StreamingCountError, "n", "Set stream=false"),
    ("chat", chat(seed=1.5), E.SeedTypeError, "seed", "must be an integer"),
    ("chat", chat(seed="7"), E.SeedTypeError, "seed", "whole number"),
    ("chat", chat(stream_options={"include_usage": True}), E.InvalidStreamOptionsError,
     "stream_options", "only allowed when `stream` is true"),
    ("chat", chat(stream=False, stream_options={"include_usage": True}), E.InvalidStreamOptionsError,
     "stream_options", "Set stream=true"),
    ("chat", chat(frequency_penalty=2.5), E.RangeError, "frequency_penalty", "[-2, 2]"),
    ("chat", chat(presence_penalty=-3), E.RangeError, "presence_penalty", "[-2, 2]"),
    ("chat", chat(logit_bias={"abc": 1}), E.InvalidNumberStringError, "logit_bias", "token ids"),
    ("chat", chat(logit_bias={"-5": 1}), E.InvalidNumberStringError, "logit_bias", "strings of digits"),
    ("chat", chat(logit_bias={"42": 101}), E.RangeError, "logit_bias", "[-100, 100]"),
    ("chat", chat(logit_bias={"42": -100.5}), E.RangeError, "logit_bias", "token 42"),
    ("chat", chat(logprobs=True, top_logprobs=21), E.RangeError, "top_logprobs", "[0, 20]"),
    ("chat", chat(logprobs=True, top_logprobs=-1), E.RangeError, "top_logprobs", "[0, 20]"),
    ("chat", chat(top_k=-2), E.MinValueError, "top_k", "at least -1"),
    ("chat", chat(top_k=2.5), E.FieldTypeError, "top_k", "integer"),
    ("chat", chat(min_p=1.01), E.RangeError, "min_p", "[0, 1]"),
    ("chat", chat(top_logprobs=2), E.DependencyError, "top_logprobs", "requires `logprobs`"),
    ("chat", chat(logprobs=False, top_logprobs=2), E.DependencyError, "top_logprobs", "Set `logprobs`"),
    # OpenAI ranges
    ("chat", chat(temperature=2.1), E.RangeError, "temperature", "[0, 2]"),
    ("chat", chat(temperature=-0.1), E.RangeError, "temperature", "greedy"),
    ("chat", chat(top_p=0), E.RangeError, "top_p", "(0, 1]"),
    ("chat", chat(top_p=1.2), E.RangeError, "top_p", "(0, 1]"),
    ("chat", chat(max_tokens=0), E.MinValueError, "max_tokens", "at least 1"),
    ("chat", chat(max_completion_tokens=0), E.MinValueError, "max_tokens", "at least 1"),
    ("chat", chat(n=0), E.MinValueError, "n", "at least 1"),
    ("chat", chat(n=1.5), E.FieldTypeError, "n", "an integer"),
    ("chat", chat(temperature="hot"), E.FieldTypeError, "temperature", "a number"),
    ("chat", chat(stream="yes"), E.FieldTypeError, "stream", "true or false"),
    ("chat", chat(repetition_penalty=0), E.RangeError, "repetition_penalty", "1.0 means no penalty"),
    ("chat", chat(stop=["a", 3]), E.FieldTypeError, "stop", "list of strings"),
    ("chat", chat(stop=""), E.FieldTypeError, "stop", "non-empty"),
    # total validation: non-finite numbers, ranges the float32 sampler can hold, unicode, limits
    ("chat", chat(temperature=float("nan")), E.FieldTypeError, "temperature", "finite number"),
    ("chat", chat(top_p=float("inf")), E.FieldTypeError, "top_p", "finite number"),
    ("chat", chat(repetition_penalty=float("nan")), E.FieldTypeError, "repetition_penalty", "finite"),
    ("chat", chat(repetition_penalty=float("inf")), E.FieldTypeError, "repetition_penalty", "finite"),
    ("chat", chat(repetition_penalty=1e300), E.RangeError, "repetition_penalty", "[0.01, 10]"),
    ("chat", chat(repetition_penalty=1e-300), E.RangeError, "repetition_penalty", "no penalty"),
    ("chat", chat(logit_bias={"42": float("nan")}), E.RangeError, "logit_bias", "[-100, 100]"),
    ("chat", chat(logit_bias={"\u00b2": 1}), E.InvalidNumberStringError, "logit_bias", "digits"),
    ("chat", chat(logit_bias={"\u0663": 1}), E.InvalidNumberStringError, "logit_bias", "digits"),
    ("chat", chat(logit_bias={"9" * 5000: 1}), E.InvalidNumberStringError, "logit_bias", "digits"),
    ("chat", chat(logit_bias={10 ** 5000: 1}), E.InvalidNumberStringError, "logit_bias", "bits"),
    ("chat", chat(logit_bias={str(i): 1 for i in range(301)}), E.LimitExceededError, "logit_bias",
     "at most 300"),
    ("chat", chat(n=17), E.RangeError, "n", "[1, 16]"),
    ("chat", chat(n=10 ** 6), E.RangeError, "n", "limit on choices"),
    ("chat", chat(stop=["a", "b", "c", "d", "e"]), E.LimitExceededError, "stop", "at most 4"),
    ("chat", chat(stop="x" * 257), E.LimitExceededError, "stop", "at most 256"),
    ("chat", chat(stop=["ok", "\ud800"]), E.InvalidTextError, "stop", "stop[1]"),
    ("chat", {"messages": [{"role": "user", "content": "a\udc00b"}]}, E.InvalidTextError, "messages",
     "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     E.InvalidTextError, "messages", "content[0].text"),
    ("chat", {"messages": [{"role": "user", "content": "a", "name": "\ud800"}]}, E.InvalidTextError,
     "messages", "messages[0].name"),
    ("chat", {"messages": [{"role": "user", "content": "a", "name": 5}]}, E.FieldTypeError,
     "messages[0].name", "a string"),
    ("chat", chat(model="m\udfff"), E.InvalidTextError, "model", "surrogate"),
    ("chat", {"messages": [*U, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                           {"role": "tool", "content": "42", "tool_call_id": "1"}]},
     E.FieldTypeError, "messages[1].tool_calls[0]", "function: {name, arguments}"),
    ("chat", {"messages": [*U, {"role": "assistant", "content": None}, *U]}, E.ContentTypeError,
     "messages", "needs text content"),
    # messages
    ("chat", {"messages": []}, E.EmptyMessagesError, "messages", "non-empty list"),
    ("chat", {}, E.EmptyMessagesError, "messages", "non-empty list"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, E.UnsupportedRoleError, "messages",
     "system, user, assistant, tool"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     E.FieldTypeError, "messages[0].content[0].image_url.url", "URL"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x",
                                                                                          "detail": 1}}]}]},
     E.FieldTypeError, "messages[0].content[0].image_url.detail", "auto"),
    ("chat", {"messages": [*U, {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     E.ContentTypeError, "messages", "must be a text part"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, E.ContentTypeError, "messages",
     "string or a list of text parts"),
    ("chat", {"messages": [{"role": "user"}]}, E.ContentTypeError, "messages", "needs text content"),
    ("chat", {"messages": [{"role": "system", "content": "s"}]}, E.MessageOrderError,
     "messages", "last message"),
    ("chat", {"messages": [*U, {"role": "assistant", "content": "a"}], "reasoning_effort": "max"},
     E.FieldTypeError, "reasoning_effort", "one of"),
    # structured output and tools (WebLLM's error types)
    ("chat", chat(response_format={"type": "xml"}), E.FieldTypeError, "response_format", "json_schema"),
    ("chat", chat(response_format={"type": "grammar"}), S.InvalidResponseFormatGrammarError,
     "response_format", "needs to be specified"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     S.InvalidResponseFormatError, "response_format", "with a `schema`"),
    ("chat", chat(response_format={"type": "json_object", "schema": "{not json"}),
     S.InvalidResponseFormatError, "response_format", "not valid JSON"),
    ("chat", chat(response_format={"type": "regex"}), S.InvalidResponseFormatRegexError,
     "response_format", "non-empty `regex`"),
    ("chat", chat(tools=[{"type": "retrieval"}]), S.UnsupportedToolTypeError, "tools", "'function'"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"),
     S.UnsupportedToolChoiceTypeError, "tool_choice", "required"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                  tool_choice={"type": "function", "function": {"name": "g"}}),
     S.FunctionNotFoundError, "tool_choice", "'g'"),
    ("chat", chat(tool_choice="required"), S.UnsupportedToolChoiceTypeError, "tool_choice", "required"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                  response_format={"type": "json_object"}), E.UnsupportedFieldsError, "response_format",
     "cannot be combined"),
    # completions
    ("comp", {"prompt": 5}, E.PromptTypeError, "prompt", "must be a string"),
    ("comp", {"prompt": ["a", "b"]}, E.PromptTypeError, "prompt", "one prompt per request"),
    ("comp", comp(suffix=3), E.FieldTypeError, "suffix", "a string"),
    ("comp", comp(echo="no"), E.FieldTypeError, "echo", "true or false"),
    ("comp", comp(best_of=3), E.UnsupportedFieldsError, "best_of", "n choices"),
    ("comp", comp(logprobs=9), E.RangeError, "logprobs", "[0, 5]"),
    ("comp", comp(stream=True, n=3), E.StreamingCountError, "n", "n=1 to stream"),
    ("comp", {"prompt": "\ud800"}, E.InvalidTextError, "prompt", "`prompt` contains"),
    ("comp", comp(suffix="\udbff"), E.InvalidTextError, "suffix", "U+DBFF"),
    # embeddings
    ("emb", {"input": []}, E.EmbeddingInputEmptyError, "input", "must not be empty"),
    ("emb", {"input": ""}, E.EmbeddingInputEmptyError, "input", "empty string"),
    ("emb", {}, E.EmbeddingInputEmptyError, "input", "no `input` field"),
    ("emb", {"input": [[1, 2], []]}, E.EmbeddingInputEmptyError, "input", "empty token-id list"),
    ("emb", {"input": ["a", 1]}, E.FieldTypeError, "input", "not a mix"),
    ("emb", {"input": {"a": 1}}, E.FieldTypeError, "input", "list of token-id lists"),
    ("emb", {"input": "a", "dimensions": 0}, E.MinValueError, "dimensions", "at least 1"),
    ("emb", {"input": "a", "dimensions": "64"}, E.FieldTypeError, "dimensions", "a positive integer"),
    ("emb", {"input": "a", "dimensions": True}, E.FieldTypeError, "dimensions", "a positive integer"),
    ("emb", {"input": ["a"] * 2049}, E.LimitExceededError, "input", "at most 2048"),
    ("emb", {"input": [[1]] * 2049}, E.LimitExceededError, "input", "at most 2048"),
    ("emb", {"input": [1] * 300_001}, E.LimitExceededError, "input", "at most 300000 allowed"),
    ("emb", {"input": [[1] * 1000] * 301}, E.LimitExceededError, "input", "tokens"),
    ("emb", {"input": ["ok", "\ud800"]}, E.InvalidTextError, "input", "input[1]"),
    ("emb", {"input": "\udc00"}, E.InvalidTextError, "input", "surrogate"),
    ("emb", {"input": "a", "encoding_format": "base64"}, E.EmbeddingUnsupportedEncodingFormatError,
     "encoding_format", "use \"float\""),
]

RULE = {"chat": rules.check_chat_request, "comp": rules.check_completion_request,
        "emb": rules.check_embedding_request}
MODEL = {"chat": M.ChatCompletionRequest, "comp": M.CompletionRequest, "emb": M.EmbeddingRequest}


@pytest.mark.parametrize("kind,req,err,param,fragment", CASES,
                         ids=[f"{c[0]}-{c[2].__name__}-{i}" for i, c in enumerate(CASES)])
def test_rule_raises_typed_error(kind, req, err, param, fragment):
    with pytest.raises(err) as ei:
        RULE[kind](req)
    e = ei.value
    assert isinstance(e, InvalidRequestError)
    assert e.http_status == 400 and e.error_type == "invalid_request_error"
    assert e.param == param
    assert fragment in e.message, e.message


@pytest.mark.parametrize("kind,req,err,param,fragment", CASES,
                         ids=[f"{c[0]}-{c[2].__name__}-{i}" for i, c in enumerate(CASES)])
def test_pydantic_model_raises_the_same_error(kind, req, err, param, fragment):
    with pytest.raises(err) as ei:
        MODEL[kind](**req)
    assert ei.value.param == param and fragment in ei.value.message


def test_valid_chat_request_is_normalised():
    req = {"messages": [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                     {"type": "text", "text": "b"}]}],
           "stop": "END", "seed": 3.0, "max_completion_tokens": 7, "presence_penalty": 0.5,
           "logit_bias": {"12": -100, 7: 5}, "logprobs": True, "top_logprobs": 0,
           "stream": True, "stream_options": {"include_usage": True}}
    out = rules.check_chat_request(req)
    assert out["messages"][1]["content"] == "a\nb"
    assert out["stop"] == ["END"] and out["seed"] == 3 and isinstance(out["seed"], int)
    assert out["max_tokens"] == 7 and "max_completion_tokens" not in out
    assert out["frequency_penalty"] == 0.0  # WebLLM: the other penalty defaults to 0
    assert out["logit_bias"] == {"12": -100.0, "7": 5.0}
    assert req["stop"] == "END"  # the caller's dict is not modified
    m = M.ChatCompletionRequest(**req)
    assert m.messages[1].content == "a\nb" and m.max_tokens == 7 and m.stop == ["END"]


def test_structured_fields_normalise_idempotently():
    req = chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": '{"type": "object"}'}},
               tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
               tool_choice="none")
    req["messages"] = [*U, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    once = rules.check_chat_request(req)
    assert once["response_format"] == {"type": "json_schema", "schema": {"type": "object"}, "name": "n"}
    assert once["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert once["messages"][1]["content"] == ""
    assert rules.check_chat_request(once) == once
    assert M.ChatCompletionRequest(**req).response_format == once["response_format"]
    assert "response_format" not in rules.check_chat_request(chat(response_format={"type": "text"}))


def test_valid_edge_values_pass():
    rules.check_chat_request(chat(temperature=0, top_p=1, frequency_penalty=-2, presence_penalty=2,
                                  logit_bias={"0": 100}, n=5, logprobs=True, top_logprobs=5))
    rules.check_chat_request({"messages": [*U, {"role": "assistant", "content": "a"},
                                           {"role": "tool", "content": "42", "tool_call_id": "1"}]})
    rules.check_chat_request(chat(n=16, stop=["a", "b", "c", "x" * 256], repetition_penalty=10,
                                  logit_bias={str(i): 1 for i in range(300)}))
    rules.check_chat_request(chat(logit_bias={"0" * 10: 1, 10 ** 10 - 1: 2}, model="caf\u00e9 \U0001f600"))
    # temperatures too small for the float32 sampler are greedy, as in vLLM
    for t in (1e-300, 1e-39, 5e-324, 1e-6):
        assert rules.check_chat_request(chat(temperature=t))["temperature"] == 0.0
    assert rules.check_chat_request(chat(temperature=1e-5))["temperature"] == 1e-5
    tight = rules.RequestLimits(max_n=2, max_stop=1, max_logit_bias=1, max_embedding_inputs=2,
                                max_embedding_tokens=3)
    with pytest.raises(E.RangeError):
        rules.check_chat_request(chat(n=3), tight)
    with pytest.raises(E.LimitExceededError):
        rules.check_completion_request(comp(stop=["a", "b"]), tight)
    with pytest.raises(E.LimitExceededError):
        rules.check_embedding_request({"input": [[1, 2], [3, 4]]}, tight)
    rules.check_embedding_request({"input": ["a", "\U0001f600"]}, tight)
    out = rules.check_completion_request(comp(prompt=["only one"], echo=True, suffix="!", logprobs=2))
    assert out["prompt"] == "only one" and out["logprobs"] is True and out["top_logprobs"] == 2
    for inp in ("a", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert M.EmbeddingRequest(input=inp).input == inp
    rules.check_embedding_request({"input": "a", "encoding_format": "float"})


def test_responses_parse_as_openai_objects():
    d = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                      "finish_reason": "stop",
                      "logprobs": {"content": [{"token": "hi", "logprob": -0.1, "bytes": [104, 105],
                                                "top_logprobs": [{"token": "hi", "logprob": -0.1}]}]}}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                   "extra": {"e2e_latency_s": 0.5, "decode_tokens_per_s": 10.0}}}
    obj = to_object(d)
    assert isinstance(obj, M.ChatCompletion)
    assert obj.choices[0].message.content == "hi" and obj.usage.extra.e2e_latency_s == 0.5
    assert to_dict(obj) == d
    chunk = to_object({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                                "total_tokens": 3}})
    assert isinstance(chunk, M.ChatCompletionChunk) and chunk.usage.total_tokens == 3
    # the official client's types accept our JSON
    from openai.types.chat import ChatCompletion as OAChat
    assert OAChat.model_validate(to_dict(obj)).choices[0].message.content == "hi"


def test_attrdict_fallback_reads_like_the_models():
    a = AttrDict({"x": 1})
    assert a.x == 1 and a.to_dict() == {"x": 1}
    from webgpu_engine.protocol.objects import _wrap
    w = _wrap({"choices": [{"delta": {"content": "t"}}]})
    assert w.choices[0].delta.content == "t"
    with pytest.raises(AttributeError):
        _ = w.missing


def test_rules_module_imports_only_the_standard_library():
    import ast
    import inspect
    import sys
    for mod in (rules, E, sys.modules["webgpu_engine.protocol.objects"]):
        tree = ast.parse(inspect.getsource(mod))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for n in top:
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            for name in names:
                assert n.__dict__.get("level", 0) > 0 or name.split(".")[0] in sys.stdlib_module_names, \
                    f"{mod.__name__} imports {name} at module level"
