"""The browser page's load (webgpu_engine/browser/app.py) with LoRA adapters (issue 52), run natively:
Pyodide's `js` / `pyodide` modules stand in, the page's Cache Storage fetch reads local files and its
staging writes them to a folder; the engine, its device and the adapters are the real ones."""
from __future__ import annotations

import asyncio
import importlib
import json
import sys
import types
from pathlib import Path

import pytest

from webgpu_engine.engine.engine import AsyncMLCEngine
from webgpu_engine.errors import InvalidRequestError

from test_lora import ADAPTERS, OPTS, _greedy, _want, base_path  # noqa: F401  (a fixture)


@pytest.fixture
def page(monkeypatch, tmp_path):
    """webgpu_engine.browser.app imported over stand-ins: fetch_all reads each URL as a local path
    (and records it), stage_files writes under tmp_path."""
    js = types.ModuleType("js")
    for name in ("Object", "Response", "Uint8Array", "caches", "fetch"):
        setattr(js, name, None)
    ffi = types.ModuleType("pyodide.ffi")
    ffi.to_js = lambda v, **kw: v
    pyodide = types.ModuleType("pyodide")
    pyodide.ffi = ffi
    for name, mod in (("js", js), ("pyodide", pyodide), ("pyodide.ffi", ffi)):
        monkeypatch.setitem(sys.modules, name, mod)
    for name in ("webgpu_engine.browser.app", "webgpu_engine.browser.artifact_cache"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    app = importlib.import_module("webgpu_engine.browser.app")
    fetched = []

    class Cache:
        def __init__(self, scope, also=()):
            pass

        async def fetch_all(self, urls, progress=None):
            fetched.extend(urls)
            stats = types.SimpleNamespace(cached_files=0, cached_bytes=0, fetched_files=len(urls), fetched_bytes=0)
            return [Path(u).read_bytes() for u in urls], stats

    def stage_files(root, files):
        for name, data in files.items():
            (Path(root) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(root) / name).write_bytes(bytes(data))

    monkeypatch.setattr(app, "BrowserArtifactCache", Cache)
    monkeypatch.setattr(app, "stage_files", stage_files)
    monkeypatch.setattr(app, "STAGE_ROOT", str(tmp_path / "stage"))
    app.fetched = fetched
    yield app
    for name in ("webgpu_engine.browser.app", "webgpu_engine.browser.artifact_cache"):
        sys.modules.pop(name, None)


MSGS = [{"role": "user", "content": "Hello there"}]


async def test_a_page_loads_adapters_with_its_model(page, device, base_path):
    """load_folder(..., lora_json): a PEFT folder and a GGUF LoRA file fetched beside the base and
    served by name, each answering as transformers + peft, the base as itself, the page's chat with
    an adapter by its request's `model`; bad specs refused."""
    from webgpu_engine.engine import EngineConfig
    page._state["engine"] = eng = AsyncMLCEngine(EngineConfig(device=device))
    files = sorted(p.name for p in Path(base_path).iterdir())
    spec = {"a": {"url": ADAPTERS["a"]}, "b": ADAPTERS["b"] + ".gguf"}
    out = json.loads(await page.load_folder(str(base_path), json.dumps(files), "tiny", json.dumps(OPTS),
                                            json.dumps(spec)))
    try:
        assert out["model_id"] == "tiny" and sorted(eng.lora_names()) == ["a", "b"]
        assert {ADAPTERS["a"] + "/adapter_config.json", ADAPTERS["a"] + "/adapter_model.safetensors",
                ADAPTERS["b"] + ".gguf"} <= set(page.fetched)
        got = await asyncio.gather(_greedy(eng, "a", 0), _greedy(eng, "b", 1), _greedy(eng, "tiny", 0))
        assert got == [_want("a", 0), _want("b", 1), _want(None, 0)]
        said = {}                            # the page's chat: the request's `model` picks an adapter
        for model in ("a", None):
            req = {"max_tokens": 6, **({"model": model} if model else {})}
            said[model] = json.loads(await page.chat(json.dumps(MSGS), None, json.dumps(req)))["text"]
            r = await eng.chat.completions.create(messages=MSGS, model=model or "tiny", max_tokens=6, temperature=0.0)
            assert said[model] == r.choices[0].message.content
        assert said["a"] != said[None]
        for bad in ('["a"]', '{"../x": "f.gguf"}', '{"a": {"files": ["x"]}}', '{"a": {"url": "u", "files": ["../x"]}}'):
            with pytest.raises(InvalidRequestError):
                await page.load_folder(str(base_path), json.dumps(files), "tiny", json.dumps(OPTS), bad)
    finally:
        await eng.unload()
