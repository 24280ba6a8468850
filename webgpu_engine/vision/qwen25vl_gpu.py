"""Qwen2.5-VL's vision tower on the GPU, one image of any grid at a time (f32 activations), with the
BERT encoder's kernels and rope_sections:

    x = patches · Wpatchᵀ                                   (N, C)  N = gh * gw, rows in window order
    for each layer:
        h = rms_norm(x) · Wqkvᵀ + b                         (N, 3C)
        q, k = rope_2d(q, k)                                 pairs < D/4 by the patch's row, the rest by its column
        full layers:   ctx = attention over all N rows
        window layers: ctx = attention inside each window (the rows gathered into windows padded to
                       the largest, attention_bidir with each window's length, gathered back)
        x += ctx · Woᵀ + bo
        x += (silu(rms_norm(x) · Wgᵀ + bg) * (rms_norm(x) · Wuᵀ + bu)) · Wdᵀ + bd
    t = rms_norm(x) viewed (N / 4, 4C)                       the merger: a 2x2 block per row
    out = gelu(t · W0ᵀ + b0) · W2ᵀ + b2                      (N / 4, C_text), gathered back to the processor's order

The window order (vision/qwen25vl.py window_order) permutes whole merge blocks, so the host writes
the patch rows and their positions already permuted, and the merger's rows come back by one gather.
Host tables and maps without numpy (the page has none): a quantised tensor alone needs it.
The patch embedding (Conv3d over (frames, p, p) with stride the kernel) is a matmul over the patch
rows: its weight (C, 3, frames, p, p) is that matmul's (C, 3 frames p p). Op lists are built per grid.
"""
from __future__ import annotations

import math
import re
from array import array

from ..errors import ModelFormatError
from ..kernels import matmul as mm
from ..kernels import nn
from ..kernels.common import OpCache, Tensor, new_tensor
from ..kernels.rope import rope_sections
from ..kernels.vision import NONE, splice_rows
from . import pure, qwen25vl
from .config import VisionConfig

# the tower's names with or without transformers' prefixes (transformers 5: model.visual.; the hub's
# releases: visual.)
_PREFIX = re.compile(r"^(model\.)?visual\.")


class Qwen25VLTower:
    """The interface VisionInputs runs (vision/runner.py): write_patches(grid), then record(batch,
    dst, index) writes the image's rows at row index * tokens_per_image of `dst`."""

    def __init__(self, dev, cfg: VisionConfig, tensors: dict, *, owner: str):
        from ..models.siglip import dequantised
        self.dev, self.cfg, self.owner = dev, cfg, owner
        q = cfg.qwen25vl
        named = {_PREFIX.sub("", n): t for n, t in tensors.items() if _PREFIX.match(n)}
        mmproj = "v.patch_embd.weight" in tensors        # llama.cpp's names (its parts joined here)
        C, F, p, T = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.text_hidden
        K, m2 = 3 * q.temporal_patch * p * p, q.merge ** 2

        def floats(t) -> array:          # any stored type (a projector file quantised whole too)
            return pure.f32_values(bytes(t.data), t.qtype) if t.qtype in ("f32", "f16", "bf16") else dequantised(t)

        def values(name: str, shape: tuple) -> array:
            parts = [tensors.get(n) for n in mmproj_names(name)] if mmproj else [named.get(name)]
            if any(t is None for t in parts):
                raise ModelFormatError(f"the vision tower lacks {name}")
            first = tuple(int(d) for d in parts[0].shape)
            if name == "patch_embed.proj.weight" and mmproj:       # the frames stacked at axis 2
                got = first[:2] + (len(parts),) + first[2:]
                a, inner, arrays = array("f"), math.prod(first[2:]), [floats(t) for t in parts]
                for i in range(math.prod(first[:2])):
                    for f in arrays:
                        a.extend(f[i * inner:(i + 1) * inner])
            else:                        # the parts concatenated at axis 0
                got = (sum(int(t.shape[0]) for t in parts),) + first[1:]
                a = array("f")
                for t in parts:
                    a.extend(floats(t))
            if got != shape or len(a) != math.prod(shape):
                raise ModelFormatError(f"vision tensor {name} has shape {got}, expected {shape}")
            return a

        def weight(names: list[str], n: int, k: int, label: str) -> mm.QWeight:
            a = array("f")
            for nm in names:
                a.extend(values(nm, (n // len(names), k)))
            return mm.upload_weight(dev, [a.tobytes()], "f32", n, k, owner=owner, label=label)

        def vector(names: list[str], n: int, label: str) -> Tensor:
            a = array("f")
            for nm in names:
                a.extend(values(nm, (n // len(names),)))
            return mm.upload_vector(dev, a.tobytes(), owner=owner, label=label)

        conv = values("patch_embed.proj.weight", (C, 3, q.temporal_patch, p, p))
        self.patch = mm.upload_weight(dev, [conv.tobytes()], "f32", C, K, owner=owner, label="v.patch")
        self.layers = []
        for i in range(cfg.n_layers):
            b = f"blocks.{i}."
            self.layers.append(dict(
                norm1=vector([b + "norm1.weight"], C, f"v{i}.n1"), norm2=vector([b + "norm2.weight"], C, f"v{i}.n2"),
                qkv=weight([b + "attn.qkv.weight"], 3 * C, C, f"v{i}.qkv"), qkv_b=vector([b + "attn.qkv.bias"], 3 * C, f"v{i}.qkvb"),
                o=weight([b + "attn.proj.weight"], C, C, f"v{i}.o"), o_b=vector([b + "attn.proj.bias"], C, f"v{i}.ob"),
                gu=weight([b + "mlp.gate_proj.weight", b + "mlp.up_proj.weight"], 2 * F, C, f"v{i}.gu"),
                gu_b=vector([b + "mlp.gate_proj.bias", b + "mlp.up_proj.bias"], 2 * F, f"v{i}.gub"),
                down=weight([b + "mlp.down_proj.weight"], C, F, f"v{i}.down"),
                down_b=vector([b + "mlp.down_proj.bias"], C, f"v{i}.downb")))
        self.ln_q = vector(["merger.ln_q.weight"], C, "v.lnq")
        self.mm0, self.mm0_b = weight(["merger.mlp.0.weight"], m2 * C, m2 * C, "v.mm0"), vector(["merger.mlp.0.bias"], m2 * C, "v.mm0b")
        self.mm2, self.mm2_b = weight(["merger.mlp.2.weight"], T, m2 * C, "v.mm2"), vector(["merger.mlp.2.bias"], T, "v.mm2b")
        # the 2D RoPE's frequencies: D/4 of them, once for the row's pairs and once for the column's
        # (1 / theta^(i / (D/2)) in f32 for i = 0, 2, ..: the power in doubles, rounded once)
        D, f32 = cfg.head_dim, pure.f32
        inv = array("f", [f32(1.0 / f32(f32(q.rope_theta) ** f32(i / (D // 2)))) for i in range(0, D // 2, 2)])
        self.freq = Tensor(dev.upload((inv + inv).tobytes(), owner=owner, label="v.freq"), (D // 2,), "f32")
        n = cfg.tokens_per_image
        N = n * m2

        def act(shape, label, dtype="f32"):
            return new_tensor(dev, shape, dtype, owner=owner, label=label)
        self.pix, self.pos = act((N, K), "v.pixels"), act((N, 3), "v.pos", "i32")
        self.x, self.h, self.ctx = act((N, C), "v.x"), act((N, C), "v.h"), act((N, C), "v.ctx")
        self.qkv, self.gu, self.ff = act((N, 3 * C), "v.qkv"), act((N, 2 * F), "v.gu"), act((N, F), "v.ff")
        self.mid, self.merged, self.out = act((n, m2 * C), "v.mid"), act((n, T), "v.merged"), act((n, T), "v.out")
        self.ops = OpCache(8)            # per grid (gh, gw)
        self._grid = None

    # ------------------------------------------------------------------ one grid's op list
    def _u32(self, values: array, label: str, shape: tuple) -> Tensor:
        return Tensor(self.dev.upload(values.tobytes() or bytes(4), owner=self.owner, label=label), shape, "u32")

    def _build(self, gh: int, gw: int) -> list:
        cfg, dev = self.cfg, self.dev
        C, H, D, eps, m2 = cfg.hidden_size, cfg.n_heads, cfg.head_dim, cfg.eps, cfg.qwen25vl.merge ** 2
        N, n = gh * gw, gh * gw // m2
        order, sizes = qwen25vl.window_order(cfg, gh, gw)
        S, W = max(sizes), len(sizes)
        # window b's rows sit at b * S ..: gather maps (row, 0) for the padded windows and back
        into, back, reverse = array("I", [NONE]) * (2 * W * S), array("I", bytes(8 * N)), array("I", bytes(8 * n))
        s0 = 0
        for b, size in enumerate(sizes):
            into[2 * b * S:2 * (b * S + size):2] = array("I", range(s0, s0 + size))
            back[2 * s0:2 * (s0 + size):2] = array("I", range(b * S, b * S + size))
            s0 += size
        for i, k in enumerate(order):    # the merged rows back in processor order
            reverse[2 * k] = i
        keep = []                        # this grid's own buffers, released with its ops
        into_t, back_t = self._u32(into, "v.into", (W * S, 2)), self._u32(back, "v.back", (N, 2))
        reverse = self._u32(reverse, "v.reverse", (n, 2))
        lengths, all_rows = self._u32(array("I", sizes), "v.lengths", (W,)), self._u32(array("I", [N]), "v.length", (1,))
        qkv_w = new_tensor(dev, (W * S, 3 * C), "f32", owner=self.owner, label="v.qkv_w")
        ctx_w = new_tensor(dev, (W * S, C), "f32", owner=self.owner, label="v.ctx_w")
        keep += [into_t, back_t, reverse, lengths, all_rows, qkv_w, ctx_w]
        x, h, ctx, qkv = (t.view((N, t.shape[1])) for t in (self.x, self.h, self.ctx, self.qkv))
        gu, ff = self.gu.view((N, self.gu.shape[1])), self.ff.view((N, self.ff.shape[1]))
        pos = self.pos.view((N, 3))
        op = mm.matmul(dev, self.pix.view((N, self.pix.shape[1])), self.patch, x)          # (N, C)
        for i, L in enumerate(self.layers):
            op += nn.rms_norm(dev, x, L["norm1"], h, eps=eps)
            op += mm.matmul(dev, h, L["qkv"], qkv, bias=L["qkv_b"])                       # (N, 3C)
            op += rope_sections(dev, qkv.view((N, 3 * H, D)), pos, self.freq, n_rot=2 * H, head_dim=D,
                                sections=(0, D // 4))
            if i in cfg.qwen25vl.full_layers:
                op += nn.attention_bidir(dev, qkv, all_rows, ctx, batch=1, seq=N, n_heads=H, head_dim=D,
                                         scale=D ** -0.5)
            else:
                op += splice_rows(dev, qkv_w, qkv, into_t)                                 # rows into windows
                op += nn.attention_bidir(dev, qkv_w, lengths, ctx_w, batch=W, seq=S, n_heads=H,
                                         head_dim=D, scale=D ** -0.5)
                op += splice_rows(dev, ctx, ctx_w, back_t)                                 # and back
            op += mm.matmul(dev, ctx, L["o"], x, bias=L["o_b"], accumulate=True)           # x += attn
            op += nn.rms_norm(dev, x, L["norm2"], h, eps=eps)
            op += mm.matmul(dev, h, L["gu"], gu, bias=L["gu_b"])                          # (N, 2F)
            op += nn.silu_mul(dev, gu, ff)
            op += mm.matmul(dev, ff, L["down"], x, bias=L["down_b"], accumulate=True)      # x += mlp
        op += nn.rms_norm(dev, x, self.ln_q, h, eps=eps)
        mid, merged, out = (t.view((n, t.shape[1])) for t in (self.mid, self.merged, self.out))
        op += mm.matmul(dev, h.view((n, m2 * C)), self.mm0, mid, bias=self.mm0_b)           # (n, 4C)
        op += nn.gelu(dev, mid, mid)
        op += mm.matmul(dev, mid, self.mm2, merged, bias=self.mm2_b)                       # (n, C_text)
        op += splice_rows(dev, out, merged, reverse)                                       # processor order
        op.buffers += [t.buf for t in keep]
        op.name = "qwen25vl_tower"
        return [op]

    def prepare(self) -> None:
        """The op list of a 448 x 448 picture's grid, built now (a load's: the pipelines every grid
        runs compile with the decoder's; a grid's own are its buffers and params)."""
        h, w = qwen25vl.smart_resize(self.cfg, 448, 448)
        grid = (h // self.cfg.patch_size, w // self.cfg.patch_size)
        self.ops.get(grid, lambda: self._build(*grid))

    # ------------------------------------------------------------------ running
    def write_patches(self, grid: "qwen25vl.Grid") -> None:
        """Write one image's patch rows (numpy's, or the page's `array`) and their 2D positions,
        permuted into window order."""
        cfg, m2 = self.cfg, self.cfg.qwen25vl.merge ** 2
        order, _ = qwen25vl.window_order(cfg, grid.gh, grid.gw)
        rows = [k * m2 + j for k in order for j in range(m2)]
        pos = qwen25vl.rope_positions(cfg, grid.gh, grid.gw)
        if isinstance(grid.rows, array):
            K = len(grid.rows) // (grid.gh * grid.gw)
            pix = b"".join(grid.rows[r * K:(r + 1) * K].tobytes() for r in rows)
        else:
            pix = grid.rows[rows].astype("float32").tobytes()
        self.dev.write(self.pix.buf, pix, self.pix.offset)
        self.dev.write(self.pos.buf, array("i", [v for r in rows for v in pos[r]]).tobytes(), self.pos.offset)
        self._grid = (grid.gh, grid.gw)

    def tokens(self) -> int:
        """The written image's tokens."""
        return self._grid[0] * self._grid[1] // self.cfg.qwen25vl.merge ** 2

    def record(self, batch, dst: Tensor, index: int):
        """Record the tower over the written image and copy its rows into `dst` at row index *
        tokens_per_image."""
        for op in self.ops.get(self._grid, lambda: self._build(*self._grid)):
            op.record(batch)
        row = 4 * self.cfg.text_hidden
        batch.copy(self.out.buf, dst.buf, self.tokens() * row, self.out.offset,
                   dst.offset + index * self.cfg.tokens_per_image * row)
        return batch

    def dispose(self) -> None:
        self.ops.release()
        self.dev.release_owner(self.owner)


# the tower's names -> llama.cpp's mmproj names (its converter splits the qkv projection and the
# Conv3d's two frames; mmproj_names joins them back: qkv rows, frames stacked)
MMPROJ_NAMES = {
    "patch_embed.proj.weight": ["v.patch_embd.weight", "v.patch_embd.weight.1"],
    "blocks.{i}.norm1.weight": ["v.blk.{i}.ln1.weight"], "blocks.{i}.norm2.weight": ["v.blk.{i}.ln2.weight"],
    "blocks.{i}.attn.qkv.weight": ["v.blk.{i}.attn_q.weight", "v.blk.{i}.attn_k.weight", "v.blk.{i}.attn_v.weight"],
    "blocks.{i}.attn.qkv.bias": ["v.blk.{i}.attn_q.bias", "v.blk.{i}.attn_k.bias", "v.blk.{i}.attn_v.bias"],
    "blocks.{i}.attn.proj.weight": ["v.blk.{i}.attn_out.weight"], "blocks.{i}.attn.proj.bias": ["v.blk.{i}.attn_out.bias"],
    "blocks.{i}.mlp.gate_proj.weight": ["v.blk.{i}.ffn_gate.weight"], "blocks.{i}.mlp.gate_proj.bias": ["v.blk.{i}.ffn_gate.bias"],
    "blocks.{i}.mlp.up_proj.weight": ["v.blk.{i}.ffn_up.weight"], "blocks.{i}.mlp.up_proj.bias": ["v.blk.{i}.ffn_up.bias"],
    "blocks.{i}.mlp.down_proj.weight": ["v.blk.{i}.ffn_down.weight"], "blocks.{i}.mlp.down_proj.bias": ["v.blk.{i}.ffn_down.bias"],
    "merger.ln_q.weight": ["v.post_ln.weight"],
    "merger.mlp.0.weight": ["mm.0.weight"], "merger.mlp.0.bias": ["mm.0.bias"],
    "merger.mlp.2.weight": ["mm.2.weight"], "merger.mlp.2.bias": ["mm.2.bias"],
}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def mmproj_names(name: str) -> list[str]:
    """The mmproj tensors that hold the tower's tensor `name`."""
    m = _BLOCK.match(name)
    if m is None:
        return MMPROJ_NAMES.get(name, [name])
    return [n.replace("{i}", m.group(1)) for n in MMPROJ_NAMES.get("blocks.{i}." + m.group(2), [name])]


def tower_bytes(cfg: VisionConfig, tensors: dict) -> tuple[int, int]:
    """(weights, activations) the tower allocates: its tensors in f32 (a folder's visual.*, an mmproj's
    all), the buffers for the largest image and the padded windows of one grid (at most twice its rows)."""
    import math
    mmproj = "v.patch_embd.weight" in tensors
    weights = sum(4 * math.prod(t.shape) for n, t in tensors.items() if mmproj or _PREFIX.match(n))
    q, C, F, T = cfg.qwen25vl, cfg.hidden_size, cfg.intermediate_size, cfg.text_hidden
    n = cfg.tokens_per_image
    N, K = n * q.merge ** 2, 3 * q.temporal_patch * cfg.patch_size ** 2
    acts = 4 * (N * (K + 3 + 3 * C + 3 * C + 3 * F) + n * (q.merge ** 2 * C + 2 * T) + 2 * N * 4 * C)
    return weights, acts
