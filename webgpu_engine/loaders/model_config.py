"""Architecture hyper-parameters of the model families (Llama-style decoders, BERT encoders).

Plain dataclasses (they run in Pyodide too). Loaders fill them from GGUF metadata or an HF
`config.json`; models read them. Derived sizes are computed once in `__post_init__`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LlamaConfig:
    """A Llama-family decoder (Llama, Qwen2 = Llama + q/k/v bias, Qwen3 = Llama + per-head q/k
    RMSNorm before RoPE, Mistral = Llama (+ sliding window), Phi-3 = Llama with fused q|k|v and
    gate|up in its files, longrope scaling and partial rotary; Gemma 2 = GeGLU, (1 + w) norms,
    embeddings times sqrt(C), norms after attention and FFN too, soft-capped scores and logits,
    sliding windows on every other layer; Gemma 3 = Gemma 2 + q/k norms, 5 local : 1 global
    layers with their own rope base, no soft-capping; OLMo-2 = Llama with post norms instead of
    pre norms and q/k norms over the whole projections; StableLM 2 = Llama with LayerNorms (with
    biases), q/k/v biases and partial rotary; Phi-1/2 = attention and a dense GELU FFN in parallel off
    one LayerNorm, biases on every projection and the LM head).

    `rope_neox` says which dimensions rope rotates together in a head of size `rot_dim`:
    False: adjacent pairs (2i, 2i+1) — GGUF llama/mistral, whose q/k rows llama.cpp's converter
    permuted for exactly that; True: halves (i, i + rot_dim/2) — HF safetensors of every family,
    and GGUF qwen2 (stored unpermuted).
    """

    arch: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 0                # 0: same as n_heads
    head_dim: int = 0                  # 0: hidden_size // n_heads
    ffn_size: int = 11008
    rope_base: float = 10000.0
    rot_dim: int = 0                   # 0: head_dim (partial rotary otherwise)
    rope_neox: bool = False
    rms_eps: float = 1e-5
    context_length: int = 4096
    tie_embeddings: bool = False       # lm_head shares the token embedding table
    qkv_bias: bool = False             # Qwen2
    qk_norm: bool = False              # Qwen3: rms_norm of each q and k head (weights q_norm, k_norm (D,))
    qk_norm_whole: bool = False        # OLMo-2: the q / k norms span the whole projection (q_norm (Hq D,),
    #                                    k_norm (Hkv D,)), not each head
    pre_norms: bool = True             # rms_norm of x before attention and FFN (OLMo-2: none, post norms only)
    norm: str = "rms"                  # the pre norms and the final norm: "rms", or "layer": LayerNorm with a
    #                                    bias (StableLM, Phi; eps rms_eps)
    # attention and FFN both off the layer's input, x += attn(n1(x)) + ffn(n2(x)): 0 no (x += attn first),
    # 1 with one norm (n2 = n1: Phi, no ffn_norm), 2 with two (GPT-NeoX)
    parallel_norms: int = 0
    ffn_gated: bool = True             # act(gate) * up; False: a dense FFN act(x · Wupᵀ + b) · Wdownᵀ + b (Phi)
    # mixture of experts (Qwen3-MoE, OLMoE, Mixtral): every layer's FFN is n_experts gated FFNs of
    # ffn_size, n_experts_used of them per token, chosen by top-k of softmax(h · Wrouterᵀ); their
    # weights renormalised to sum 1 when moe_norm_topk (0 experts: a dense FFN)
    n_experts: int = 0
    n_experts_used: int = 0
    moe_norm_topk: bool = False
    # act "swiglu_oai" (gpt-oss's experts): (clamp(up, ±act_limit) + 1) * g * sigmoid(act_alpha g),
    # g = min(gate, act_limit)
    act_alpha: float = 0.0
    act_limit: float = 0.0
    attn_sinks: bool = False           # gpt-oss: a learned logit per q head in each softmax's denominator
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    # sliding-window attention: a query at position p sees keys p-sliding_window+1..p (Mistral v0.1,
    # Phi-3-mini), in every layer or, when `window_layers` is set, in the layers it marks True
    sliding_window: int | None = None
    window_layers: tuple | None = None
    # RoPE scaling: frequency i is divided by rope_freq_factors[i] (rot_dim/2 values; None: all 1):
    # Llama 3.1+ ("llama3": GGUF rope_freqs.weight or HF rope_scaling) and "linear" scaling
    rope_freq_factors: tuple | None = None
    rope_scaling: str = ""             # the scaling's name, for messages ("", "llama3", "linear", "longrope")
    # Phi-3 "longrope" / "su": rope_freq_factors are the short factors; a model whose context window
    # exceeds rope_original_context rotates by these long ones instead (llama.cpp's choice); the
    # rotated dimensions of q and k are also scaled by rope_attn_factor
    rope_long_factors: tuple | None = None
    rope_original_context: int = 0
    rope_attn_factor: float = 1.0
    # Gemma 2 / 3
    act: str = "silu"                  # FFN gate activation: "silu", "gelu_tanh" (GeGLU), "swiglu_oai"; a dense FFN's:
    #                                    "gelu_tanh" or "gelu" (erf)
    embed_scale: float = 1.0           # x = embed[ids] * embed_scale (Gemma: sqrt(hidden_size))
    post_norms: bool = False           # rms_norm of the attention and FFN outputs before each residual add
    norm_plus_one: bool = False        # norm weights stored as w, applied as 1 + w (HF Gemma; GGUF adds the 1)
    attn_scale: float = 0.0            # scores' scale (0: head_dim^-0.5; Gemma: query_pre_attn_scalar^-0.5)
    attn_softcap: float = 0.0          # scores s -> c * tanh(s / c) (Gemma 2; 0: none)
    final_softcap: float = 0.0         # logits -> c * tanh(logits / c) (Gemma 2; 0: none)
    rope_local_base: float = 0.0       # rope base of the sliding-window layers, unscaled (Gemma 3; 0: rope_base)
    # Gemma 4: layers of different widths, layers attending another layer's cache, proportional RoPE
    layer_head_dims: tuple | None = None   # head_dim of each layer (None: head_dim everywhere)
    layer_ffn_sizes: tuple | None = None   # ffn_size of each layer (None: ffn_size everywhere)
    kv_sources: tuple | None = None    # the layer whose K / V cache each layer attends: itself, or an earlier
    #                                    one (the layer then stores none; its k / v projections go unused)
    rope_pairs: int = 0                # proportional RoPE of the layers without a window: only the first
    #                                    rope_pairs of a head's D/2 (neox) pairs rotate, at base^(-2j/D); 0: all
    v_norm: bool = False               # each v head rms-normalised (no weight) before the cache
    ple_dim: int = 0                   # per-layer inputs: P values per layer and token (0: none), see decoder.py
    name: str = ""
    # a family's own values (what its module's readers add and its decoder ops read: new math
    # needs no field here; see loaders/decoder_config.py DecoderFamily.ops)
    extra: dict = field(default_factory=dict)
    # derived (set in __post_init__)
    q_dim: int = field(init=False)     # n_heads * head_dim
    kv_dim: int = field(init=False)    # n_kv_heads * head_dim
    qkv_dim: int = field(init=False)   # rows of the fused q|k|v matrix
    n_rep: int = field(init=False)     # query heads per kv head (GQA)

    def __post_init__(self) -> None:
        # the family's registered name (models/registry.py is the one list of families)
        if not isinstance(self.arch, str) or not self.arch:
            raise ValueError(f"LlamaConfig.arch must be a family name, got {self.arch!r}")
        if self.n_kv_heads <= 0:
            self.n_kv_heads = self.n_heads
        if self.head_dim <= 0:
            self.head_dim = self.hidden_size // self.n_heads
        if self.rot_dim <= 0:
            self.rot_dim = self.head_dim
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be rms or layer, got {self.norm!r}")
        acts = ("silu", "gelu_tanh", "swiglu_oai") if self.ffn_gated else ("gelu_tanh", "gelu")
        if self.act not in acts:
            raise ValueError(f"act of a {'gated' if self.ffn_gated else 'dense'} FFN must be one of {acts}, "
                             f"got {self.act!r}")
        if self.act == "swiglu_oai" and not (self.n_experts and self.act_limit > 0):
            raise ValueError("act swiglu_oai is a MoE layer's, with act_limit > 0 (gpt-oss)")
        if self.parallel_norms not in (0, 1, 2):
            raise ValueError(f"parallel_norms must be 0, 1 or 2, got {self.parallel_norms!r}")
        if self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.ffn_gated
                                   and not self.parallel_norms and not self.post_norms):
            raise ValueError(f"{self.n_experts_used} of {self.n_experts} experts per token: a MoE layer "
                             f"takes 1..n_experts of its gated FFNs, in sequence after the attention")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.rot_dim % 2 or self.rot_dim > self.head_dim:
            raise ValueError(f"rot_dim {self.rot_dim} must be even and <= head_dim {self.head_dim}")
        self.eos_ids = list(dict.fromkeys(int(i) for i in self.eos_ids))
        if self.rope_freq_factors is not None:
            self.rope_freq_factors = tuple(float(f) for f in self.rope_freq_factors)
            if len(self.rope_freq_factors) != self.rot_dim // 2 or min(self.rope_freq_factors) <= 0:
                raise ValueError(f"rope_freq_factors needs rot_dim/2 = {self.rot_dim // 2} positive values, "
                                 f"got {len(self.rope_freq_factors)}")
        if self.rope_long_factors is not None:
            self.rope_long_factors = tuple(float(f) for f in self.rope_long_factors)
            if len(self.rope_long_factors) != self.rot_dim // 2:
                raise ValueError(f"rope_long_factors needs rot_dim/2 = {self.rot_dim // 2} values")
        self.q_dim = self.n_heads * self.head_dim
        self.kv_dim = self.n_kv_heads * self.head_dim
        self.qkv_dim = self.q_dim + 2 * self.kv_dim
        self.n_rep = self.n_heads // self.n_kv_heads
        for name in ("layer_head_dims", "layer_ffn_sizes", "kv_sources"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, tuple(int(x) for x in v))
                if len(getattr(self, name)) != self.n_layers:
                    raise ValueError(f"{name} needs one value per layer ({self.n_layers}), got {len(v)}")
        if self.kv_sources and any(s > i or self.kv_sources[s] != s for i, s in enumerate(self.kv_sources)):
            raise ValueError(f"kv_sources {self.kv_sources}: each layer attends itself or an earlier layer that "
                             f"stores its own cache")
        if self.kv_sources and any(self.head_dim_of(s) != self.head_dim_of(i) for i, s in enumerate(self.kv_sources)):
            raise ValueError("a layer must attend a cache of its own head_dim")
        if self.rope_scaling == "proportional" and not self.rope_pairs:
            raise ValueError("proportional RoPE needs rope_pairs")

    # ------------------------------------------------------------------ per-layer shapes (Gemma 4)
    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def ffn_of(self, layer: int) -> int:
        return self.layer_ffn_sizes[layer] if self.layer_ffn_sizes else self.ffn_size

    def kv_source(self, layer: int) -> int:
        """The layer whose cache `layer` attends (itself unless kv_sources says)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def rot_dim_of(self, layer: int) -> int:
        """Rotated dimensions of a layer's heads (partial rotary scales with a layer's head_dim)."""
        return self.rot_dim * self.head_dim_of(layer) // self.head_dim

    def cache_head_dims(self) -> list[int]:
        """head_dim of each layer that stores a K / V cache, in layer order."""
        return [self.head_dim_of(i) for i in range(self.n_layers) if self.kv_source(i) == i]

    @property
    def max_head_dim(self) -> int:
        return max(self.layer_head_dims or (self.head_dim,))

    @property
    def max_ffn(self) -> int:
        return max(self.layer_ffn_sizes or (self.ffn_size,))

    def window_of(self, layer: int) -> int:
        """The sliding window of one layer (0: it attends to every earlier key)."""
        if not self.sliding_window or (self.window_layers is not None and not self.window_layers[layer]):
            return 0
        return int(self.sliding_window)

    def rope_of(self, layer: int, factors: tuple | None) -> tuple:
        """(base, frequency divisors) one layer rotates by: Gemma 3's sliding-window layers take
        their own base and no scaling; every other layer `rope_base` and `factors`."""
        if self.rope_local_base and self.window_of(layer):
            return self.rope_local_base, None
        if self.rope_pairs and not self.window_of(layer):   # proportional: the other pairs keep frequency 0
            half = self.rot_dim_of(layer) // 2
            return self.rope_base, (1.0,) * self.rope_pairs + (float("inf"),) * (half - self.rope_pairs)
        return self.rope_base, factors

    def rope_factors_for(self, context: int) -> tuple | None:
        """The frequency divisors a model with this context window rotates by."""
        if self.rope_long_factors is not None and context > self.rope_original_context:
            return self.rope_long_factors
        return self.rope_freq_factors


@dataclass
class BertConfig:
    """A BERT encoder (sentence-transformers embedders such as all-MiniLM-L6-v2), XLM-RoBERTa (the
    same encoder; positions count from `position_offset` = padding_idx + 1), their cross-encoders
    (`num_labels` > 0: a classification head on the first token gives the scores), and NomicBert
    (rotary positions instead of a position table, SwiGLU feed-forward, no linear biases)."""

    arch: str = "bert"                 # "bert" | "xlm-roberta" | "nomic_bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    n_layers: int = 12
    n_heads: int = 12
    intermediate_size: int = 3072
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"           # erf GELU; "gelu_new"/"gelu_pytorch_tanh" would need tanh
    pad_id: int = 0
    name: str = ""
    position_offset: int = 0           # position id of the first token (XLM-RoBERTa: pad_id + 1)
    num_labels: int = 0                # 0: an embedder; > 0: a cross-encoder's classifier outputs
    # what CrossEncoder.predict applies to the logits: "sigmoid" | "identity" (config.json's
    # sentence_transformers.activation_fn, else sigmoid for one label, identity for more)
    classifier_activation: str = "identity"
    rope_base: float = 0.0             # > 0: rotary positions (half-split pairs) instead of a position table
    rot_dim: int = 0                   # rotated dimensions of each head (0: all, when rope_base > 0)
    ffn: str = "gelu"                  # "gelu": gelu(x·W1ᵀ)·W2ᵀ; "swiglu": (silu(x·Wgᵀ) * x·Wuᵀ)·W2ᵀ;
    #                                    "geglu": (gelu(x·Wiᵀ) * x·Wgᵀ)·W2ᵀ (ModernBERT)
    # ModernBERT: layer i attends keys within layer_windows[i] of each query (0: all keys), with
    # RoPE base local_rope_base in those local layers (rope_base in the global ones)
    layer_windows: tuple = ()
    local_rope_base: float = 0.0
    gguf: bool = False                 # weights named as loaders.gguf names a GGUF's (not HF names)
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of n_heads {self.n_heads}")
        self.head_dim = self.hidden_size // self.n_heads
        if self.rope_base > 0 and self.rot_dim <= 0:
            self.rot_dim = self.head_dim


def llama3_rope_factors(rot_dim: int, base: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> tuple:
    """Llama 3.1's RoPE scaling as divisors of the rot_dim/2 frequencies base^(-2i/rot_dim): long
    wavelengths (beyond original_context / low_freq_factor) slowed by `factor`, short ones (below
    original_context / high_freq_factor) kept, the band between blended smoothly. The numbers
    llama.cpp's converter writes as rope_freqs.weight, and transformers' `llama3` rope type."""
    import math
    low_wl, high_wl = original_context / low_freq_factor, original_context / high_freq_factor
    out = []
    for i in range(rot_dim // 2):
        wavelen = 2 * math.pi / (float(base) ** (-(2.0 * i) / rot_dim))
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(float(factor))
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)

