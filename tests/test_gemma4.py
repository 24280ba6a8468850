"""Gemma 4 (text; gemma-4-E2B-it's decoder, models/family_gemma4.py) against transformers: a tiny
random Gemma4ForCausalLM with every part E2B's config turns on (tests/tinygemma4.py: sliding and
full-attention layers of different head sizes, proportional RoPE, the last two layers attending
earlier layers' caches with double-wide FFNs, v norms, per-layer inputs, layer scalars, soft-capped
logits) that tests/fixtures/make_gemma4.py ran through transformers once (its JSON committed): the
same token ids, logits at positions up to 319 within 1e-3 and 16 greedy tokens; the same greedy
tokens for each of 3 requests batched together through the scheduler. The kernels it added against
their numpy references."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from test_families import batch_answers, check_golden, run_golden, values_golden
from tinygemma4 import gemma4_config, write_tiny_gemma4_mlc, write_tiny_gemma4_safetensors
from webgpu_engine.kernels import nn, nn_ref
from _nn_util import TOL, get, put, rounded, run

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def ref() -> dict:
    return json.loads((FIXTURES / "gemma4_transformers.json").read_text())


@pytest.mark.parametrize("released", [False, True], ids=["causal_lm", "released_folder"])
def test_gemma4_matches_transformers(device, tmp_path, ref, released):
    """A Gemma4ForCausalLM folder, and the same model laid out as gemma-4-E2B-it is released
    (Gemma4ForConditionalGeneration: text_config, model.language_model. names, a vision tower not read)."""
    folder = write_tiny_gemma4_safetensors(tmp_path / "gemma4", seed=ref["seed"], released=released)["folder"]
    check_golden(device, folder, ref)


@pytest.mark.parametrize("quant", ["q0f32", "q4f16_1", "q4f32_1"])
def test_gemma4_mlc_artifact(device, tmp_path, ref, quant):
    """The tiny model as mlc-llm's gemma4 loader lays out WebLLM's gemma-4-E2B-it artifacts (language_model.
    names, gate|up fused, the per-layer table as one embedding per layer, audio tensors beside them): q0f32
    gives transformers' logits and greedy tokens; q4f16_1 / q4f32_1 (every matrix and embedding in MLC's
    4-bit groups) those of an HF folder holding the values their files encode."""
    from webgpu_engine.kernels.quant_ref import dequantize
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    from webgpu_engine.models.registry import open_model
    art = write_tiny_gemma4_mlc(tmp_path / "mlc", quant, seed=ref["seed"])
    opened = open_model(art["folder"])
    try:
        assert opened.arch.name == "gemma4" and opened.config.kv_sources == (0, 1, 2, 3, 3, 2)
        t = opened.weights["ple_embed"]               # the per-layer tables side by side, exactly
        np.testing.assert_array_equal(dequantize(t.data, t.qtype, t.n, t.k),
                                      art["encoded"]["model.embed_tokens_per_layer.weight"])
        assert load_tokenizer(art["folder"]).encode(ref["text"]) == ref["text_ids"]
        rows, greedy = run_golden(device, opened.config, opened.weights, ref)
    finally:
        opened.close()
    if quant == "q0f32":
        want_rows, want_greedy = {r: np.asarray(v) for r, v in zip(ref["rows"], ref["logits"])}, ref["greedy"]
    else:
        want_rows, want_greedy = values_golden(device, tmp_path / "encoded", art["encoded"],
                                               gemma4_config(art["dims"]), art["dims"], ref)
    for r in ref["rows"]:
        err = np.abs(rows[r] - want_rows[r]).max() / np.abs(want_rows[r]).max()
        assert err <= 1e-3, f"position {r}: relative error {err:.2e}"
    assert greedy == want_greedy


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_gemma4_gguf_from_llamacpp(device, qtype):
    """The tiny model (with Gemma's kind of vocabulary) as llama.cpp's convert_hf_to_gguf.py writes it
    (arch gemma4: per-layer sliding flags, head sizes and FFN widths, shared KV layers, per-layer
    embeddings, proportional RoPE as rope_freqs, its `gemma4` vocabulary of merges without a space
    prefix), f16 and Q8_0: the tokenizer's ids, and transformers' logits within 1e-3 and 16 greedy
    tokens on the weights the file holds (tests/fixtures/make_gemma4.py)."""
    ref = json.loads((FIXTURES / f"gemma4_gguf_{qtype}_transformers.json").read_text())
    check_golden(device, FIXTURES / "gemma4_gguf" / ref["gguf"], ref)


def test_gguf_gemma4_vocabulary_merges_within_newline_runs():
    """llama.cpp's `gemma4` vocabulary (llm_tokenizer_bpe with its Gemma 4 pre-tokenizer): text splits
    into runs of newlines and runs of other characters, merges by rank within each run (no space
    prefix; spaces as ▁), a newline run that is a token taken whole, byte fallback for the rest."""
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "\n", "\n\n", "b\n", "\u2581", "\u2581a", "<0x21>"]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 6]
    md = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.merges": ["b \n", "\n \n", "\u2581 a"],
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_space_prefix": False}
    tok = load_tokenizer(md, native=True)
    v = {t: i for i, t in enumerate(tokens)}
    # "b" and "\n" never merge across the run's edge; "\n\n\n" is no token: merged within its run
    assert tok.encode("ab\n\n\nb a!") == [v["a"], v["b"], v["\n\n"], v["\n"], v["b"], v["\u2581a"], v["<0x21>"]]
    assert tok.encode("\n\n") == [v["\n\n"]] and tok.encode(" a") == [v["\u2581a"]]
    assert tok.decode(tok.encode("ab\n\n\nb a!")) == "ab\n\n\nb a!"


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("rows,hq,hkv,d", [(1, 4, 1, 64), (5, 8, 2, 32), (3, 2, 1, 6)])
def test_head_rms_norm_with_v_heads(device, dtype, rows, hq, hkv, d):
    """Gemma 4's v norm: the v heads after q and k normed with w[2D:3D] (ones in the model), in the
    same dispatch as q and k (which keep w[:D] and w[D:2D], as for Qwen3)."""
    rng = np.random.default_rng(rows * hq * d)
    qkv = rng.standard_normal((rows, hq + 2 * hkv, d)) * 2 + 0.3
    w = rng.standard_normal(3 * d)
    xt = put(device, qkv, dtype, lead=4)
    run(device, nn.head_rms_norm(device, xt, put(device, w, lead=4), n_q_heads=hq, n_k_heads=hkv, head_dim=d,
                                 eps=1e-6, n_v_heads=hkv))
    want = nn_ref.head_rms_norm_v(rounded(qkv, dtype), w, hq, hkv, hkv, 1e-6)
    assert np.abs(want[:, hq + hkv:] - rounded(qkv, dtype)[:, hq + hkv:]).max() > 0.1
    np.testing.assert_allclose(get(device, xt), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("rows,p,layers,layer", [(1, 8, 6, 0), (5, 8, 6, 5), (3, 6, 3, 1), (2, 256, 4, 2)])
def test_gelu_tanh_gate(device, dtype, rows, p, layers, layer):
    """Gemma 4's per-layer input gate, in place: gelu_tanh(g[t]) times layer `layer`'s p values of
    row t of the per-layer inputs (T, L P), with 4-wide loads where the sizes allow."""
    rng = np.random.default_rng(rows * p + layer)
    g, e = rng.standard_normal((rows, p)) * 3, rng.standard_normal((rows, layers * p))
    gt, et = put(device, g, dtype, lead=4), put(device, e, dtype, lead=8)
    run(device, nn.gelu_tanh_gate(device, gt, et, gt, col=layer * p))
    want = nn_ref.gelu_tanh_gate(rounded(g, dtype), rounded(e, dtype), layer * p)
    np.testing.assert_allclose(get(device, gt), want, **TOL[dtype])


async def test_gemma4_in_a_batch_answers_as_alone(device, tmp_path, ref):
    """Three requests at once through continuous batching (max_num_sequences 4: the paged pool, the
    ROWS and PREFILL modes, the shared layers reading their source layers' pools) give the greedy
    tokens each gives alone (max_num_sequences 1); one prompt runs past the 48-key window."""
    folder = str(write_tiny_gemma4_safetensors(tmp_path / "gemma4", seed=ref["seed"])["folder"])
    alone, batched = await batch_answers(folder, ["Grüße aus Köln", "東京で会いましょう 🌍", ref["text"][:160]],
                                         context=192)
    assert alone == batched and all(alone)


@pytest.mark.parametrize("key", ["enable_moe_block", "attention_k_eq_v", "use_bidirectional_attention"])
def test_gemma4_options_not_implemented_are_refused_by_name(key):
    """The larger Gemma 4 models' options (MoE, keys as values) and bidirectional attention ("all"; with
    "vision" only image tokens attend both ways, so text runs)."""
    from tinygemma4 import DIMS, gemma4_config
    from webgpu_engine.errors import UnsupportedModelError
    from webgpu_engine.loaders.decoder_config import hf_config_from_dict
    c = {**gemma4_config(DIMS), "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2}
    assert hf_config_from_dict(c).kv_sources == (0, 1, 2, 3, 3, 2)
    assert hf_config_from_dict({**c, "use_bidirectional_attention": "vision"}).kv_sources   # text stays causal
    with pytest.raises(UnsupportedModelError, match=key):
        hf_config_from_dict({**c, key: "all" if key == "use_bidirectional_attention" else True})


def test_gemma4_gguf_with_experts_is_refused_by_name():
    """A gemma4 GGUF of the MoE model (llama.cpp writes expert_count) is refused naming it."""
    from webgpu_engine.errors import UnsupportedModelError
    from webgpu_engine.loaders.gguf import GGUFFile
    from webgpu_engine.models.family_gemma4 import GEMMA4
    g = GGUFFile(FIXTURES / "gemma4_gguf" / "gemma4-q8_0.gguf")
    try:
        assert GEMMA4.gguf(g, {"n_layers": 6, "hidden_size": 64})["kv_sources"] == (0, 1, 2, 3, 3, 2)
        g.metadata["gemma4.expert_count"] = 8
        with pytest.raises(UnsupportedModelError, match="expert_count"):
            GEMMA4.gguf(g, {"n_layers": 6, "hidden_size": 64})
    finally:
        g.close()


def test_gemma4_f16_activations(device, tmp_path, ref):
    """f16 activations and caches (what a GPU with shader-f16 runs): transformers' logits within 8e-2
    of the largest, through prefill chunks of 64 and decode steps past the window. Gemma 4 does not
    scale its scores (q and k heads of unit RMS), so f16's rounding of q and k moves the softmax more
    than in Gemma 3: 1-6 % here against f32's 1e-6 (Gemma 3's tiny model: 0.1 %)."""
    from decoder_runner import DecoderRunner
    from webgpu_engine.models.registry import open_model
    opened = open_model(write_tiny_gemma4_safetensors(tmp_path / "gemma4", seed=ref["seed"])["folder"])
    ids, P = ref["text_ids"][:ref["seq_len"]], ref["prompt_len"]
    run = DecoderRunner(device, opened.config, opened.weights, owner="test:gemma4", chunk=64, dtype="f16")
    try:
        got = run.prefill(ids, {r + 1 for r in ref["rows"] if r < P} | {P})
        for pos in range(P, len(ids)):
            got[pos] = run.decode(ids[pos], pos)
        for r, want in zip(ref["rows"], ref["logits"]):
            want = np.asarray(want)
            assert np.abs(got[r] - want).max() / np.abs(want).max() <= 8e-2, f"position {r}"
    finally:
        run.release()
        opened.close()


def test_webllm_sliding_window_refused_by_name(tmp_path, ref):
    """WebLLM's ring of sinks and a window (sliding_window_size) is refused with its option's name:
    the layers reading earlier layers' caches do not run over it."""
    from types import SimpleNamespace

    from webgpu_engine.errors import UnsupportedChatOptionError
    from webgpu_engine.models.plan import plan_decoder
    from webgpu_engine.models.registry import open_model
    opened = open_model(write_tiny_gemma4_safetensors(tmp_path / "gemma4", seed=ref["seed"])["folder"])
    try:
        opts = SimpleNamespace(sliding_window_size=64, attention_sink_size=4, dtype="f32", context_window_size=-1,
                               prefill_chunk_size=32, max_num_sequences=1, kv_block_size=16, kv_pool_tokens=0)
        with pytest.raises(UnsupportedChatOptionError, match="sliding_window_size"):
            plan_decoder(opened.config, opts, None)
    finally:
        opened.close()


def test_e2b_text_config():
    """gemma-4-E2B-it's text config (the values of mlc-llm's Gemma4TextConfig, which targets it: 35
    layers of which every fifth is global, 20 reading earlier caches, heads of 256 and 512, PLE of
    256): which layer reads which cache, the widths, the rotated pairs, and the KV bytes per token
    (15 layers store K and V: 12 of 256 values, 3 of 512, one KV head, f16)."""
    from webgpu_engine.loaders.decoder_config import hf_config_from_dict
    from webgpu_engine.models.plan import DecoderPlan
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)]
    c = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
        "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
        "global_head_dim": 512, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512, "layer_types": types,
        "final_logit_softcapping": 30.0, "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
        "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "attention_k_eq_v": False,
        "enable_moe_block": False,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1000000.0}}}}
    cfg = hf_config_from_dict(c)
    assert cfg.arch == "gemma4" and cfg.n_layers == 35 and cfg.ple_dim == 256 and cfg.v_norm
    assert cfg.kv_sources == tuple(range(15)) + tuple(14 if (i + 1) % 5 == 0 else 13 for i in range(15, 35))
    assert [cfg.head_dim_of(i) for i in (0, 4, 13, 14, 34)] == [256, 512, 256, 512, 512]
    assert [cfg.ffn_of(i) for i in (14, 15, 34)] == [6144, 12288, 12288]
    assert cfg.rope_of(4, None) == (1e6, (1.0,) * 64 + (float("inf"),) * 192)
    assert cfg.rope_of(0, None) == (10000.0, None) and cfg.window_of(0) == 512 and cfg.window_of(4) == 0
    assert DecoderPlan("f16", 4096, 256, 1).kv_bytes_per_token(cfg) == 2 * 2 * (12 * 256 + 3 * 512)
