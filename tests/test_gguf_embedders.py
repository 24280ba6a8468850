"""GGUF embedders written by llama.cpp's convert_hf_to_gguf.py (tests/fixtures/make_gguf_embedders.py):
a tiny BERT (`bert`, WordPiece vocabulary), a tiny bge-m3-style XLM-RoBERTa (`bert` with a "t5"
Unigram vocabulary, positions cut at padding_idx + 1) and a tiny NomicBert (`nomic-bert`), each as
F32, F16 and Q8_0, on the real adapter: vectors against sentence-transformers' (BERT, XLM-R; the
committed reference) and the numpy NomicBert reference (tests/ref_nomic.py), equal token ids, mixed
lengths in one batch, non-ASCII text; broken files give typed errors."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import ref_nomic as R
from tiny_encoders import write_tiny_nomic

from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import (
    ModelFormatError,
    UnsupportedModelError,
    WebGPUEngineError,
)
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.loaders.tokenizer import load_tokenizer
from webgpu_engine.models.registry import open_model
from webgpu_engine.pipelines.embedding import EmbeddingPipeline

DIR = Path(__file__).resolve().parent / "fixtures" / "gguf_embedders"
REF = json.loads((DIR / "reference.json").read_text(encoding="utf-8"))
TEXTS = REF["texts"]
TYPES = ("f32", "f16", "q8_0")
# cosine to the reference. F32: measured >= 0.9999999 (max abs 3e-7), F16 (each weight rounded by
# 2^-11 relative): >= 0.9999992. Q8_0 rounds each weight to 1/127 of its block's largest: measured
# 0.99994 (BERT), 0.99993 (NomicBert), 0.99928 (XLM-R, 32 wide: fewer values average the rounding
# out), so its bound is looser: 0.998.
COSINE = {"f32": 0.9999, "f16": 0.9999, "q8_0": 0.998}


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def pipes(device):
    async def load():
        # compile_at_load off: the first request compiles (nine loads, most sharing their pipelines)
        cc = ChatConfig(max_batch_size=4, compile_at_load=False)
        return {(m, t): await EmbeddingPipeline.load(device, DIR / f"{m}-{t}.gguf", cc)
                for m in ("bert", "xlmr", "nomic") for t in TYPES}
    out = asyncio.run(load())
    yield out
    for p in out.values():
        p.dispose()


def test_read_as_llama_cpp_wrote_them():
    """Architecture, pooling from `<arch>.pooling_type`, L2 normalisation, trained context."""
    want = {"bert": ("bert", "bert", "mean", 128), "xlmr": ("bert", "bert", "cls", 40),
            "nomic": ("nomic-bert", "nomic_bert", "mean", 2048)}
    for name, (arch, ours, pooling, ctx) in want.items():
        m = open_model(DIR / f"{name}-q8_0.gguf")
        try:
            assert (m.arch.name, m.kind, m.config.arch, m.config.gguf) == (arch, "embedding", ours, True)
            assert (m.extra.pooling, m.extra.normalize, m.extra.max_seq_length) == (pooling, True, ctx)
            assert m.weights["embed"].qtype == "q8_0" and m.config.position_offset == 0
        finally:
            m.close()


def test_wordpiece_vocabulary_undoes_the_phantom_space_form():
    """The converter writes word starts as "▁word" and continuations without "##"; the tokenizer built
    from the GGUF gives sentence-transformers' ids, natively and in pure Python (the browser's)."""
    with GGUFFile(DIR / "bert-f32.gguf") as g:
        tokens = g.metadata["tokenizer.ggml.tokens"]
        assert "[CLS]" in tokens and any(t.startswith("\u2581") for t in tokens)
        ids = REF["models"]["bert"]["token_ids"]
        L = REF["models"]["bert"]["max_seq_length"]
        for native in (True, False):
            tk = load_tokenizer(g, native=native, max_length=L, encoder=True)
            assert [tk.encode(t, add_special_tokens=True, max_length=L) for t in TEXTS] == ids, native


def test_wordpiece_vocabulary_without_the_phantom_form():
    """Files from converters before the phantom-space rewrite keep BERT's "##" pieces: read as they are."""
    with GGUFFile(DIR / "bert-f32.gguf") as g:
        md = dict(g.metadata)
    md["tokenizer.ggml.tokens"] = [t if ty == 3 else t[1:] if t.startswith("\u2581") else "##" + t
                                   for t, ty in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"])]
    L = REF["models"]["bert"]["max_seq_length"]
    tk = load_tokenizer(md, native=False, max_length=L, encoder=True)
    assert [tk.encode(t, add_special_tokens=True, max_length=L) for t in TEXTS] == REF["models"]["bert"]["token_ids"]


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("name", ["bert", "xlmr"])
async def test_vectors_equal_sentence_transformers(pipes, name, t):
    pipe, ref = pipes[(name, t)], REF["models"][name]
    assert pipe.max_seq_length == ref["max_seq_length"]
    assert pipe.tokenize(TEXTS) == ref["token_ids"]              # truncation, accents, CJK, emoji
    res = await pipe.embed_step(TEXTS)                           # batches of 4 of mixed lengths, padded
    for text, got, want in zip(TEXTS, res.embeddings, ref["embeddings"]):
        c = _cos(got, want)
        assert c > COSINE[t], f"{name}-{t} {text[:20]!r}: cosine {c:.6f}"
        assert abs(np.linalg.norm(got) - 1) < 1e-5              # normalised, as llama.cpp / Ollama return
    assert res.prompt_tokens == sum(len(i) for i in ref["token_ids"])


@pytest.mark.parametrize("t", TYPES)
async def test_nomic_equals_numpy_reference(pipes, tmp_path_factory, t):
    info = write_tiny_nomic(tmp_path_factory.mktemp("nomic"), seed=REF["models"]["nomic"]["seed"],
                            n_positions=REF["models"]["nomic"]["n_positions"])
    W, cfg = R.load_weights(info["folder"]), R.load_config(info["folder"])
    pipe = pipes[("nomic", t)]
    ids = pipe.tokenize(TEXTS)
    folder_tk = load_tokenizer(info["folder"], max_length=pipe.max_seq_length, encoder=True)
    assert ids == [folder_tk.encode(x, add_special_tokens=True) for x in TEXTS]
    res = await pipe.embed_step(TEXTS)
    for text, s, got in zip(TEXTS, ids, res.embeddings):
        c = _cos(got, R.embed(W, cfg, s))
        assert c > COSINE[t], f"nomic-{t} {text[:20]!r}: cosine {c:.6f}"


def test_batched_equals_one_at_a_time(pipes):
    """Padding never reaches a vector: each input alone gives what it gave in a mixed batch."""
    pipe = pipes[("xlmr", "f32")]
    together = asyncio.run(pipe.embed_step(TEXTS)).embeddings
    for text, v in zip(TEXTS, together):
        alone = asyncio.run(pipe.embed_step([text])).embeddings[0]
        assert np.abs(np.asarray(alone) - np.asarray(v)).max() < 1e-5


def _rewrite(src: Path, dst: Path, *, drop: str | None = None, meta: dict | None = None, tensor=None) -> Path:
    """A copy of GGUF `src` without tensor `drop` / with metadata values replaced / each tensor as
    `tensor(name, data, type)` returns it, (data, type) (the gguf package)."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        value = (meta or {}).get(name, f.contents())
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    for t in r.tensors:
        if t.name != drop:
            data, qtype = tensor(t.name, t.data, t.tensor_type) if tensor else (t.data, t.tensor_type)
            w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


async def test_decoder_quant_types_run_exactly(device, tmp_path):
    """Other GGUF types the decoders read (here Q4_0: the matrices and token_embd quantised by gguf-py's
    numpy quantiser, in llama.cpp's block layout) run through the same kernels: their vectors equal
    those of an F32 file holding the same dequantised weights."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants
    qtype = "Q4_0"
    qt = T[qtype]

    def quantised(name, data, t):
        if data.ndim == 2 and name.endswith(".weight") and not name.startswith(("position", "token_types")):
            return quants.quantize(data, qt), qt
        return data, t

    def dequantised(name, data, t):
        q, t2 = quantised(name, data, t)
        return (quants.dequantize(q, qt), t) if t2 == qt else (data, t)
    q = _rewrite(DIR / "bert-f32.gguf", tmp_path / f"bert-{qtype}.gguf", tensor=quantised)
    d = _rewrite(DIR / "bert-f32.gguf", tmp_path / "bert-deq.gguf", tensor=dequantised)
    cc = ChatConfig(max_batch_size=4, compile_at_load=False)
    pq, pd = await EmbeddingPipeline.load(device, q, cc), await EmbeddingPipeline.load(device, d, cc)
    try:
        with GGUFFile(q) as g:
            assert g.tensors["blk.0.ffn_up.weight"].qtype == qtype.lower()
        got, want = (await pq.embed_step(TEXTS)).embeddings, (await pd.embed_step(TEXTS)).embeddings
        for a, b in zip(got, want):
            assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-5
        ref = REF["models"]["bert"]["embeddings"]
        # and near the model's own vectors: 4-bit weights move them (measured min cosine 0.985)
        assert min(_cos(a, b) for a, b in zip(got, ref)) > 0.98
    finally:
        pq.dispose()
        pd.dispose()


def test_bad_files_get_typed_errors(device, tmp_path):
    src = DIR / "bert-f32.gguf"
    cases = [
        ({"meta": {"bert.pooling_type": 4}}, UnsupportedModelError, "pooling_type 4"),
        ({"meta": {"bert.pooling_type": 0}}, UnsupportedModelError, "pooling_type 0"),
        ({"meta": {"bert.pooling_type": 9}}, UnsupportedModelError, "pooling_type 9"),
        ({"meta": {"bert.attention.causal": True}}, UnsupportedModelError, "causal"),
        ({"drop": "blk.1.ffn_down.weight"}, UnsupportedModelError, "blk.1.ffn_down.weight"),
        ({"drop": "token_embd_norm.bias"}, UnsupportedModelError, "token_embd_norm.bias"),
        ({"meta": {"tokenizer.ggml.model": "bpe-ish"}}, UnsupportedModelError, "bpe-ish"),
    ]
    for i, (kw, err, text) in enumerate(cases):
        bad = _rewrite(src, tmp_path / f"bad{i}.gguf", **kw)
        with pytest.raises(err, match=text):
            asyncio.run(EmbeddingPipeline.load(device, bad, ChatConfig(max_batch_size=2)))
    shutil.copy(src, tmp_path / "cut.gguf")
    with open(tmp_path / "cut.gguf", "r+b") as f:
        f.truncate(src.stat().st_size - 1000)
    with pytest.raises(ModelFormatError, match="truncated"):
        asyncio.run(EmbeddingPipeline.load(device, tmp_path / "cut.gguf", ChatConfig(max_batch_size=2)))
    assert issubclass(UnsupportedModelError, WebGPUEngineError)


async def test_engine_serves_a_gguf_embedder_by_path(device, pipes):
    """A .gguf reference resolves to an embedder (no longer "a bert GGUF is not supported"), serves
    the pipeline's vectors under its file name, and a bad request leaves it usable."""
    from webgpu_engine.engine import EngineConfig, create_mlc_engine
    from webgpu_engine.engine.references import resolve_model_reference
    path = DIR / "xlmr-q8_0.gguf"
    assert resolve_model_reference(str(path)).model_type == "embedding"
    engine = await create_mlc_engine([str(path)], EngineConfig(device=device))
    try:
        loaded = engine.models["xlmr-q8_0"]
        assert loaded.pipeline.max_seq_length == 40
        assert loaded.estimate is not None and loaded.estimate.weights > 0     # the pre-load memory check read it
        r = await engine.embeddings.create(model="xlmr-q8_0", input=TEXTS[:3])
        want = (await pipes[("xlmr", "q8_0")].embed_step(TEXTS[:3])).embeddings
        for d, w in zip(r.data, want):
            assert np.abs(np.asarray(d.embedding) - np.asarray(w)).max() < 1e-6
        with pytest.raises(WebGPUEngineError):
            await engine.embeddings.create(model="xlmr-q8_0", input=[[1, 10_000]])     # id beyond the vocabulary
        assert len((await engine.embeddings.create(model="xlmr-q8_0", input="a")).data[0].embedding) == 32
    finally:
        await engine.unload()
