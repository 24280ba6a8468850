"""Every decoder family against llama.cpp itself, on GGUF files llama.cpp converted (its
convert_hf_to_gguf.py) and quantised (llama_model_quantize) to Q4_K_M, Q5_K_M and IQ4_XS:
tests/fixtures/make_llamacpp.py wrote the files under tests/fixtures/llamacpp/ and llama.cpp's
logits and greedy tokens into tests/fixtures/llamacpp.json once. Opened like any user file, ours
must read the tensor types llama.cpp wrote, give llama.cpp's 16 greedy tokens and its logits at
positions up to 319 within the file's tolerance (relative to the row's largest logit): 1.25 times
how far llama.cpp's CPU backend (activations quantised to Q8_K) is from an exact forward pass over
the same weights, which ours computes within ~2e-6 (the JSON's `measured`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from decoder_runner import DecoderRunner
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.models.registry import open_model

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "llamacpp.json").read_text())
CASES = [(family, quant) for family, entry in REF["families"].items() for quant in entry["files"]]
MAIN_TYPE = {"Q4_K_M": "q4_k", "Q5_K_M": "q5_k", "IQ4_XS": "iq4_xs"}


def _file(family: str, quant: str) -> tuple[Path, dict]:
    f = REF["families"][family]["files"][quant]
    return FIXTURES / "llamacpp" / f["file"], f


def run(device, cfg, weights, ids: list[int], rows: list[int], prompt_len: int, greedy_prompt: list[int],
        n_greedy: int) -> tuple[dict, list]:
    """({row: logits}, greedy) of our model, context window 512 as llama.cpp ran (Phi-3's long RoPE
    factors): `ids` through a chunked prefill up to prompt_len whose chunks end at the rows kept, then
    one token per decode step (rows from prompt_len on: the decode path); then `greedy_prompt` from
    position 0 again (its prefill rewrites the cache rows it reads) and n_greedy greedy decode steps."""
    r = DecoderRunner(device, cfg, weights, owner="test:llamacpp")
    try:
        got = r.prefill(ids, {x + 1 for x in rows if x < prompt_len} | {prompt_len})
        for pos in range(prompt_len, max(rows) + 1):
            got[pos] = r.decode(ids[pos], pos)
        n = len(greedy_prompt)
        greedy = r.greedy(r.prefill(greedy_prompt, [n])[n - 1], n, n_greedy)
    finally:
        r.release()
    return {x: got[x] for x in rows}, greedy


@pytest.mark.parametrize("family,quant", CASES)
def test_llamacpp_quantised_file_types(family, quant):
    """The committed files hold llama.cpp's K / IQ blocks (no fallback for narrow rows), as our
    loader reads them."""
    path, f = _file(family, quant)
    with GGUFFile(path) as g:
        types = {name: t.qtype for name, t in g.tensors.items()}
        assert g.architecture == {"mistral": "llama"}.get(family, family)
    assert types == {name: t.lower() for name, t in f["tensor_types"].items()}
    assert MAIN_TYPE[quant] in types.values()
    assert not set(types.values()) & {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "f16"}


@pytest.mark.parametrize("family,quant", CASES)
def test_matches_llamacpp(device, family, quant):
    path, f = _file(family, quant)
    entry, rows = REF["families"][family], REF["rows"]
    opened = open_model(path)
    try:
        got, greedy = run(device, opened.config, opened.weights, entry["ids"], rows, REF["prompt_len"],
                          entry["greedy_prompt"], len(f["greedy"]))
    finally:
        opened.close()
    tol = f["tolerance"]
    for r, want in zip(rows, f["logits"]):
        want = np.asarray(want)
        err = np.abs(got[r] - want).max() / np.abs(want).max()
        assert err <= tol, f"{family} {quant} position {r}: relative error {err:.2e} > {tol:.0e}"
    assert greedy == f["greedy"]
