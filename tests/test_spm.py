"""SentencePiece GGUF vocabularies (tokenizer.ggml.model "llama"): our pure-Python tokenizer and its
`tokenizers` twin against the ids sentencepiece itself gives (tests/fixtures/make_spm.py), for
texts with runs of spaces, non-ASCII letters and byte-fallback characters (CJK, emoji)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from webgpu_engine.loaders.tokenizer import load_tokenizer

REF = json.loads((Path(__file__).parent / "fixtures" / "spm_vocab.json").read_text(encoding="utf-8"))


def spm_metadata(**extra) -> dict:
    """The tokenizer.ggml.* keys llama.cpp's converter writes for this vocabulary."""
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": REF["tokens"],
          "tokenizer.ggml.scores": REF["scores"], "tokenizer.ggml.token_type": REF["token_types"],
          "tokenizer.ggml.bos_token_id": REF["bos_id"], "tokenizer.ggml.eos_token_id": REF["eos_id"],
          "tokenizer.ggml.unknown_token_id": REF["unk_id"], "tokenizer.ggml.add_bos_token": True,
          "tokenizer.ggml.add_space_prefix": True}
    md.update(extra)
    return md


@pytest.fixture(scope="module", params=[False, True], ids=["python", "native"])
def tok(request):
    return load_tokenizer(spm_metadata(), native=request.param)


@pytest.mark.parametrize("case", REF["cases"], ids=lambda c: c["text"][:16])
def test_ids_equal_sentencepiece(tok, case):
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["decoded"]


def test_byte_fallback_and_specials(tok):
    ids = tok.encode("東")                               # no piece holds it: its three UTF-8 bytes
    assert [REF["tokens"][i] for i in ids[-3:]] == ["<0xE6>", "<0x9D>", "<0xB1>"]
    assert b"".join(tok.token_bytes(i) for i in ids) == " 東".encode()
    # control tokens are matched whole, with the space prefix after them (as llama.cpp does)
    assert tok.encode("<s>Hi</s>") == [1] + tok.encode("Hi") + [2]
    assert 1 not in tok.encode("<s>", parse_special=False)
    assert tok.encode("Hi", add_special_tokens=True) == [1] + tok.encode("Hi")
    assert tok.bos_id == 1 and 2 in tok.eos_ids


def test_gguf_with_spm_vocab_opens(tmp_path):
    """A llama GGUF with a SentencePiece vocabulary (Llama-2 / Mistral files) loads its tokenizer."""
    import gguf

    import tinymodels
    from webgpu_engine.models.registry import open_model
    info = tinymodels.write_tiny_llama_gguf(tmp_path / "spm.gguf", vocab_size=len(REF["tokens"]),
                                            spm=REF, seed=3)
    m = open_model(info["path"])
    try:
        t = m.tokenizer()
        assert t.encode(REF["cases"][3]["text"]) == REF["cases"][3]["ids"]
        assert m.config.vocab_size == len(REF["tokens"]) and m.config.bos_id == 1
    finally:
        m.close()
    assert gguf.GGUFReader(str(info["path"])).fields["tokenizer.ggml.model"].contents() == "llama"


async def test_pipeline_chats_with_spm_gguf(device, tmp_path):
    """The chat pipeline on a SentencePiece GGUF: BOS + [INST] template tokenised as llama.cpp does,
    greedy tokens equal to the numpy reference, and the reply decoded through token_bytes."""
    import tinymodels
    from ref_llama import greedy
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    info = tinymodels.write_tiny_llama_gguf(tmp_path / "spm.gguf", vocab_size=len(REF["tokens"]), spm=REF, seed=3)
    pipe = await LLMChatPipeline.load(device, info["path"], ChatConfig(dtype="f32", context_window_size=64))
    try:
        gen = GenerationConfig(temperature=0.0, max_tokens=6, ignore_eos=True)
        await pipe.prefill_step([{"role": "user", "content": "Grüße aus Köln"}], gen)
        while not pipe.stopped:
            await pipe.decode_step()
        prompt = pipe.kv_ids[:pipe.usage()["prompt_tokens"]]
        assert prompt == [1] + pipe.tokenizer.encode("[INST] Grüße aus Köln [/INST]")
        assert pipe.output_ids == greedy(info["config"], info["weights"], prompt, 6)
    finally:
        pipe.dispose()


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_hf_folder_spm_tokenizer_equals_transformers(native):
    """An HF folder's tokenizer.json of the SentencePiece kind (BPE with byte fallback, Metaspace
    spaces: what transformers writes for Llama-2 / Mistral / Phi-3 / Gemma) gives transformers' ids,
    pure-Python (merge ranks in place of scores) and natively."""
    tok = load_tokenizer(Path(__file__).parent / "fixtures" / "spm_hf", native=native)
    for case in REF["cases"]:
        assert tok.encode(case["text"]) == case["transformers_ids"], case["text"]
    assert tok.decode(tok.encode("Grüße aus 東京")) == "Grüße aus 東京"
    assert tok.encode("<s>Hi") == [1] + tok.encode("Hi")
