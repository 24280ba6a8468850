"""The SigLIP vision tower and its projector on the GPU (Gemma 3, Idefics3 / SmolVLM), and CLIP's
(LLaVA 1.5): one tile's patches in, its image tokens' embeddings (in the text model's width) out. A
pre-norm ViT, run with the BERT encoder's kernels:

    x = patches · Wpatchᵀ + b + pos                                  (N, C)   N = (S/p)^2 patches
    CLIP:     x = LN_pre([x; class + pos_0])                         (N + 1, C), the class row last
    for each layer:
        x += attn(LN1(x)) · Woᵀ + bo                                 bidirectional over the N patches
        x += act(LN2(x) · W1ᵀ + b1) · W2ᵀ + b2                       gelu_tanh (CLIP: quick_gelu)
    x = LN(x)                                                        (not after LLaVA's selected layer)
    Gemma 3:  t = avg_pool_KxK(x)                                    (n, C)   n soft tokens
              out = rms_norm(t) * (1 + w) · Wproj                    (n, C_text)
    Idefics3: t = pixel_shuffle_s(x)                                 (N / s^2, C s^2)
              out = t · Wprojᵀ                                       (N / s^2, C_text)
    LLaVA:    out = gelu(x[:N] · W1ᵀ + b1) · W2ᵀ + b2                (N, C_text)  the class row dropped

The patch embedding (a p x p convolution with stride p) is a matmul over unfolded patches
(vision/config.py `patches`: the conv weight (C, 3, p, p) is already that matmul's (C, 3 p p)).
Activations are f32 whatever the decoder's dtype; the output goes to the decoder's splice buffer.
"""
from __future__ import annotations

import bisect
import math
import re
import struct
from array import array
from dataclasses import dataclass

from ..errors import ModelFormatError, UnsupportedModelError
from ..kernels import matmul as mm
from ..kernels import nn, vision
from ..kernels.common import Op, Tensor, new_tensor
from ..kernels.elementwise import quick_gelu
from ..loaders.tensor_info import TensorInfo
from ..vision import pure
from ..vision.config import VisionConfig
from .llama import _floats

# the tower's and projector's names, with or without transformers' prefixes (Gemma 3's hub releases:
# vision_tower.vision_model.*; transformers 5: model.vision_tower.*; Idefics3: model.vision_model.*,
# model.connector.*)
_PREFIX = re.compile(r"^(model\.)?(vision_tower\.(vision_model\.)?|multi_modal_projector\.|vision_model\.|connector\.)")


def vision_tensors(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """{name without prefix: TensorInfo} of the tower's and the projector's tensors."""
    return {_PREFIX.sub("", n): t for n, t in tensors.items() if _PREFIX.match(n)}


@dataclass
class _Layer:
    ln1_w: Tensor
    ln1_b: Tensor
    qkv: mm.QWeight                  # (3C, C) rows [q | k | v]
    qkv_b: Tensor
    o: mm.QWeight                    # (C, C)
    o_b: Tensor
    ln2_w: Tensor
    ln2_b: Tensor
    fc1: mm.QWeight                  # (F, C)
    fc1_b: Tensor
    fc2: mm.QWeight                  # (C, F)
    fc2_b: Tensor


class SiglipTower:
    """The tower's weights and activations on `dev`, owned by `owner`; `record(batch, i)` runs the
    patches last written by `write_patches` and copies the n x C_text features to row i * n of `out`."""

    def __init__(self, dev, cfg: VisionConfig, tensors: dict[str, TensorInfo], *, owner: str):
        self.dev, self.cfg, self.owner = dev, cfg, owner
        named = vision_tensors(tensors)
        C, F, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
        N = cfg.patches_per_side ** 2

        def get(name: str, shape: tuple) -> TensorInfo:
            t = named.get(name)
            if t is None:
                raise ModelFormatError(f"the vision tower lacks {name}")
            if tuple(t.shape) != shape:
                raise ModelFormatError(f"vision tensor {name} has shape {tuple(t.shape)}, expected {shape}")
            return t

        def weight(names: list[str], n: int, k: int, label: str) -> mm.QWeight:
            parts = [get(nm, (n // len(names), k)) for nm in names]
            return mm.upload_weight(dev, [t.data for t in parts], parts[0].qtype, n, k, owner=owner, label=label)

        def vector(names: list[str], n: int, label: str, plus: float = 0.0) -> Tensor:
            vals = [v + plus for nm in names for v in _floats(get(nm, (n // len(names),)))]
            return mm.upload_vector(dev, struct.pack(f"<{len(vals)}f", *vals), owner=owner, label=label)

        conv = get("embeddings.patch_embedding.weight", (C, 3, p, p))
        self.patch = mm.upload_weight(dev, [conv.data], conv.qtype, C, 3 * p * p, owner=owner, label="v.patch")
        has_bias = "embeddings.patch_embedding.bias" in named          # CLIP's convolution has none
        self.patch_b = vector(["embeddings.patch_embedding.bias"], C, "v.patch_b") if has_bias else None
        if cfg.class_token:              # CLIP: the class row last, after the patches (attention ignores order)
            if has_bias:
                raise ModelFormatError("a vision tower with a class embedding and a patch bias is not read")
            pos = get("embeddings.position_embedding.weight", (N + 1, C))
            self.pos = self._class_last(pos, get("embeddings.class_embedding", (C,)))
        else:
            pos = get("embeddings.position_embedding.weight", (N, C))
            self.pos = self._matrix(pos, "v.pos", rows=position_ids(cfg.patches_per_side) if cfg.kind == "idefics3" else None)
        if cfg.pre_norm:
            self.pre_w = vector(["pre_layrnorm.weight"], C, "v.pre")
            self.pre_b = vector(["pre_layrnorm.bias"], C, "v.preb")
        self.layers = []
        for i in range(cfg.n_layers):
            a, L = f"encoder.layers.{i}.self_attn.", f"encoder.layers.{i}."
            self.layers.append(_Layer(
                ln1_w=vector([L + "layer_norm1.weight"], C, f"v{i}.ln1"), ln1_b=vector([L + "layer_norm1.bias"], C, f"v{i}.ln1b"),
                qkv=weight([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], 3 * C, C, f"v{i}.qkv"),
                qkv_b=vector([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], 3 * C, f"v{i}.qkvb"),
                o=weight([a + "out_proj.weight"], C, C, f"v{i}.o"), o_b=vector([a + "out_proj.bias"], C, f"v{i}.ob"),
                ln2_w=vector([L + "layer_norm2.weight"], C, f"v{i}.ln2"), ln2_b=vector([L + "layer_norm2.bias"], C, f"v{i}.ln2b"),
                fc1=weight([L + "mlp.fc1.weight"], F, C, f"v{i}.fc1"), fc1_b=vector([L + "mlp.fc1.bias"], F, f"v{i}.fc1b"),
                fc2=weight([L + "mlp.fc2.weight"], C, F, f"v{i}.fc2"), fc2_b=vector([L + "mlp.fc2.bias"], C, f"v{i}.fc2b")))
        if cfg.post_norm:
            self.post_w = vector(["post_layernorm.weight"], C, "v.post")
            self.post_b = vector(["post_layernorm.bias"], C, "v.postb")
        T = cfg.text_hidden
        if cfg.kind == "llava":          # LLaVA's projector: linear_2(gelu(linear_1(x)))
            self.mm1, self.mm1_b = weight(["linear_1.weight"], T, C, "v.mm1"), vector(["linear_1.bias"], T, "v.mm1b")
            self.mm2, self.mm2_b = weight(["linear_2.weight"], T, T, "v.mm2"), vector(["linear_2.bias"], T, "v.mm2b")
        elif cfg.kind == "gemma3":
            # x * (1 + w): w as transformers stores it, or 1 + w as llama.cpp's mmproj does
            plus_one = "mm_soft_emb_norm.one_plus_weight" in named
            self.mm_norm = vector(["mm_soft_emb_norm.one_plus_weight" if plus_one else "mm_soft_emb_norm.weight"],
                                  C, "v.mmnorm", plus=0.0 if plus_one else 1.0)
            # out = t · Wproj with Wproj (C, C_text): the matmul's weight is its transpose (C_text, C)
            self.proj = self._transposed(get("mm_input_projection_weight", (C, cfg.text_hidden)), "v.proj")
        elif cfg.kind != "phi3v":        # (Phi-3.5-vision: the tower alone, vision/phi3v_gpu.py)
            # Idefics3's nn.Linear (C_text, C s^2), no bias
            self.proj = weight(["modality_projection.proj.weight"], cfg.text_hidden, C * cfg.scale ** 2, "v.proj")
        self._allocate(N + cfg.class_token)
        self.ops = self._build(N + cfg.class_token)

    # ------------------------------------------------------------------ weights and activations
    def _array(self, t: TensorInfo) -> array:
        """A table read on the host (positions, Gemma 3's projection) as f32 values, row-major, without
        numpy (the page has none) where it is stored as floats; a quantised one (a projector file
        quantised whole) dequantised as ggml does, with numpy."""
        if t.qtype in ("f32", "f16", "bf16"):
            return pure.f32_values(bytes(t.data), t.qtype)
        return dequantised(t)

    def _upload(self, values: array, shape: tuple, label: str) -> Tensor:
        return Tensor(self.dev.upload(values.tobytes(), owner=self.owner, label=label), shape, "f32")

    def _matrix(self, t: TensorInfo, label: str, rows=None) -> Tensor:
        a, width = self._array(t), t.shape[-1]
        if rows is not None:             # the rows in this order
            a = array("f", b"".join(a[int(r) * width:(int(r) + 1) * width].tobytes() for r in rows))
        return self._upload(a, (len(a) // width, width), label)

    def _class_last(self, pos: TensorInfo, cls: TensorInfo) -> Tensor:
        """CLIP's positions (N + 1, C) reordered for the class row last: its input row stays zero, so
        its embedding is the class embedding plus position 0's."""
        a, c = self._array(pos), self._array(cls)
        C = len(c)
        rows = a[C:] + array("f", [x + y for x, y in zip(a[:C], c)])       # f32 sums, as numpy's
        return self._upload(rows, (len(rows) // C, C), "v.pos")

    def _transposed(self, t: TensorInfo, label: str) -> mm.QWeight:
        rows, cols = t.shape                               # (C, C_text) -> (C_text, C), small
        a = pure.transposed(self._array(t), rows, cols)
        return mm.upload_weight(self.dev, [a.tobytes()], "f32", cols, rows, owner=self.owner, label=label)

    def _allocate(self, N: int) -> None:
        cfg, dev, own = self.cfg, self.dev, self.owner
        C, F, n = cfg.hidden_size, cfg.intermediate_size, cfg.tokens_per_image

        def act(shape, label, dtype="f32"):
            return new_tensor(dev, shape, dtype, owner=own, label=label)
        self.pix = act((N, 3 * cfg.patch_size ** 2), "v.pixels")
        self.x, self.h, self.ctx = act((N, C), "v.x"), act((N, C), "v.h"), act((N, C), "v.ctx")
        self.qkv, self.ff = act((N, 3 * C), "v.qkv"), act((N, F), "v.ff")
        if cfg.kind == "llava":
            self.mid = act((n, cfg.text_hidden), "v.mid")
        elif cfg.kind == "gemma3":
            self.pooled, self.normed = act((n, C), "v.pooled"), act((n, C), "v.normed")
        elif cfg.kind != "phi3v":
            self.shuffled = act((n, C * cfg.scale ** 2), "v.shuffled")
        if cfg.kind != "phi3v":
            self.out = act((n, cfg.text_hidden), "v.out")
        self.lengths = Tensor(dev.upload(struct.pack("<I", N), owner=own, label="v.lengths"), (1,), "u32")

    def _build(self, N: int) -> Op:
        cfg, dev = self.cfg, self.dev
        H, D, eps = cfg.n_heads, cfg.head_dim, cfg.eps
        x, h, ctx, qkv, ff = self.x, self.h, self.ctx, self.qkv, self.ff
        e = h if cfg.pre_norm else x                                             # the embeddings
        op = mm.matmul(dev, self.pix, self.patch, e, bias=self.patch_b)           # (N, C)
        op += nn.add(dev, e, self.pos, e)
        if cfg.pre_norm:
            op += nn.layer_norm(dev, h, self.pre_w, self.pre_b, x, eps=eps)
        for L in self.layers:
            op += nn.layer_norm(dev, x, L.ln1_w, L.ln1_b, h, eps=eps)
            op += mm.matmul(dev, h, L.qkv, qkv, bias=L.qkv_b)                     # (N, 3C)
            op += nn.attention_bidir(dev, qkv, self.lengths, ctx, batch=1, seq=N, n_heads=H, head_dim=D,
                                     scale=D ** -0.5)
            op += mm.matmul(dev, ctx, L.o, x, bias=L.o_b, accumulate=True)         # x += attn
            op += nn.layer_norm(dev, x, L.ln2_w, L.ln2_b, h, eps=eps)
            op += mm.matmul(dev, h, L.fc1, ff, bias=L.fc1_b)                      # (N, F)
            op += quick_gelu(dev, ff, ff) if cfg.act == "quick_gelu" else nn.gelu_tanh(dev, ff, ff)
            op += mm.matmul(dev, ff, L.fc2, x, bias=L.fc2_b, accumulate=True)      # x += mlp
        if cfg.post_norm:
            op += nn.layer_norm(dev, x, self.post_w, self.post_b, h, eps=eps)
        if cfg.kind == "llava":          # the patches' rows (the class row, last, dropped)
            feats = (h if cfg.post_norm else x).view((cfg.tokens_per_image, cfg.hidden_size))
            op += mm.matmul(dev, feats, self.mm1, self.mid, bias=self.mm1_b)       # (n, C_text)
            op += nn.gelu(dev, self.mid, self.mid)
            op += mm.matmul(dev, self.mid, self.mm2, self.out, bias=self.mm2_b)    # (n, C_text)
        elif cfg.kind == "gemma3":
            op += vision.avg_pool(dev, h, self.pooled, side=cfg.patches_per_side, kernel=cfg.pool)
            op += nn.rms_norm(dev, self.pooled, self.mm_norm, self.normed, eps=eps)
            op += mm.matmul(dev, self.normed, self.proj, self.out)                # (n, C_text)
        elif cfg.kind != "phi3v":
            op += vision.pixel_shuffle(dev, h, self.shuffled, side=cfg.patches_per_side, scale=cfg.scale)
            op += mm.matmul(dev, self.shuffled, self.proj, self.out)              # (n, C_text)
        op.name = "siglip"
        return op

    # ------------------------------------------------------------------ running
    def write_patches(self, rows) -> None:
        """Write one image's unfolded patches (vision/config.py `patches`, (N, 3 p p) f32: numpy's, or
        an `array` of them from vision/pure.py)."""
        self.dev.write(self.pix.buf, rows.tobytes() if isinstance(rows, array) else rows.astype("float32").tobytes())

    def record(self, batch, dst: Tensor, index: int):
        """Record the tower over the written patches and copy its n x C_text features into `dst` at
        row index * n."""
        self.ops.record(batch)
        size = self.out.nbytes
        batch.copy(self.out.buf, dst.buf, size, self.out.offset, dst.offset + index * size)
        return batch

    def dispose(self) -> None:
        self.ops.release()
        self.dev.release_owner(self.owner)



def dequantised(t: TensorInfo) -> array:
    """A quantised tensor's values as f32, row-major (kernels/quant_ref.py, numpy's: natively only)."""
    try:
        import numpy as np

        from ..kernels import quant_ref
    except ImportError:                  # the page: no numpy
        raise UnsupportedModelError(f"vision tensor {t.name} is {t.qtype}; the page reads it in f32, f16 or "
                                    f"bf16 only (use an f16 or f32 mmproj)") from None
    width = int(t.shape[-1])
    try:
        values = quant_ref.dequantize(bytes(t.data), t.qtype, t.numel // width, width)
    except (KeyError, ValueError) as e:
        raise UnsupportedModelError(f"vision tensor {t.name} is {t.qtype}, which this engine does not "
                                    f"dequantise ({e})") from None
    out = array("f")
    out.frombytes(values.astype(np.float32).tobytes())
    return out


def position_ids(side: int) -> list[int]:
    """Idefics3's position ids of a full tile's patches, as its embeddings compute them in f32
    (fractional coordinates i * f32(1 / side), capped below 1, bucketed on numpy's f32 arange of the
    boundaries 1/side ..): the identity where 1/side is exact."""
    f32 = pure.f32
    step, top, d = f32(1.0 / side), f32(1.0 - 1e-6), 1.0 / side
    n = max(math.ceil((1.0 - d) / d), 0)
    b0, b1 = f32(d), f32(d + d)              # numpy fills an f32 arange from its first two values
    bounds = [b0, b1][:n] + [f32(b0 + f32(i * f32(b1 - b0))) for i in range(2, n)]
    b = [bisect.bisect_right(bounds, min(f32(i * step), top)) for i in range(side)]
    return [r * side + c for r in b for c in b]
