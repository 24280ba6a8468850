"""The decoder families are one module each (models/family_*.py) collected into the registry's one
table, the loaders never import models/, and a family registered at run time is found by open_model,
by architecture lookup and by the loaders called directly, with no other file touched."""
from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

import tinymodels
from webgpu_engine.errors import UnsupportedModelError
from webgpu_engine.loaders import decoder_config
from webgpu_engine.loaders.decoder_config import DecoderFamily
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.loaders.hf_config import load_llama_config
from webgpu_engine.models import registry

PACKAGE = Path(registry.__file__).resolve().parent.parent


def test_each_decoder_family_comes_from_its_own_module():
    owners = {}
    for mod in registry.DECODER_FAMILY_MODULES:
        m = importlib.import_module(f"webgpu_engine.models.{mod}")
        assert mod.startswith("family_") and m.FAMILIES
        for fam in m.FAMILIES:
            assert fam.name not in owners, f"{fam.name} declared twice"
            owners[fam.name] = m.__name__
            for hook in (fam.gguf, fam.hf):
                assert hook is None or hook.__module__ == m.__name__, (fam.name, hook)
    decoders = {n: a for n, a in registry.ARCHITECTURES.items() if a.family is not None}
    assert set(decoders) == set(owners) == set(decoder_config.FAMILIES) \
        >= {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"}
    for name, arch in decoders.items():
        assert arch.family is decoder_config.FAMILIES[name] and arch.hf_names == arch.family.hf_names
        for a in arch.family.hf_architectures:
            assert registry.hf_architecture({"architectures": [a]}) is arch


def test_loaders_do_not_import_models():
    for path in sorted((PACKAGE / "loaders").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                name = "." * node.level + (node.module or "")
                assert not name.startswith("..models") and "webgpu_engine.models" not in name, (path.name, name)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("webgpu_engine.models") for a in node.names), path.name


def _toy_hf(c: dict, fields: dict, where: str) -> dict:
    return {**fields, "rope_base": float(c["toy_rope_base"])}


def _toy_gguf(g, fields: dict) -> dict:
    return {**fields, "rope_base": float(g.meta("toy_rope_base", required=True))}


# A family as its own module would declare it: a Llama-shaped decoder with its own names and one key
TOY = DecoderFamily("toy", hf_architectures=("ToyForCausalLM",), hf_model_types=("toy",),
                    hf_defaults={"attention_bias": True}, gguf_neox=True, gguf=_toy_gguf, hf=_toy_hf)


def _toy_gguf_file(path: Path) -> Path:
    import gguf
    w = gguf.GGUFWriter(str(path), "toy")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_float32("toy.toy_rope_base", 1234.0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def test_a_family_registered_at_run_time_is_found_everywhere(tmp_path):
    info = tinymodels.write_tiny_llama_safetensors(tmp_path / "toy", arch="llama", seed=2)
    cfg_file = info["folder"] / "config.json"
    c = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**c, "architectures": ["ToyForCausalLM"], "model_type": "toy",
                                    "toy_rope_base": 5e4}))
    gguf_path = _toy_gguf_file(tmp_path / "toy.gguf")
    with pytest.raises(UnsupportedModelError, match="ToyForCausalLM"):
        registry.open_model(info["folder"])
    arch = registry.register(TOY)
    try:
        assert registry.architecture("toy") is arch and arch.family is TOY and arch.kind == registry.LLM
        m = registry.open_model(info["folder"])
        try:
            assert m.arch is arch and set(m.weights) == set(info["weights"])
            # the shared reading, then the family's defaults and its own key
            want = {**vars(info["config"]), "arch": "toy", "rope_base": 5e4, "qkv_bias": True}
            assert {k: getattr(m.config, k) for k in want} == want
        finally:
            m.close()
        assert load_llama_config(info["folder"]) == m.config         # a loader called directly
        with GGUFFile(gguf_path) as g:
            cfg = g.model_config()
            assert (cfg.arch, cfg.rope_base, cfg.rope_neox, cfg.n_layers) == ("toy", 1234.0, True, 2)
    finally:
        registry.unregister("toy")
    assert "toy" not in registry.ARCHITECTURES and "toy" not in decoder_config.FAMILIES
    assert "ToyForCausalLM" not in registry.HF_ARCHITECTURES
    with pytest.raises(UnsupportedModelError, match="toy"):
        registry.architecture("toy")


async def test_a_family_registered_at_run_time_runs(tmp_path, device):
    """Served under its own name, the toy family computes what the same weights compute as Llama."""
    from webgpu_engine.engine import EngineConfig, create_mlc_engine
    llama = tinymodels.write_tiny_llama_safetensors(tmp_path / "llama", arch="llama", seed=2)["folder"]
    toy = tmp_path / "toy"
    toy.mkdir()
    for f in llama.iterdir():
        (toy / f.name).write_bytes(f.read_bytes())
    c = json.loads((llama / "config.json").read_text())
    (toy / "config.json").write_text(json.dumps({**c, "architectures": ["ToyForCausalLM"], "model_type": "toy",
                                                 "toy_rope_base": c.get("rope_theta", 10000.0),
                                                 "attention_bias": False}))

    async def greedy(folder):
        engine = await create_mlc_engine(str(folder), EngineConfig(device=device))
        try:
            r = await engine.completions.create(prompt="hello world", max_tokens=8, temperature=0)
            return engine.models[next(iter(engine.models))].pipeline.model.cfg.arch, r.choices[0].text
        finally:
            await engine.unload()
    registry.register(TOY)
    try:
        arch, got = await greedy(toy)
    finally:
        registry.unregister("toy")
    assert arch == "toy"
    assert got == (await greedy(llama))[1] and got


def _scaled(point: str):
    """A toy family's new math at `point`: the tensor times its `extra` value (an existing op)."""
    from webgpu_engine.kernels import nn

    def ops(m, i, t, T, *where):             # "embed", "inputs", "layer_end": where = (Rows,)
        return [nn.scale(m.dev, t, t, m.cfg.extra[point] * (1.0 + 0.1 * max(i, 0)))]
    return ops


async def test_a_familys_new_math_is_its_own_module(tmp_path, device):
    """A family's new math lives in its module: values in LlamaConfig.extra and ops at the decoder's
    points (DecoderFamily.ops: "embed", "inputs", "qkv", "attn", "ffn", "layer_end", "logits"), which
    every row mode runs; the fusions across those points are off (RoPE in the qkv matmul, act(gate)·up
    in the down matmul), and prefill and fused decode logits equal the numpy reference with the same math."""
    import dataclasses

    import numpy as np
    from decoder_runner import DecoderRunner
    from ref_llama import RefLlama, weights_from_infos

    from webgpu_engine.models.decoder import FusionPlan
    extra = {"embed": 1.25, "inputs": 0.8, "qkv": 0.75, "attn": 1.5, "ffn": 0.5, "layer_end": 0.9, "logits": 2.0}
    fam = DecoderFamily("toymath", ops={p: _scaled(p) for p in extra})
    info = tinymodels.write_tiny_llama_gguf(tmp_path / "t.gguf", qtype="q8_0", seed=4)
    opened = registry.open_model(info["path"])
    registry.register(fam)
    try:
        cfg = dataclasses.replace(opened.config, arch="toymath", extra=extra)
        ids = [int(i) for i in np.random.default_rng(5).integers(3, 250, 16)]
        run = DecoderRunner(device, cfg, opened.weights, owner="test:toymath", context_window=64, chunk=16)
        m = run.model
        try:
            plain = FusionPlan.choose(device, opened.config, m.layers, m.lm_head, True)
            assert any(plain.rope_kv) and not any(m.decode_plan.rope_kv)    # what "qkv" turns off
            assert not m.decode_plan.gate_in_down
            got = [run.prefill(ids[:12], [12])[11]] + [run.decode(ids[pos], pos) for pos in range(12, 16)]
        finally:
            run.release()
        ref_ops = {p: (lambda i, a, p=p: a * (extra[p] * (1.0 + 0.1 * max(i, 0)))) for p in extra}
        want = RefLlama(cfg, weights_from_infos(opened.weights), context=64, ops=ref_ops).forward(ids)[11:]
        plain = RefLlama(opened.config, weights_from_infos(opened.weights), context=64).forward(ids)[11:]
        assert np.abs(want - plain).max() > 0.1 * np.abs(plain).max()       # the math changes the answer
        np.testing.assert_allclose(np.array(got), want, atol=2e-3 * np.abs(want).max(), rtol=0)
    finally:
        registry.unregister("toymath")
        opened.close()
