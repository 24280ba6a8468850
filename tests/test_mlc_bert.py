"""WebLLM's own embedders: MLC's bert artifacts (snowflake-arctic-embed-{m,s}-q0f32-MLC, loaders/mlc_bert.py).
A tiny random BERT (tests/tinymodels.py) written here in MLC's layout, as mlc-llm's bert model names
its parameters (HF's names, query|key|value fused into `attention.self.qkv`, no pooler) and its
gen_config writes the chat config, answers with sentence-transformers' vectors on the same weights
(CLS pooling, L2-normalised; tests/fixtures/make_mlc_bert.py: raw f32 records, and the bf16 records
MLC's converter writes with the reference run on the weights rounded to bf16), by folder and by
WebLLM id from a prepared offline HF cache through the engine's `embeddings.create`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_mlc import _write_shards
from test_references import _folder_files, fake_hf_repo
from tinymodels import write_tiny_bert
from webgpu_engine.config import ChatConfig
from webgpu_engine.engine import EngineConfig, create_mlc_engine
from webgpu_engine.engine.references import resolve_model_reference
from webgpu_engine.errors import IncorrectPipelineLoadedError, ModelFormatError, UnsupportedModelError
from webgpu_engine.loaders.safetensors import SafetensorsFolder
from webgpu_engine.models.registry import EMBEDDING, LLM, open_model
from webgpu_engine.pipelines.embedding import EmbeddingPipeline

REF = json.loads((Path(__file__).parent / "fixtures" / "mlc_bert_reference.json").read_text())
FAST = {"compile_at_load": False, "max_batch_size": 4}       # 6 texts: two batches, lengths mixed


def write_mlc_bert(hf_folder: Path, folder: Path, *, bf16: bool = False, quant: str = "q0f32",
                   cache_name: str = "tensor-cache.json", **chat) -> None:
    """An MLC artifact of an HF BertModel folder as mlc-llm writes one: bert_loader's names (q | k | v
    concatenated into qkv, position_ids and the pooler dropped), gen_config's mlc-chat-config.json
    (model_config: BertConfig.asdict(), max_position_embeddings moved to context_window_size), the
    tokenizer files copied."""
    folder.mkdir(parents=True)
    sf = SafetensorsFolder(hf_folder)
    t = {n: np.frombuffer(x.data, np.float32).reshape(x.shape) for n, x in sf.tensors.items() if x.qtype == "f32"}
    sf.close()
    params = {}
    for name, a in t.items():
        if ".attention.self.query." in name:
            parts = [t[name.replace(".query.", f".{p}.")] for p in ("query", "key", "value")]
            params[name.replace(".query.", ".qkv.")] = np.concatenate(parts)
        elif ".attention.self.key." not in name and ".attention.self.value." not in name:
            params[name] = a
    _write_shards(folder, params, bf16=bf16, cache_name=cache_name)
    c = json.loads((hf_folder / "config.json").read_text())
    ctx = c["max_position_embeddings"]
    mc = {"vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"], "num_hidden_layers": c["num_hidden_layers"],
          "num_attention_heads": c["num_attention_heads"], "intermediate_size": c["intermediate_size"],
          "hidden_act": c["hidden_act"], "layer_norm_eps": c["layer_norm_eps"], "context_window_size": ctx,
          "prefill_chunk_size": ctx, "tensor_parallel_shards": 1, "type_vocab_size": c["type_vocab_size"],
          "pad_token_id": 0, "position_offset": 0, "head_dim": c["hidden_size"] // c["num_attention_heads"],
          "max_batch_size": 32}
    (folder / "mlc-chat-config.json").write_text(json.dumps({
        "version": "0.1.0", "model_type": "bert", "quantization": quant, "model_config": mc,
        "vocab_size": c["vocab_size"], "context_window_size": ctx, "sliding_window_size": -1,
        "prefill_chunk_size": ctx, "attention_sink_size": -1, "tensor_parallel_shards": 1,
        "temperature": 1.0, "top_p": 1.0, "pad_token_id": 0,
        "conv_template": {"name": "LM", "system_template": "{system_message}", "system_message": "",
                          "roles": {"user": "", "assistant": ""}, "seps": [""], "role_content_sep": "",
                          "role_empty_sep": "", "stop_str": [], "stop_token_ids": [2]},
        "tokenizer_files": ["tokenizer.json", "vocab.txt", "tokenizer_config.json"], **chat}))
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(hf_folder / f, folder / f)


@pytest.fixture(scope="module")
def hf_bert(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mlc-bert") / "hf"
    write_tiny_bert(folder, pooling="cls", normalize=True, seed=REF["seed"],
                    max_seq_length=REF["dims"]["max_position"], **REF["dims"])
    return folder


def _close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
        assert cos >= 0.9999 and np.abs(g - w).max() < 1e-4, (cos, np.abs(g - w).max())
        assert abs(np.linalg.norm(g) - 1) < 1e-5


@pytest.mark.parametrize("weights", ["f32", "bf16"])
async def test_mlc_bert_artifact_equals_sentence_transformers(device, hf_bert, tmp_path, weights):
    """q0f32 with raw f32 records (tensor-cache.json) and as MLC's converter writes it (bf16 records,
    the older ndarray-cache.json): opened as a BERT embedder (CLS, normalised, inputs up to the
    position table), its token ids and vectors are sentence-transformers' for a mixed-length batch
    with accents, CJK, Cyrillic, an emoji and two inputs truncated to 48 tokens."""
    bf16 = weights == "bf16"
    art = tmp_path / "snowflake-tiny-q0f32-MLC"
    write_mlc_bert(hf_bert, art, bf16=bf16, cache_name="ndarray-cache.json" if bf16 else "tensor-cache.json")
    m = open_model(art, EMBEDDING)
    try:
        assert (m.arch.name, m.extra.pooling, m.extra.normalize, m.extra.max_seq_length) == ("bert", "cls", True, 48)
        assert m.weights["encoder.layer.1.attention.self.key.weight"].qtype == ("bf16" if bf16 else "f32")
        assert m.template() is None
    finally:
        m.close()
    ref = REF["weights"][weights]
    pipe = await EmbeddingPipeline.load(device, art, ChatConfig(**FAST))
    try:
        assert pipe.tokenize(REF["texts"]) == ref["token_ids"]
        res = await pipe.embed_step(REF["texts"])
    finally:
        pipe.dispose()
    _close(res.embeddings, ref["embeddings"])
    assert res.prompt_tokens == sum(map(len, ref["token_ids"]))


async def test_webllm_arctic_id_from_the_hf_cache_embeds(device, hf_bert, tmp_path, monkeypatch):
    """`snowflake-arctic-embed-s-q0f32-MLC-b32` / `-b4` resolve to mlc-ai/snowflake-arctic-embed-s-q0f32-MLC
    in a prepared offline HF cache as embedders; the engine loads the id and `embeddings.create`
    answers with sentence-transformers' vectors; a chat request to it is refused."""
    art = tmp_path / "art"
    write_mlc_bert(hf_bert, art, bf16=True)
    snap = fake_hf_repo(tmp_path / "hub", "mlc-ai/snowflake-arctic-embed-s-q0f32-MLC", _folder_files(art))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path / "artifacts"))
    rec = resolve_model_reference("snowflake-arctic-embed-s-q0f32-MLC-b4")
    assert (rec.model_id, rec.model, rec.model_type, rec.reference, rec.overrides) == (
        "snowflake-arctic-embed-s-q0f32-MLC-b4", str(snap), EMBEDDING, "hf://mlc-ai/snowflake-arctic-embed-s-q0f32-MLC",
        {})
    ref = REF["weights"]["bf16"]
    model_id = "snowflake-arctic-embed-s-q0f32-MLC-b32"
    engine = await create_mlc_engine(model_id, EngineConfig(device=device), FAST)
    try:
        res = await engine.embeddings.create(input=REF["texts"], model=model_id)
        _close([d.embedding for d in res.data], ref["embeddings"])
        assert res.usage.prompt_tokens == sum(map(len, ref["token_ids"]))
        with pytest.raises(IncorrectPipelineLoadedError, match="expects a model of type llm"):
            await engine.chat.completions.create(messages=[{"role": "user", "content": "hi"}], model=model_id)
    finally:
        await engine.unload()


def test_mlc_bert_options_and_refusals(hf_bert, tmp_path):
    """embedding_metadata (mlc-llm's newer chat configs) picks the pooling; quantisations other than the
    float ones, an unknown pooling and a decoder embedder are typed errors; the
    artifact is no chat model."""
    mean = tmp_path / "mean"
    write_mlc_bert(hf_bert, mean, embedding_metadata={"model_type": "encoder", "pooling_strategy": "mean",
                                                      "normalize": False})
    m = open_model(mean)
    try:
        assert (m.kind, m.extra.pooling, m.extra.normalize) == (EMBEDDING, "mean", False)
    finally:
        m.close()
    with pytest.raises(ModelFormatError, match="not an llm model"):
        open_model(mean, LLM)
    cases = [({"quantization": "q4f16_1"}, UnsupportedModelError, "quantization 'q4f16_1'"),
             ({"embedding_metadata": {"pooling_strategy": "max"}}, UnsupportedModelError, "pooling_strategy 'max'"),
             ({"model_type": "qwen3", "model_task": "embedding"}, UnsupportedModelError, "qwen3 embedder")]
    for i, (chat, err, match) in enumerate(cases):
        bad = tmp_path / f"bad{i}"
        write_mlc_bert(hf_bert, bad, **chat)
        with pytest.raises(err, match=match):
            open_model(bad).close()
