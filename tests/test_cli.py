"""CLI tests: `python -m webgpu_engine ...` in subprocesses on the real adapter and default models."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from webgpu_engine.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp"), "PYTHONUNBUFFERED": "1"}


def run(*args, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "webgpu_engine", *args], cwd=ROOT, env=ENV, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", ["info", "chat", "complete", "embed", "serve", "bench", "download", "cache"])
def test_help_for_every_subcommand(cmd, capsys):
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m webgpu_engine " + cmd) and len(out.splitlines()) > 3


def test_top_level_help_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("info", "chat", "complete", "embed", "serve", "download", "cache", "bench"):
        assert cmd in out


def test_info_shows_the_adapter(device):
    p = run("info")
    assert p.returncode == 0, p.stderr
    assert device.info.name in p.stdout and "max-storage-buffer-binding-size" in p.stdout
    assert ("shader-f16: yes" if device.has_f16 else "shader-f16: no") in p.stdout
    assert "SmolLM2-135M-Instruct-Q4_1" in p.stdout and "all-MiniLM-L6-v2" in p.stdout
    d = json.loads(run("info", "--json").stdout)
    assert d["adapter"]["vendor"] == device.info.vendor and sorted(d["features"]) == sorted(device.features)


def test_bench_lists_and_runs_scripts(tmp_path):
    (tmp_path / "tiny.py").write_text("import sys\nprint('tiny ran', sys.argv[1:])\n")
    p = run("bench", "--dir", str(tmp_path), "--list")
    assert p.returncode == 0 and p.stdout.split() == ["tiny"]
    p = run("bench", "--dir", str(tmp_path), "tiny", "--", "--quick")
    assert p.returncode == 0 and "tiny ran ['--quick']" in p.stdout
    p = run("bench", "--dir", str(tmp_path), "nope")
    assert p.returncode == 2 and "unknown benchmark" in p.stderr


def test_cache_commands_are_delegated():
    p = run("cache", "ls")
    assert p.returncode == 0 and "SmolLM2-135M-Instruct-Q4_1" in p.stdout


def test_engine_errors_are_one_line(minilm_dir):
    p = run("embed", "--model", "no-such-model", "hi")
    assert p.returncode == 1 and p.stderr.strip().startswith("error: ") and "Traceback" not in p.stderr


@pytest.mark.slow
def test_embed_similarities(minilm_dir):
    p = run("embed", "--quiet", "-s", "a cat on a mat", "a kitten on a rug", "quarterly tax report")
    assert p.returncode == 0, p.stderr
    rows = [ln.split()[-3:] for ln in p.stdout.strip().splitlines()]
    sims = [[float(x) for x in r] for r in rows]
    assert sims[0][0] == pytest.approx(1.0, abs=1e-3) and sims[0][1] > sims[0][2] + 0.2
    p = run("embed", "--quiet", "hello")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["dim"] == 384 and len(d["embedding"]) == 384


# a faster load in a fresh process (no warm-up run of every pipeline): these tests assert on what
# the commands print, not on compiling (tests/test_correctness.py checks compile_at_load)
FAST_LOAD = ("--chat-opts", '{"compile_at_load": false}')


@pytest.mark.slow
def test_complete_and_multi_turn_chat(smollm2_gguf):
    p = run("complete", "--quiet", *FAST_LOAD, "--max-tokens", "4", "--temperature", "0", "--echo", "The sky is")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("The sky is") and len(p.stdout.strip()) > len("The sky is")
    p = run("chat", "--quiet", *FAST_LOAD, "--max-tokens", "8", "--temperature", "0",
            stdin="What is the capital of France?\n/stats\nAnd of Italy?\n/exit\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(">>> ") >= 3 and "Paris" in p.stdout and "tokens/sec" in p.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_subcommand(minilm_dir):
    import openai
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "webgpu_engine", "serve", "--model", "all-MiniLM-L6-v2",
                             "--port", str(port), "--api-key", "k"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if json.loads(r.read())["status"] == "ready":
                        break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not become ready"
            time.sleep(0.3)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in c.models.list()] == ["all-MiniLM-L6-v2"]
        assert len(c.embeddings.create(model="all-MiniLM-L6-v2", input="hi").data[0].embedding) == 384
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_parser_defaults():
    a = build_parser().parse_args(["serve"])
    assert a.model is None and a.host == "127.0.0.1" and a.port == 8000
    a = build_parser().parse_args(["chat"])
    assert a.model == "SmolLM2-135M-Instruct-Q4_1"
    a = build_parser().parse_args(["embed", "x"])
    assert a.model == "all-MiniLM-L6-v2"


def test_max_queue_values_match_engine_config():
    """--max-queue takes EngineConfig.max_queue_length's values: a count (0: none may wait) or none."""
    from webgpu_engine.engine import EngineConfig
    parse = lambda *v: build_parser().parse_args(["serve", *v]).max_queue
    assert parse() == 32 and parse("--max-queue", "0") == 0 and parse("--max-queue", "5") == 5
    assert parse("--max-queue", "none") is None
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit):
            parse("--max-queue", bad)
    with pytest.raises(ValueError, match="max_queue_length"):
        EngineConfig(max_queue_length=-1)


def test_serve_batches_every_chat_model():
    """serve's chat models batch by default: context shifts, speculation (prompt lookup or a draft
    model) and a sliding window (the ring) all run per sequence in the batch; options that name
    max_num_sequences keep it."""
    from webgpu_engine.cli.commands import SERVE_MAX_NUM_SEQUENCES, serve_chat_opts
    for opts in (None, {}, {"context_overflow": "shift", "n_keep": 4}, {"speculation": "ngram"},
                 {"speculation": {"method": "draft", "model": "d.gguf"}},
                 {"context_window_size": -1, "sliding_window_size": 64, "attention_sink_size": 4}):
        assert serve_chat_opts(opts)["max_num_sequences"] == SERVE_MAX_NUM_SEQUENCES == 0, opts
    assert serve_chat_opts({"sliding_window_size": 64, "max_num_sequences": 1})["max_num_sequences"] == 1
