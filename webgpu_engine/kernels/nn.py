"""Host functions for the transformer's non-matmul kernels: norms, elementwise ops, RoPE, KV-cache
writes, attention (causal prefill, split-key decode, bidirectional) and pooling.
The host functions live in one module per shader family, all importable from here
(`from webgpu_engine.kernels import nn; nn.rms_norm(...)`): norm.py, elementwise.py, rope.py (RoPE
and the KV write), attention.py, pooling.py; nn_base.py holds their shared helpers.

Each function checks shapes, writes its parameters into a uniform buffer once, builds its bind
group once and returns an `Op`; per-step values (pos0, n_new) come from the `step` buffer, so a
decode op built once stays right while the context grows. Tensors may sit at any element offset
of their buffer: bindings start at the offset rounded down to the device's alignment and the kernel
gets the remainder. Norm, elementwise, rope and pooling bind activations read_write so that an
output may alias an input (WebGPU forbids one buffer bound read-only and read_write in the same
dispatch); attention binds qkv and the caches read-only, so its `out` must live in another buffer.

Decode dispatches per Llama layer from these modules, where the matmuls take no epilogues (GPU
adapters): rms_norm 1 + rope_kv 1 (rope and kv_write fused) + attention 2 (split + combine; 1 while
the context is short) + rms_norm 1 + silu_mul 1 = 6. On CPU adapters the decode matmuls absorb
rope_kv, silu_mul and both norms (kernels/matmul/epilogues.py), leaving attention alone.
"""
from __future__ import annotations

from .attention import (_MAX_LANE_DIMS, _attn_header, _heads_per_lane, attention, attention_bidir,  # noqa: F401
                        decode_splits, flash_attention)
from .elementwise import (_unary_f, _unary_op, add, bias_add, gelu, gelu_mul, gelu_tanh, gelu_tanh_gate,  # noqa: F401
                          scale, silu_mul, softcap, tanh)
from .nn_base import (MAX_WG, WG, _WRITERS, _act, _grid, _op, _qkv_heads, _rows_cols, _step_entry,  # noqa: F401
                      _store, _vec_entry, _vec_header, _width, _window)
from .norm import head_rms_norm, layer_norm, proj_rms_norm, rms_norm  # noqa: F401
from .pooling import (_pool, _pool_header, cls_pool, l2_normalize, last_pool, max_pool, mean_pool,  # noqa: F401
                      weighted_mean_pool)
from .rope import _rope_op, kv_write, rope, rope_frequencies, rope_kv  # noqa: F401

__all__ = ["rms_norm", "head_rms_norm", "proj_rms_norm", "layer_norm", "add", "bias_add", "silu_mul", "scale", "softcap",
           "gelu", "gelu_tanh", "rope", "rope_kv",
           "kv_write", "attention", "attention_bidir", "mean_pool", "cls_pool", "max_pool",
           "l2_normalize", "decode_splits"]
