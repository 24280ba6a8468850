"""Every benchmark script in bench/ runs to the end: each one in its --smoke form (the same code paths
at tiny sizes, on tiny models where it loads one), as a subprocess on the real adapter, writing its
JSON into a temporary folder (never bench/results/). The figures are not checked, only that the
script exits 0 and writes what it should (and, for kernels.py's ceilings, that every ceiling and
fraction it prints is a finite positive number)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tinymodels import write_tiny_bert, write_tiny_llama_gguf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny Q4_1 chat model (SmolLM2's weight type; a context of 1024 holds serve.py's longest
    prompt in the tiny vocabulary) and a tiny BERT embedder."""
    d = tmp_path_factory.mktemp("bench_models")
    chat = write_tiny_llama_gguf(d / "tiny-chat.gguf", qtype="q4_1", context_length=1024)["path"]
    embed = write_tiny_bert(d / "tiny-bert")["folder"]
    return {"chat": str(chat), "embed": str(embed)}


def run_script(name: str, *args: str) -> str:
    """Run bench/<name>.py with `args`; its stdout (it must exit 0)."""
    try:
        r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:     # say where it was: its output so far (bytes, even with text)
        said = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
        pytest.fail(f"bench/{name}.py ran past {TIMEOUT_S} s:\n{said[0][-3000:]}\n{said[1][-3000:]}")
    assert r.returncode == 0, f"bench/{name}.py exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def load(path: Path, keys: set) -> dict:
    assert path.is_file(), f"{path.name} was not written"
    data = json.loads(path.read_text())
    assert keys <= set(data), f"{path.name} lacks {keys - set(data)}"
    return data


def test_attention_paged(tmp_path):
    out = tmp_path / "attention_paged.json"
    stdout = run_script("attention_paged", "--smoke", "--out", str(out))
    data = load(out, {"device", "heads", "rows"})
    assert data["rows"] and {"paged_ms", "contiguous_ms", "paged_form"} <= set(data["rows"][0])
    assert {r["paged_form"] for r in data["rows"]} == {"1-dispatch", "split+combine"}
    assert f"wrote {out}" in stdout


def test_dispatch_leak(tmp_path):
    out = tmp_path / "dispatch_leak.json"
    run_script("dispatch_leak", "--smoke", "--out", str(out))
    data = load(out, {"vocab", "n", "adapter", "variants"})
    assert {"barrier_sample", "sample_passes", "greedy_pair", "no_barrier"} <= set(data["variants"])
    assert all("kib_per_dispatch" in v for v in data["variants"].values())


def test_load_probe(tmp_path):
    out = tmp_path / "load_probe.json"
    stdout = run_script("load_probe", "--smoke", "--out", str(out))
    data = load(out, {"adapter", "rows", "k", "probes"})
    kinds = {p["probe"] for p in data["probes"]}
    assert {"copy", "u32", "vec4", "vec4_load", "texture"} <= kinds
    assert all(math.isfinite(p["cpu_us"]) and p["cpu_us"] > 0 for p in data["probes"])
    assert data["agree"] and all(data["agree"].values()), data["agree"]   # every probe sums as numpy does
    assert f"wrote {out}" in stdout


@pytest.mark.parametrize("mode", ["default", "batch", "ceilings"])
def test_kernels(tmp_path, tiny, mode):
    out = tmp_path / "kernels.json"
    flag = {"default": [], "batch": ["--batch"], "ceilings": ["--ceilings"]}[mode]
    stdout = run_script("kernels", "--smoke", *flag, "--chat-model", tiny["chat"], "--embed-model", tiny["embed"],
                        "--out", str(out))
    if mode == "batch":
        data = load(out, {"adapter", "act", "rows", "tuned"})
        assert {r["T"] for r in data["rows"]} == {1, 2}
    elif mode == "default":      # the matmul table, then the ceilings section
        data = load(out, {"adapter", "config", "act", "copy", "copies", "matmul", "ceilings"})
        assert len(data["copies"]) == 2 and {r["T"] for r in data["matmul"]} == {1, 32}
        check_ceilings(data["ceilings"])
    else:
        check_ceilings(load(out, {"adapter", "runs", "ceilings", "rows"}))
    if mode != "batch":
        assert "%bound" in stdout and "GFLOP/cpu-s" in stdout


def check_ceilings(data: dict) -> None:
    """The ceilings and every kernel's fraction of its bound are finite positive numbers, for the
    decode step, the prefill and the embedder's batch, each with its matmuls and a total."""
    def positive(*values):
        return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)
    ceil = data["ceilings"]
    assert positive(ceil["GB/s"], ceil["GB/cpu-s"])
    assert {r["kernel"] for r in ceil["streams"]} == {"copy_vec4", "read_probe"}
    assert "f32" in ceil["fma"] and all(positive(f["GFLOP/s"], f["GFLOP/cpu-s"]) for f in ceil["fma"].values())
    sections = {}
    for r in data["rows"]:
        sections.setdefault(r["section"].split()[0], []).append(r)
        assert positive(r["ms"], r["cpu_ms"], r["pct_bound"], r["pct_bound_cpu"]), r
    assert set(sections) == {"decode", "prefill", "embed"}
    for rows in sections.values():
        matmuls = [r for r in rows if r["kernel"].startswith("matmul")]
        assert len(matmuls) >= 4 and rows[-1]["kernel"] == "(all of the above)"
        assert all(positive(r["GB/s"], r["GFLOP/s"]) and r["bound"] in ("bytes", "flops") for r in matmuls)


def test_prefill(tmp_path):
    out = tmp_path / "prefill.json"
    run_script("prefill", "--smoke", "--out", str(out))
    data = load(out, {"adapter", "config_overrides", "act", "rows", "bounds"})
    assert [(r["model"], r["shape"], r["T"]) for r in data["rows"]] == [("smollm2", "down", 16)]
    assert all(r["new_ms"] > 0 and r["old_ms"] > 0 for r in data["rows"])


def test_llm(tmp_path, tiny):
    """The default mode: warm-up, timed prefills and a decode run on one pipeline, whose KV cache
    would overflow the benchmark's context if the prefills did not each start from an empty cache."""
    out = tmp_path / "llm.json"
    stdout = run_script("llm", "--smoke", "--model", tiny["chat"], "--out", str(out))
    data = load(out, {"model", "sampling", "engine"})
    assert {"load_s", "prefill_16_tokens_per_s", "time_to_first_token_16_s", "step_loop_tokens_per_s",
            "step_loop_step_ms", "gpu_ms_by_kernel_decode", "gpu_ms_by_kernel_prefill_128",
            "decode_loop_ahead_tokens_per_s", "decode_loop_serial_tokens_per_s", "gpu_bound_step_ms",
            "host_ms_per_step", "decode_loop_ahead_cpu_ms_per_token"} <= set(data["engine"])
    assert data["engine"]["decode_loop_same_tokens"] is True        # decode_ahead changes no token
    # the comparison rows are the pipeline's own loop and its prefill, never the hand-written steps
    table = stdout.split("engine diagnostics")[0]
    assert "own greedy loop" in table and "prefill 16 tok/s" in table and "step_loop" not in table
    try:
        import llama_cpp  # noqa: F401
    except ImportError:       # said so, and our rows still printed
        assert "llama-cpp-python is not installed" in stdout and "error" in data["llama_cpp"]
    else:
        assert "decode_tokens_per_s" in data["llama_cpp"]


def test_embeddings(tmp_path, tiny):
    out = tmp_path / "embeddings.json"
    run_script("embeddings", "--smoke", "--model", tiny["embed"], "--out", str(out))
    data = load(out, {"adapter", "workload", "sentence_transformers_available", "results"})
    ours = [r for r in data["results"] if r["engine"] == "webgpu_engine"]
    assert ours and all(r["sentences"] == 8 and r["kernels"] for r in ours)


def test_first_request(tmp_path, tiny):
    out = tmp_path / "first_request.json"
    run_script("first_request", "--smoke", "--chat-model", tiny["chat"], "--embed-model", tiny["embed"],
               "--out", str(out))
    data = load(out, {"shader_cache", "tokens", "results"})
    assert [(r["model"], r["mode"]) for r in data["results"]] == [("chat", "background"), ("embed", "background")]
    for r in data["results"]:
        assert 0 < r["loaded_s"] <= r["first_first_s"] <= r["all_compiled_s"]
        assert r["third_compiles"] == r["fourth_compiles"] == 0    # nothing compiles once the queue is done
        # lavapipe compiles at the first dispatch: what the first request compiled, it dispatched empty
        assert r["first_warmed"] >= r["first_compiles"] and r["first_cpu_s"] > r["python_ready_cpu_s"] > 0


def test_serve(tmp_path, tiny):
    out = tmp_path / "serve.json"
    run_script("serve", "--smoke", "--model", tiny["chat"], "--port", "0", "--out", str(out))
    data = load(out, {"model", "max_tokens", "batch", "rows", "summary"})
    assert {(r["max_num_sequences"], r["clients"]) for r in data["rows"]} == {(1, 1), (1, 8), (2, 1), (2, 8)}
    assert all(r["chunks"] > 0 and len(r["tok_s_rounds"]) == 2 and r["cpu_s_per_token"] >= 0 for r in data["rows"])
    # the server's CPU time is read in clock ticks (10 ms): a lone client's few smoke tokens may take
    # less than one; eight clients' take several
    assert all(r["cpu_s_per_token"] > 0 for r in data["rows"] if r["clients"] == 8)
    assert set(data["summary"]) == {"tok_s_8_over_1", "ttft_p95_8_over_lone", "cpu_per_token_8_x1_over_batched"}


def test_batch_width(tmp_path, tiny):
    """Decode steps per width and row count, and the rule's width (never stored by the smoke run)."""
    sys.path.insert(0, str(BENCH))
    from batch_width import choose_width
    out = tmp_path / "batch_width.json"
    run_script("batch_width", "--smoke", "--model", tiny["chat"], "--out", str(out))
    data = load(out, {"steps", "width", "rule", "fused_rows"})
    assert {(s["width"], s["rows"]) for s in data["steps"]} == {(1, 1), (2, 1), (2, 2)}
    assert all(s["cpu_ms"] > 0 and s["ms"] > 0 for s in data["steps"]) and data["width"] in (1, 2)
    steps = {(4, 1): (0, 58.0), (4, 4): (0, 131.0), (8, 1): (0, 82.0), (8, 8): (0, 135.0),
             (16, 1): (0, 81.0), (16, 16): (0, 236.0)}
    assert choose_width(steps, 3) == 4          # width 8's lone row: 82 > 1.25 x 58
    assert choose_width(steps, 3, lone=1.5) == 8 and choose_width(steps, 5, lone=1.5) == 16
    assert choose_width(steps, 2, lone=2) == 4


def test_ray_serve(tmp_path, tiny):
    """One replica only: each replica count runs the same code of the script (the count is passed
    to `serve --ray-replicas`), and two replicas serving and spreading conversations are
    tests/test_ray.py's (a second replica cost the smoke run ~5 s)."""
    out = tmp_path / "ray_serve.json"
    run_script("ray_serve", "--smoke", "--replicas", "1", "--model", tiny["chat"], "--out", str(out))
    data = load(out, {"model", "max_tokens", "batch", "rows"})
    assert {(r["replicas"], r["clients"]) for r in data["rows"]} == {(1, 8)}
    assert all(r["chunks"] > 0 for r in data["rows"])


def test_soak(tmp_path, tiny):
    out = tmp_path / "soak.json"
    run_script("soak", "--smoke", "--chat-model", tiny["chat"], "--embed-model", tiny["embed"],
               "--out", str(out))
    data = load(out, {"wall_s", "served", "unexpected", "results", "rss_mib", "exit_after_sigterm_s"})
    assert data["served"] > 0 and data["unexpected"] == 0, data["unexpected_kinds"]
    assert data["rss_mib"] and data["exit_after_sigterm_s"] is not None


def test_speculative(tmp_path, tiny):
    out = tmp_path / "speculative.json"
    stdout = run_script("speculative", "--smoke", "--model", tiny["chat"], "--draft", "self", "--out", str(out))
    data = load(out, {"adapter", "model", "tokens", "rows"})
    assert [r["task"] for r in data["rows"]] == ["rag", "rag_quote", "quote", "code_edit", "chat"]
    for r in data["rows"]:
        runs = [(s["method"], s["k"], s["auto_off"]) for s in r["speculative"]]
        assert runs == [("ngram", 2, False), ("ngram", 2, True), ("draft", 2, False)]
        # speculation changes nothing: verify rows are the decode rows (the same op lists)
        assert all(s["equals_fused"] for s in r["speculative"])
        assert r["speculative"][2]["accepted"] > 0                           # the model guessing itself
    assert f"wrote {out}" in stdout


def test_long_context(tmp_path):
    chat = write_tiny_llama_gguf(tmp_path / "tiny-wide-heads.gguf", qtype="q4_1", context_length=512,
                                 n_heads=2, n_kv_heads=1)["path"]          # head_dim 32: q8_0's blocks
    out = tmp_path / "long_context.json"
    stdout = run_script("long_context", "--smoke", "--model", str(chat), "--out", str(out))
    data = load(out, {"adapter", "model", "positions", "rows", "llama_cpp"})
    auto, q8, q4, *windowed = data["rows"]
    assert (auto["kv_cache_dtype"], q8["kv_cache_dtype"], q4["kv_cache_dtype"]) == ("auto", "q8_0", "q4_0")
    # the sliding window's row: a ring of 48 positions plus a chunk, the same cache at every position
    # (its ring is kept in the activations' dtype: quantised caches with a ring are refused at load)
    assert [(r["kv_cache_dtype"], r["sliding_window"]) for r in windowed] == [("auto", 48)]
    assert all(r["context"] == 96 and set(r["decode_tok_s"]) == {"64", "128"} for r in windowed)
    assert windowed[0]["kv_cache_bytes"] < auto["kv_cache_bytes"]
    assert q4["kv_bytes_per_token"] < q8["kv_bytes_per_token"] < auto["kv_bytes_per_token"]
    assert set(q8["decode_tok_s"]) == set(q4["decode_tok_s"]) == {"64", "128"}
    assert auto["accuracy_vs_auto"]["identical_answers"] == auto["accuracy_vs_auto"]["answers"]
    assert f"wrote {out}" in stdout


def test_lora_step(tmp_path, tiny):
    """bench/lora_step.py's prefill form on the tiny model with a random adapter (lora_rows' lists)."""
    out = tmp_path / "lora_step.json"
    stdout = run_script("lora_step", "--smoke", "--prefill", "6", "--model", tiny["chat"], "--lora-dtype", "bf16",
                        "--out", str(out))
    data = load(out, {"model", "kind", "rows", "cpu_ms", "held"})
    assert data["kind"] == "prefill" and data["rows"] == 6 and data["lora_dtype"] == "bf16"
    assert set(data["cpu_ms"]) == {"base", "adapter", "adapter, base", "lora only", "lora, base"}
    assert "lora only" in stdout and f"held in {data['held']}" in stdout


def test_lora_delta(tmp_path):
    """bench/lora_delta.py: its kernel variants, one round of one dispatch each."""
    out = tmp_path / "lora_delta.json"
    run_script("lora_delta", "--rounds", "1", "--dispatches", "1", "--out", str(out))
    data = load(out, {"rounds", "dispatches", "groups"})
    assert set(data["groups"]) == {"qkv", "o", "gate_up", "down"}
