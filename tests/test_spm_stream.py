"""A SentencePiece reply streams the text its tokenizer decodes: the word-boundary space in front of
the first token ("▁Hello") is dropped as decode() drops it, for the pure-Python and native
tokenizers, GGUF and HF-folder vocabularies; byte-level BPE keeps its leading space, as its decode
does. Then on the real adapter: a chat reply of the tiny SentencePiece GGUF (tests/tinymodels.py,
spm=) streams what get_message() and the tokenizer's decode of its ids give."""
from __future__ import annotations

from pathlib import Path

import pytest

from test_spm import REF, spm_metadata
from webgpu_engine.loaders.tokenizer import load_tokenizer
from webgpu_engine.pipelines.detokenizer import StreamDetokenizer

SPM_HF = Path(__file__).parent / "fixtures" / "spm_hf"
TEXTS = [c["text"] for c in REF["cases"]] + [" leading space", "Grüße aus 東京 🙂", "<s>Hi</s> there"]


def _streamed(tok, ids, **kw) -> tuple[str, str]:
    d = StreamDetokenizer(tok.token_bytes, **kw)
    deltas = []
    for t in ids:
        d.add(t)
        deltas.append(d.take_delta())
    deltas.append(d.finish())
    return "".join(deltas), d.text


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_spm_streams_what_decode_gives(native, source):
    tok = load_tokenizer(spm_metadata() if source == "gguf" else SPM_HF, native=native)
    for text in TEXTS:
        ids = tok.encode(text)
        streamed, whole = _streamed(tok, ids)
        assert streamed == whole == tok.decode(ids), (text, streamed)
    ids = tok.encode("Hello world")
    assert tok.token_bytes(ids[0]).startswith(b" ")              # "▁Hello": the space is the token's
    assert _streamed(tok, ids)[0] == "Hello world"
    assert _streamed(tok, ids, strip_leading_space=False)[0] == " Hello world"     # asked to keep it


def test_without_space_prefix_nothing_is_dropped():
    tok = load_tokenizer(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}), native=False)
    ids = tok.encode(" Hello world")
    assert _streamed(tok, ids)[0] == tok.decode(ids) == " Hello world"


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_byte_level_bpe_keeps_its_leading_space(tmp_path, native):
    from tinymodels import write_tiny_llama_gguf
    tok = load_tokenizer(write_tiny_llama_gguf(tmp_path / "bpe.gguf")["path"], native=native)
    for text in (" hello world", "hello world"):
        ids = tok.encode(text)
        assert _streamed(tok, ids)[0] == tok.decode(ids) == text


async def test_a_chat_reply_streams_its_decoded_text(device, tmp_path):
    import tinymodels
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    info = tinymodels.write_tiny_llama_gguf(tmp_path / "spm.gguf", vocab_size=len(REF["tokens"]), spm=REF, seed=3)
    pipe = await LLMChatPipeline.load(device, info["path"], ChatConfig(dtype="f32", context_window_size=64,
                                                                       compile_at_load=False))
    try:
        the = REF["tokens"].index("\u2581the")
        for bias in ({}, {the: 100.0}):        # the model's own reply; one that starts with "▁the"
            gen = GenerationConfig(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias=bias)
            pipe.reset_chat()
            await pipe.prefill_step([{"role": "user", "content": "Grüße aus Köln"}], gen)
            deltas = [pipe.take_delta()]
            while not pipe.stopped:
                await pipe.decode_step()
                deltas.append(pipe.take_delta())
            ids = pipe.output_ids
            assert "".join(deltas) == pipe.get_message() == pipe.tokenizer.decode(ids), ids
            if bias:
                assert ids[0] == the and pipe.get_message().startswith("the")
    finally:
        pipe.dispose()
