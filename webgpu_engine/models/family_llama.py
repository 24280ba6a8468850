"""Llama 1-3.x (SmolLM, TinyLlama, ...): the decoder every other family is read against.

Everything a Llama file says is read by the shared reading (loaders.decoder_config): head counts and
sizes, RoPE base and scaling (Llama 3.1+'s `llama3` from HF rope_scaling or GGUF rope_freqs.weight,
linear), the tied head, stop ids. llama.cpp's converter permutes Llama's q/k rows to adjacent-pair
rope (gguf_neox False); HF safetensors keep them as rotate_half halves.
"""
from __future__ import annotations

from ..loaders.decoder_config import DecoderFamily

LLAMA = DecoderFamily("llama", hf_architectures=("LlamaForCausalLM",), hf_model_types=("llama",),
                      mlc_model_types=("llama",))

FAMILIES = (LLAMA,)
