"""Ministral 3 (models/family_ministral3.py: YaRN RoPE and Llama 4's query temperature) against
transformers: a tiny random Ministral3ForCausalLM (tests/tinyministral3.py, original context 64) that
tests/fixtures/make_ministral3.py ran through transformers once (its JSON committed), as an HF folder,
as the released Mistral3ForConditionalGeneration folder and as llama.cpp's converter wrote it
(tests/fixtures/ministral3.gguf): the same token ids, logits at positions up to 319 within 1e-3 and
16 greedy tokens. MLC's artifacts (model_type ministral3) run MLC's math: against transformers on a
folder that computes it (tinyministral3.write_mlc_equivalent). The temperature's kernel against its
numpy reference."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from _nn_util import TOL, get, put, rounded, run, step_buf
from test_families import assert_runs_agree, batch_answers, check_golden, run_golden
from tinyministral3 import (write_mlc_equivalent, write_tiny_ministral3_mlc,
                            write_tiny_ministral3_safetensors)
from webgpu_engine.kernels import nn_ref
from webgpu_engine.kernels.rope import q_temperature
from webgpu_engine.models.registry import open_model

FIXTURES = Path(__file__).parent / "fixtures"


def _ref(name: str = "ministral3") -> dict:
    return json.loads((FIXTURES / f"{name}_transformers.json").read_text())


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("per_row", [False, True])
def test_q_temperature_matches_numpy(device, dtype, per_row):
    """Rows crossing multiples of the length (one sequence from pos0 60, or the paged batch's own
    positions): each row's q heads scaled by 1 + beta ln(1 + floor(pos / 64)), k and v untouched."""
    rng = np.random.default_rng(7)
    T, Hq, Hkv, D = 9, 4, 2, 16
    x = rng.standard_normal((T, Hq + 2 * Hkv, D))
    pos = np.array([3, 64, 200, 127, 128, 0, 500, 63, 1000] if per_row else range(60, 60 + T), np.uint32)
    t = put(device, x, dtype, lead=2)
    where = dict(positions=put(device, pos, "u32")) if per_row else dict(step=step_buf(device, 60, T))
    run(device, q_temperature(device, t, n_q_heads=Hq, head_dim=D, beta=0.2, length=64, **where))
    want = nn_ref.q_temperature(rounded(x, dtype), pos, n_q_heads=Hq, beta=0.2, length=64)
    np.testing.assert_allclose(get(device, t), want, **TOL[dtype])
    np.testing.assert_array_equal(get(device, t)[:, Hq:], rounded(x, dtype)[:, Hq:])


def test_ministral3_config_reads_yarn_and_the_temperature(tmp_path):
    """config.json's rope_parameters: YaRN factors, no cos / sin scale (mscale = mscale_all_dim), the
    temperature's beta and length; the GGUF of llama.cpp's converter says the same."""
    folder = write_tiny_ministral3_safetensors(tmp_path / "m")["folder"]
    cfgs = []
    for path in (folder, FIXTURES / "ministral3.gguf"):
        opened = open_model(path)
        cfgs.append(opened.config)
        opened.close()
    for c in cfgs:
        assert c.arch == "mistral3" and c.rope_scaling == "yarn" and c.rope_attn_factor == 1.0
        assert c.extra["q_temperature"] == pytest.approx((0.2, 64)) and not c.attn_scale
    np.testing.assert_allclose(cfgs[0].rope_freq_factors, cfgs[1].rope_freq_factors)
    assert cfgs[0].rope_freq_factors[0] == 1.0 and cfgs[0].rope_freq_factors[-1] == 4.0


@pytest.mark.parametrize("form", ["causal_lm", "released", "released_v4", "gguf"])
def test_ministral3_matches_transformers(device, tmp_path, form):
    """Ministral3ForCausalLM's folder, the released Mistral3ForConditionalGeneration folder (text
    model under model.language_model., or language_model.model. as transformers 4 saved it; a vision
    tower beside it) and llama.cpp's GGUF (mistral3)."""
    if form == "gguf":
        path = FIXTURES / "ministral3.gguf"
    else:
        path = write_tiny_ministral3_safetensors(tmp_path / form, layout=form)["folder"]
    check_golden(device, path, _ref())


def test_ministral3_in_a_batch_answers_as_alone(tmp_path):
    """Continuous batching (the paged rows' own positions) gives each prompt's greedy tokens alone;
    the prompts run past the original context (64), where the temperature applies."""
    folder = write_tiny_ministral3_safetensors(tmp_path / "m")["folder"]
    text = _ref()["text"]
    alone, batched = asyncio.run(batch_answers(str(folder), [text[:100], text[20:180], text[5:140]], context=256))
    assert alone == batched


@pytest.mark.parametrize("quant", ["q0f32", "q4f16_1", "q4f32_1"])
def test_ministral3_mlc_artifact(device, tmp_path, quant):
    """MLC's artifact (model_type ministral3) runs as mlc-llm's Ministral 3 does: q0f32 gives the
    logits and greedy tokens of transformers on a folder computing MLC's math (scores times
    (0.1 ln(factor) mscale_all_dim + 1)^2, no query temperature); q4f16_1 / q4f32_1 those of such a
    folder holding the values their files encode ((q - 7) * scale)."""
    art = write_tiny_ministral3_mlc(tmp_path / "mlc", quant)
    ref = _ref("ministral3_mlc")
    opened = open_model(art["folder"])
    try:
        c = opened.config
        assert opened.arch.name == "mistral3" and "q_temperature" not in c.extra and c.rope_attn_factor == 1.0
        assert c.attn_scale == pytest.approx(ref["mlc_softmax"] / c.head_dim ** 0.5)
        got = run_golden(device, c, opened.weights, ref)
    finally:
        opened.close()
    if quant == "q0f32":
        want = {r: np.asarray(v) for r, v in zip(ref["rows"], ref["logits"])}, ref["greedy"]
    else:
        enc = open_model(write_mlc_equivalent(tmp_path / "encoded", art["encoded"]))
        try:
            want = run_golden(device, enc.config, enc.weights, ref)
        finally:
            enc.close()
    assert_runs_agree(got, want, ref["rows"])


def test_ministral3_f16_activations(device, tmp_path):
    """f16 activations and caches (what a GPU with shader-f16 runs; the temperature's kernel in f16):
    transformers' logits at every kept position within 3e-3 of the largest (measured: 0.5-0.9e-3) and
    its 16 greedy tokens."""
    ref = _ref()
    opened = open_model(write_tiny_ministral3_safetensors(tmp_path / "m")["folder"])
    try:
        got = run_golden(device, opened.config, opened.weights, ref, dtype="f16")
    finally:
        opened.close()
    assert_runs_agree(got, ({r: np.asarray(v) for r, v in zip(ref["rows"], ref["logits"])}, ref["greedy"]),
                      ref["rows"], tol=3e-3)
