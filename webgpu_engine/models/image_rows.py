"""Where a decoder's forward finds its images (models/decoder.py, PREFILL rows only): the image
features of the current request (f32, the text model's width) and, per forward row, the feature row
it takes and the end of its image's keys (kernels/vision.py's `rows`). The pipeline stages a chunk's
rows before recording it (`pending`); every PREFILL forward writes its rows, text rows as none.
With M-RoPE (Qwen2.5-VL, models/family_qwen25vl.py) it also stages each row's rotation before RoPE:
its 3-axis position minus its cache row (`pending_offsets`; a text-only prompt's are zero)."""
from __future__ import annotations

import struct

from ..kernels import vision
from ..kernels.common import Op, Tensor, new_tensor
from ..kernels.rope import rope_sections


class ImageRows:
    def __init__(self, dev, *, rows: int, features: int, width: int, owner: str, bidirectional: bool = True):
        self.dev, self.cap, self.bidirectional = dev, rows, bidirectional
        self.rows = new_tensor(dev, (rows, 2), "u32", owner=owner, label="image_rows")          # (P, 2)
        self.feats = new_tensor(dev, (features, width), "f32", owner=owner, label="image_feats")  # (N, C)
        self.pending: list[tuple[int, int]] | None = None
        self.offsets: Tensor | None = None       # (P, 3) i32, with M-RoPE (enable_offsets)
        self.pending_offsets: list[tuple[int, int, int]] | None = None

    def enable_offsets(self, m, owner: str) -> None:
        """M-RoPE: each PREFILL row rotated by its (t, h, w) offsets before RoPE (`rotate`)."""
        from ..kernels.rope import rope_frequencies
        c = m.cfg
        self.offsets = new_tensor(self.dev, (self.cap, 3), "i32", owner=owner, label="image_offsets")
        # the same frequencies as the layer's RoPE, so the two rotations add up to the position's
        self.freq = Tensor(rope_frequencies(self.dev, c.head_dim, c.rope_base, owner=owner), (c.head_dim // 2,), "f32")
        t, h, _ = c.extra["mrope_section"]
        self.sections = (t, t + h)

    def write(self, T: int) -> None:
        """Write the rows of a forward of T rows: the staged ones, else none (text)."""
        rows = self.pending or [(vision.NONE, 0)] * T
        self.pending = None
        rows = (rows + [(vision.NONE, 0)] * T)[:T]
        self.dev.write(self.rows.buf, struct.pack(f"<{2 * T}I", *(v for r in rows for v in r)))
        if self.offsets is not None:
            offs = ((self.pending_offsets or []) + [(0, 0, 0)] * T)[:T]
            self.pending_offsets = None
            self.dev.write(self.offsets.buf, struct.pack(f"<{3 * T}i", *(v for r in offs for v in r)))

    def rotate(self, m, i: int, qkv: Tensor, T: int) -> list[Op]:
        """M-RoPE: the q and k heads of each row rotated by its staged offsets (none without them)."""
        if self.offsets is None:
            return []
        c = m.cfg
        return [rope_sections(m.dev, qkv, self.offsets.view((T, 3)), self.freq, n_rot=c.n_heads + c.n_kv_heads,
                              head_dim=c.head_dim_of(i), sections=self.sections)]

    def splice(self, m, x: Tensor, T: int) -> Op:
        """x[t] = the image feature of row t, where it holds an image token (after the embedding's scale)."""
        return vision.splice_rows(m.dev, x, self.feats, self.rows.view((T, 2)))

    def attention(self, m, i: int, qkv: Tensor, attn: Tensor, T: int, spec) -> list[Op]:
        """Layer i's attention of the image rows over their whole image (contiguous caches), where an
        image's rows attend each other both ways (Gemma 3; Idefics3's stay causal: no op)."""
        if not self.bidirectional:
            return []
        return [vision.attn_image_rows(m.dev, qkv, m.k_cache[i], m.v_cache[i], attn, m.step, self.rows.view((T, 2)),
                                       **spec.heads(), ctx=m.ctx, scale=spec.scale, window=spec.window)]
