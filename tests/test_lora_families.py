"""LoRA adapters over other decoder families (issue 52): Phi-3's fused qkv_proj / gate_up_proj (and
llama.cpp's attn_qkv / 2 x ffn ffn_up), the Llama names of Qwen2 / Qwen3, Mistral, Gemma 1-3 (norms
after the attention and the FFN), OLMo-2 (no norms before) and StableLM (LayerNorms), as PEFT folders and as
convert_lora_to_gguf.py's files, against transformers + peft (tests/fixtures/make_lora.py
--families): the base's, the folder's and the file's rows in one batch."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from webgpu_engine.engine.engine import AsyncMLCEngine
from webgpu_engine.models.lora import LoraAdapterError

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "lora_families_transformers.json").read_text())
OPTS = {"dtype": "f32", "context_window_size": 128, "prefill_chunk_size": 32, "max_num_sequences": 6,
        "kv_block_size": 16}


@pytest.fixture(scope="module", params=list(REF["families"]))
async def family(request, device, tmp_path_factory):
    import sys
    sys.path.insert(0, str(FIXTURES))
    from make_lora import family_base
    arch = request.param
    base = family_base(arch, tmp_path_factory.mktemp("lora_" + arch) / "base")
    eng = AsyncMLCEngine()
    await eng.reload(str(base), chat_opts=OPTS, lora_adapters={
        "peft": str(FIXTURES / "lora_families" / arch), "gguf": str(FIXTURES / "lora_families" / f"{arch}.gguf")})
    yield arch, eng
    await eng.unload()


async def _batch(eng, arch: str, runs: list) -> None:
    """`runs` (model: the base's id, "peft" or "gguf"; prompt index) in one batch, each equal to
    transformers (+ peft)'s greedy tokens."""
    ref = REF["families"][arch]
    (base_id,) = eng.models

    async def greedy(model: str, i: int) -> str:
        r = await eng.completions.create(model=model or base_id, prompt=REF["prompts"][i],
                                         max_tokens=len(ref["base"][i]), temperature=0.0, ignore_eos=True)
        return r.choices[0].text
    got = await asyncio.gather(*[greedy(m, i) for m, i in runs])
    decode = eng.models[base_id].pipeline.tokenizer.decode
    assert got == [decode(ref["adapter" if m else "base"][i]) for m, i in runs]
    assert ref["adapter"] != ref["base"]


async def test_base_peft_folder_and_gguf_file_in_one_batch_equal_transformers_with_peft(family):
    arch, eng = family
    await _batch(eng, arch, [(None, 0), ("peft", 0), ("gguf", 1), (None, 1), ("peft", 1), ("gguf", 0)])


async def test_the_gpu_form_answers_the_same(family):
    """lora_shrink + lora_expand (a GPU's form; a CPU adapter's is lora_delta) over the same adapters."""
    arch, eng = family
    (base_id,) = eng.models
    pipe = eng.models[base_id].pipeline
    pipe.lora.use_fused(False)
    pipe.scheduler.fwd.release()                 # the op lists are built again
    try:
        await _batch(eng, arch, [("peft", 1), (None, 0), ("gguf", 0)])
    finally:
        pipe.lora.use_fused(True)
        pipe.scheduler.fwd.release()


@pytest.mark.parametrize("family", ["phi3"], indirect=True)     # one family's engine: the refusals are the loader's
async def test_fused_rows_that_do_not_add_up_and_other_modules_are_refused_by_name(family, tmp_path):
    from test_lora import _copy_adapter
    _, eng = family
    phi3 = str(FIXTURES / "lora_families" / "phi3")
    short = _copy_adapter(phi3, tmp_path / "short", reshape=lambda n, a: a[:-8]
                          if "layers.1.self_attn.qkv_proj.lora_B" in n else a)
    with pytest.raises(LoraAdapterError, match=r"tensor \S*layers\.1\.self_attn\.qkv_proj\.lora_A\.weight has B "
                                               r"\(\d+, 8\); the base's fused q\|k\|v output has \d+ rows"):
        await eng.load_lora_adapter("short", short)
    dense = _copy_adapter(phi3, tmp_path / "dense", rename=lambda n: n.replace("o_proj", "dense"))
    with pytest.raises(LoraAdapterError, match=r"layers\.0\.self_attn\.dense\.lora_A\.weight' is not a LoRA A/B of "
                                               r"a q/k/v/o/gate/up/down \(or fused qkv / gate_up\)_proj"):
        await eng.load_lora_adapter("dense", dense)
    assert sorted(eng.lora_names()) == ["gguf", "peft"]
