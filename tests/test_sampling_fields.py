"""The sampling settings are declared once (config.SAMPLING_FIELDS) and every place that names them
reads that table: the OpenAI rules and request model, Ollama's options and params layers, MLC's chat
config, the request path's model defaults. No GPU."""
from __future__ import annotations

from dataclasses import fields

from webgpu_engine.config import SAMPLING_FIELDS, ChatConfig, GenerationConfig, SamplingParams


def test_every_field_lands_where_each_api_names_it():
    gen = {f.name for f in fields(GenerationConfig)}
    chat = {f.name for f in fields(ChatConfig)}
    names = {f.name for f in SAMPLING_FIELDS}
    assert names <= gen and {f.name for f in fields(SamplingParams)} <= names
    assert {f.chat_config for f in SAMPLING_FIELDS if f.chat_config} <= chat
    from webgpu_engine.protocol.models import ChatCompletionRequest, CompletionRequest
    for model in (ChatCompletionRequest, CompletionRequest):
        assert {f.openai for f in SAMPLING_FIELDS if f.openai} <= set(model.model_fields), model


def test_readers_take_their_names_from_the_table():
    from webgpu_engine.engine.ollama_store import PARAMS_TO_CHAT_CONFIG
    from webgpu_engine.loaders.mlc import SAMPLING_KEYS
    from webgpu_engine.protocol.ollama import OPTION_FIELDS, options_fields
    from webgpu_engine.protocol.rules import KNOWN_FIELDS
    assert OPTION_FIELDS["repeat_penalty"] == "repetition_penalty" and "num_predict" not in OPTION_FIELDS
    assert options_fields({"repeat_penalty": 1.1, "num_predict": 5, "top_k": 3}, 128) == {
        "repetition_penalty": 1.1, "max_tokens": 5, "top_k": 3}
    assert PARAMS_TO_CHAT_CONFIG == {"temperature": "temperature", "top_p": "top_p", "stop": "stop_str",
                                     "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                                     "frequency_penalty": "frequency_penalty"}
    assert SAMPLING_KEYS["repetition_penalty"] == "repetition_penalty" and "top_k" not in SAMPLING_KEYS
    for f in SAMPLING_FIELDS:
        assert f.openai in KNOWN_FIELDS["chat"] and f.openai in KNOWN_FIELDS["completion"]
