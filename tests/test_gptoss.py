"""gpt-oss against transformers: a tiny random GptOssForCausalLM (tests/tinygptoss.py, written here as
transformers saves one; tests/fixtures/make_gptoss.py ran transformers on it once) must give
transformers' token ids, its logits at positions up to 319 within 1e-3 of the largest and its 16
greedy tokens (attention sinks, alternating sliding-window layers, q/k/v/o biases, YaRN, a router
with a bias, experts with biases and a clamped SwiGLU); three requests through continuous batching
give transformers' greedy tokens of each, as each gives alone. The GGUF llama.cpp's converter writes of
it (general.architecture gpt-oss) gives the same; with its experts in MXFP4 (ggml's blocks: an E8M0
scale byte and 16 bytes of E2M1 codes per 32) the logits and tokens of a GGUF holding those values
in f32, and OpenAI's MXFP4 folder of the same blocks the same logits. Its answers are in harmony (its family's parser, engine/harmony.py): through the openai client,
the analysis channel arrives as reasoning_content and the final channel as content, a call to
functions.NAME as a tool call, streamed or not (the random model writes them under a grammar)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

import test_families as families
import tinygptoss
from test_moe import check_quantized_as_floats
from webgpu_engine.models.registry import open_model

REF = json.loads((Path(__file__).parent / "fixtures" / "gptoss_transformers.json").read_text())


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return tinygptoss.write_tiny_gptoss_safetensors(tmp_path_factory.mktemp("gptoss") / "f32", seed=REF["seed"])["folder"]


def test_gptoss_matches_transformers(device, hf_folder):
    families.check_golden(device, hf_folder, REF)


async def test_gptoss_in_a_batch_answers_as_transformers(device, hf_folder):
    """Three requests together (max_num_sequences 4: paged KV with sinks, the ROWS and PREFILL row
    modes) and each alone give transformers' 12 greedy tokens."""
    from webgpu_engine.engine.engine import AsyncMLCEngine
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    tok = load_tokenizer(hf_folder)
    eng = AsyncMLCEngine()
    await eng.reload(str(hf_folder), chat_opts={"dtype": "f32", "context_window_size": 160, "prefill_chunk_size": 32,
                                                "max_num_sequences": 4, "kv_block_size": 16})
    try:
        async def one(b):
            assert tok.encode(b["prompt"]) == b["ids"]
            r = await eng.completions.create(prompt=b["prompt"], max_tokens=len(b["greedy"]), ignore_eos=True,
                                             temperature=0.0)
            return r.choices[0].text
        together = await asyncio.gather(*(one(b) for b in REF["batch"]))
        alone = [await one(b) for b in REF["batch"]]
    finally:
        await eng.unload()
    assert together == alone
    assert alone == [tok.decode(b["greedy"]) for b in REF["batch"]]


@pytest.mark.parametrize("fused", [False, True])
def test_gptoss_gguf_matches_transformers(device, tmp_path, fused):
    """The converter's layout: gate / up de-interleaved and transposed to ffn_{gate,up}_exps (or one
    ffn_gate_up_exps, --fuse-gate-up-exps), biases beside, attn_sinks, post_attention_norm as the FFN's
    norm, YaRN and the window in the metadata."""
    path = tinygptoss.write_tiny_gptoss_gguf(tmp_path / "gptoss.gguf", seed=REF["seed"], fused=fused)["path"]
    families.check_golden(device, path, REF)


def test_llamacpp_converted_ggufs(device, tmp_path):
    """GGUFs written by llama.cpp's convert_hf_to_gguf.py itself (tests/fixtures/gptoss_gguf): the
    folder's gives transformers' ids, logits and greedy tokens; the one of its MXFP4 form (OpenAI's
    layout, repacked by the converter) gives, bit for bit, the logits of tests/tinygptoss.py's MXFP4
    GGUF, so that writer lays the model out as the converter does."""
    converted = Path(__file__).parent / "fixtures" / "gptoss_gguf"
    families.check_golden(device, converted / "f32.gguf", REF)
    ours = tinygptoss.write_tiny_gptoss_gguf(tmp_path / "mxfp4.gguf", seed=REF["seed"], expert_qtype="MXFP4")["path"]
    got = []
    for p in (converted / "mxfp4.gguf", ours):
        m = open_model(p)
        try:
            got.append(families.run_golden(device, m.config, m.weights, {**REF, "rows": [0, 299]}))
        finally:
            m.close()
    assert all(np.array_equal(got[0][0][r], got[1][0][r]) for r in (0, 299)) and got[0][1] == got[1][1]


def test_mxfp4_experts_as_their_floats(device, tmp_path):
    """MXFP4 experts (each expert a slice of the stacked blocks, read by the MoE kernels through
    dequant.wgsl's dq_mxfp4) give the logits and greedy tokens of the same file with the experts'
    dequantised values in f32."""
    check_quantized_as_floats(device, lambda deq: tinygptoss.write_tiny_gptoss_gguf(
        tmp_path / f"mxfp4_{deq}.gguf", seed=REF["seed"], expert_qtype="MXFP4", dequantized=deq)["path"], "mxfp4", REF)


def test_bf16_folder_as_its_values_in_f32(device, tmp_path):
    """A bf16 folder (as transformers saves gpt-oss: the experts transposed on upload from 2-byte
    floats, bf16 biases and sinks widened) gives the logits and greedy tokens of an f32 folder holding
    the same values."""
    got = []
    for dtype in ("bf16", "bf16-values"):
        folder = tinygptoss.write_tiny_gptoss_safetensors(tmp_path / dtype, seed=REF["seed"], dtype=dtype)["folder"]
        m = open_model(folder)
        try:
            assert m.weights["layers.0.gate_up_exps_t"].qtype == ("bf16" if dtype == "bf16" else "f32")
            got.append(families.run_golden(device, m.config, m.weights, {**REF, "rows": [0, 299]}))
        finally:
            m.close()
    for r in (0, 299):
        assert np.abs(got[0][0][r] - got[1][0][r]).max() <= 1e-5 * np.abs(got[1][0][r]).max()
    assert got[0][1] == got[1][1]


def test_openai_mxfp4_folder_as_the_mxfp4_gguf(device, tmp_path):
    """OpenAI's release layout (gate_up_proj_blocks / _scales in the row layout, gate and up rows
    interleaved, quantization_config mxfp4), repacked into ggml's blocks on upload, gives the logits
    of the MXFP4 GGUF holding the same blocks, bit for bit; its blocks decode, as transformers'
    convert_moe_packed_tensors reads them, to gguf.quants' values."""
    import gguf
    rows = tinygptoss.tiny_gptoss(REF["seed"])[3]["model.layers.0.mlp.experts.down_proj"].transpose(0, 2, 1)
    blocks, scales = tinygptoss.mxfp4_blocks(np.ascontiguousarray(rows))
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    vals = np.stack([lut[blocks & 15], lut[blocks >> 4]], -1).reshape(*blocks.shape[:-1], 32)
    theirs = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).reshape(rows.shape)
    ours = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType.MXFP4),
                                  gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(theirs, ours)
    folder = tinygptoss.write_tiny_gptoss_safetensors(tmp_path / "mxfp4", seed=REF["seed"], mxfp4=True)["folder"]
    path = tinygptoss.write_tiny_gptoss_gguf(tmp_path / "mxfp4.gguf", seed=REF["seed"], expert_qtype="MXFP4")["path"]
    got = []
    for p in (folder, path):
        m = open_model(p)
        try:
            assert {m.weights[f"layers.1.{x}_exps"].qtype for x in ("gate", "up", "down")} == {"mxfp4"}
            got.append(families.run_golden(device, m.config, m.weights, {**REF, "rows": [0, 299]}))
        finally:
            m.close()
    assert all(np.array_equal(got[0][0][r], got[1][0][r]) for r in (0, 299)) and got[0][1] == got[1][1]


# ---------------------------------------------------------------------- harmony through the server
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                          "maxLength": 12}}, "required": ["city"]}}}]
# the answer a grammar makes the random model write: its reasoning, then the answer
ANSWER = ('start: <|channel|> "analysis" <|message|> "The user wants the capital." <|end|> <|start|> "assistant" '
          '<|channel|> "final" <|message|> "Paris is the capital."')


@pytest.fixture(scope="module")
def server(device, hf_folder):
    from webgpu_engine.engine import EngineConfig
    from webgpu_engine.server.app import ServerOptions, ServerThread
    s = ServerThread(ServerOptions(models=[str(hf_folder)], chat_opts=[{"dtype": "f32", "context_window_size": 1024}],
                                   port=0, engine_config=EngineConfig(device=device)))
    yield s
    s.stop()


def _client(server):
    import openai
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def test_harmony_prompt_and_channels_through_the_openai_client(server):
    """The template renders the conversation in harmony (tools as a functions namespace, a call and
    its result as commentary messages); the analysis channel comes back as reasoning_content and
    the final one as content, whole and streamed."""
    from webgpu_engine.loaders.chat_template import from_folder
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = from_folder(server.opts.models[0]).render(msgs, add_generation_prompt=True, tools=TOOLS)
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text and "type get_weather = " in text
    assert ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            'sunny<|end|><|start|>assistant') in text
    c = _client(server)
    kw = dict(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "The capital of France?"}],
              temperature=0.0, max_tokens=120, response_format={"type": "grammar", "grammar": ANSWER})
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == ("The user wants the capital.", "Paris is the capital.")
    assert r.choices[0].finish_reason == "stop" and not msg.tool_calls
    reasoning, content = "", ""
    for chunk in c.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta if chunk.choices else None
        reasoning += (d.model_extra or {}).get("reasoning_content") or "" if d else ""
        content += (d.content or "") if d else ""
    assert (reasoning, content) == ("The user wants the capital.", "Paris is the capital.")


def test_reasoning_effort_reaches_the_harmony_template(server):
    """OpenAI's reasoning_effort (low / medium / high) is harmony's `Reasoning:` line (the template's
    reasoning_effort), in the prompt a request renders (POST /tokenize) and through the openai client."""
    import json
    import urllib.request

    def prompt(**fields):
        def post(path, body):
            req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            return json.loads(urllib.request.urlopen(req).read())
        ids = post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], **fields})["tokens"]
        return post("/detokenize", {"tokens": ids})["prompt"]
    assert "Reasoning: high\n" in prompt(reasoning_effort="high")
    assert "Reasoning: medium\n" in prompt() and "Reasoning: medium\n" in prompt(reasoning_effort="none")
    c = _client(server)
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}],
                                  reasoning_effort="low", temperature=0.0, max_tokens=120,
                                  response_format={"type": "grammar", "grammar": ANSWER})
    assert r.choices[0].message.content == "Paris is the capital."


def test_harmony_tool_calls_through_the_openai_client(server):
    """A call to functions.get_weather (forced by tool_choice: harmony's commentary message with
    arguments that follow the schema) is an OpenAI tool call, whole and streamed."""
    import json
    c = _client(server)
    kw = dict(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.0,
              max_tokens=120)
    r = c.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"} and call.id.startswith("call_")
    name, args = None, ""
    for chunk in c.chat.completions.create(**kw, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
    assert (name, args) == ("get_weather", call.function.arguments)


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_harmony_parser_streams_what_it_returns(piece):
    """An answer with reasoning, a preamble, a call whose recipient comes before its channel and
    whitespace in its arguments, fed in pieces of 1, 3 or all characters: the deltas add up to the
    message, markers never leak into the text, and without tools a call is text."""
    from webgpu_engine.engine.harmony import HarmonyParser
    from webgpu_engine.engine.tools import HARMONY, ToolContext
    text = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary'
            '<|message|>Checking…<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
            '<|message|>{"city": "Paris" }')
    for tools, want in ((ToolContext(HARMONY, {"get_weather"}, False), {"reasoning_content": "Need the weather.",
                                                                          "content": "Checking…"}),
                        (None, {"reasoning_content": "Need the weather.", "content": 'Checking…{"city": "Paris" }'})):
        parser = HarmonyParser(tools)
        deltas = [d for i in range(0, len(text), piece) for d in parser.feed(text[i:i + piece])]
        last, msg, finish = parser.finish("stop")
        deltas += last
        got = {k: "".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content")}
        assert got == want and {k: msg.get(k) for k in want} == want
        assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)
        if tools is None:
            assert finish == "stop" and "tool_calls" not in msg
            continue
        args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", []))
        (call,) = msg["tool_calls"]
        assert (finish, call["function"]["name"], call["function"]["arguments"], args) == \
            ("tool_calls", "get_weather", '{"city": "Paris" }', '{"city": "Paris" }')


def test_gptoss_f16_activations(device, hf_folder):
    """f16 activations and caches (what a GPU with shader-f16 runs), sinks and the clamped SwiGLU
    included: transformers' logits within 1e-2 of the largest (0.1-0.4 % measured) at the prompt's kept
    positions (each the last row of a prefill chunk) and at the decode steps after it."""
    opened = open_model(hf_folder)
    try:
        got, _ = families.run_golden(device, opened.config, opened.weights, REF, chunk=64, dtype="f16")
    finally:
        opened.close()
    errs = {r: np.abs(got[r] - np.asarray(want)).max() / np.abs(want).max() for r, want in zip(REF["rows"], REF["logits"])}
    assert max(errs.values()) <= 1e-2, errs
