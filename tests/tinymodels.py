"""Writers of tiny random-weight models (GGUF llama/qwen2/qwen3, HF safetensors llama/qwen2/qwen3/mistral, BERT
sentence-transformers folders) for tests, returning the exact float32 weights the GPU will see.

Every writer is deterministic in `seed`. Llama-family writers draw the same HF-layout weights for the
same seed and dims, so a GGUF file and a safetensors folder of one seed are the same model (up to
quantization): GGUF llama stores q/k rows permuted (llama.cpp's converter does that so that rope
rotates adjacent pairs), safetensors keep HF's layout (rope rotates halves: neox).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from webgpu_engine.loaders.bpe import QWEN2_PATTERN, BPETokenizer, bytes_to_unicode
from webgpu_engine.loaders.hf_config import HF_LLAMA_TO_OURS
from webgpu_engine.loaders.safetensors import write_safetensors
from webgpu_engine.loaders.model_config import BertConfig, LlamaConfig, llama3_rope_factors

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Mistral v0.1's template (its [INST] markers are plain text of a SentencePiece vocabulary)
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]        # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
_CORPUS = ("Hello world! The quick brown fox jumps over the lazy dog. user assistant system "
           "What is the capital of France? Paris is the capital of France. Tell me a joke about the "
           "weather in the morning and the evening. The engine runs on the GPU in the browser. ") * 3

LLAMA_DIMS = dict(vocab_size=300, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=128,
                  context_length=256, rope_base=10000.0, rms_eps=1e-5, tie_embeddings=False)


# ============================================================================ tokenizer
def tiny_bpe_vocab(vocab_size: int = 300, pre: str = "smollm") -> tuple[list[str], list[str]]:
    """(tokens, merges): 3 ChatML specials, the 256 byte symbols, then merges learned on a small corpus."""
    byte_syms = [bytes_to_unicode()[b] for b in range(256)]
    tokens = SPECIAL_TOKENS + byte_syms
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be at least {len(tokens)}")
    probe = BPETokenizer(tokens, [], [3, 3, 3] + [1] * 256, pre=pre)
    enc = bytes_to_unicode()
    words = [tuple(enc[b] for b in w.encode()) for w in probe.pre_tokenize(_CORPUS)]
    merges, known = [], set(tokens)
    while len(tokens) < vocab_size:
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))       # most frequent, ties by text
        merges.append(f"{best[0]} {best[1]}")
        new = best[0] + best[1]
        if new not in known:
            tokens.append(new)
            known.add(new)
        out = []
        for w in words:
            merged, i = [], 0
            while i < len(w):
                if i < len(w) - 1 and (w[i], w[i + 1]) == best:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(w[i])
                    i += 1
            out.append(tuple(merged))
        words = out
    return tokens, merges


def _hf_bpe_tokenizer_json(tokens: list[str], merges: list[str], arch: str) -> str:
    """tokenizer.json as HF writes it: SmolLM2's pre-tokenizer for llama/mistral, Qwen2's for qwen2."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                              merges=[tuple(m.split(" ")) for m in merges]))
    if arch in ("qwen2", "qwen3"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tk.to_str()


# ============================================================================ llama-family weights
def _dims(**dims) -> dict:
    d = dict(LLAMA_DIMS)
    unknown = set(dims) - set(d) - {"head_dim"}
    if unknown:
        raise TypeError(f"unknown dims {sorted(unknown)}; known: {sorted(d)} + head_dim")
    d.update(dims)
    d.setdefault("head_dim", d["hidden_size"] // d["n_heads"])
    return d


def _hf_weights(d: dict, arch: str, seed: int) -> dict[str, np.ndarray]:
    """HF-layout f32 weights keyed by our names (q/k unpermuted)."""
    rng = np.random.default_rng(seed)
    C, F, V, D = d["hidden_size"], d["ffn_size"], d["vocab_size"], d["head_dim"]
    Hq, Hkv = d["n_heads"], d["n_kv_heads"]

    def mat(n, k):                      # std 1/sqrt(k): activations stay O(1) through the layers
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n, center):
        return (center + 0.1 * rng.standard_normal(n)).astype(np.float32)
    w = {"embed": rng.standard_normal((V, C)).astype(np.float32), "norm": vec(C, 1.0)}
    if not d["tie_embeddings"]:
        w["lm_head"] = mat(V, C)
    for i in range(d["n_layers"]):
        p = f"layers.{i}."
        w[p + "attn_norm"] = vec(C, 1.0)
        w[p + "q"], w[p + "k"], w[p + "v"] = mat(Hq * D, C), mat(Hkv * D, C), mat(Hkv * D, C)
        if arch == "qwen2":
            w[p + "q_bias"], w[p + "k_bias"], w[p + "v_bias"] = vec(Hq * D, 0.0), vec(Hkv * D, 0.0), vec(Hkv * D, 0.0)
        if arch == "qwen3":
            w[p + "q_norm"], w[p + "k_norm"] = vec(D, 1.0), vec(D, 1.0)
        w[p + "o"] = mat(C, Hq * D)
        w[p + "ffn_norm"] = vec(C, 1.0)
        w[p + "gate"], w[p + "up"], w[p + "down"] = mat(F, C), mat(F, C), mat(C, F)
    return w


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert's row permutation of q/k (HF halves -> GGUF adjacent pairs); works on any rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _is_matrix(name: str) -> bool:
    return name.split(".")[-1] in ("embed", "lm_head", "q", "k", "v", "o", "gate", "up", "down")


def _rope_factors(d: dict, rope_scaling: dict | None, f32: bool = False):
    """The frequency divisors of an HF-style rope_scaling dict (llama3 or linear), or None."""
    if not rope_scaling:
        return None
    rs, half = rope_scaling, d["head_dim"] // 2
    if rs["rope_type"] == "linear":
        f = (float(rs["factor"]),) * half
    else:
        f = llama3_rope_factors(d["head_dim"], d["rope_base"], rs["factor"], rs["low_freq_factor"],
                                rs["high_freq_factor"], rs["original_max_position_embeddings"])
    return tuple(float(v) for v in np.asarray(f, np.float32)) if f32 else f


def _llama_config(d: dict, arch: str, neox: bool, eos_ids=(EOS_ID, 0), factors=None) -> LlamaConfig:
    return LlamaConfig(arch=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                       n_layers=d["n_layers"], n_heads=d["n_heads"], n_kv_heads=d["n_kv_heads"],
                       head_dim=d["head_dim"], ffn_size=d["ffn_size"], rope_base=d["rope_base"],
                       rot_dim=d["head_dim"], rope_neox=neox, rms_eps=d["rms_eps"],
                       context_length=d["context_length"], tie_embeddings=d["tie_embeddings"],
                       qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", bos_id=BOS_ID, eos_ids=list(eos_ids),
                       name=f"tiny-{arch}",
                       rope_freq_factors=factors,
                       rope_scaling="" if factors is None else ("linear" if len(set(factors)) == 1 else "llama3"))


# ============================================================================ K-quant encoders
# gguf-py can dequantize K-quants and IQ4 but not quantize them: these simple (not error-optimal)
# encoders write valid blocks; what the GPU sees is then gguf.dequantize of those bytes.
def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """(n, k) f32 -> (n, k/256*144) u8: d, dmin f16; 6-bit scale/min per 32; 4-bit q (x = d*sc*q - dmin*m)."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)                        # (blocks, sub, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0                                    # (blocks, 8)
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, mf, out=np.zeros_like(lo), where=mf > 0)), 0, 63).astype(np.uint8)
    step, off = (df * sc)[..., None], (mf * mn)[..., None]
    q = np.clip(np.round(np.divide(x + off, step, out=np.zeros_like(x), where=step > 0)), 0, 15).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    q = q.reshape(-1, 4, 2, 32)                                        # 64-element chunks: low | high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], axis=1)
    return out.reshape(n, k // 256 * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """(n, k) f32 -> (n, k/256*210) u8: ql[128], qh[64], int8 scales[16] (per 16), d f16; x = d*sc*(q-32)."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31.0                                   # (blocks, 16)
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step > 0)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)                                        # halves of 128, quarters of 32
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4,
                         q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    return out.reshape(n, k // 256 * 210)


def _div(a, b):
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(np.shape(a), np.shape(b)), np.float32), where=b > 0)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """(n, k) f32 -> (n, k/256*176) u8: Q4_K's d, dmin and scales, qh[32] (bit j: fifth bit of
    sub-block j), qs[128] low nibbles; x = d*sc*q - dmin*m with q 0..31."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 31.0
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(_div(scale, df)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_div(-lo, mf)), 0, 63).astype(np.uint8)
    q = np.clip(np.round(_div(x + (mf * mn)[..., None], (df * sc)[..., None])), 0, 31).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qh, qs], axis=1)
    return out.reshape(n, k // 256 * 176)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """(n, k) f32 -> (n, k/256*110) u8: hmask[32], qs[64], 16 six-bit scales (+32), d f16;
    x = d*sc*(q - 4) with q 0..7, one scale per 16."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 4.0
    d = (scale.max(-1) / 31.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(_div(scale, df)), -32, 31).astype(np.int64)            # (blocks, 16)
    q = np.clip(np.round(_div(x, (df * sc)[..., None])) + 4, 0, 7).astype(np.uint8)
    q = q.reshape(-1, 8, 32)                        # chunk j = 32 weights
    hmask = np.zeros((x.shape[0], 32), np.uint8)
    qs = np.zeros((x.shape[0], 2, 32), np.uint8)
    for j in range(8):
        hmask |= (q[:, j] >> 2) << j
        qs[:, j // 4] |= (q[:, j] & 3) << (2 * (j % 4))
    s = (sc + 32).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)
    scales[:, 0:8] = (s[:, 0:8] & 0xF) | ((s[:, 8:16] & 0xF) << 4)
    for i in range(16):
        scales[:, 8 + i % 4] |= (s[:, i] >> 4) << (2 * (i // 4))
    out = np.concatenate([hmask, qs.reshape(-1, 64), scales, d[:, None].view(np.uint8)], axis=1)
    return out.reshape(n, k // 256 * 110)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """(n, k) f32 -> (n, k/256*84) u8: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin f16;
    x = d*sc*q - dmin*m with q 0..3, one pair per 16."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 3.0
    d = (scale.max(-1) / 15.0).astype(np.float16)
    dmin = ((-lo).max(-1) / 15.0).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(_div(scale, df)), 0, 15).astype(np.uint8)
    mn = np.clip(np.round(_div(-lo, mf)), 0, 15).astype(np.uint8)
    q = np.clip(np.round(_div(x + (mf * mn)[..., None], (df * sc)[..., None])), 0, 3).astype(np.uint8)
    q = q.reshape(-1, 8, 32)
    qs = np.zeros((x.shape[0], 2, 32), np.uint8)
    for j in range(8):
        qs[:, j // 4] |= q[:, j] << (2 * (j % 4))
    out = np.concatenate([sc | (mn << 4), qs.reshape(-1, 64), d[:, None].view(np.uint8),
                          dmin[:, None].view(np.uint8)], axis=1)
    return out.reshape(n, k // 256 * 84)


def _iq4_index(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Nearest kvalues_iq4nl entry of x / step (u8 indices)."""
    import gguf
    kv = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)
    return np.abs(_div(x, step)[..., None] - kv).argmin(-1).astype(np.uint8)


def _iq4_pack(idx: np.ndarray) -> np.ndarray:
    # (..., 32) indices -> (..., 16) bytes: low nibbles elements 0..15, high 16..31
    return idx[..., :16] | (idx[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """(n, k) f32 -> (n, k/32*18) u8: d f16, qs[16]; x = d * kvalues_iq4nl[q]."""
    n, k = w.shape
    x = w.reshape(-1, 32).astype(np.float32)
    d = (np.abs(x).max(-1) / 127.0).astype(np.float16)
    idx = _iq4_index(x, d.astype(np.float32)[:, None])
    return np.concatenate([d[:, None].view(np.uint8), _iq4_pack(idx)], axis=1).reshape(n, k // 32 * 18)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """(n, k) f32 -> (n, k/256*136) u8: d f16, scales_h u16, scales_l[4], qs[128]; x = d * (ls - 32) *
    kvalues_iq4nl[q] with a six-bit ls per 32."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    scale = np.abs(x).max(-1) / 127.0
    d = (scale.max(-1) / 31.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    ls = np.clip(np.round(_div(scale, df)) + 32, 0, 63).astype(np.uint16)      # (blocks, 8)
    idx = _iq4_index(x, (df * (ls.astype(np.float32) - 32))[..., None])
    sh = np.zeros(x.shape[0], np.uint16)
    for j in range(8):
        sh |= (ls[:, j] >> 4) << (2 * j)
    sl = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    out = np.concatenate([d[:, None].view(np.uint8), sh[:, None].view(np.uint8), sl,
                          _iq4_pack(idx).reshape(-1, 128)], axis=1)
    return out.reshape(n, k // 256 * 136)


_K_QUANTIZERS = {"q4_k": quantize_q4_k, "q6_k": quantize_q6_k, "q5_k": quantize_q5_k, "q3_k": quantize_q3_k,
                 "q2_k": quantize_q2_k, "iq4_nl": quantize_iq4_nl, "iq4_xs": quantize_iq4_xs}


# ============================================================================ GGUF
def write_tiny_llama_gguf(path, arch: str = "llama", qtype: str = "f32", seed: int = 0, *,
                          embed_qtype: str | None = None, pad_rows: int = 0, rope_scaling: dict | None = None,
                          tensor_qtypes: dict | None = None, spm: dict | None = None,
                          chat_template: str | None = None, **dims) -> dict:
    """Write a tiny llama/qwen2 GGUF (`chat_template`: instead of ChatML or INST_TEMPLATE). Matrices in `qtype` (f32 f16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl, or
    q4_k q5_k q6_k q3_k q2_k iq4_xs with hidden_size/ffn_size multiples of 256; the embedding in
    `embed_qtype`, default the same), norms and biases f32. `pad_rows`: embedding / LM-head rows past
    the tokenizer's vocabulary (as Qwen2.5 pads 151665 tokens to 151936 rows), their LM-head rows
    scaled up so that they would win the sampling if they were not masked. `tensor_qtypes`: per
    matrix (our last name part: q k v o gate up down lm_head) a type other than `qtype`, for mixes
    such as Q4_K_M's ({"v": "q6_k", "down": "q6_k"}). `spm`: a SentencePiece vocabulary ({tokens,
    scores, token_types}, tests/fixtures/spm_vocab.json) written as llama.cpp's converter does instead
    of the byte-level BPE one (Llama-2 / Mistral files, with INST_TEMPLATE). Returns
    {path, arch, config (LlamaConfig our loader must produce), rope_neox, qtypes {our name: qtype},
    weights {our name: f32 array as stored and dequantized: what the GPU sees, q/k in file layout},
    hf_weights {same, q/k in HF layout}, tokens, merges, chat_template}."""
    import gguf
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError("GGUF tiny models: arch 'llama', 'qwen2' or 'qwen3'")
    d = _dims(**dims)
    d["rms_eps"], d["rope_base"] = (float(np.float32(d[k])) for k in ("rms_eps", "rope_base"))  # GGUF keeps f32
    qwen = arch in ("qwen2", "qwen3")
    tokens, merges = (spm["tokens"], []) if spm else tiny_bpe_vocab(d["vocab_size"], "qwen2" if qwen else "smollm")
    d["vocab_size"] = len(tokens) + pad_rows
    hf = _hf_weights(d, arch, seed)
    if pad_rows:
        if d["tie_embeddings"]:
            raise ValueError("pad_rows needs an untied LM head")
        hf["lm_head"][len(tokens):] *= 40.0
    neox = qwen
    qtypes, stored, gpu, hf_deq = {}, {}, {}, {}
    for name, w in hf.items():
        qt = (embed_qtype or qtype) if name == "embed" else (qtype if _is_matrix(name) else "f32")
        if _is_matrix(name) and name != "embed":       # a K-quant mix: e.g. {"v": "q6_k", "down": "q6_k"}
            qt = (tensor_qtypes or {}).get(name.split(".")[-1], qt)
        if qt in ("f32", "f16"):
            raw = w.astype(np.float32 if qt == "f32" else np.float16)
            deq = raw.astype(np.float32)
        else:
            gq = gguf.GGMLQuantizationType[qt.upper()]
            block = gguf.GGML_QUANT_SIZES[gq][0]
            if w.shape[-1] % block:
                raise ValueError(f"{name}: k={w.shape[-1]} is not a multiple of the {qt} block ({block}); "
                                 f"K-quants need hidden_size and ffn_size multiples of 256")
            raw = _K_QUANTIZERS[qt](w) if qt in _K_QUANTIZERS else gguf.quantize(w, gq)
            deq = gguf.dequantize(raw, gq).astype(np.float32).reshape(w.shape)
        heads = {"q": d["n_heads"], "k": d["n_kv_heads"]}.get(name.split(".")[-1])
        if heads and not neox:          # stored permuted; row permutation commutes with row-wise blocks
            raw, deq_file = permute_qk(raw, heads), permute_qk(deq, heads)
        else:
            deq_file = deq
        qtypes[name], stored[name], gpu[name], hf_deq[name] = qt, raw, deq_file, deq

    gguf_names = {v: k for k, v in _GGUF_TABLE().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(d["context_length"]); w.add_embedding_length(d["hidden_size"])
    w.add_block_count(d["n_layers"]); w.add_feed_forward_length(d["ffn_size"])
    w.add_head_count(d["n_heads"]); w.add_head_count_kv(d["n_kv_heads"])
    w.add_rope_freq_base(d["rope_base"]); w.add_layer_norm_rms_eps(d["rms_eps"])
    w.add_rope_dimension_count(d["head_dim"]); w.add_vocab_size(d["vocab_size"])
    if d["head_dim"] != d["hidden_size"] // d["n_heads"]:
        w.add_key_length(d["head_dim"]); w.add_value_length(d["head_dim"])
    if spm:
        w.add_tokenizer_model("llama"); w.add_tokenizer_pre("default")
        w.add_token_list(tokens); w.add_token_scores(spm["scores"]); w.add_token_types(spm["token_types"])
        w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)
        w.add_add_bos_token(True); w.add_add_space_prefix(True); w.add_chat_template(chat_template or INST_TEMPLATE)
    else:
        w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen2" if qwen else "smollm")
        w.add_token_list(tokens); w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        w.add_token_merges(merges)
        w.add_bos_token_id(BOS_ID); w.add_eos_token_id(EOS_ID); w.add_add_bos_token(False)
        w.add_chat_template(chat_template or CHATML_TEMPLATE)
    factors = _rope_factors(d, rope_scaling, f32=True)
    if factors is not None:               # llama.cpp's converter writes Llama 3.1's factors so
        w.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))
    for name, raw in stored.items():
        file_name = _gguf_name(name, gguf_names)
        if qtypes[name] in ("f32", "f16"):
            w.add_tensor(file_name, raw)
        else:
            w.add_tensor(file_name, raw, raw_dtype=gguf.GGMLQuantizationType[qtypes[name].upper()])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dict(path=Path(path), arch=arch, config=_llama_config(d, arch, neox, factors=factors), rope_neox=neox,
                qtypes=qtypes, weights=gpu, hf_weights=hf_deq, tokens=tokens, merges=merges,
                chat_template=chat_template or (INST_TEMPLATE if spm else CHATML_TEMPLATE))


def _GGUF_TABLE():
    from webgpu_engine.loaders.gguf import GGUF_TO_OURS
    return GGUF_TO_OURS


def _gguf_name(ours: str, table: dict) -> str:
    parts = ours.split(".")
    if parts[0] == "layers":
        return table["layers.{i}." + ".".join(parts[2:])].replace("{i}", parts[1])
    return table[ours]


# ============================================================================ HF safetensors
def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns (u16), round to nearest even like torch."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _cast(x: np.ndarray, dtype: str) -> tuple[bytes, np.ndarray]:
    """(bytes as stored, f32 values the GPU sees)."""
    if dtype == "f32":
        a = x.astype(np.float32)
        return a.tobytes(), a
    if dtype == "f16":
        a = x.astype(np.float16)
        return a.tobytes(), a.astype(np.float32)
    if dtype == "bf16":
        b = _to_bf16_bits(x)
        return b.tobytes(), bf16_bits_to_f32(b)
    raise ValueError(f"dtype must be f32, f16 or bf16, got {dtype!r}")


def _write_folder_tensors(folder: Path, tensors: dict, sharded: bool) -> None:
    """tensors: {hf name: (dtype, shape, bytes)} -> model.safetensors or two shards + index."""
    if not sharded:
        write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
        return
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for j, chunk in enumerate((names[:half], names[half:])):
        fname = f"model-{j + 1:05d}-of-00002.safetensors"
        write_safetensors(folder / fname, {n: tensors[n] for n in chunk}, {"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    total = sum(len(b) for _, _, b in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_tiny_llama_safetensors(folder, arch: str = "llama", dtype: str = "f32", sharded: bool = False,
                                 seed: int = 0, rope_scaling: dict | None = None, sliding_window: int | None = None,
                                 **dims) -> dict:
    """Write an HF folder (config.json, safetensors, tokenizer.json, tokenizer_config.json with the
    ChatML template) of a tiny llama/qwen2/mistral. Returns {folder, arch, config, rope_neox (True),
    weights {our name: f32 as the GPU sees it}, hf_names {our name: HF name}, tokens, merges, chat_template}."""
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise ValueError("arch must be llama, qwen2, qwen3 or mistral")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d = _dims(**dims)
    tokens, merges = tiny_bpe_vocab(d["vocab_size"], "qwen2" if arch in ("qwen2", "qwen3") else "smollm")
    d["vocab_size"] = len(tokens)
    hf = _hf_weights(d, arch, seed)
    ours_to_hf = {}
    for hf_pat, ours_pat in HF_LLAMA_TO_OURS.items():
        for i in range(d["n_layers"]):
            ours_to_hf[ours_pat.replace("{i}", str(i))] = hf_pat.replace("{i}", str(i))
    tensors, gpu = {}, {}
    for name, w in hf.items():
        raw, seen = _cast(w, dtype)
        tensors[ours_to_hf[name]] = (dtype, w.shape, raw)
        gpu[name] = seen
    _write_folder_tensors(folder, tensors, sharded)
    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM"}[arch]
    config = {
        "_name_or_path": f"tiny-{arch}", "architectures": [cls], "model_type": arch,
        "vocab_size": len(tokens), "hidden_size": d["hidden_size"],
        "intermediate_size": d["ffn_size"], "num_hidden_layers": d["n_layers"],
        "num_attention_heads": d["n_heads"], "num_key_value_heads": d["n_kv_heads"], "head_dim": d["head_dim"],
        "rms_norm_eps": d["rms_eps"], "rope_theta": d["rope_base"], "max_position_embeddings": d["context_length"],
        "tie_word_embeddings": d["tie_embeddings"], "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "hidden_act": "silu", "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
    }
    if arch == "mistral":
        config["sliding_window"] = sliding_window
    if rope_scaling:
        config["rope_scaling"] = dict(rope_scaling)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(_hf_bpe_tokenizer_json(tokens, merges, arch))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML_TEMPLATE, "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID], "add_bos_token": False, "model_max_length": d["context_length"],
        "tokenizer_class": "GPT2Tokenizer"}, indent=2))
    cfg = _llama_config(d, arch, True, [EOS_ID], _rope_factors(d, rope_scaling))
    cfg.sliding_window = sliding_window if arch == "mistral" else None
    return dict(folder=folder, arch=arch, config=cfg, rope_neox=True, weights=gpu,
                hf_names={k: v for k, v in ours_to_hf.items() if k in hf}, tokens=tokens, merges=merges,
                chat_template=CHATML_TEMPLATE)


# ============================================================================ BERT (sentence-transformers)
BERT_DIMS = dict(vocab_size=0, hidden_size=64, n_layers=2, n_heads=4, intermediate_size=128,
                 max_position=128, type_vocab_size=2, layer_norm_eps=1e-12)
_BERT_WORDS = ("the a cat sat on mat dog hello world web gpu engine runs fast quick brown fox is of and to "
               "in it was for that with as at by this be are from paris france capital").split()


def tiny_wordpiece_vocab() -> list[str]:
    """[PAD] [UNK] [CLS] [SEP] [MASK], ASCII letters/digits/punctuation, ##-continuations, some words."""
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789") + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab += ["##s", "##ing", "##ed", "##er"] + [w for w in _BERT_WORDS if w not in vocab]
    return list(dict.fromkeys(vocab))


def write_tiny_bert(folder, pooling: str = "mean", normalize: bool = True, dtype: str = "f32", seed: int = 0,
                    max_seq_length: int = 64, **dims) -> dict:
    """Write a sentence-transformers folder of a tiny BERT: config.json, model.safetensors, tokenizer.json
    (WordPiece), vocab.txt, modules.json, 1_Pooling/config.json, sentence_bert_config.json. Returns
    {folder, config (BertConfig), weights {HF name: f32 as the GPU sees it}, pooling, normalize,
    max_seq_length, vocab}."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    if pooling not in ("mean", "cls", "max", "lasttoken", "weightedmean"):
        raise ValueError("pooling must be mean, cls, max, lasttoken or weightedmean")
    folder = Path(folder)
    (folder / "1_Pooling").mkdir(parents=True, exist_ok=True)
    d = dict(BERT_DIMS)
    unknown = set(dims) - set(d)
    if unknown:
        raise TypeError(f"unknown dims {sorted(unknown)}; known: {sorted(d)}")
    d.update(dims)
    vocab = tiny_wordpiece_vocab()
    d["vocab_size"] = max(d["vocab_size"], len(vocab))
    vocab += [f"[unused{i}]" for i in range(d["vocab_size"] - len(vocab))]
    C, F, L = d["hidden_size"], d["intermediate_size"], d["n_layers"]
    rng = np.random.default_rng(seed)

    def mat(n, k):
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n, center=0.0, scale=0.1):
        return (center + scale * rng.standard_normal(n)).astype(np.float32)
    def table(n, std):
        return (std * rng.standard_normal((n, C))).astype(np.float32)
    w = {"embeddings.word_embeddings.weight": table(d["vocab_size"], 1.0),
         "embeddings.position_embeddings.weight": table(d["max_position"], 0.5),
         "embeddings.token_type_embeddings.weight": table(d["type_vocab_size"], 0.5),
         "embeddings.LayerNorm.weight": vec(C, 1.0), "embeddings.LayerNorm.bias": vec(C)}
    for i in range(L):
        p = f"encoder.layer.{i}."
        for part, (n, k) in [("attention.self.query", (C, C)), ("attention.self.key", (C, C)),
                             ("attention.self.value", (C, C)), ("attention.output.dense", (C, C)),
                             ("intermediate.dense", (F, C)), ("output.dense", (C, F))]:
            w[p + part + ".weight"], w[p + part + ".bias"] = mat(n, k), vec(n)
        for part in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + part + ".weight"], w[p + part + ".bias"] = vec(C, 1.0), vec(C)
    tensors, seen = {"embeddings.position_ids": ("i64", (1, d["max_position"]),
                                                 np.arange(d["max_position"], dtype=np.int64)[None].tobytes())}, {}
    for name, a in w.items():
        raw, seen[name] = _cast(a, dtype)
        tensors[name] = (dtype, a.shape, raw)
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": d["vocab_size"], "hidden_size": C,
        "num_hidden_layers": L, "num_attention_heads": d["n_heads"], "intermediate_size": F,
        "max_position_embeddings": d["max_position"], "type_vocab_size": d["type_vocab_size"],
        "layer_norm_eps": d["layer_norm_eps"], "hidden_act": "gelu", "pad_token_id": 0,
        "position_embedding_type": "absolute", "torch_dtype": "float32" if dtype == "f32" else "float16"}, indent=2))
    tk = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]",
                                    max_input_chars_per_word=100))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                               lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                      special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tk.decoder = decoders.WordPiece(prefix="##")
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab[:5]])
    (folder / "tokenizer.json").write_text(tk.to_str())
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "do_lower_case": True, "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "cls_token": "[CLS]", "mask_token": "[MASK]", "tokenizer_class": "BertTokenizer",
        "model_max_length": d["max_position"]}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": C, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken",
        "pooling_mode_weightedmean_tokens": pooling == "weightedmean"}, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": False}))
    cfg = BertConfig(vocab_size=d["vocab_size"], hidden_size=C, n_layers=L, n_heads=d["n_heads"],
                     intermediate_size=F, max_position=d["max_position"], type_vocab_size=d["type_vocab_size"],
                     layer_norm_eps=d["layer_norm_eps"])
    return dict(folder=folder, config=cfg, weights=seen, pooling=pooling, normalize=normalize,
                max_seq_length=max_seq_length, vocab=vocab)


# ============================================================================ opened through our loaders
def open_tiny(tmp_path, arch: str = "llama", fmt: str = "gguf", *, qtype: str = "f32", dtype: str = "f32",
              seed: int = 0, **dims):
    """Write a tiny llama-family model and open it with our loaders: (LlamaConfig as the loader builds
    it, {our name: TensorInfo}, close()). fmt "gguf" uses `qtype`, "safetensors" uses `dtype`."""
    tmp_path = Path(tmp_path)
    if fmt == "gguf":
        from webgpu_engine.loaders.gguf import GGUFFile
        info = write_tiny_llama_gguf(tmp_path / f"tiny-{arch}-{qtype}.gguf", arch=arch, qtype=qtype, seed=seed, **dims)
        f = GGUFFile(info["path"])
        return f.model_config(), f.weights(), f.close
    if fmt == "safetensors":
        from webgpu_engine.loaders.hf_config import load_llama_config
        from webgpu_engine.loaders.safetensors import SafetensorsFolder
        info = write_tiny_llama_safetensors(tmp_path / f"tiny-{arch}-{dtype}", arch=arch, dtype=dtype, seed=seed,
                                            **dims)
        f = SafetensorsFolder(info["folder"])
        return load_llama_config(info["folder"]), f.weights("llama"), f.close
    raise ValueError(f"fmt must be 'gguf' or 'safetensors', got {fmt!r}")


TRANSFORMER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                     "sentence_bert_config.json")


def nest(flat: Path, dst: Path, sub: str = "0_Transformer") -> Path:
    """`flat` re-laid as an older sentence-transformers save: the Transformer's files in `sub`/."""
    import shutil
    shutil.copytree(flat, dst)
    (dst / sub).mkdir()
    for name in TRANSFORMER_FILES:
        (dst / name).rename(dst / sub / name)
    modules = json.loads((dst / "modules.json").read_text())
    modules[0]["path"] = sub
    (dst / "modules.json").write_text(json.dumps(modules, indent=2))
    return dst
