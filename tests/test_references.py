"""Model references resolved into records and loaded through the engine: a local GGUF, an HF folder, a
sentence-transformers folder, URLs (a local HTTP server), Hugging Face repo ids from a pre-filled
Hugging Face cache (offline), and the typed errors of bad references. Tiny models written here."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cache_server import FileServer
from tinymodels import write_tiny_bert, write_tiny_llama_gguf, write_tiny_llama_safetensors
from webgpu_engine import errors as E
from webgpu_engine.engine import EngineConfig, create_mlc_engine, default_app_config
from webgpu_engine.engine.records import EMBEDDING, LLM
from webgpu_engine.engine.references import resolve_model_reference

REV = "0123456789abcdef0123456789abcdef01234567"
U = [{"role": "user", "content": "Hello world"}]


def fake_hf_repo(hub: Path, repo: str, files: dict[str, Path]) -> Path:
    """A repo as huggingface_hub caches it: models--ORG--REPO/{refs/main, snapshots/<rev>/...}."""
    d = hub / ("models--" + repo.replace("/", "--"))
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(REV)
    snap = d / "snapshots" / REV
    for name, src in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, snap / name)
    return snap


def _folder_files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models on disk, a pre-filled Hugging Face cache and an artifact cache root, with the
    environment pointing at them (HF_HUB_OFFLINE=1: nothing may reach a hub)."""
    root = tmp_path_factory.mktemp("refs")
    m = {"root": root}
    m["gguf"] = write_tiny_llama_gguf(root / "tiny-llama.gguf", qtype="q8_0")["path"]
    (root / "other").mkdir()
    q4 = write_tiny_llama_gguf(root / "other" / "tiny-llama-Q4_0.gguf", qtype="q4_0")["path"]
    m["hf"] = write_tiny_llama_safetensors(root / "tiny-hf")["folder"]
    m["bert"] = write_tiny_bert(root / "tiny-bert")["folder"]
    hub = root / "hub"
    m["snap_gguf"] = fake_hf_repo(hub, "test-org/tiny-GGUF", {"tiny-llama-Q8_0.gguf": m["gguf"],
                                                              "tiny-llama-Q4_0.gguf": q4})
    fake_hf_repo(hub, "test-org/tiny-llama", _folder_files(m["hf"]))
    fake_hf_repo(hub, "test-org/tiny-minilm", _folder_files(m["bert"]))
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_CACHE", str(hub))
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("WEBGPU_ENGINE_CACHE", str(root / "artifacts"))
    yield m
    mp.undo()


@pytest.fixture(scope="module")
def server(models):
    with FileServer() as srv:
        srv.add("files/tiny-llama.gguf", models["gguf"].read_bytes())
        srv.add("files/tiny-by-url.gguf", models["gguf"].read_bytes())
        for name, p in _folder_files(models["bert"]).items():
            srv.add(f"st/tiny-minilm/{name}", p.read_bytes())
        yield srv


# --------------------------------------------------------------------------- each kind of reference
def test_local_gguf_file_and_folders(models):
    rec = resolve_model_reference(str(models["gguf"]))
    assert (rec.model_id, rec.model_type, Path(rec.model)) == ("tiny-llama", LLM, models["gguf"])
    assert rec.is_local and rec.overrides["context_window_size"] == 256     # the tiny model's trained context
    rec = resolve_model_reference(str(models["hf"]))
    assert (rec.model_id, rec.model_type, Path(rec.model)) == ("tiny-hf", LLM, models["hf"])
    rec = resolve_model_reference(str(models["bert"]), model_id="my-embedder")
    assert (rec.model_id, rec.model_type) == ("my-embedder", EMBEDDING)
    rec = resolve_model_reference(str(models["root"] / "other"))        # a folder holding one .gguf
    assert rec.model_id == "tiny-llama-Q4_0" and rec.model.endswith("tiny-llama-Q4_0.gguf")


def test_app_config_ids_win(models):
    cfg = default_app_config()
    assert resolve_model_reference("all-MiniLM-L6-v2", app_config=cfg) is cfg.get("all-MiniLM-L6-v2")


def test_hugging_face_repo_ids_from_the_hf_cache(models):
    rec = resolve_model_reference("test-org/tiny-GGUF:Q8_0")
    assert (rec.model_id, rec.model_type) == ("test-org/tiny-GGUF:Q8_0", LLM)
    assert Path(rec.model) == models["snap_gguf"] / "tiny-llama-Q8_0.gguf"
    assert rec.reference == "hf://test-org/tiny-GGUF/tiny-llama-Q8_0.gguf"
    rec = resolve_model_reference("hf.co/test-org/tiny-GGUF:q4_0")          # Ollama's spelling, any case
    assert rec.model.endswith("tiny-llama-Q4_0.gguf") and rec.model_id == "test-org/tiny-GGUF:q4_0"
    rec = resolve_model_reference("test-org/tiny-GGUF:tiny-llama-Q4_0.gguf")    # a file name
    assert rec.model.endswith("tiny-llama-Q4_0.gguf")
    rec = resolve_model_reference("test-org/tiny-llama")                   # safetensors repo: a folder
    assert (rec.model_id, rec.model_type) == ("test-org/tiny-llama", LLM) and Path(rec.model).is_dir()
    rec = resolve_model_reference("https://huggingface.co/test-org/tiny-minilm")
    assert (rec.model_id, rec.model_type) == ("test-org/tiny-minilm", EMBEDDING)
    assert (Path(rec.model) / "1_Pooling" / "config.json").is_file()


def test_urls_of_a_file_and_of_a_folder(models, server):
    rec = resolve_model_reference(server.url("files/tiny-llama.gguf"))
    assert (rec.model_id, rec.model_type) == ("tiny-llama", LLM)
    assert Path(rec.model).read_bytes() == models["gguf"].read_bytes()
    assert Path(rec.model).is_relative_to(models["root"] / "artifacts")
    n = server.count("files/tiny-llama.gguf")
    resolve_model_reference(server.url("files/tiny-llama.gguf"))            # cached: no second download
    assert server.count("files/tiny-llama.gguf") == n
    rec = resolve_model_reference(server.url("st/tiny-minilm/"))
    assert (rec.model_id, rec.model_type) == ("tiny-minilm", EMBEDDING)
    assert (Path(rec.model) / "1_Pooling" / "config.json").is_file()
    served = server.total_requests()
    assert resolve_model_reference(server.url("st/tiny-minilm/"), offline=True).model == rec.model
    assert server.total_requests() == served                            # offline: the cache alone


def test_hugging_face_hub_through_hf_endpoint(models, tmp_path, monkeypatch):
    """Online: the repo listing and the files come from the hub (HF_ENDPOINT) into the HF cache, once;
    later the cache answers alone, offline and with the hub unreachable alike."""
    from hf_hub_server import HubServer
    bert = {name: p.read_bytes() for name, p in _folder_files(models["bert"]).items()}
    with HubServer() as hub:
        hub.add_repo("hub-org/tiny-GGUF", {"tiny-llama-Q8_0.gguf": models["gguf"].read_bytes(), "README.md": b"x"})
        hub.add_repo("hub-org/tiny-minilm", {**bert, "pytorch_model.bin": b"not wanted", "onnx/model.onnx": b"no"})
        hub.gate("hub-org/gated")
        falcon = {**bert, "config.json": b'{"architectures": ["FalconForCausalLM"], "model_type": "falcon"}'}
        hub.add_repo("hub-org/tiny-falcon", falcon)
        hub.add_repo("hub-org/split-GGUF", {f"Q8_0/m-Q8_0-0000{i}-of-00002.gguf": b"GGUF" for i in (1, 2)})
        hub.add_repo("hub-org/torch-only", {"config.json": bert["config.json"], "tokenizer.json": b"{}",
                                            "pytorch_model.bin": b"x"})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE")
        rec = resolve_model_reference("hub-org/tiny-GGUF")             # the repo's only GGUF
        assert rec.model_type == LLM and Path(rec.model).read_bytes() == models["gguf"].read_bytes()
        assert Path(rec.model).is_relative_to(tmp_path / "hub-cache")
        assert resolve_model_reference("hub-org/tiny-GGUF:Q8_0").model == rec.model
        assert hub.downloads("hub-org/tiny-GGUF", "tiny-llama-Q8_0.gguf") == 1
        st = resolve_model_reference("hub-org/tiny-minilm")
        assert st.model_type == EMBEDDING and (Path(st.model) / "1_Pooling" / "config.json").is_file()
        assert not (Path(st.model) / "pytorch_model.bin").exists() and not (Path(st.model) / "onnx").exists()
        with pytest.raises(E.ModelAccessError, match="gated.*HF_TOKEN") as ei:
            resolve_model_reference("hub-org/gated")
        assert ei.value.http_status == 403
        with pytest.raises(E.ModelReferenceError, match="no such Hugging Face repo"):
            resolve_model_reference("hub-org/missing")
        with pytest.raises(E.UnsupportedModelError, match="FalconForCausalLM"):
            resolve_model_reference("hub-org/tiny-falcon")
        assert hub.downloads("hub-org/tiny-falcon", "model.safetensors") == 0       # refused on config.json
        with pytest.raises(E.ModelReferenceError, match="lacks safetensors weights"):
            resolve_model_reference("hub-org/torch-only")
        assert hub.downloads("hub-org/torch-only", "config.json") == 0
        with pytest.raises(E.UnsupportedModelError, match="split into 2 files"):
            resolve_model_reference("hub-org/split-GGUF:Q8_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_reference("hub-org/tiny-GGUF:Q8_0").model == rec.model
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.port}")   # stopped: nothing answers
    assert resolve_model_reference("hub-org/tiny-minilm").model == st.model


# --------------------------------------------------------------------------- bad references
def test_bad_references_fail_with_what_was_tried(models, tmp_path):
    cfg = default_app_config()
    with pytest.raises(E.ModelReferenceError) as ei:
        resolve_model_reference(str(tmp_path / "missing.gguf"), app_config=cfg)
    assert "no file or folder at" in str(ei.value) and "SmolLM2-135M-Instruct-Q4_1" in str(ei.value)
    with pytest.raises(E.ModelReferenceError) as ei:
        resolve_model_reference("nope", app_config=cfg)
    assert len(ei.value.tried) == 3 and "not a Hugging Face repo id" in ei.value.tried[-1]
    with pytest.raises(E.ModelReferenceError) as ei:
        resolve_model_reference("no-org/no-repo:Q4_K_M", app_config=cfg)
    assert len(ei.value.tried) == 3 and "Hugging Face cache" in ei.value.tried[-1]
    assert ei.value.http_status == 404
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(E.ModelReferenceError, match="lacks config.json, tokenizer.json"):
        resolve_model_reference(str(tmp_path / "empty"))
    with pytest.raises(E.AmbiguousModelReferenceError) as ei:
        resolve_model_reference("test-org/tiny-GGUF")           # two GGUFs, none of them Q4_K_M
    assert sorted(ei.value.candidates) == ["tiny-llama-Q4_0.gguf", "tiny-llama-Q8_0.gguf"]
    assert ei.value.http_status == 400
    with pytest.raises(E.ModelReferenceError, match=r"no GGUF in test-org/tiny-GGUF matches 'Q6_K'.*Q4_0"):
        resolve_model_reference("test-org/tiny-GGUF:Q6_K")
    with pytest.raises(E.ModelReferenceError, match="matches 'Q4' .*Choose one of its files"):
        resolve_model_reference("test-org/tiny-GGUF:Q4", app_config=cfg)    # Q4 is not Q4_0


def test_unsupported_files_are_refused_by_name(models, tmp_path):
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(tmp_path / "tiny-gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(E.UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        resolve_model_reference(str(tmp_path / "tiny-gpt2.gguf"))
    shutil.copytree(models["hf"], tmp_path / "phi")
    cfg = (tmp_path / "phi" / "config.json")
    cfg.write_text(cfg.read_text().replace("LlamaForCausalLM", "FalconForCausalLM").replace('"llama"', '"falcon"'))
    with pytest.raises(E.UnsupportedModelError, match="FalconForCausalLM"):
        resolve_model_reference(str(tmp_path / "phi"))


# --------------------------------------------------------------------------- through the engine
async def test_every_kind_loads_and_answers_in_one_engine(device, models, server):
    refs = [str(models["gguf"]), str(models["hf"]), "test-org/tiny-GGUF:Q4_0",
            server.url("files/tiny-by-url.gguf"), "test-org/tiny-llama", "test-org/tiny-minilm",
            server.url("st/tiny-minilm/")]
    # compile_at_load off: a faster load of the seven models (nothing here asserts on compiling)
    fast = {"compile_at_load": False}
    engine = await create_mlc_engine(refs, EngineConfig(device=device),
                                     [{"context_window_size": 128, **fast}] + [fast] * 6)
    try:
        ids = ["tiny-llama", "tiny-hf", "test-org/tiny-GGUF:Q4_0", "tiny-by-url", "test-org/tiny-llama",
               "test-org/tiny-minilm", "tiny-minilm"]
        assert list(engine.models) == ids
        assert engine.models["tiny-llama"].chat_config.context_window_size == 128        # chat_opts win
        assert engine.models["tiny-hf"].chat_config.context_window_size == 256           # trained context
        answers = {}
        for mid in ids[:5]:
            r = await engine.chat.completions.create(model=mid, messages=U, max_tokens=3, temperature=0,
                                                     ignore_eos=True)
            assert r.model == mid and r.usage.completion_tokens == 3
            answers[mid] = r.choices[0].message.content
        assert answers["tiny-by-url"] == answers["tiny-llama"]          # the same file, by URL and by path
        a = await engine.embeddings.create(model=ids[5], input=["a cat", "the dog"])
        b = await engine.embeddings.create(model=ids[6], input=["a cat", "the dog"])
        assert len(a.data[0].embedding) == 64
        assert a.data[1].embedding == pytest.approx(b.data[1].embedding, abs=1e-5)   # the same model twice
        assert engine.app_config.get("tiny-llama").reference == str(models["gguf"])
    finally:
        await engine.unload()
    with pytest.raises(E.ModelReferenceError):
        await engine.reload(str(models["root"] / "nope.gguf"))
    rec = resolve_model_reference(str(models["gguf"]), model_id="alias")      # aliasing from Python
    engine.set_app_config(engine.app_config.with_records(rec))
    await engine.reload("alias")
    try:
        r = await engine.chat.completions.create(messages=U, max_tokens=1)
        assert list(engine.models) == ["alias"] and r.model == "alias"
    finally:
        await engine.unload()


# --------------------------------------------------------------------------- the command line
def test_cli_resolves_references_and_aliases(models, tmp_path):
    from webgpu_engine.cli import _models, build_parser
    args = build_parser().parse_args(["serve", "--model", str(models["gguf"]), "--model", "test-org/tiny-minilm",
                                      "--model-id", "chat"])
    app, ids = _models(args, args.model)
    assert ids == ["chat", "test-org/tiny-minilm"]
    assert app.get("chat").model == str(models["gguf"]) and app.get("test-org/tiny-minilm").model_type == EMBEDDING
    assert "SmolLM2-135M-Instruct-Q4_1" in app.ids()                   # the built-in records stay known
    args = build_parser().parse_args(["chat", "--model", str(models["gguf"]), "--model-id", "a", "hi"])
    assert _models(args, [args.model])[1] == ["a"]
    args = build_parser().parse_args(["serve", "--model", str(models["gguf"]),
                                      "--model-id", "a", "--model-id", "b"])
    with pytest.raises(E.InvalidRequestError, match="2 --model-id given for 1 --model"):
        _models(args, args.model)


def test_cli_load_options_per_model():
    from webgpu_engine.cli import _chat_opts, build_parser
    args = build_parser().parse_args(["serve", "--model", "a", "--model", "b", "--context-window", "512",
                                      "--dtype", "f32", "--dtype", "auto", "--chat-opts", '{"temperature": 0.2}'])
    assert _chat_opts(args, 2) == [{"temperature": 0.2, "context_window_size": 512, "dtype": "f32"},
                                   {"temperature": 0.2, "context_window_size": 512, "dtype": "auto"}]
    assert _chat_opts(build_parser().parse_args(["serve"]), 2) is None
    args = build_parser().parse_args(["serve", "--prefill-chunk", "1", "--prefill-chunk", "2",
                                      "--prefill-chunk", "3"])
    with pytest.raises(E.InvalidRequestError, match="given 3 times for 2 models"):
        _chat_opts(args, 2)
    with pytest.raises(E.InvalidRequestError, match="must be a JSON object"):
        _chat_opts(build_parser().parse_args(["chat", "--chat-opts", "[1]"]), 1)


def test_cli_app_config_json(models, tmp_path):
    import json
    from webgpu_engine.cli import _models, build_parser
    shutil.copyfile(models["gguf"], tmp_path / "chat.gguf")
    (tmp_path / "app_config.json").write_text(json.dumps({"model_list": [
        {"model_id": "my-chat", "model": "chat.gguf", "model_type": 0, "overrides": {"context_window_size": 128}},
        {"model_id": "my-embedder", "model": str(models["bert"]), "model_type": "embedding"}]}))
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "app_config.json")])
    app, ids = _models(args, args.model or [])
    assert ids == [] and app.ids() == ["my-chat", "my-embedder"]
    assert app.get("my-chat").model == str(tmp_path / "chat.gguf")         # relative to the JSON file
    assert app.get("my-chat").overrides == {"context_window_size": 128}
    bad = {"model_list": [{"model_id": "x", "model": "y", "model_type": 2}]}       # 2: WebLLM's VLM
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "bad.json")])
    with pytest.raises(E.InvalidRequestError, match="model_type 2 has no pipeline"):
        _models(args, [])


def test_cli_download_and_info_take_references(models, capsys):
    from webgpu_engine.cli import main
    assert main(["download", "--quiet", "test-org/tiny-GGUF:Q8_0"]) == 0
    assert capsys.readouterr().out.strip() == \
        f"test-org/tiny-GGUF:Q8_0: {models['snap_gguf'] / 'tiny-llama-Q8_0.gguf'}"
    assert main(["download", "--quiet", "no-org/none"]) == 1
    assert "no-org/none" in capsys.readouterr().err
    assert main(["info", "--model", "test-org/tiny-minilm"]) == 0
    out = capsys.readouterr().out
    assert "model:     test-org/tiny-minilm   type: embedding" in out and "MiB on the GPU" in out


def test_serve_two_references_through_the_openai_client(models):
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    import openai
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    proc = subprocess.Popen([sys.executable, "-m", "webgpu_engine", "serve", "--model", str(models["gguf"]),
                             "--model", "test-org/tiny-minilm", "--model-id", "tiny-chat", "--port", str(port),
                             "--chat-opts", '{"compile_at_load": false}'],   # a faster load
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if b'"ready"' in r.read():
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not become ready"
            time.sleep(0.3)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert sorted(m.id for m in c.models.list()) == ["test-org/tiny-minilm", "tiny-chat"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
            listed = {m["id"]: m for m in json.loads(resp.read())["data"]}
        assert listed["tiny-chat"]["model_type"] == LLM and listed["tiny-chat"]["context_window"] == 256
        assert listed["test-org/tiny-minilm"]["model_type"] == EMBEDDING
        assert listed["test-org/tiny-minilm"]["context_window"] > 0
        for m in listed.values():
            assert m["memory"]["estimated_bytes"] > 0 and m["memory"]["allocated_bytes"] > 0
        r = c.chat.completions.create(model="tiny-chat", messages=U, max_tokens=2, temperature=0)
        assert r.model == "tiny-chat" and r.usage.completion_tokens >= 1
        assert len(c.embeddings.create(model="test-org/tiny-minilm", input="a cat").data[0].embedding) == 64
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "webgpu_engine", "serve", "--model", "./no-such.gguf",
                          "--port", str(port)], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.startswith("error: Cannot load model './no-such.gguf'")
    # A model that resolves but then fails to load: the server says why and exits 1 (it does not keep
    # running without its models).
    bad = subprocess.run([sys.executable, "-m", "webgpu_engine", "serve", "--model", str(models["gguf"]),
                          "--chat-opts", '{"sliding_window_size": 64}', "--port", str(port)],
                         cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert "error: cannot serve tiny-llama: " in bad.stderr and "sliding_window_size" in bad.stderr
    assert "Traceback" not in bad.stderr


async def test_reload_reports_downloads_and_takes_aliases(device, models, tmp_path, monkeypatch):
    """reload() of references that must be fetched reports the downloads to init_progress_callback
    (a URL into the artifact cache, a repo from the hub into the HF cache), never going backwards;
    `aliases` name the models in engine.models, /v1/models (describe) and responses."""
    from hf_hub_server import HubServer
    reports: list[dict] = []
    with FileServer() as files, HubServer() as hub:
        files.add("fresh/tiny-fresh.gguf", models["gguf"].read_bytes())
        hub.add_repo("hub-org/fresh-GGUF", {"tiny-llama-Q8_0.gguf": models["gguf"].read_bytes()})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE")
        engine = await create_mlc_engine([files.url("fresh/tiny-fresh.gguf"), "hub-org/fresh-GGUF"],
                                         EngineConfig(device=device, init_progress_callback=reports.append),
                                         aliases=["by-url", "by-hub"])
    try:
        assert list(engine.models) == ["by-url", "by-hub"]
        r = await engine.chat.completions.create(model="by-hub", messages=U, max_tokens=1)
        assert r.model == "by-hub"
        d = engine.models["by-url"].describe(engine.device)
        assert d["context_window"] > 0 and d["memory"]["estimated_bytes"] > 0
        assert 0 < d["memory"]["allocated_bytes"]
    finally:
        await engine.unload()
    url = [r for r in reports if r["text"].startswith(f"[{files.url('fresh/tiny-fresh.gguf')}] Fetching")]
    hub_ = [r for r in reports if r["text"].startswith("[hub-org/fresh-GGUF] fetching tiny-llama-Q8_0.gguf")]
    assert url and hub_, [r["text"] for r in reports]
    assert all(r["progress"] <= 0.1 for r in url + hub_)          # the fetch tenth of the progress
    progress = [r["progress"] for r in reports]
    assert progress == sorted(progress) and progress[-1] == 1.0
    assert all(r["time_elapsed"] >= 0 for r in reports)
    with pytest.raises(E.ReloadArgumentSizeUnmatchedError):
        await engine.reload(str(models["gguf"]), aliases=["a", "b"])
