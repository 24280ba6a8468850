"""Ollama's model store (`ollama:NAME:TAG`) and Ollama's HTTP API on `serve`, through the official
`ollama` client: a store laid out as Ollama lays it (manifests + sha256- blobs, made here) serves the
default SmolLM2 GGUF with its params layer, a tiny chat GGUF and a BERT GGUF embedder (llama.cpp's
converter's, as Ollama ships all-minilm); chat, streamed chat, generate (templated and raw), embed and
/api/embeddings (the store's GGUF embedder and the default MiniLM loaded by id), tags, show, ps,
version, `format` json and a JSON Schema, a tool call in Ollama's shape, logprobs, think, dimensions,
keep_alive (a duration in /api/ps, an idle model unloaded); greedy answers equal the OpenAI route's; bad
store layouts and bad API input get typed errors, 4xx `{"error": ...}` bodies, never a 500."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import urllib.request
from pathlib import Path

import jsonschema
import ollama
import openai
import pytest
from tinymodels import write_tiny_llama_gguf

from webgpu_engine.engine import EngineConfig
from webgpu_engine.engine.ollama_store import list_store
from webgpu_engine.engine.references import resolve_model_reference
from webgpu_engine.errors import (
    ModelFormatError,
    OllamaBlobError,
    OllamaManifestNotFoundError,
    UnsupportedModelError,
)
from webgpu_engine.server.app import ServerOptions, ServerThread

MEDIA = "application/vnd.ollama.image."
PARAMS = {"stop": ["<|im_end|>", "\n\n\n"], "temperature": 0.2, "num_ctx": 1024}
HI = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
GREEDY = {"temperature": 0, "num_predict": 12}
GGUF_EMBEDDER = Path(__file__).resolve().parent / "fixtures" / "gguf_embedders" / "bert-q8_0.gguf"
M = "tiny:latest"          # the chat model the server loads (NAME alone finds NAME:latest)


# --------------------------------------------------------------------------- a store as Ollama lays it
class Store:
    def __init__(self, root):
        self.root = root
        (root / "blobs").mkdir(parents=True, exist_ok=True)

    def blob(self, data: bytes | None = None, src=None) -> dict:
        """A blob named by its sha256; `src` is hard-linked in (copied where links cannot be made)."""
        data_hash = hashlib.sha256(data if src is None else src.read_bytes()).hexdigest()
        dst = self.root / "blobs" / f"sha256-{data_hash}"
        if not dst.exists():
            if src is None:
                dst.write_bytes(data)
            else:
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copyfile(src, dst)
        return {"digest": f"sha256:{data_hash}", "size": dst.stat().st_size}

    def manifest(self, name: str, tag: str, layers: list, host="registry.ollama.ai", ns="library",
                 raw: bytes | None = None):
        path = self.root / "manifests" / host / ns / name / tag
        path.parent.mkdir(parents=True, exist_ok=True)
        cfg = {"mediaType": "application/vnd.docker.container.image.v1+json",
               **self.blob(json.dumps({"model_format": "gguf", "model_family": "llama", "model_type": "135M",
                                       "file_type": "Q4_1"}).encode())}
        path.write_bytes(raw if raw is not None else json.dumps(
            {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
             "config": cfg, "layers": layers}).encode())
        return path

    def layer(self, kind: str, data: bytes | None = None, src=None) -> dict:
        return {"mediaType": MEDIA + kind, **self.blob(data, src)}


@pytest.fixture(scope="module")
def store(tmp_path_factory, smollm2_gguf):
    s = Store(tmp_path_factory.mktemp("ollama-models"))
    model = s.layer("model", src=smollm2_gguf)
    params = s.layer("params", json.dumps(PARAMS).encode())
    s.manifest("smollm2", "135m", [model, params])
    s.manifest("smollm2", "latest", [model])
    # what the server loads: a tiny random GGUF (fast on lavapipe), with the same params layer
    tiny = tmp_path_factory.mktemp("tiny-src") / "tiny.gguf"
    write_tiny_llama_gguf(tiny, context_length=2048, seed=3)
    s.manifest("tiny", "latest", [s.layer("model", src=tiny), params])
    # an embedder as Ollama ships them (all-minilm): a BERT GGUF written by llama.cpp's converter
    s.manifest("tiny-minilm", "latest", [s.layer("model", src=GGUF_EMBEDDER)])
    s.manifest("tiny", "q4", [model], host="example.org:5000", ns="team")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLLAMA_MODELS", str(s.root))
        yield s


def test_reference_resolves_the_blob_in_place_with_params(store, smollm2_gguf):
    rec = resolve_model_reference("ollama:smollm2:135m")
    assert rec.model_id == "smollm2:135m" and rec.model_type == "llm"
    assert rec.model.endswith(hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest())
    assert os.path.dirname(rec.model) == str(store.root / "blobs")        # used in place, not copied
    assert rec.overrides["stop_str"] == PARAMS["stop"] and rec.overrides["temperature"] == 0.2
    assert rec.overrides["context_window_size"] == 1024
    assert resolve_model_reference("ollama:smollm2").model_id == "smollm2:latest"
    other = resolve_model_reference("ollama:example.org:5000/team/tiny:q4")
    assert other.model_id == "example.org:5000/team/tiny:q4"
    assert resolve_model_reference("ollama:smollm2", model_id="alias").model_id == "alias"
    rows = {r["name"]: r for r in list_store()}
    assert set(rows) == {"smollm2:135m", "smollm2:latest", "tiny:latest", "tiny-minilm:latest",
                         "example.org:5000/team/tiny:q4"}
    assert rows["smollm2:135m"]["family"] == "llama" and rows["smollm2:135m"]["size"] > 90_000_000


def test_bad_store_layouts_are_typed_errors(store, smollm2_gguf, tmp_path):
    with pytest.raises(OllamaManifestNotFoundError, match="manifests/registry.ollama.ai/library/nope/latest"):
        resolve_model_reference("ollama:nope")
    with pytest.raises(OllamaManifestNotFoundError, match="not a valid part"):
        resolve_model_reference("ollama:../../etc:passwd")
    model = store.layer("model", src=smollm2_gguf)
    store.manifest("badjson", "latest", [], raw=b"{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        resolve_model_reference("ollama:badjson")
    store.manifest("noblob", "latest", [{"mediaType": MEDIA + "model", "digest": "sha256:" + "0" * 64,
                                         "size": 10}])
    with pytest.raises(OllamaBlobError, match="sha256-0000.*missing"):
        resolve_model_reference("ollama:noblob")
    store.manifest("vision", "latest", [model, store.layer("projector", b"\0" * 32)])
    with pytest.raises(ModelFormatError, match="projector layer .* is not a multimodal projector GGUF"):
        resolve_model_reference("ollama:vision")
    store.manifest("badparams", "latest", [model, store.layer("params", b"[1, 2")])
    with pytest.raises(ModelFormatError, match="params layer"):
        resolve_model_reference("ollama:badparams")
    # a blob whose bytes changed after the manifest was written (same size: only the hash sees it)
    fake = store.layer("params", b'{"temperature": 0.5}')
    store.manifest("tampered", "latest", [model, fake])
    (store.root / "blobs" / fake["digest"].replace(":", "-")).write_bytes(b'{"temperature": 0.9}')
    with pytest.raises(OllamaBlobError, match="does not match its digest"):
        resolve_model_reference("ollama:tampered")
    rows = {r["name"]: r for r in list_store()}
    assert "not valid JSON" in rows["badjson:latest"]["error"]


def test_go_template_without_a_jinja_one_is_refused_by_name(store, tmp_path, monkeypatch):
    import gguf
    with monkeypatch.context() as mp:                   # a chat GGUF that carries no Jinja template
        mp.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, template: None)
        write_tiny_llama_gguf(tmp_path / "bare.gguf", context_length=256)
    model = store.layer("model", src=tmp_path / "bare.gguf")
    go = store.layer("template", b"{{ if .System }}{{ .System }}{{ end }}{{ .Prompt }}")
    store.manifest("gotemplate", "latest", [model, go])
    with pytest.raises(UnsupportedModelError, match="Go template layer"):
        resolve_model_reference("ollama:gotemplate")
    store.manifest("bare", "latest", [model])            # without one it loads (completions only)
    assert resolve_model_reference("ollama:bare").model_id == "bare:latest"


def test_list_ollama_command(store, capsys):
    from webgpu_engine.cli import main
    assert main(["list", "--ollama", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["smollm2:135m"]["parameter_size"] == "135M" and rows["tiny:latest"]["size"] > 0
    assert main(["list", "--ollama"]) == 0
    out = capsys.readouterr().out
    assert "example.org:5000/team/tiny:q4" in out and "98." in out     # SmolLM2's 98 MB


# --------------------------------------------------------------------------- the API
def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(device, store):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")           # /api/pull of a Hugging Face GGUF: offline here
        s = ServerThread(ServerOptions(models=["ollama:tiny", "all-MiniLM-L6-v2", "ollama:tiny-minilm"], port=0,
                                       engine_config=EngineConfig(device=device),
                                       chat_opts=[{"max_num_sequences": 1}, None, None]))
        yield s
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base, timeout=300)


def test_chat_equals_the_openai_route_and_streams(server, client):
    r = client.chat(model=M, messages=HI, options=GREEDY, stream=False)
    assert r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant"
    assert r.message.content and r.eval_count >= 1 and r.prompt_eval_count > 10
    assert r.total_duration > 0 and r.eval_duration > 0 and r.prompt_eval_duration > 0
    o = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    ref = o.chat.completions.create(model=M, messages=HI, temperature=0, max_tokens=12)
    assert r.message.content == ref.choices[0].message.content
    assert r.eval_count == ref.usage.completion_tokens and r.prompt_eval_count == ref.usage.prompt_tokens
    parts = list(client.chat(model="tiny", messages=HI, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].eval_count == r.eval_count and parts[-1].done_reason == r.done_reason
    # top_k 1 / min_p 1 leave the best token only: sampled at temperature 1.5 it answers as greedy
    for opts in ({"top_k": 1}, {"min_p": 1.0}):
        hot = client.chat(model=M, messages=HI, options={**GREEDY, "temperature": 1.5, "seed": 3, **opts})
        assert hot.message.content == r.message.content


def test_generate_templated_raw_and_load(server, client):
    g = client.generate(model=M, prompt=HI[0]["content"], options=GREEDY)
    c = client.chat(model=M, messages=HI, options=GREEDY)
    assert g.response == c.message.content and g.done
    parts = list(client.generate(model=M, prompt=HI[0]["content"], options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == g.response and parts[-1].eval_count == g.eval_count
    o = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    raw = client.generate(model=M, prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 8})
    ref = o.completions.create(model=M, prompt="The capital of France is", temperature=0,
                               max_tokens=8)
    assert raw.response == ref.choices[0].text and raw.eval_count == ref.usage.completion_tokens
    streamed = "".join(p.response for p in client.generate(model=M, prompt="The capital of "
                       "France is", raw=True, stream=True, options={"temperature": 0, "num_predict": 8}))
    assert streamed == raw.response
    load = client.generate(model=M)       # no prompt: Ollama's "load the model"
    assert load.done and load.done_reason == "load" and load.response == ""


def test_embed_and_the_older_embeddings_route(server, client):
    o = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    texts = ["a cat sits on the mat", "Grüße aus Köln"]
    e = client.embed(model="all-MiniLM-L6-v2", input=texts)
    ref = o.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 384
    assert e.embeddings[1] == pytest.approx(ref.data[1].embedding, abs=1e-6)
    assert e.prompt_eval_count == ref.usage.prompt_tokens
    old = client.embeddings(model="all-MiniLM-L6-v2", prompt=texts[0])
    assert old.embedding == pytest.approx(e.embeddings[0], abs=1e-6)
    # the store's GGUF embedder (served as NAME:TAG, found by NAME), normalised as Ollama returns it
    g = client.embed(model="tiny-minilm", input=texts)
    ref = o.embeddings.create(model="tiny-minilm:latest", input=texts, encoding_format="float")
    assert g.model == "tiny-minilm:latest" and len(g.embeddings) == 2
    assert g.embeddings[0] == pytest.approx(ref.data[0].embedding, abs=1e-6)
    assert math.sqrt(sum(x * x for x in g.embeddings[1])) == pytest.approx(1.0, abs=1e-4)
    assert client.show("tiny-minilm").capabilities == ["embedding"]


def test_tags_show_ps_version(server, client, store):
    names = {m.model: m for m in client.list().models}
    assert set(names) == {M, "all-MiniLM-L6-v2", "tiny-minilm:latest"}
    sm = names[M]
    assert sm.details.family == "llama" and sm.details.quantization_level == "Q4_1" and sm.size > 0
    manifest = store.root / "manifests/registry.ollama.ai/library/tiny/latest"
    assert sm.digest == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert names["all-MiniLM-L6-v2"].details.format == "safetensors"
    s = client.show(M)
    assert 'stop "<|im_end|>"' in s.parameters and "temperature 0.2" in s.parameters
    assert "<|im_start|>" in s.template and s.modelinfo["llama.context_length"] == 1024
    assert "completion" in s.capabilities
    assert client.show("all-MiniLM-L6-v2").capabilities == ["embedding"]
    ps = {m.model: m for m in client.ps().models}
    assert ps[M].context_length == 1024 and ps[M].size_vram > 0
    with urllib.request.urlopen(server.base + "/api/version") as r:
        assert json.loads(r.read())["version"]


def test_format_json_and_schema(client):
    r = client.chat(model=M, messages=[{"role": "user", "content": "Give a trip as JSON."}],
                    format=CITY, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(r.message.content), CITY)
    r = client.generate(model=M, prompt="Reply in JSON.", format="json",
                        options={"temperature": 0, "num_predict": 24})
    assert r.response.lstrip().startswith("{")


def test_tool_call_in_ollamas_shape(server, client):
    def forecast(city: str, days: int) -> str:
        """Weather forecast.

        Args:
          city: the city
          days: how many days
        """
        return "sunny"
    # Ollama has no tool_choice; this server takes one as an extension, so the tiny model must call
    r = ollama.ChatResponse(**_post(server, "/api/chat", {
        "model": M, "messages": HI, "stream": False, "options": {"temperature": 0, "num_predict": 200},
        "tools": [{"type": "function", "function": {"name": "forecast", "description": "Weather forecast",
                                                    "parameters": CITY}}],
        "tool_choice": "required"}))
    call = r.message.tool_calls[0]
    body = {"model": M, "messages": HI, "options": {"temperature": 0, "num_predict": 200}, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "forecast", "parameters": CITY}}]}
    req = urllib.request.Request(server.base + "/api/chat", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:                # streamed (Ollama's default)
        assert resp.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in resp.read().splitlines()]
    calls = [c for x in lines for c in x["message"].get("tool_calls") or []]
    assert lines[-1]["done"] and len(calls) >= 1 and isinstance(calls[0]["function"]["arguments"], dict)
    jsonschema.validate(calls[0]["function"]["arguments"], CITY)
    assert call.function.name == "forecast" and isinstance(call.function.arguments, dict)
    jsonschema.validate(dict(call.function.arguments), CITY)
    # the call goes back as Ollama sends it (arguments an object) with the tool's answer
    follow = client.chat(model=M, tools=[forecast], options=GREEDY, stream=False, messages=[
        *HI, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "sunny", "tool_name": "forecast"}])
    assert follow.done


def test_logprobs_dimensions_and_think(server, client):
    """logprobs / top_logprobs in Ollama's shape, equal to the OpenAI route's (chat, streamed chat,
    raw generate); /api/embed's dimensions; think's levels accepted on a template without thinking."""
    o = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    r = client.chat(model=M, messages=HI, options=GREEDY, logprobs=True, top_logprobs=3)
    ref = o.chat.completions.create(model=M, messages=HI, temperature=0, max_tokens=12, logprobs=True,
                                    top_logprobs=3).choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in r.logprobs] == [(e.token, e.logprob) for e in ref]
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in r.logprobs)
    assert "".join(e.token for e in r.logprobs) == r.message.content
    parts = list(client.chat(model=M, messages=HI, options=GREEDY, logprobs=True, stream=True))
    assert [(e.token, e.logprob) for p in parts for e in p.logprobs or []] == [(e.token, e.logprob) for e in ref]
    raw = client.generate(model=M, prompt="The capital of France is", raw=True, logprobs=True, top_logprobs=2,
                          options={"temperature": 0, "num_predict": 6})
    cref = o.completions.create(model=M, prompt="The capital of France is", temperature=0, max_tokens=6,
                                logprobs=2).choices[0].logprobs
    assert [(e.token, e.logprob) for e in raw.logprobs] == list(zip(cref.tokens, cref.token_logprobs))
    assert client.chat(model=M, messages=HI, options=GREEDY).logprobs is None
    # dimensions goes to the embeddings path: its own size is taken, a cut of a model not trained
    # for it (not Matryoshka) is a 400 naming the field
    e = client.embed(model="all-MiniLM-L6-v2", input=["a cat"], dimensions=384)
    assert len(e.embeddings[0]) == 384
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model="all-MiniLM-L6-v2", input=["a cat"], dimensions=64)
    assert err.value.status_code == 400 and "dimensions" in err.value.error
    plain = client.chat(model=M, messages=HI, options=GREEDY)
    for think in (True, "medium"):        # SmolLM2's template has no thinking: the same answer
        t = client.chat(model=M, messages=HI, options=GREEDY, think=think)
        assert t.message.content == plain.message.content and not t.message.thinking
    back = client.chat(model=M, options=GREEDY, messages=[*HI, {"role": "assistant", "content": "Paris.",
                                                               "thinking": "easy"}, *HI])
    assert back.done                      # an earlier answer's thinking sent back is accepted


@pytest.mark.parametrize("path,body,status,says", [
    ("/api/chat", {"model": M, "messages": HI, "options": {"mirostat": 2}}, 400, "mirostat"),
    ("/api/chat", {"model": M, "messages": HI, "options": {"num_ctx": 99999}}, 400, "num_ctx"),
    ("/api/chat", {"model": M, "messages": HI, "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/chat", {"model": M, "messages": [{"role": "user", "content": "x", "images": ["AA=="]}]},
     400, "images"),
    ("/api/chat", {"model": "nope", "messages": HI}, 404, "nope"),
    ("/api/chat", {"model": M, "messages": "hi"}, 400, "messages"),
    ("/api/chat", {"model": M, "messages": HI, "format": 3}, 400, "format"),
    ("/api/chat", {"model": M, "messages": HI, "think": "max"}, 400, "think"),
    ("/api/chat", {"model": M, "messages": HI, "logprobs": "yes"}, 400, "logprobs"),
    ("/api/chat", {"model": M, "messages": HI, "keep_alive": "5 parsecs"}, 400, "keep_alive"),
    ("/api/generate", {"model": M, "prompt": "x", "top_logprobs": 50}, 400, "top_logprobs"),
    ("/api/generate", {"model": M, "prompt": "x", "context": [1, 2]}, 400, "context"),
    ("/api/generate", {"model": M, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/generate", {"model": M, "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"model": M, "prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/api/embed", {"model": M, "input": "x"}, 400, "chat model"),
    ("/api/embed", {"model": "all-MiniLM-L6-v2", "input": [1, 2]}, 400, "input"),
    ("/api/embed", {"model": "all-MiniLM-L6-v2", "input": "x", "truncate": False}, 400, "truncate"),
    ("/api/pull", {"model": "llama3.2:1b"}, 404, "ollama pull"),
    ("/api/nope", {}, 404, "Unknown route"),
])
def test_bad_api_input_is_an_ollama_4xx(server, path, body, status, says):
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server, path, body)
    assert e.value.code == status
    err = json.loads(e.value.read())["error"]
    assert isinstance(err, str) and says in err


def test_client_errors_api_key_and_pull(server, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=M, messages=HI, options={"typical_p": 0.5})
    assert e.value.status_code == 400 and "typical_p" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(M)                                  # model management is off
    assert e.value.status_code == 403 and "allow-model-management" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/org/repo:Q4_K_M")              # downloads need model management too
    assert e.value.status_code == 403
    assert client.pull("smollm2:135m", stream=False).status == "success"      # in the store: verified
    assert [p.status for p in client.pull("smollm2:135m", stream=True)][-1] == "success"
    server.opts.api_key = "sesame"                        # the API key guards /api/ as it does /v1/
    try:
        with pytest.raises(ollama.ResponseError) as e:
            client.list()
        assert e.value.status_code == 401 and "API key" in e.value.error
        keyed = ollama.Client(host=server.base, timeout=300, headers={"Authorization": "Bearer sesame"})
        assert keyed.chat(model=M, messages=HI, options=GREEDY).done       # still serving
    finally:
        server.opts.api_key = None


def test_model_management_keep_alive_and_delete(server, client):
    """Last: it unloads both models."""
    server.opts.allow_model_management = True
    try:
        with pytest.raises(ollama.ResponseError) as e:
            client.pull("hf.co/org/repo:Q4_K_M")          # offline: a clear error, not a 500
        assert 400 <= e.value.status_code < 600 and e.value.status_code != 500 and "org/repo" in e.value.error
        # a duration: /api/ps tells when; a negative one: never; a request restarts the wait
        client.chat(model=M, messages=HI, options=GREEDY, keep_alive="1h")
        exp = {m.model: m for m in client.ps().models}[M].expires_at
        assert abs(exp.timestamp() - time.time() - 3600) < 120, exp
        client.chat(model=M, messages=HI, options=GREEDY, keep_alive=-1)
        assert {m.model: m for m in client.ps().models}[M].expires_at.year == 2318
        # idle past its keep_alive, a model is unloaded; the others stay
        client.embed(model="tiny-minilm", input="x", keep_alive="1s")
        t0 = time.time()
        while "tiny-minilm:latest" in {m.model for m in client.ps().models} and time.time() - t0 < 30:
            time.sleep(0.2)
        left = {m.model for m in client.ps().models}
        assert "tiny-minilm:latest" not in left and M in left, left
        r = client.chat(model=M, messages=HI, options=GREEDY, keep_alive=0)
        assert r.done and M not in {m.model for m in client.ps().models}
        assert client.delete("all-MiniLM-L6-v2").status == "success"
        assert client.list().models == []
        with pytest.raises(ollama.ResponseError) as e:
            client.delete("all-MiniLM-L6-v2")
        assert e.value.status_code == 404
    finally:
        server.opts.allow_model_management = False
