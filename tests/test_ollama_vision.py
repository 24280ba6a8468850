"""Ollama's one-GGUF vision layout: its gemma3 blobs hold the vision tower and projector in the
model's own GGUF (`v.*` / `mm.*` tensors under Hugging Face's names through its converter's
replacements, `gemma3.vision.*` keys; ollama's convert/convert_gemma3.go), with no projector layer.
The tiny Gemma 3 vision checkpoint written that way (its text from llama.cpp's converter, its tower
from the folder's safetensors renamed as Ollama's converter renames them) reads as the projector
pair does and, from a store with a model layer alone, answers transformers' greedy tokens."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from test_vision_refusals import rewrite_gguf
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.vision.mmproj import MmprojFile, holds_tower

FIXTURES = Path(__file__).parent / "fixtures"
FOLDER, PAIR, IMAGES = FIXTURES / "tiny_gemma3_vision", FIXTURES / "mmproj_gguf", FIXTURES / "vision_images"
TEXT, PROJ = PAIR / "tiny-gemma3.gguf", PAIR / "mmproj-tiny-gemma3.gguf"
OPTS = {"dtype": "f32", "context_window_size": 256, "prefill_chunk_size": 32, "compile_at_load": False}

# ollama's convert/convert_gemma3.go Replacements(), the pairs that touch the tower and projector, in
# its order (Go's strings.Replacer: at each position the first pair that matches)
REPLACEMENTS = [("vision_tower.vision_model.embeddings", "v"), ("vision_tower.vision_model", "v"),
                ("vision_model.vision_model.embeddings", "v"), ("vision_model.vision_model", "v"),
                ("language_model.", ""), ("model.layers", "blk"), ("encoder.layers", "blk"),
                ("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"), ("self_attn.q_norm", "attn_q_norm"),
                ("self_attn.k_proj", "attn_k"), ("self_attn.k_norm", "attn_k_norm"), ("self_attn.v_proj", "attn_v"),
                ("self_attn.o_proj", "attn_output"), ("self_attn.out_proj", "attn_output"),
                ("mlp.gate_proj", "ffn_gate"), ("mlp.down_proj", "ffn_down"), ("mlp.up_proj", "ffn_up"),
                ("post_attention_layernorm", "post_attention_norm"), ("pre_feedforward_layernorm", "ffn_norm"),
                ("post_feedforward_layernorm", "post_ffw_norm"), ("input_projection_weight", "input_projection.weight"),
                ("multi_modal_projector", "mm")]


def ollama_name(name: str) -> str:
    out, i = [], 0
    while i < len(name):
        for old, new in REPLACEMENTS:
            if name.startswith(old, i):
                out.append(new)
                i += len(old)
                break
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


def write_one_gguf(dst: Path) -> Path:
    """The text GGUF with the folder's tower and projector added as Ollama's converter writes them:
    the hub release's names (vision_tower.vision_model.*) replaced, 1 added to *_norm.weight outside
    v.* (its gemmaModel repacker), the vision_config as gemma3.vision.* keys, no epsilon or rope bases."""
    from safetensors.numpy import load_file
    cfg = json.loads((FOLDER / "config.json").read_text())
    v = cfg["vision_config"]
    tensors = {}
    for name, a in load_file(str(FOLDER / "model.safetensors")).items():
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            hub = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
            new = ollama_name(hub)
            tensors[new] = a + 1 if not new.startswith("v.") and new.endswith("_norm.weight") else a
    assert "v.blk.1.attn_output.weight" in tensors and "mm.mm_input_projection.weight" in tensors
    meta = {"gemma3.vision.block_count": v["num_hidden_layers"], "gemma3.vision.embedding_length": v["hidden_size"],
            "gemma3.vision.feed_forward_length": v["intermediate_size"], "gemma3.vision.image_size": v["image_size"],
            "gemma3.vision.patch_size": v["patch_size"], "gemma3.vision.num_channels": v["num_channels"],
            "gemma3.vision.attention.head_count": v["num_attention_heads"],
            "gemma3.vision.attention.layer_norm_epsilon": v["layer_norm_eps"],
            "gemma3.mm.tokens_per_image": cfg["mm_tokens_per_image"]}
    import gguf
    # its multimodal branch writes no norm epsilon or rope bases (Gemma 3's own are its runtime's defaults)
    dropped = {"gemma3.attention.layer_norm_rms_epsilon", "gemma3.rope.freq_base", "gemma3.rope.freq_base_swa"}
    path = rewrite_gguf(TEXT, dst, meta=meta, drop_keys=dropped)
    extra = dst.with_suffix(".tower.gguf")
    w = gguf.GGUFWriter(str(extra), "gemma3")
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    rewrite_gguf(path, dst.with_suffix(".both.gguf"), extra=[extra])
    dst.with_suffix(".both.gguf").replace(dst)
    extra.unlink()
    return dst


@pytest.fixture(scope="module")
def one_gguf(tmp_path_factory):
    return write_one_gguf(tmp_path_factory.mktemp("ollama_vision") / "gemma3-one.gguf")


@pytest.fixture(scope="module")
def ref():
    return json.loads((FIXTURES / "gemma3_vision_transformers.json").read_text())


def test_one_gguf_reads_as_the_projector_pair(one_gguf):
    """The model GGUF's own tower: the pair's VisionConfig and tensors (same names, shapes and values;
    the projector norm as 1 + w); a text GGUF and a projector GGUF do not count as holding one."""
    with GGUFFile(TEXT) as g:
        tok = g.tokenizer()
    assert holds_tower(one_gguf) and not holds_tower(TEXT) and not holds_tower(PROJ)
    one, pair = MmprojFile(one_gguf, tok), MmprojFile(PROJ, tok)
    try:
        for field in ("kind", "hidden_size", "intermediate_size", "n_layers", "n_heads", "image_size", "patch_size",
                      "text_hidden", "tokens_per_image", "image_token_id", "marker", "size", "mean", "std", "act",
                      "class_token", "pre_norm", "post_norm", "pool"):
            assert getattr(one.cfg, field) == getattr(pair.cfg, field), field
        assert one.cfg.eps == pytest.approx(pair.cfg.eps)
        assert one.tensors.keys() == pair.tensors.keys() and len(one.tensors) == 39
        from webgpu_engine.kernels.quant_ref import dequantize
        for name, t in one.tensors.items():
            p = pair.tensors[name]
            assert tuple(t.shape) == tuple(p.shape), name
            k = int(t.shape[-1])
            a, b = (dequantize(bytes(x.data), x.qtype, x.numel // k, k) for x in (t, p))
            np.testing.assert_allclose(a, b, atol=1e-3 if p.qtype == "f16" else 1e-7, err_msg=name)
    finally:
        one.close()
        pair.close()


async def test_a_store_of_one_gguf_answers_about_images(device, one_gguf, ref, tmp_path, monkeypatch):
    """An Ollama store whose manifest has the model layer alone (no projector): the model takes
    images, and for one and two pictures gives transformers' prompt ids and greedy tokens."""
    from test_mmproj import _blob, _messages
    from webgpu_engine.engine.engine import AsyncMLCEngine
    from webgpu_engine.engine.references import resolve_model_reference
    root = tmp_path / "ollama"
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "tiny-one" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [_blob(root, "model", one_gguf)]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    assert "mmproj" not in (resolve_model_reference("ollama:tiny-one").overrides or {})
    eng = AsyncMLCEngine()
    await eng.reload("ollama:tiny-one", chat_opts=OPTS)
    try:
        model = next(iter(eng.models))
        pipe = eng.models[model].pipeline
        assert pipe.vision is not None and pipe.vision.cfg.tokens_per_image == 16
        for key in ("one", "two"):
            want = ref["prompts"][key]
            await eng.chat.completions.create(model=model, messages=_messages(ref, key), max_tokens=12, temperature=0.0)
            assert pipe.kv_ids[:len(want["input_ids"])] == want["input_ids"]
            assert pipe.output_ids == want["greedy"]
    finally:
        await eng.unload()
