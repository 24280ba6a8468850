"""Qwen2.5-VL's text model (Qwen2_5_VLForConditionalGeneration): Qwen2 (q/k/v biases) with M-RoPE,
config.json's `text_config` (transformers 5) or its top level (the hub's releases), the weights under
model.language_model. (transformers 5) or model. (the hub's), the LM head lm_head. Its tower and image
processor are vision/qwen25vl.py's and vision/qwen25vl_gpu.py's. llama.cpp's converter writes the text
model as general.architecture qwen2vl with rope.dimension_sections, its vision side as an mmproj.

M-RoPE rotates the frequency pairs of `mrope_section` (t | h | w) by three positions per row: a text
row's are all its position, an image token's are (start, start + row, start + column) of its merged
patch, and the text after an image goes on from the image's largest position + 1, so past an image a
row's position falls behind its place in the cache. As RoPE's scores depend only on differences, a
sequence's positions are all shifted by how far behind its last text falls: from its last image on
every row's position is its cache row (decode rows take plain RoPE), and the prompt's rows before
that are rotated by their difference first (models/image_rows.py `rotate`, rope_sections; a sequence
without images: none).
"""
from __future__ import annotations

from ..errors import ModelFormatError
from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS

HF_QWEN25VL_TO_OURS = {**HF_LLAMA_TO_OURS,
                       **{k.replace("model.", "model.language_model.", 1): v for k, v in HF_LLAMA_TO_OURS.items()
                          if k.startswith("model.")}}


def _sections(c: dict, fields: dict, where: str) -> dict:
    """mrope_section (t, h, w frequency pairs) from rope_parameters (or rope_scaling) into extra."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    sec = rp.get("mrope_section")
    half = fields["head_dim"] // 2
    if not isinstance(sec, list) or len(sec) != 3 or sum(int(s) for s in sec) != half:
        raise ModelFormatError(f"{where}: mrope_section {sec!r} must be 3 counts of the {half} frequency pairs")
    return {**fields, "extra": {**(fields.get("extra") or {}), "mrope_section": tuple(int(s) for s in sec)}}


def _gguf_sections(g, fields: dict) -> dict:
    """llama.cpp's qwen2vl: rope.dimension_sections (t, h, w, 0)."""
    sec = list(g.meta("rope.dimension_sections", []) or [])
    return _sections({"rope_parameters": {"mrope_section": sec[:3]}}, fields, g.where)


QWEN25VL = DecoderFamily("qwen2vl", hf_architectures=("Qwen2_5_VLForConditionalGeneration",),
                         hf_model_types=("qwen2_5_vl",), hf_defaults={"attention_bias": True}, gguf_neox=True,
                         hf_names=HF_QWEN25VL_TO_OURS, hf=_sections, gguf=_gguf_sections)

FAMILIES = (QWEN25VL,)
