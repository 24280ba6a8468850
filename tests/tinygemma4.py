"""A tiny random Gemma 4 text model (transformers' Gemma4ForCausalLM, `gemma4_text`) with every part
gemma-4-E2B-it's text config turns on, at sizes a test runs in seconds:

- layers of two kinds: sliding (head_dim 16, RoPE base 10000 over the whole head, a window of 48
  keys) and full attention (global_head_dim 32, proportional RoPE: base 1e6, only the first quarter
  of the head's neox pairs rotate, at base^(-2j/32));
- the last `num_kv_shared_layers` layers compute no K / V: each attends the cache of the last
  earlier layer of its kind; their FFN is twice as wide (use_double_wide_mlp);
- q / k RMSNorms per head (weights w, not 1 + w), v RMS-normalised without a weight, scores not
  scaled (1.0);
- per-layer input embeddings: a (V, L * P) table and a projection of the scaled embeddings, each
  layer's P values gating a GELU of its own projection of x, added back through a post norm;
- a per-layer scalar multiplying x at the end of the layer; logits soft-capped at 30.

Deterministic for a seed; names are transformers'. Used by tests/test_gemma4.py and
tests/fixtures/make_gemma4.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import tinymodels as tm
from tinyfamilies import _write_hf, write_released_hf
from webgpu_engine.models.family_gemma4 import kv_sources

DIMS = dict(vocab_size=300, hidden_size=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_size=96, head_dim=16,
            context_length=512, rope_base=1e6, rms_eps=1e-6, tie_embeddings=True)
GLOBAL_HEAD_DIM, PLE_DIM, KV_SHARED, WINDOW = 32, 32, 2, 48
# layers 4 (sliding) and 5 (full) share the caches of layers 3 and 2
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention"]


def gemma_spm_tokenizer_json() -> dict:
    """A tiny tokenizer.json of Gemma's kind (SentencePiece-style BPE: spaces become ▁ by a Replace
    normalizer, no space prefix, no pre-tokenizer, byte fallback), with the vocabulary and merges of
    tests/fixtures/spm_hf (420 tokens; <s> 1, </s> 2): what llama.cpp's Gemma 4 converter reads."""
    import json
    spec = json.loads((Path(__file__).parent / "fixtures" / "spm_hf" / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    spec["pre_tokenizer"] = None
    spec["decoder"]["decoders"] = [x for x in spec["decoder"]["decoders"] if x["type"] != "Strip"]
    return spec


def gemma4_weights(seed: int = 0, vocab: str = "bpe", **dims) -> tuple[dict, list, list, dict]:
    """(dims, tokens, merges, {HF name: array}) of the tiny model; `vocab` "spm": Gemma's kind of
    vocabulary (gemma_spm_tokenizer_json) in place of the byte-level BPE one."""
    d = tm._dims(**{**DIMS, **dims})
    if vocab == "spm":
        spec = gemma_spm_tokenizer_json()
        tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
        merges = [" ".join(m) for m in spec["model"]["merges"]]              # (overwritten by the spec)
    else:
        tokens, merges = tm.tiny_bpe_vocab(d["vocab_size"], "smollm")
    d["vocab_size"] = V = len(tokens)
    rng = np.random.default_rng(seed)
    C, F, L, P, H, Hkv = d["hidden_size"], d["ffn_size"], d["n_layers"], PLE_DIM, d["n_heads"], d["n_kv_heads"]

    def mat(n, k):                      # std 1/sqrt(k): activations stay O(1) through the layers
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n, center=1.0, spread=0.2):
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    src = kv_sources(LAYER_TYPES, KV_SHARED)
    w = {"model.embed_tokens.weight": (rng.standard_normal((V, C)) / np.sqrt(C)).astype(np.float32),
         "model.embed_tokens_per_layer.weight": (rng.standard_normal((V, L * P)) / np.sqrt(P)).astype(np.float32),
         "model.per_layer_model_projection.weight": mat(L * P, C),
         "model.per_layer_projection_norm.weight": vec(P),
         "model.norm.weight": vec(C)}
    for i, kind in enumerate(LAYER_TYPES):
        p, D = f"model.layers.{i}.", GLOBAL_HEAD_DIM if kind == "full_attention" else d["head_dim"]
        Fi = 2 * F if src[i] != i else F
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_per_layer_input_norm"):
            w[p + n + ".weight"] = vec(C)
        w[p + "self_attn.q_proj.weight"] = mat(H * D, C)
        w[p + "self_attn.q_norm.weight"] = vec(D)
        if src[i] == i:
            w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"] = mat(Hkv * D, C), mat(Hkv * D, C)
            w[p + "self_attn.k_norm.weight"] = vec(D)
        w[p + "self_attn.o_proj.weight"] = mat(C, H * D)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = mat(Fi, C), mat(Fi, C)
        w[p + "mlp.down_proj.weight"] = mat(C, Fi)
        w[p + "per_layer_input_gate.weight"], w[p + "per_layer_projection.weight"] = mat(P, C), mat(C, P)
        w[p + "layer_scalar"] = np.array([0.6 + 0.15 * i], np.float32)
    return d, tokens, merges, w


def gemma4_config(d: dict) -> dict:
    return {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "head_dim": d["head_dim"],
            "global_head_dim": GLOBAL_HEAD_DIM, "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": WINDOW, "layer_types": LAYER_TYPES, "final_logit_softcapping": 30.0,
            "hidden_size_per_layer_input": PLE_DIM, "vocab_size_per_layer_input": d["vocab_size"],
            "num_kv_shared_layers": KV_SHARED, "use_double_wide_mlp": True, "attention_k_eq_v": False,
            "enable_moe_block": False, "attention_bias": False,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1e6}}}


def write_tiny_gemma4_safetensors(folder, seed: int = 0, released: bool = False, vocab: str = "bpe", **dims) -> dict:
    """The HF folder (config.json, model.safetensors, tokenizer) of the tiny model; `released`: laid
    out as gemma-4-E2B-it is, a Gemma4ForConditionalGeneration whose text model's config is
    `text_config` and whose weights lie under model.language_model., beside a vision tower; `vocab`
    "spm": Gemma's kind of vocabulary (what llama.cpp's converter takes)."""
    d, tokens, merges, w = gemma4_weights(seed, vocab, **dims)
    folder = Path(folder)
    if released:
        w = write_released_hf(folder, w, gemma4_config(d), tokens, merges, d,
                              architecture="Gemma4ForConditionalGeneration", model_type="gemma4",
                              towers={"model.vision_tower.patch_embedder.input_proj.weight":
                                      np.ones((4, 12), np.float32)},
                              config={"vision_config": {"model_type": "gemma4_vision"}})
    else:
        _write_hf(folder, w, gemma4_config(d), tokens, merges, d)
    if vocab == "spm":
        import json
        (folder / "tokenizer.json").write_text(json.dumps(gemma_spm_tokenizer_json(), ensure_ascii=False))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>", "add_bos_token": True,
            "model_max_length": d["context_length"], "tokenizer_class": "PreTrainedTokenizerFast"}))
        c = json.loads((folder / "config.json").read_text())
        (c.get("text_config") or c).update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        (folder / "config.json").write_text(json.dumps(c, indent=2))
    return dict(folder=folder, weights=w, dims=d)


# mlc-llm's Gemma4TextConfig fields (what its mlc-chat-config.json's model_config.text_config holds)
MLC_TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "global_head_dim", "hidden_activation", "max_position_embeddings",
                   "rms_norm_eps", "pad_token_id", "tie_word_embeddings", "attention_bias", "sliding_window",
                   "layer_types", "final_logit_softcapping", "vocab_size_per_layer_input",
                   "hidden_size_per_layer_input", "attention_k_eq_v", "num_kv_shared_layers", "enable_moe_block",
                   "use_double_wide_mlp", "rope_parameters")


def write_tiny_gemma4_mlc(folder, quant: str, seed: int = 0, **dims) -> dict:
    """The tiny model as mlc-llm's gemma4 loader writes WebLLM's gemma-4-E2B-it artifacts: the text
    model under language_model. (HF's names less model.), q / k / v apart, gate | up fused as
    mlp.gate_up_proj, the per-layer table split into one (V, P) embedding per layer
    (embed_tokens_per_layer.{i}), layer_scalar without a suffix, plain norm weights, and audio tower
    tensors beside them (not read); q4f16_1 / q4f32_1 quantise every matrix, the embeddings too (MLC's
    group quantisation, tests/test_mlc.py). model_config nests the text config as MLC's Gemma4Config
    does (text_config, audio_config, sliding_window_size -1). Returns {"folder", "encoded": {HF name:
    the float values the files encode}, "dims"}."""
    import json
    import shutil
    from test_mlc import _write_shards, mlc_param
    d, _, _, w = gemma4_weights(seed, **dims)
    dt = {"q0f32": np.float32, "q0f16": np.float16, "q4f16_1": np.float16, "q4f32_1": np.float32}[quant]
    folder = Path(folder)
    hf = write_tiny_gemma4_safetensors(folder / "hf", seed, **dims)["folder"]
    groups: dict[str, tuple] = {}          # MLC name less its suffix -> (HF name, column slice or rows fused)
    for n in w:
        base = "language_model." + n.removeprefix("model.").removesuffix(".weight")
        if n == "model.embed_tokens_per_layer.weight":
            for i in range(d["n_layers"]):
                groups[f"language_model.embed_tokens_per_layer.{i}"] = (n, slice(i * PLE_DIM, (i + 1) * PLE_DIM))
        elif ".mlp.gate_proj." in n:
            groups[base.replace("gate_proj", "gate_up_proj")] = (n, n.replace("gate_proj", "up_proj"))
        elif ".mlp.up_proj." not in n:
            groups[base] = (n,)
    rng = np.random.default_rng(seed + 1)
    towers = {"audio_tower.output_proj": rng.standard_normal((64, 32)).astype(np.float32),
              "embed_audio.embedding_projection": rng.standard_normal((d["hidden_size"], 64)).astype(np.float32)}
    params, encoded = {}, {}
    for mlc, how in [*groups.items(), *((k, None) for k in towers)]:
        if how is None:
            full = towers[mlc]
        elif len(how) == 2 and isinstance(how[1], slice):
            full = w[how[0]][:, how[1]]
        else:
            full = np.concatenate([w[n] for n in how]) if len(how) > 1 else w[how[0]]
        full = mlc_param(params, mlc, full, quant, dt, "" if mlc.endswith("layer_scalar") else ".weight")
        if how is None:
            continue
        if isinstance(how[-1], slice):
            encoded.setdefault(how[0], np.zeros(w[how[0]].shape))[:, how[1]] = full
        else:
            rows = np.cumsum([0] + [w[n].shape[0] for n in how])
            encoded.update({n: full[a:b].reshape(w[n].shape) for n, a, b in zip(how, rows[:-1], rows[1:])})
    _write_shards(folder, params)
    c = json.loads((hf / "config.json").read_text())
    text = {k: c[k] for k in MLC_TEXT_FIELDS if k in c} | {"attention_dropout": 0.0, "kwargs": {}}
    chat = {"model_type": "gemma4", "quantization": quant, "model_config": {
        "text_config": text, "audio_config": {"hidden_size": 64}, "vision_config": None,
        "context_window_size": d["context_length"], "sliding_window_size": -1, "prefill_chunk_size": WINDOW,
        "tensor_parallel_shards": 1, "max_batch_size": 1},
        "context_window_size": d["context_length"], "sliding_window_size": -1, "prefill_chunk_size": WINDOW,
        "bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"], "pad_token_id": c["pad_token_id"]}
    (folder / "mlc-chat-config.json").write_text(json.dumps(chat))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / f, folder / f)
    shutil.rmtree(hf)
    return dict(folder=folder, encoded=encoded, dims=d)
