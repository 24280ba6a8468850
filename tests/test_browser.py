"""The engine in the browser: Pyodide + navigator.gpu in headless Debian Chromium, driven by Playwright.

Two pages from demo/browser, served on 127.0.0.1 by demo/browser/serve.py:
- selftest.html runs the gpu backend's self-test (kernels, JS/Python writes, readback, typed errors,
  device loss) on the browser's adapter (SwiftShader here: no shader-f16, so f32 kernels);
- index.html loads the default chat model and embedder from the same origin and is checked against the
  golden data: greedy ids, streamed text, embeddings, and a reload served from the Cache API; then the
  same page loads MLC folders by URL and from WebLLM's Cache Storage (_check_mlc_folders).
A missing Chromium, Playwright or Pyodide is a failure with the command that installs it, never a skip.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import threading
from pathlib import Path

import pytest

from webgpu_engine.catalogue import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo" / "browser"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
# Verified on Debian Chromium: without --enable-unsafe-webgpu requestAdapter() returns null.
FLAGS = ["--headless=new", "--no-sandbox", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic", "--enable-unsafe-webgpu"]
SETUP = "run `bash scripts/browser_setup.sh` (or `make browser-setup`)"
N_IDS = 16
CHAT_MODEL, EMBED_MODEL = DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL
MLC_FIXTURES = ROOT / "tests" / "fixtures" / "mlc_tvm"        # MLC folders written by TVM (make_mlc_tvm.py)
MLC_REFERENCE = ROOT / "tests" / "fixtures" / "mlc_tvm_transformers.json"
GREEDY_OPTS = {"temperature": 0.0, "top_p": 1.0}


@pytest.fixture(scope="module")
def browser_env():
    """Chromium, Playwright and Pyodide present; the project wheel rebuilt from this checkout."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: {SETUP}"
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        pytest.fail(f"the playwright pip package is missing: {SETUP}")
    assert (DEMO / "vendor" / "pyodide" / "pyodide.mjs").is_file(), f"Pyodide is missing: {SETUP}"
    sys.path.insert(0, str(DEMO))
    try:
        import build_wheel
        build_wheel.build()
    finally:
        sys.path.remove(str(DEMO))
    ARTIFACTS.mkdir(exist_ok=True)


@pytest.fixture(scope="module")
def server(browser_env, tmp_path_factory):
    """(base URL, request log path) of the demo server on a free port of 127.0.0.1."""
    sys.path.insert(0, str(DEMO))
    try:
        import serve
    finally:
        sys.path.remove(str(DEMO))
    log = tmp_path_factory.mktemp("server") / "requests.log"
    log.write_text("")
    httpd = serve.serve(0, str(log), routes={"mlc": MLC_FIXTURES, "fixtures": ROOT / "tests" / "fixtures"})
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", log
    httpd.shutdown()
    httpd.server_close()


@contextlib.asynccontextmanager
async def chromium(user_data_dir: Path):
    """A headless Chromium with WebGPU and a fresh profile (so the Cache API starts empty)."""
    from playwright.async_api import async_playwright
    async with async_playwright() as p:
        ctx = await p.chromium.launch_persistent_context(str(user_data_dir), executable_path=CHROMIUM,
                                                         headless=True, args=FLAGS)
        try:
            yield ctx
        finally:
            await ctx.close()


def _console(page, sink: list) -> None:
    page.on("console", lambda m: sink.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: sink.append(f"pageerror: {e}"))


async def test_gpu_backend_selftest(server, tmp_path):
    base, _ = server
    logs: list[str] = []
    async with chromium(tmp_path / "profile") as ctx:
        page = await ctx.new_page()
        _console(page, logs)
        await page.goto(base + "selftest.html")
        await page.wait_for_function("window.selftestResult !== undefined", timeout=240_000, polling=250)
        r = await page.evaluate("window.selftestResult")
        await page.screenshot(path=str(ARTIFACTS / "browser_selftest.png"), full_page=True)
    print(json.dumps({k: r.get(k) for k in ("adapter", "has_f16", "timings_ms")}, indent=1))
    assert "error" not in r, f"{r.get('error')}\n{r.get('traceback', '')}\n" + "\n".join(logs[-20:])
    failed = [k for k, ok in r["checks"].items() if not ok]
    assert not failed, f"failed checks: {failed}\n{json.dumps(r, indent=1)}"
    assert len(r["checks"]) >= 14 and r["ok"]
    # the GPU kernel family's decode kernel, GEMM and flash attention ran in the page against Python
    assert sum(k.startswith("gpu_family_") for k in r["checks"]) == 9
    # a q8_0 KV cache that is a sliding window's ring, written and attended in the page
    assert r["checks"]["kv_q8_0_ring_attention"]
    assert r["backend"] == "browser-webgpu"
    # The kernel variant follows the adapter: f32 where shader-f16 is missing (SwiftShader).
    assert r["has_f16"] == ("shader-f16" in r["features"])
    assert re.match(r"shaders/broken\.wgsl:3:\d+: ", r["shader_error"]), r["shader_error"]


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


async def _open_demo(ctx, base: str, logs: list, query: str = ""):
    page = await ctx.new_page()
    _console(page, logs)
    await page.goto(base + "index.html?auto=0" + query)
    await page.wait_for_function("window.demo !== undefined || window.demoError !== undefined",
                                 timeout=600_000, polling=500)
    err = await page.evaluate("window.demoError")
    assert err is None, f"demo page failed: {err}\n" + "\n".join(logs[-30:])
    return page


async def test_demo_page_chat_embeddings_and_cache(server, tmp_path, smollm2_reference, minilm_reference):
    base, log = server
    logs: list[str] = []
    g = smollm2_reference["greedy"][0]
    want_ids = g["greedy_ids_no_eos_stop"][:N_IDS]
    items = minilm_reference["items"][:3]
    async with chromium(tmp_path / "profile") as ctx:
        pages: list = []
        try:
            mark = len(log.read_text().splitlines())
            page = await _open_demo(ctx, base, logs)
            pages.append(page)
            first_load = log.read_text().splitlines()[mark:]
            loaded = await page.evaluate("window.demo.loaded")
            assert all(s["fetched_files"] > 0 for s in loaded["fetch"].values()), loaded
            for mid in (CHAT_MODEL, EMBED_MODEL):
                assert any(f"/models/{mid}/" in ln for ln in first_load), f"{mid} was not fetched"

            # Greedy ids after the reference prompt: the f32 path reproduces transformers' ids.
            got = await page.evaluate(f"window.demo.greedyIds({json.dumps(g['prompt_ids'])}, {N_IDS})")
            print(f"\nbrowser greedy decode: {got['decode_tokens_per_s']:.2f} tokens/s "
                  f"(prefill of {len(g['prompt_ids'])} tokens: {got['prefill_seconds']:.2f} s)")
            assert got["ids"] == want_ids, f"browser ids {got['ids']} != reference {want_ids}"

            # A streamed chat answer appears in the page as it is generated.
            content = g["messages"][0]["content"]
            r = await page.evaluate(f"window.demo.chat({json.dumps(content)}, {{max_tokens: 32}})")
            answer = await page.inner_text("#answer")
            expected = g["greedy_text"].split("<|im_end|>")[0]
            print(f"browser chat: {r['text']!r}, decode {r['decode_tokens_per_s']:.2f} tokens/s, "
                  f"first token after {r['time_to_first_token_s']:.2f} s")
            assert r["text"] == expected and answer.strip() == expected.strip()
            assert r["finish_reason"] == "stop"
            # Anthropic's Messages API in the page: the same greedy text, whole and streamed
            body = {"max_tokens": 32, "temperature": 0, "messages": [{"role": "user", "content": content}]}
            m = await page.evaluate(f"window.demo.messages({json.dumps(body)})")
            assert m["message"]["content"][0]["text"] == expected and m["message"]["stop_reason"] == "end_turn"
            m = await page.evaluate(f"window.demo.messages({json.dumps({**body, 'stream': True})})")
            assert m["message"]["content"][0]["text"] == expected and m["events"]["message_stop"] == 1
            assert m["message"]["usage"]["output_tokens"] == r["usage"]["completion_tokens"]
            stats = await page.inner_text("#chat-stats")
            assert "tokens/s" in stats

            # A reload reads every model file from the Cache API: no weight request reaches the server.
            mark = len(log.read_text().splitlines())
            await page.close()
            page = await _open_demo(ctx, base, logs)
            pages.append(page)
            second = log.read_text().splitlines()[mark:]
            loaded = await page.evaluate("window.demo.loaded")
            model_requests = [ln for ln in second if "/models/" in ln]
            assert not model_requests, model_requests
            assert all(s["fetched_files"] == 0 and s["cached_files"] > 0 for s in loaded["fetch"].values()), loaded
            again = await page.evaluate(f"window.demo.greedyIds({json.dumps(g['prompt_ids'])}, 4)")
            assert again["ids"] == want_ids[:4]

            # MiniLM embeddings match sentence-transformers.
            e = await page.evaluate(f"window.demo.embed({json.dumps([it['text'] for it in items])})")
            coss = [_cos(v, it["embedding"]) for v, it in zip(e["embeddings"], items)]
            print(f"browser embeddings: cosine vs sentence-transformers {[round(c, 6) for c in coss]}")
            assert len(coss) == 3 and min(coss) >= 0.999, coss

            # The embedding search ranks the matching document first.
            ranked = await page.evaluate("window.demo.search('Where do cats like to sleep?')")
            assert "cat" in ranked[0]["doc"].lower(), ranked
            assert len(await page.query_selector_all("#results li")) == len(ranked)
            await page.screenshot(path=str(ARTIFACTS / "browser_demo.png"), full_page=True)

            # The same page loads MLC folders by URL, replacing its models (a page of its own cost a
            # Chromium and a Pyodide start)
            await _check_mlc_folders(page, base, log)
        except BaseException:
            if pages and not pages[-1].is_closed():   # the page as it was when a check failed
                await pages[-1].screenshot(path=str(ARTIFACTS / "browser_demo.png"), full_page=True)
            print("\n".join(logs[-40:]))
            raise


async def _check_mlc_folders(page, base: str, log: Path) -> None:
    """An MLC folder as WebLLM publishes it (TVM-written, q4f16_1) loads by URL in the page and decodes
    transformers' greedy ids; a second folder already in WebLLM's Cache Storage ("webllm/model", keyed
    by URL) loads from there without a request."""
    ref = json.loads(MLC_REFERENCE.read_text())["models"]
    mark = len(log.read_text().splitlines())
    r = await page.evaluate(f"window.demo.loadUrl({json.dumps(base + 'mlc/llama-q4f16_1/')}, 'tiny-mlc', "
                            f"{json.dumps(GREEDY_OPTS)})")
    served = log.read_text().splitlines()[mark:]
    assert r["model_id"] == "tiny-mlc" and "params_shard_0.bin" in r["files"], r
    assert any("/mlc/llama-q4f16_1/params_shard_0.bin" in ln for ln in served), served
    assert r["fetch"]["tiny-mlc"]["fetched_files"] == len(r["files"])
    want = ref["llama-q4f16_1"]
    got = await page.evaluate(f"window.demo.greedyIds({json.dumps(want['prompt_ids'])}, "
                              f"{len(want['greedy'])})")
    assert got["ids"] == want["greedy"], got

    # WebLLM downloaded qwen2-q4f32_1 from a hub URL earlier: its files sit in its cache
    hub = "https://huggingface.co/mlc-ai/tiny-qwen2-q4f32_1-MLC/resolve/main/"
    names = sorted(f.name for f in (MLC_FIXTURES / "qwen2-q4f32_1").iterdir())
    await page.evaluate("""async ([src, hub, names]) => {
        const c = await caches.open("webllm/model");
        for (const n of names) await c.put(hub + n, await fetch(src + n));
    }""", [base + "mlc/qwen2-q4f32_1/", hub, names])
    mark = len(log.read_text().splitlines())
    r = await page.evaluate(f"window.demo.loadUrl({json.dumps(hub)}, '', {json.dumps(GREEDY_OPTS)})")
    assert not [ln for ln in log.read_text().splitlines()[mark:] if "/mlc/" in ln]
    st = r["fetch"][r["model_id"]]
    assert r["model_id"] == "tiny-qwen2-q4f32_1-MLC", r            # the repo's name, as WebLLM's id
    assert st["fetched_files"] == 0 and st["cached_files"] == len(r["files"]), st
    want = ref["qwen2-q4f32_1"]
    got = await page.evaluate(f"window.demo.greedyIds({json.dumps(want['prompt_ids'])}, "
                              f"{len(want['greedy'])})")
    assert got["ids"] == want["greedy"], got
