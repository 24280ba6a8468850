"""Mistral / Ministral: Llama with a sliding window in every layer where config.json sets
`sliding_window` (on unless use_sliding_window says otherwise, as MistralForCausalLM reads it).

Most Mistral GGUFs are written as general.architecture "llama" (and read as Llama: llama.cpp's
converter permutes their q/k rows the same way); those carry no window.
"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily

MISTRAL = DecoderFamily("mistral", hf_architectures=("MistralForCausalLM",), hf_model_types=("mistral",), mlc_model_types=("mistral",),
                        hf_defaults={"use_sliding_window": True})

FAMILIES = (MISTRAL,)
