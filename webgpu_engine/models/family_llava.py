"""LLaVA 1.5 and 1.6 (llava-hf's LlavaForConditionalGeneration, LlavaNextForConditionalGeneration): its
text model is a Llama under language_model.model. (the hub's files) or model.language_model. (transformers 5), config.json's
`text_config`; its CLIP tower and MLP projector are models/siglip.py's, its image processor
vision/llava.py's. (A LLaVA GGUF is a plain llama GGUF beside its mmproj: vision/mmproj.py.)"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS

HF_LLAVA_TO_OURS = {**{k.replace("model.", prefix, 1): v for k, v in HF_LLAMA_TO_OURS.items() if k.startswith("model.")
                       for prefix in ("language_model.model.", "model.language_model.")},
                    "language_model.lm_head.weight": "lm_head", "lm_head.weight": "lm_head"}
LLAVA = DecoderFamily("llava", hf_architectures=("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"),
                      hf_model_types=("llava", "llava_next"),
                      hf_names=HF_LLAVA_TO_OURS)

FAMILIES = (LLAVA,)
