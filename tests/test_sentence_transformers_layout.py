"""Older sentence-transformers saves keep the Transformer in a subfolder: modules.json names
`0_Transformer`, which holds config.json, the weights, the tokenizer and sentence_bert_config.json;
`1_Pooling/` sits beside it. Such a folder loads as an embedder by every kind of reference (a local
folder, a folder URL, a Hugging Face repo from the hub and from the HF cache) and gives the vectors
of the same model in the flat layout. A tiny BERT written here; no network."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cache_server import FileServer
from test_references import _folder_files, fake_hf_repo
from tinymodels import TRANSFORMER_FILES, nest, write_tiny_bert
from webgpu_engine import errors as E
from webgpu_engine.engine import EngineConfig, create_mlc_engine
from webgpu_engine.engine.records import EMBEDDING
from webgpu_engine.engine.references import resolve_model_reference
from webgpu_engine.loaders.sentence_transformers import load_sentence_transformer_config, transformer_subfolder

TEXTS = ["a cat sat on the mat", "the dog runs", "hello world!"]
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("st-layout")
    flat = write_tiny_bert(root / "tiny-flat", pooling="mean", normalize=True)["folder"]
    nested = nest(flat, root / "tiny-nested")
    hub = root / "hub"
    fake_hf_repo(hub, "test-org/tiny-nested", _folder_files(nested))
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_CACHE", str(hub))
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("WEBGPU_ENGINE_CACHE", str(root / "artifacts"))
    yield {"root": root, "flat": flat, "nested": nested}
    mp.undo()


def test_the_module_stack_names_the_subfolder(models):
    st = load_sentence_transformer_config(models["nested"])
    flat = load_sentence_transformer_config(models["flat"])
    assert st.model_folder == models["nested"] / "0_Transformer" and flat.model_folder == models["flat"]
    assert (st.pooling, st.normalize, st.max_seq_length) == (flat.pooling, flat.normalize, flat.max_seq_length)
    assert transformer_subfolder([{"idx": 0, "path": "0_Transformer/", "type": "x.Transformer"}]) == "0_Transformer"
    assert transformer_subfolder([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]) == ""
    for bad in ("../elsewhere", "/abs", "a\\b"):
        with pytest.raises(E.ModelFormatError, match="must be a folder inside the model folder"):
            transformer_subfolder([{"idx": 0, "path": bad, "type": "x.Transformer"}])


def test_local_folder_and_hf_cache_resolve_as_embedders(models):
    rec = resolve_model_reference(str(models["nested"]))
    assert (rec.model_id, rec.model_type, Path(rec.model)) == ("tiny-nested", EMBEDDING, models["nested"])
    rec = resolve_model_reference("test-org/tiny-nested")                     # from the HF cache, offline
    assert rec.model_type == EMBEDDING and (Path(rec.model) / "0_Transformer" / "model.safetensors").is_file()
    broken = nest(models["flat"], models["root"] / "no-weights")
    (broken / "0_Transformer" / "model.safetensors").unlink()
    with pytest.raises(E.ModelReferenceError, match=r"lacks \*\.safetensors weights \(in 0_Transformer/"):
        resolve_model_reference(str(broken))


def test_the_hub_downloads_the_subfolder_and_not_the_rest(models, tmp_path, monkeypatch):
    from hf_hub_server import HubServer
    files = {name: p.read_bytes() for name, p in _folder_files(models["nested"]).items()}
    with HubServer() as hub:
        hub.add_repo("hub-org/tiny-nested", {**files, "0_Transformer/pytorch_model.bin": b"not wanted",
                                             "0_Transformer/onnx/model.onnx": b"no"})
        hub.add_repo("hub-org/torch-only", {"modules.json": files["modules.json"],
                                            "0_Transformer/config.json": files["0_Transformer/config.json"],
                                            "0_Transformer/tokenizer.json": b"{}",
                                            "0_Transformer/pytorch_model.bin": b"x"})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE")
        rec = resolve_model_reference("hub-org/tiny-nested")
        got = Path(rec.model)
        assert rec.model_type == EMBEDDING and got.is_relative_to(tmp_path / "hub-cache")
        for name in [*(f"0_Transformer/{n}" for n in TRANSFORMER_FILES), "modules.json", "1_Pooling/config.json"]:
            assert (got / name).read_bytes() == files[name], name
        assert not (got / "0_Transformer" / "pytorch_model.bin").exists()
        assert not (got / "0_Transformer" / "onnx").exists()
        with pytest.raises(E.ModelReferenceError, match="lacks safetensors weights or tokenizer.json in 0_Trans"):
            resolve_model_reference("hub-org/torch-only")
        assert hub.downloads("hub-org/torch-only", "0_Transformer/config.json") == 0


async def test_every_reference_gives_the_flat_layouts_vectors(device, models):
    with FileServer() as srv:
        for name, p in _folder_files(models["nested"]).items():
            srv.add(f"st/tiny-by-url/{name}", p.read_bytes())
        refs = [str(models["flat"]), str(models["nested"]), "test-org/tiny-nested", srv.url("st/tiny-by-url/")]
        engine = await create_mlc_engine(refs, EngineConfig(device=device), None)
    try:
        ids = list(engine.models)
        assert ids == ["tiny-flat", "tiny-nested", "test-org/tiny-nested", "tiny-by-url"]
        want = [d.embedding for d in (await engine.embeddings.create(model=ids[0], input=TEXTS)).data]
        assert abs(np.linalg.norm(want[0]) - 1.0) < 1e-4                     # Normalize applies
        for mid in ids[1:]:
            got = [d.embedding for d in (await engine.embeddings.create(model=mid, input=TEXTS)).data]
            assert got == want, mid                                         # the same model, bit for bit
        assert engine.models[ids[1]].pipeline.max_seq_length == 64           # its sentence_bert_config.json
    finally:
        await engine.unload()


def test_sentence_transformers_reads_the_nested_folder_as_we_do(device, models):
    """The layout written here is one sentence-transformers itself loads, to the same vectors: its
    vectors for this folder were written once by tests/fixtures/make_st_nested.py (`bench` extra)."""
    import asyncio
    ref_file = json.loads((Path(__file__).parent / "fixtures" / "st_nested_reference.json").read_text())
    assert ref_file["texts"] == TEXTS
    ref = np.array(ref_file["embeddings"], dtype=np.float32)

    async def ours():
        engine = await create_mlc_engine(str(models["nested"]), EngineConfig(device=device))
        try:
            return [d.embedding for d in (await engine.embeddings.create(input=TEXTS)).data]
        finally:
            await engine.unload()
    got = np.array(asyncio.run(ours()))
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos
    assert np.abs(got - ref).max() < 1e-3
