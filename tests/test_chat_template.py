"""Chat templates render exactly as Hugging Face transformers does (golden renders), plus HF features."""
from __future__ import annotations

import pytest

from webgpu_engine.loaders.chat_template import ChatTemplate, TemplateError, from_gguf_metadata
from webgpu_engine.loaders.gguf import GGUFFile


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return GGUFFile(smollm2_gguf)


def test_gguf_template_matches_reference(smol, smollm2_reference):
    tpl = smol.template()
    assert tpl.bos_token == "<|im_start|>" and tpl.eos_token == "<|im_end|>"
    for item in smollm2_reference["chat_template"]:
        assert tpl.render(item["messages"], add_generation_prompt=item["add_generation_prompt"]) == item["rendered"]


def test_prompt_ids_match_reference(smol, smollm2_reference):
    """Template + tokenizer together give the prompt ids transformers fed the model."""
    tpl, tok = smol.template(), smol.tokenizer()
    for item in smollm2_reference["greedy"]:
        assert tok.encode(tpl.render(item["messages"], add_generation_prompt=True)) == item["prompt_ids"]


def test_without_generation_prompt(smol):
    out = smol.template().render([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert out.endswith("<|im_start|>user\nx<|im_end|>\n")


def test_hf_environment_features():
    src = ("{{ bos_token }}{% for m in messages %}"
           "{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}"
           "{% if loop.index > 3 %}{% break %}{% endif %}"
           "  {{ m.role }}: {{ m.content | tojson }}\n"
           "{% endfor %}{% generation %}{{ eos_token }}{% endgeneration %}")
    tpl = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    out = tpl.render([{"role": "user", "content": "héllo \"q\" <b>"}, {"role": "assistant", "content": "ok"}])
    # lstrip_blocks/trim_blocks; tojson keeps non-ASCII and does not HTML-escape (unlike jinja's own)
    assert out == '<s>  user: "héllo \\"q\\" <b>"\n  assistant: "ok"\n</s>'
    with pytest.raises(TemplateError, match="bad role system"):
        tpl.render([{"role": "system", "content": "s"}])


def test_sandbox_blocks_attribute_escape():
    import jinja2.exceptions
    tpl = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tpl.render([])


def test_tokenizer_config_forms():
    cfg = {"chat_template": [{"name": "default", "template": "{{ bos_token }}A"},
                             {"name": "tool_use", "template": "B"}],
           "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    assert ChatTemplate.from_tokenizer_config(cfg).render([]) == "<s>A"
    assert ChatTemplate.from_tokenizer_config(cfg, "tool_use").render([]) == "B"
    assert ChatTemplate.from_tokenizer_config({}) is None
    assert from_gguf_metadata({}) is None


def test_from_folder(tmp_path):
    from tinymodels import CHATML_TEMPLATE, write_tiny_llama_safetensors

    from webgpu_engine.loaders.chat_template import from_folder
    info = write_tiny_llama_safetensors(tmp_path / "m")
    tpl = from_folder(info["folder"])
    assert tpl.source == CHATML_TEMPLATE and tpl.bos_token == "<|im_start|>" and tpl.eos_token == "<|im_end|>"
    assert tpl.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                    "<|im_start|>assistant\n")
    (info["folder"] / "chat_template.jinja").write_text("{{ eos_token }}!")
    assert from_folder(info["folder"]).render([]) == "<|im_end|>!"
    assert from_folder(tmp_path) is None
