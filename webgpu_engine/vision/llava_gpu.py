"""LLaVA-NeXT's image embedding on the GPU (vision/llava.py says what it computes): models/siglip.py's
CLIP tower and LLaVA projector over each tile (its patches copied in from one buffer holding every
tile's, its projected rows copied out into a table whose last row is the learned image_newline), then
the image's rows as a gather of the table's rows (splice_rows with every row given: out[t] =
table[idx[t]]: the global tile's patches, the kept patch grid's rows each ended by the newline),
copied into the decoder's features buffer.

Op lists of the gather are built per count of image rows and kept.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import replace

from ..errors import ModelFormatError
from .config import VisionConfig
from .llava import NEWLINE, Tiles
from .tile_tower import TileTower

NEWLINE_NAMES = ("image_newline", "model.image_newline", "v.image_newline")


def buffer_bytes(cfg: VisionConfig) -> int:
    """The bytes of LlavaNextTower's own buffers (besides its SigLIP tower's): the largest pinpoint's
    tiles' patch rows, the table of their projected rows and image_newline, the layout."""
    S, N, T = cfg.image_size, cfg.patches_per_side ** 2, cfg.text_hidden
    K = 1 + max(h // S * (w // S) for h, w in cfg.pinpoints)
    return 4 * (K * N * (3 * cfg.patch_size ** 2 + T) + T + 2 * cfg.tokens_per_image)


class LlavaNextTower(TileTower):
    """The interface VisionInputs runs (vision/runner.py): write_patches(tiles), then
    record(batch, dst, index) writes the image's rows at row index * tokens_per_image of `dst`."""

    def __init__(self, dev, cfg: VisionConfig, tensors: dict, *, owner: str):
        from ..kernels.common import new_tensor
        from ..models.siglip import SiglipTower
        self.dev, self.cfg, self.owner = dev, cfg, owner
        P, T = cfg.patches_per_side, cfg.text_hidden
        self.n = P * P                   # a tile's rows
        self.siglip = SiglipTower(dev, replace(cfg, tokens_per_image=self.n, pinpoints=()), tensors, owner=owner)
        S = cfg.image_size
        self.max_tiles = 1 + max(h // S * (w // S) for h, w in cfg.pinpoints)          # buffer_bytes' K
        t = next((tensors[n] for n in NEWLINE_NAMES if n in tensors), None)
        if t is None or math.prod(t.shape) != T:
            raise ModelFormatError(f"LLaVA-NeXT's image_newline of {T} values is missing or of shape "
                                   f"{None if t is None else tuple(t.shape)}")
        self.newline = self.max_tiles * self.n
        self.table = new_tensor(dev, (self.newline + 1, T), "f32", owner=owner, label="v.table")
        dev.write(self.table.buf, self.siglip._array(t).tobytes(), self.table.offset + self.newline * T * 4)
        M = cfg.tokens_per_image
        self.pix = new_tensor(dev, (self.max_tiles * self.n, 3 * cfg.patch_size ** 2), "f32", owner=owner, label="v.tiles")
        self.idx = new_tensor(dev, (M, 2), "u32", owner=owner, label="v.layout")
        self.out = new_tensor(dev, (M, T), "f32", owner=owner, label="v.rows")
        self._ops: dict[int, object] = {}
        self._tiles: Tiles | None = None

    def _gather(self, M: int):
        """The gather of M image rows from the table (built once per M)."""
        def build(M: int):
            from ..kernels import vision
            op = vision.splice_rows(self.dev, self.out.view((M, self.cfg.text_hidden)), self.table,
                                    self.idx.view((M, 2)))
            op.name = "llava_next_rows"
            return op
        return self._op(M, build)

    def prepare(self) -> None:
        """The op lists a picture runs, built now (a load's: their pipelines compile with the decoder's):
        the gather of the most rows (the tiles' tower is built with SiglipTower)."""
        self._gather(self.cfg.tokens_per_image)

    def write_patches(self, tiles: Tiles) -> None:
        """One picture's tiles' patch rows (vision/llava.py `patches`: numpy's, or the page's `array`)
        and its layout (the newline rows at the table's last)."""
        rows = tiles.pixels
        K = len(rows) // (self.n * (1 if hasattr(rows, "shape") else 3 * self.cfg.patch_size ** 2))
        if K > self.max_tiles or len(tiles.layout) > self.cfg.tokens_per_image:
            raise ModelFormatError(f"{K} tiles of {len(tiles.layout)} rows; at most {self.max_tiles} of "
                                   f"{self.cfg.tokens_per_image}")
        self.dev.write(self.pix.buf, rows.tobytes() if isinstance(rows, array) else rows.astype("float32").tobytes(),
                       self.pix.offset)
        idx = array("I", bytes(8 * len(tiles.layout)))               # (M, 2): each row's table row, 0
        idx[0::2] = array("I", (self.newline if r == NEWLINE else r for r in tiles.layout))
        self.dev.write(self.idx.buf, idx.tobytes(), self.idx.offset)
        self._tiles, self._k = tiles, K

    def record(self, batch, dst, index: int):
        """The tower and projector over each tile (its rows into the table), the gather; the picture's
        rows into `dst` from row index * tokens_per_image."""
        tiles = self._tiles
        self._tiles_into_table(batch, self._k, self.n, self.siglip.out, self.cfg.text_hidden)
        M = len(tiles.layout)
        self._gather(M).record(batch)
        return self._rows_out(batch, dst, index, M)
