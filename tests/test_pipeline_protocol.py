"""The pipeline contract (pipelines/protocol.py): the real pipelines' classes and the test stubs
conform to it, a class missing a member or taking other arguments is refused by name, and the engine
refuses such a class in pipeline_factories before loading anything. No model is loaded."""
from __future__ import annotations

import pytest

from stub_pipelines import StubEmbedder, StubLLM, stub_config
from webgpu_engine.config import ChatConfig
from webgpu_engine.engine import create_mlc_engine
from webgpu_engine.pipelines.embedding import EmbeddingPipeline
from webgpu_engine.pipelines.llm import LLMChatPipeline
from webgpu_engine.pipelines.protocol import (ChatPipelineProtocol, ChatTemplateProtocol, ChatTokenizerProtocol,
                                              EmbeddingPipelineProtocol, EmbeddingTokenizerProtocol,
                                              GrammarCompilerProtocol, PipelineContractError, check_pipeline,
                                              conformance_problems)

CHAT_ATTRS = {"dev", "owner", "chat_config", "tokenizer", "template", "vocab_size", "grammars", "stopped",
              "finish_reason", "token_logprobs"}


def test_real_pipeline_classes_conform():
    # methods and signatures by inspect, attributes from the annotations in the class bodies
    assert conformance_problems(LLMChatPipeline, ChatPipelineProtocol) == []
    assert conformance_problems(EmbeddingPipeline, EmbeddingPipelineProtocol) == []
    # and each is refused as the other kind
    wrong = conformance_problems(LLMChatPipeline, EmbeddingPipelineProtocol)
    assert "no method prepare_embed()" in wrong and "no attribute 'max_seq_length'" in wrong
    wrong = conformance_problems(EmbeddingPipeline, ChatPipelineProtocol)
    assert "no method decode_step()" in wrong and "no attribute 'template'" in wrong
    # what a request generates through with continuous batching: the same request-level members
    from webgpu_engine.pipelines.protocol import GenerationProtocol
    from webgpu_engine.pipelines.scheduler import BatchSequence
    assert conformance_problems(BatchSequence, GenerationProtocol) == []
    assert "no method sequence()" in conformance_problems(BatchSequence, ChatPipelineProtocol)


async def test_stub_pipelines_conform_loaded_and_as_classes(device):
    assert conformance_problems(StubLLM, ChatPipelineProtocol, attributes=False) == []
    assert conformance_problems(StubEmbedder, EmbeddingPipelineProtocol, attributes=False) == []
    llm = await StubLLM.load(device, "stub/llm", ChatConfig(), model_id="proto-llm")
    emb = await StubEmbedder.load(device, "stub/emb", ChatConfig(), model_id="proto-emb")
    try:
        assert conformance_problems(llm, ChatPipelineProtocol) == []
        assert conformance_problems(emb, EmbeddingPipelineProtocol) == []
        # a class check without attributes cannot see what __init__ sets: they are reported
        missing = conformance_problems(StubLLM, ChatPipelineProtocol)
        assert {p.split("'")[1] for p in missing} == CHAT_ATTRS
        # the stub embedder's two steps give what its one step gives
        job = await emb.prepare_embed(["ab", "a b c"])
        assert job.seqs and job.prompt_tokens == 4
        (res,) = await emb.embed_jobs([job])
        one = await emb.embed_step(["ab", "a b c"])
        assert res.embeddings == one.embeddings == [[2.0, 1.0, 0.0], [5.0, 1.0, 0.0]]
    finally:
        llm.dispose()
        emb.dispose()
    assert device.allocated_bytes("model:proto-llm") == 0 and device.allocated_bytes("model:proto-emb") == 0


class _NoInterrupt(StubLLM):
    interrupt = None                              # a member that is not a method


class _SyncDecode(StubLLM):
    def decode_step(self):                        # the engine awaits it
        return None


class _RenamedKeyword(StubLLM):
    async def prefill_step(self, messages, gen, text=None):    # the engine passes prompt=
        return None


class _ExtraRequired(StubEmbedder):
    async def embed_jobs(self, jobs, batch_size, *, deadline=None, cancelled=None, timeout_s=None):
        return []


class _NotClassmethodLoad(StubEmbedder):
    async def load(self, dev, path, chat_config, progress=None, model_id=None):
        return None


@pytest.mark.parametrize("cls, proto, problem", [
    (_NoInterrupt, ChatPipelineProtocol, "interrupt is not callable"),
    (_SyncDecode, ChatPipelineProtocol, "decode_step() must be async"),
    (_RenamedKeyword, ChatPipelineProtocol, "prefill_step() has no parameter 'prompt'"),
    (_ExtraRequired, EmbeddingPipelineProtocol, "embed_jobs() requires 'batch_size', which the engine never passes"),
    (_NotClassmethodLoad, EmbeddingPipelineProtocol, "load() must be a classmethod"),
])
def test_a_nonconforming_class_is_refused_by_name(cls, proto, problem):
    assert conformance_problems(cls, proto, attributes=False) == [problem]
    with pytest.raises(PipelineContractError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(cls, proto, attributes=False)


def test_a_missing_method_and_attribute_are_named():
    class NoReset:
        dev = owner = chat_config = tokenizer = template = grammars = finish_reason = stop_str = None
        vocab_size, stopped, token_logprobs = 10, True, []

    for name, v in vars(StubLLM).items():
        if (callable(v) or isinstance(v, classmethod)) and not name.startswith("_") and name != "reset_chat":
            setattr(NoReset, name, v)
    assert conformance_problems(NoReset, ChatPipelineProtocol) == ["no method reset_chat()"]
    del NoReset.vocab_size
    assert conformance_problems(NoReset, ChatPipelineProtocol) == ["no attribute 'vocab_size'",
                                                                    "no method reset_chat()"]
    with pytest.raises(TypeError, match="NoReset does not implement ChatPipelineProtocol"):
        check_pipeline(NoReset, ChatPipelineProtocol)


async def test_engine_refuses_a_nonconforming_factory_before_loading(device):
    cfg = stub_config(device)
    cfg.pipeline_factories = {"llm": _SyncDecode, "embedding": StubEmbedder}
    with pytest.raises(PipelineContractError, match=r"pipeline_factories\['llm'\].*decode_step\(\) must be async"):
        await create_mlc_engine("stub-llm", cfg)
    assert device.allocated_bytes("model:stub-llm") == 0

    class NoOwner(StubEmbedder):              # the class passes; the loaded object lacks `owner`
        def __init__(self, *a):
            super().__init__(*a)
            del self.owner

    cfg.pipeline_factories = {"llm": StubLLM, "embedding": NoOwner}
    with pytest.raises(PipelineContractError, match="model stub-emb.*no attribute 'owner'"):
        await create_mlc_engine("stub-emb", cfg)
    assert device.allocated_bytes("model:stub-emb") == 0      # the partial load was freed


# --------------------------------------------------------------------------- a pipeline's parts
def test_the_real_parts_conform(tmp_path):
    """Tokenizers (pure Python and native, BPE, SentencePiece and WordPiece), the chat template and
    the grammar compiler, as classes and as the objects the loaders build."""
    from test_spm import spm_metadata
    from tinymodels import write_tiny_bert, write_tiny_llama_gguf
    from webgpu_engine.loaders.bpe import BPETokenizer
    from webgpu_engine.loaders.chat_template import ChatTemplate
    from webgpu_engine.loaders.spm import SPMTokenizer
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    from webgpu_engine.loaders.wordpiece import WordPieceTokenizer
    from webgpu_engine.pipelines.grammar import GrammarCompiler
    for cls in (BPETokenizer, SPMTokenizer):
        assert conformance_problems(cls, ChatTokenizerProtocol) == [], cls
    assert conformance_problems(WordPieceTokenizer, EmbeddingTokenizerProtocol) == []
    assert conformance_problems(GrammarCompiler, GrammarCompilerProtocol) == []
    assert conformance_problems(ChatTemplate, ChatTemplateProtocol, attributes=False) == []
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")["path"]
    bert = write_tiny_bert(tmp_path / "tiny-bert")["folder"]
    for native in (False, True):
        for source in (gguf, spm_metadata()):
            tok = load_tokenizer(source, native=native)
            assert conformance_problems(tok, ChatTokenizerProtocol) == [], (type(tok), source)
        enc = load_tokenizer(bert, native=native, encoder=True)
        assert conformance_problems(enc, EmbeddingTokenizerProtocol) == [], type(enc)
    assert conformance_problems(ChatTemplate("{{ messages[0].content }}"), ChatTemplateProtocol) == []


async def test_a_loaded_pipelines_parts_are_checked(device, tmp_path):
    from tinymodels import write_tiny_bert
    emb = await EmbeddingPipeline.load(device, write_tiny_bert(tmp_path / "tiny-bert")["folder"],
                                       ChatConfig(compile_at_load=False))
    try:
        assert conformance_problems(emb, EmbeddingPipelineProtocol) == []        # its tokenizer included
    finally:
        emb.dispose()
    llm = await StubLLM.load(device, "stub/llm", ChatConfig(), model_id="parts-llm")
    try:
        class NoBytes:                      # a tokenizer without token_bytes
            def encode(self, text, add_special_tokens=False):
                return []

        class Template:                     # a template that takes no template variables
            source = ""

            def render(self, messages, add_generation_prompt=True, **kw):
                return ""

            def encode(self, tokenizer, messages, add_generation_prompt=True):
                return []
        llm.tokenizer, llm.template, llm.grammars = NoBytes(), Template(), None
        assert conformance_problems(llm, ChatPipelineProtocol) == [
            "tokenizer: no method token_bytes()", "template: encode() takes no **keyword arguments (**variables)",
            "grammars is None"]
        llm.template = None                 # a model without a chat template is fine
        assert conformance_problems(llm, ChatPipelineProtocol) == ["tokenizer: no method token_bytes()",
                                                                   "grammars is None"]
    finally:
        llm.dispose()


async def test_engine_refuses_a_pipeline_whose_tokenizer_does_not_conform(device):
    class NoBytesLLM(StubLLM):
        def __init__(self, *a):
            super().__init__(*a)
            self.tokenizer = type("Tok", (), {"encode": lambda self, text, add_special_tokens=False: []})()

    cfg = stub_config(device)
    cfg.pipeline_factories = {"llm": NoBytesLLM, "embedding": StubEmbedder}
    with pytest.raises(PipelineContractError, match=r"model stub-llm.*tokenizer: no method token_bytes\(\)"):
        await create_mlc_engine("stub-llm", cfg)
    assert device.allocated_bytes("model:stub-llm") == 0
