"""Idefics3 (SmolVLM): Idefics3ForConditionalGeneration's text model is a Llama under model.text_model.
(config.json's `text_config`); its vision tower and connector are models/siglip.py's, its image
processor vision/idefics3.py's."""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily
from ..loaders.hf_config import HF_LLAMA_TO_OURS

HF_IDEFICS3_TO_OURS = {**{k.replace("model.", "model.text_model.", 1): v for k, v in HF_LLAMA_TO_OURS.items()
                          if k.startswith("model.")}, "lm_head.weight": "lm_head"}
IDEFICS3 = DecoderFamily("idefics3", hf_architectures=("Idefics3ForConditionalGeneration",),
                         hf_model_types=("idefics3",), hf_names=HF_IDEFICS3_TO_OURS)

FAMILIES = (IDEFICS3,)
