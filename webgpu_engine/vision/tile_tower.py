"""What an image side that runs its tower tile by tile shares (LLaVA-NeXT's tiles, llava_gpu.py;
Phi-3.5-vision's crops, phi3v_gpu.py): the picture's tiles' patch rows staged in one buffer, each
tile through the SigLIP/CLIP tower with its output rows copied into a table, an op list per count of
image rows (built once and kept), and the picture's rows copied into the decoder's features buffer.
Standard library only at module level (the page imports the vision package).
"""
from __future__ import annotations


class TileTower:
    """A base for towers run tile by tile. The subclass sets dev, cfg, siglip (models/siglip.py), pix
    (the tiles' patch rows), table, out (the picture's rows in the text width) and _ops = {}."""

    dev: object
    cfg: object
    siglip: object
    pix: object
    table: object
    out: object
    _ops: dict

    def _op(self, M: int, build):
        """The op list over M image rows: build(M) once, then kept."""
        op = self._ops.get(M)
        if op is None:
            op = self._ops[M] = build(M)
        return op

    def _tiles_into_table(self, batch, K: int, n: int, src, width: int) -> None:
        """K tiles of n patch rows each through the tower; its rows `src` (n, width) into the table."""
        s, row = self.siglip, 3 * self.cfg.patch_size ** 2 * 4
        for k in range(K):
            batch.copy(self.pix.buf, s.pix.buf, n * row, self.pix.offset + k * n * row, s.pix.offset)
            s.ops.record(batch)
            batch.copy(src.buf, self.table.buf, n * width * 4, src.offset, self.table.offset + k * n * width * 4)

    def _rows_out(self, batch, dst, index: int, M: int):
        """The picture's M rows of `out` into `dst` from row index * tokens_per_image."""
        T = self.cfg.text_hidden
        batch.copy(self.out.buf, dst.buf, M * T * 4, self.out.offset, dst.offset + index * self.cfg.tokens_per_image * T * 4)
        return batch

    def dispose(self) -> None:
        for op in self._ops.values():
            op.release()
        self.siglip.dispose()
