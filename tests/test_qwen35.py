"""Qwen3.5 (models/family_qwen35.py: Gated DeltaNet layers and gated full-attention layers) against
transformers: a tiny random Qwen3_5ForCausalLM (tests/tinyqwen35.py) that
tests/fixtures/make_qwen35.py ran through transformers once (its JSON committed): the same token ids,
logits at positions up to 319 within 1e-3 and 16 greedy tokens. Its kernels (kernels/deltanet.py)
against their numpy references (kernels/deltanet_ref.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from decoder_runner import DecoderRunner
from test_families import batch_answers
from tinyqwen35 import write_tiny_qwen35_gguf, write_tiny_qwen35_safetensors
from webgpu_engine.kernels import deltanet, deltanet_ref
from webgpu_engine.loaders.tokenizer import load_tokenizer
from webgpu_engine.models.registry import open_model
from _nn_util import TOL, empty, get, put, rounded, run, step_buf

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def ref() -> dict:
    return json.loads((FIXTURES / "qwen35_transformers.json").read_text())


def _run_golden(device, cfg, weights, ref: dict, chunk: int = 128, dtype: str = "f32") -> tuple[dict, list]:
    """({row: logits}, greedy): a chunked prefill up to prompt_len (chunks end at the rows kept), the
    sequence's own tokens decoded on from there (rows past it: the states carried on), then the
    prompt prefilled again from position 0 (the states start over: the same last row) and 16
    greedy steps; through the paged forward of one sequence (tests/decoder_runner.py)."""
    ids, P = ref["text_ids"][:ref["seq_len"]], ref["prompt_len"]
    run_ = DecoderRunner(device, cfg, weights, owner="test:qwen35", chunk=chunk, dtype=dtype)
    try:
        rows = run_.prefill(ids, {r + 1 for r in ref["rows"] if r < P} | {P})
        for pos in range(P, len(ids)):
            rows[pos] = run_.decode(ids[pos], pos)
        again = run_.prefill(ids[:P], {P})[P - 1]
        np.testing.assert_array_equal(again, rows[P - 1])
        greedy = run_.greedy(again, P, len(ref["greedy"]))
    finally:
        run_.release()
    return rows, greedy


@pytest.mark.parametrize("form", ["causal_lm", "released_folder", "gguf"])
def test_qwen35_matches_transformers(device, tmp_path, ref, form):
    """A Qwen3_5ForCausalLM folder, the same model laid out as Qwen releases it
    (Qwen3_5ForConditionalGeneration: text_config, model.language_model. names, a vision tower and
    an mtp layer not read) and as llama.cpp's converter writes its GGUF (qwen35: value heads tiled, A
    as -exp(A_log), 1 + w norms, each layer's kind in attention.recurrent_layers while
    full_attention_interval keeps its default 4; tests/fixtures/make_qwen35.py --llama-cpp checks the
    writer against the converter): transformers' token ids (non-ASCII text), logits at positions up to
    319 within 1e-3 of the largest, its 16 greedy tokens."""
    if form == "gguf":
        folder = write_tiny_qwen35_gguf(tmp_path / "qwen35.gguf", seed=ref["seed"])["path"]
    else:
        folder = write_tiny_qwen35_safetensors(tmp_path / "qwen35", seed=ref["seed"],
                                               released=form == "released_folder")["folder"]
    opened = open_model(folder)
    try:
        assert opened.arch.name == "qwen35"
        assert load_tokenizer(str(folder) if form == "gguf" else folder).encode(ref["text"]) == ref["text_ids"]
        rows, greedy = _run_golden(device, opened.config, opened.weights, ref)
    finally:
        opened.close()
    for r, want in zip(ref["rows"], ref["logits"]):
        want = np.asarray(want)
        err = np.abs(rows[r] - want).max() / np.abs(want).max()
        assert err <= 1e-3, f"position {r}: relative error {err:.2e}"
    assert greedy == ref["greedy"]


# --------------------------------------------------------------------------- kernels
def _rows(device, positions, slots):
    return (put(device, np.array(positions), "u32"), put(device, np.array(slots), "u32"))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("taps,channels,width", [(4, 96, 112), (2, 5, 5), (4, 130, 140)])
def test_causal_conv1d_carries_its_state_across_calls(device, dtype, taps, channels, width):
    """One sequence in chunks of 7, 1 and 5 rows (x the first `channels` columns of wider rows): the
    rows and the state are those of the whole sequence at once; a new sequence at position 0 ignores
    the state it finds."""
    rng = np.random.default_rng(channels + taps)
    x = rng.standard_normal((13, width))
    w = rng.standard_normal((channels, taps))
    state = put(device, rng.standard_normal((1, channels, taps - 1)) if taps > 1 else np.zeros(4))
    wt = put(device, w)
    want, want_state = deltanet_ref.causal_conv1d(rounded(x, dtype)[:, :channels], w, None)
    got, p0 = [], 0
    for n in (7, 1, 5):
        xt, yt = put(device, x[p0:p0 + n], dtype, lead=2), empty(device, (n, channels), dtype, lead=6)
        run(device, deltanet.causal_conv1d(device, xt, wt, state, yt, step_buf(device, p0, n), channels=channels))
        got.append(get(device, yt))
        p0 += n
    np.testing.assert_allclose(np.concatenate(got), want, **TOL[dtype])
    np.testing.assert_allclose(get(device, state).reshape(want_state.shape), want_state, **TOL[dtype])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_causal_conv1d_rows_of_several_sequences(device, dtype):
    """The paged batch's rows: a row per sequence, each with its own slot and position (one at
    position 0: a zero state), then a chunk of one sequence's rows."""
    rng = np.random.default_rng(3)
    C, K, slots = 24, 4, 4
    w, s0 = rng.standard_normal((C, K)), rng.standard_normal((slots, C, K - 1))
    x = rng.standard_normal((3, C))
    state, wt = put(device, s0), put(device, w)
    xt, yt = put(device, x, dtype), empty(device, (3, C), dtype)
    rows = _rows(device, [5, 0, 9], [2, 0, 3])
    run(device, deltanet.causal_conv1d(device, xt, wt, state, yt, channels=C, rows=rows))
    got, st = get(device, yt), get(device, state)
    for r, (slot, fresh) in enumerate([(2, False), (0, True), (3, False)]):
        want, ws = deltanet_ref.causal_conv1d(rounded(x, dtype)[r:r + 1], w, None if fresh else s0[slot])
        np.testing.assert_allclose(got[r], want[0], **TOL[dtype])
        np.testing.assert_allclose(st[slot], ws, **TOL[dtype])
    np.testing.assert_array_equal(st[1], rounded(s0[1], "f32"))     # a slot no row names stays
    chunk = rng.standard_normal((6, C))
    xt, yt = put(device, chunk, dtype), empty(device, (6, C), dtype)
    run(device, deltanet.causal_conv1d(device, xt, wt, state, yt, channels=C,
                                       rows=_rows(device, range(6, 12), [1] * 6)))
    want, ws = deltanet_ref.causal_conv1d(rounded(chunk, dtype), w, s0[1])
    np.testing.assert_allclose(get(device, yt), want, **TOL[dtype])
    np.testing.assert_allclose(get(device, state)[1], ws, **TOL[dtype])


def _delta_inputs(rng, T, Hk, Hv, Dk, Dv, extra=3):
    """qkv (T, 2 Hk Dk + Hv Dv); proj (T, M): `extra` columns, z, b, a, 2 more; A_log | dt_bias | w."""
    qkv = rng.standard_normal((T, 2 * Hk * Dk + Hv * Dv))
    proj = rng.standard_normal((T, extra + Hv * Dv + 2 * Hv + 2))
    hw = np.concatenate([np.log(rng.uniform(0.5, 8.0, Hv)), rng.standard_normal(Hv) * 0.5,
                         1.0 + 0.2 * rng.standard_normal(Dv)])
    return qkv, proj, hw


def _delta_ref(qkv, proj, hw, state, Hk, Hv, Dk, Dv, extra=3, tiled=False):
    z = proj[:, extra:extra + Hv * Dv]
    b, a = proj[:, extra + Hv * Dv:extra + Hv * Dv + Hv], proj[:, extra + Hv * Dv + Hv:extra + Hv * Dv + 2 * Hv]
    return deltanet_ref.gated_delta_rule(qkv, z, b, a, hw[:Hv], hw[Hv:2 * Hv], hw[2 * Hv:], state,
                                         n_k_heads=Hk, k_dim=Dk, v_dim=Dv, eps=1e-6, tiled=tiled)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 4, 16, 16), (1, 1, 128, 128), (2, 2, 32, 8), (1, 3, 8, 48)])
def test_gated_delta_rule_carries_its_state_across_calls(device, dtype, Hk, Hv, Dk, Dv):
    """One sequence in chunks of 9, 1 and 30 rows: each row's normed output and the final state are
    those of transformers' recurrence over the whole sequence (float64 reference)."""
    rng = np.random.default_rng(Hk * Hv + Dk + Dv)
    T = 40
    qkv, proj, hw = _delta_inputs(rng, T, Hk, Hv, Dk, Dv)
    want, want_state = _delta_ref(rounded(qkv, dtype), rounded(proj, dtype), hw, None, Hk, Hv, Dk, Dv)
    state, hwt = put(device, np.full((1, Hv, Dk, Dv), 7.0)), put(device, hw)
    got, p0 = [], 0
    for n in (9, 1, 30):
        qt, pt = put(device, qkv[p0:p0 + n], dtype, lead=4), put(device, proj[p0:p0 + n], dtype, lead=2)
        yt = empty(device, (n, Hv * Dv), dtype, lead=8)
        run(device, deltanet.gated_delta_rule(device, qt, pt, hwt, state, yt, step_buf(device, p0, n), n_k_heads=Hk,
                                              n_v_heads=Hv, k_dim=Dk, v_dim=Dv, z_col=3, eps=1e-6))
        got.append(get(device, yt))
        p0 += n
    np.testing.assert_allclose(np.concatenate(got), want, **TOL[dtype])
    np.testing.assert_allclose(get(device, state)[0], want_state, **TOL[dtype])


def test_gated_delta_rule_rows_of_several_sequences(device):
    """A decode row per sequence, each on its own slot (one at position 0 over a stale state), as
    transformers' one-token step from each state."""
    rng = np.random.default_rng(8)
    Hk, Hv, Dk, Dv, slots = 2, 4, 16, 16, 4
    qkv, proj, hw = _delta_inputs(rng, 3, Hk, Hv, Dk, Dv)
    s0 = rng.standard_normal((slots, Hv, Dk, Dv)) * 0.3
    state, hwt = put(device, s0), put(device, hw)
    qt, pt, yt = put(device, qkv), put(device, proj), empty(device, (3, Hv * Dv))
    run(device, deltanet.gated_delta_rule(device, qt, pt, hwt, state, yt, n_k_heads=Hk, n_v_heads=Hv, k_dim=Dk,
                                          v_dim=Dv, z_col=3, eps=1e-6, rows=_rows(device, [4, 0, 17], [3, 1, 0])))
    got, st = get(device, yt), get(device, state)
    for r, (slot, fresh) in enumerate([(3, False), (1, True), (0, False)]):
        want, ws = _delta_ref(qkv[r:r + 1], proj[r:r + 1], hw, None if fresh else s0[slot], Hk, Hv, Dk, Dv)
        np.testing.assert_allclose(got[r], want[0], **TOL["f32"])
        np.testing.assert_allclose(st[slot], ws, **TOL["f32"])
    np.testing.assert_array_equal(st[2], rounded(s0[2], "f32"))


def test_gated_delta_rule_with_value_heads_tiled(device):
    """llama.cpp's GGUF order (value heads tiled over the key heads: head h reads key head h % Hk)
    against the reference in that order, and the same outputs as HF's grouped order with every
    per-value-head input and output permuted alike."""
    rng = np.random.default_rng(21)
    Hk, Hv, Dk, Dv, T = 2, 6, 8, 16, 5
    qkv, proj, hw = _delta_inputs(rng, T, Hk, Hv, Dk, Dv)
    state, hwt = put(device, np.zeros((1, Hv, Dk, Dv))), put(device, hw)
    yt = empty(device, (T, Hv * Dv))
    run(device, deltanet.gated_delta_rule(device, put(device, qkv), put(device, proj), hwt, state, yt,
                                          step_buf(device, 0, T), n_k_heads=Hk, n_v_heads=Hv, k_dim=Dk, v_dim=Dv,
                                          z_col=3, eps=1e-6, tiled=True))
    want, _ = _delta_ref(qkv, proj, hw, None, Hk, Hv, Dk, Dv, tiled=True)
    np.testing.assert_allclose(get(device, yt), want, **TOL["f32"])
    tiled_of = np.arange(Hv).reshape(Hv // Hk, Hk).T.ravel()      # grouped head g*R + r is tiled head r*Hk + g
    per_head = lambda a, d: a.reshape(T, Hv, d)[:, tiled_of].reshape(T, Hv * d)   # noqa: E731
    qkv_g = np.concatenate([qkv[:, :2 * Hk * Dk], per_head(qkv[:, 2 * Hk * Dk:], Dv)], axis=1)
    zba = proj[:, 3:3 + Hv * Dv + 2 * Hv]
    proj_g = np.concatenate([proj[:, :3], per_head(zba[:, :Hv * Dv], Dv), per_head(zba[:, Hv * Dv:Hv * Dv + Hv], 1),
                             per_head(zba[:, Hv * Dv + Hv:], 1), proj[:, 3 + Hv * Dv + 2 * Hv:]], axis=1)
    hw_g = np.concatenate([hw[:Hv][tiled_of], hw[Hv:2 * Hv][tiled_of], hw[2 * Hv:]])
    grouped, _ = _delta_ref(qkv_g, proj_g, hw_g, None, Hk, Hv, Dk, Dv)
    np.testing.assert_allclose(per_head(get(device, yt), Dv), grouped, **TOL["f32"])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_sigmoid_gate(device, dtype):
    rng = np.random.default_rng(1)
    y, g = rng.standard_normal((5, 64)) * 2, rng.standard_normal((5, 64)) * 3
    yt, gt = put(device, y, dtype, lead=3), put(device, g, dtype, lead=1)
    run(device, deltanet.sigmoid_gate(device, yt, gt))
    np.testing.assert_allclose(get(device, yt), deltanet_ref.sigmoid_gate(rounded(y, dtype), rounded(g, dtype)),
                               **TOL[dtype])


@pytest.mark.parametrize("quant", ["q0f32", "q0f16", "q4f16_1", "q4f32_1"])
def test_qwen35_mlc_artifact(device, tmp_path, ref, quant):
    """The tiny model as MLC-LLM's converter lays out WebLLM's Qwen3.5 artifacts (model_type qwen3_5:
    fused c_attn and gate_up_proj, 1 + w norms, A_log / dt_bias / conv1d_weight without a suffix), in
    each quantisation WebLLM ships it: q0f32 gives transformers' logits and greedy tokens; the others
    the logits and greedy tokens of an HF folder holding the values their files encode (f16 values,
    MLC's (q - 7) * scale)."""
    from tinyfamilies import _write_hf
    from tinyqwen35 import qwen35_config, write_tiny_qwen35_mlc
    art = write_tiny_qwen35_mlc(tmp_path / "mlc", quant, seed=ref["seed"])
    opened = open_model(art["folder"])
    try:
        assert opened.arch.name == "qwen35" and not opened.config.norm_plus_one
        assert load_tokenizer(art["folder"]).encode(ref["text"]) == ref["text_ids"]
        rows, greedy = _run_golden(device, opened.config, opened.weights, ref)
    finally:
        opened.close()
    if quant == "q0f32":
        want_rows, want_greedy = {r: np.asarray(v) for r, v in zip(ref["rows"], ref["logits"])}, ref["greedy"]
    else:
        import tinymodels as tm
        d = art["dims"]
        tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
        _write_hf(tmp_path / "encoded", {n: a.astype(np.float32) for n, a in art["encoded"].items()},
                  qwen35_config(d), tokens, merges, d)
        enc = open_model(tmp_path / "encoded")
        try:
            want_rows, want_greedy = _run_golden(device, enc.config, enc.weights, ref)
        finally:
            enc.close()
    for r in ref["rows"]:
        err = np.abs(rows[r] - want_rows[r]).max() / np.abs(want_rows[r]).max()
        assert err <= 1e-3, f"position {r}: relative error {err:.2e}"
    assert greedy == want_greedy


def test_webllm_qwen35_ids_are_claimed_by_what_loads():
    """list --webllm claims WebLLM's nine Qwen3.5 ids because the family reads MLC's qwen3_5 artifacts
    (its mlc_model_types, proved by test_qwen35_mlc_artifact), not because of the id: without them the
    ids are refused by MLC's model_type."""
    from webgpu_engine.cli.webllm import webllm_rows
    from webgpu_engine.loaders.mlc import refusal
    from webgpu_engine.models.family_qwen35 import QWEN35
    rows = [r for r in webllm_rows() if r["model_id"].startswith("Qwen3.5-")]
    assert len(rows) == 9 and all(r["loads"] and r["family"] == "qwen3_5" for r in rows)
    mlc_types = QWEN35.mlc_model_types
    try:
        object.__setattr__(QWEN35, "mlc_model_types", ())
        assert all(refusal(r["family"], r["quantization"], r["model_type"]) for r in rows)
    finally:
        object.__setattr__(QWEN35, "mlc_model_types", mlc_types)


# --------------------------------------------------------------------------- serving
async def test_qwen35_in_a_batch_answers_as_alone(device, tmp_path, ref):
    """Three requests at once through continuous batching (max_num_sequences 4: the paged pool, each
    sequence's conv and delta states in its slot, ROWS and PREFILL modes, prompts prefilled in chunks
    of 32) give the greedy tokens each gives alone (max_num_sequences 1), one after another (each
    starting its states over: no cached prefix is reused)."""
    folder = str(write_tiny_qwen35_safetensors(tmp_path / "qwen35", seed=ref["seed"])["folder"])
    alone, batched = await batch_answers(folder, ["Grüße aus Köln", "東京で会いましょう 🌍", ref["text"][:160]],
                                         context=192)
    assert alone == batched and all(alone)


def test_memory_estimate_counts_the_recurrent_states(tmp_path, ref):
    """The load's memory estimate counts every Gated DeltaNet layer's f32 conv and delta states once
    for a scheduler of one slot and once per sequence slot of a batch of four, and the rows' wider
    projection and scratch."""
    from webgpu_engine.models.memory import estimate_llm
    from webgpu_engine.models.plan import DecoderPlan
    from tinyqwen35 import LINEAR
    opened = open_model(write_tiny_qwen35_safetensors(tmp_path / "qwen35", seed=ref["seed"])["folder"])
    try:
        cfg = opened.config
        mem = cfg.extra["mixer_memory"]
        Hk, Hv, Dk, Dv = (LINEAR[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                              "linear_key_head_dim", "linear_value_head_dim"))
        conv = 2 * Hk * Dk + Hv * Dv
        assert mem["state_bytes"] == 4 * 4 * (Hv * Dk * Dv + conv * 3)          # 4 linear layers, 4 taps
        one, four = (estimate_llm(cfg, opened.weights, DecoderPlan("f32", 512, 128, n, 16, 64 if n > 1 else 0),
                                  max_binding=1 << 27) for n in (1, 4))
        bare = {**cfg.extra, "mixer_memory": {}}
        cfg.extra = bare
        without = estimate_llm(cfg, opened.weights, DecoderPlan("f32", 512, 128, 1), max_binding=1 << 27)
        assert one.activations - without.activations == mem["state_bytes"] + 4 * 128 * mem["row_elems"]
        assert four.activations - one.activations > 4 * mem["state_bytes"]
    finally:
        opened.close()


def test_qwen35_f16_activations(device, tmp_path, ref):
    """f16 activations and caches (what a GPU with shader-f16 runs; the recurrent states stay f32):
    through prefill chunks of 64 and decode steps, transformers' logits within 1.5e-1 of the largest
    (measured 0.2-12 % at the 7 rows, the worst at 300, where a prefill's row is as far: f16's
    rounding, not the decode path; f32: 1e-6 to 5e-5), then its 16 greedy tokens after a fresh prefill."""
    opened = open_model(write_tiny_qwen35_safetensors(tmp_path / "qwen35", seed=ref["seed"])["folder"])
    try:
        got, greedy = _run_golden(device, opened.config, opened.weights, ref, chunk=64, dtype="f16")
    finally:
        opened.close()
    errs = [np.abs(got[r] - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
            for r, w in zip(ref["rows"], ref["logits"])]
    assert max(errs) <= 1.5e-1, errs
    assert greedy == ref["greedy"]
