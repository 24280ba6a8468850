"""Phi-3.5-vision's image embedding on the GPU (vision/phi3v.py says what it computes): the CLIP
tower of models/siglip.py over each crop (its patches copied in from one buffer holding every crop's,
its features copied out into a table), the HD layout as a gather of the table's rows (splice_rows
with every row given: out[t] = table[idx[t]]; the separators glb_GN / sub_GN are the table's last
8 rows), the projector's linear-GELU-linear (MLC quantises it with the text model; the tower stays
in the model's float dtype), the rows copied into the decoder's features buffer.

Op lists are built per count of image rows (a picture's crop grid) and kept.
"""
from __future__ import annotations

import math
from array import array

from ..errors import ModelFormatError
from .config import VisionConfig
from .phi3v import TOWER_PREFIX, VISION_PREFIX, Crops, layout, token_count
from .tile_tower import TileTower

PROJ = VISION_PREFIX + "img_projection."


class Phi3vTower(TileTower):
    """The interface VisionInputs runs (vision/runner.py): write_patches(crops), then
    record(batch, dst, index) writes the image's rows at row index * tokens_per_image of `dst`."""

    def __init__(self, dev, cfg: VisionConfig, art, *, owner: str):
        from ..kernels import matmul as mm
        from ..kernels.common import new_tensor
        from ..models.siglip import SiglipTower
        self.dev, self.cfg, self.owner = dev, cfg, owner
        t = art.tensors
        tower = {"vision_model." + n[len(TOWER_PREFIX):]: x for n, x in t.items() if n.startswith(TOWER_PREFIX)}
        self.siglip = SiglipTower(dev, cfg, tower, owner=owner)
        C, T, P = cfg.hidden_size, cfg.text_hidden, cfg.patches_per_side
        self.N = P * P
        self.max_crops = 1 + 16

        def weight(name: str, n: int, k: int):
            parts = {p: t[f"{PROJ}{name}.{p}"] for p in ("q_weight", "q_scale", "weight") if f"{PROJ}{name}.{p}" in t}
            w = art._q4_pair(name, parts) if "q_weight" in parts else parts.get("weight")
            if w is None:
                raise ModelFormatError(f"{art.cache_path}: the artifact lacks {PROJ}{name}")
            if "q_weight" not in parts and tuple(w.shape) != (n, k):
                raise ModelFormatError(f"{PROJ}{name} has shape {tuple(w.shape)}, expected {(n, k)}")
            return mm.upload_weight(dev, [w.data], w.qtype, n, k, owner=owner, label="v." + name)

        def values(name: str, n: int) -> array:
            x = t.get(name)
            if x is None or math.prod(x.shape) != n:
                raise ModelFormatError(f"{art.cache_path}: {name} of {n} values is missing or of shape "
                                       f"{None if x is None else tuple(x.shape)}")
            return self.siglip._array(x)

        self.mm1, self.mm2 = weight("linear_1", T, 4 * C), weight("linear_2", T, T)
        self.mm1_b = mm.upload_vector(dev, values(PROJ + "linear_1.bias", T).tobytes(), owner=owner, label="v.mm1b")
        self.mm2_b = mm.upload_vector(dev, values(PROJ + "linear_2.bias", T).tobytes(), owner=owner, label="v.mm2b")
        seps = values(VISION_PREFIX + "sub_GN", 4 * C) + values(VISION_PREFIX + "glb_GN", 4 * C)
        self.table_rows = self.max_crops * self.N + 8
        self.table = new_tensor(dev, (self.table_rows, C), "f32", owner=owner, label="v.table")
        dev.write(self.table.buf, seps.tobytes(), self.table.offset + self.max_crops * self.N * C * 4)
        M = cfg.tokens_per_image
        self.pix = new_tensor(dev, (self.max_crops * self.N, 3 * cfg.patch_size ** 2), "f32", owner=owner, label="v.crops")
        self.idx = new_tensor(dev, (4 * M, 2), "u32", owner=owner, label="v.layout")
        self.merged = new_tensor(dev, (4 * M, C), "f32", owner=owner, label="v.merged")
        self.mid = new_tensor(dev, (M, T), "f32", owner=owner, label="v.mid")
        self.out = new_tensor(dev, (M, T), "f32", owner=owner, label="v.out")
        self._ops: dict[int, object] = {}
        self._crops: Crops | None = None

    def _projector(self, M: int):
        """The gather and the projector over M rows (built once per M)."""
        def build(M: int):
            from ..kernels import matmul as mm
            from ..kernels import vision
            from ..kernels.elementwise import gelu
            C, T = self.cfg.hidden_size, self.cfg.text_hidden
            merged = self.merged.view((4 * M, C))
            op = vision.splice_rows(self.dev, merged, self.table, self.idx.view((4 * M, 2)))
            op += mm.matmul(self.dev, self.merged.view((M, 4 * C)), self.mm1, self.mid.view((M, T)), bias=self.mm1_b)
            op += gelu(self.dev, self.mid.view((M, T)), self.mid.view((M, T)))
            op += mm.matmul(self.dev, self.mid.view((M, T)), self.mm2, self.out.view((M, T)), bias=self.mm2_b)
            op.name = "phi3v_projector"
            return op
        return self._op(M, build)

    def prepare(self) -> None:
        """The op lists a picture runs, built now (a load's: their pipelines compile with the decoder's):
        the projector's over the most rows (the crops' tower is built with SiglipTower)."""
        self._projector(self.cfg.tokens_per_image)

    def write_patches(self, crops: Crops) -> None:
        """One picture's crops' patches (vision/phi3v.py `patches`: numpy's, or the page's `array`) and
        its layout's rows."""
        rows = crops.pixels
        K = len(rows) // (self.N * (1 if hasattr(rows, "shape") else 3 * self.cfg.patch_size ** 2))
        if K > self.max_crops:
            raise ModelFormatError(f"{K} crops; at most {self.max_crops}")
        self.dev.write(self.pix.buf, rows.tobytes() if isinstance(rows, array) else rows.astype("float32").tobytes(),
                       self.pix.offset)
        idx = layout(self.cfg, crops.rows, crops.cols, self.table_rows)
        pairs = array("I", bytes(8 * len(idx)))                         # (4M, 2): each quarter's table row, 0
        pairs[0::2] = idx
        self.dev.write(self.idx.buf, pairs.tobytes(), self.idx.offset)
        self._crops, self._k = crops, K

    def record(self, batch, dst, index: int):
        """The tower over each crop (its features into the table), the layout and the projector;
        the picture's rows into `dst` from row index * tokens_per_image."""
        crops = self._crops
        self._tiles_into_table(batch, self._k, self.N, self.siglip.x, self.cfg.hidden_size)
        M = token_count(self.cfg, crops.rows, crops.cols)
        self._projector(M).record(batch)
        return self._rows_out(batch, dst, index, M)

