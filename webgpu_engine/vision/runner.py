"""A loaded vision-language model's image side, as its chat pipeline's scheduler uses it
(pipelines/llm.py, pipelines/scheduler.py):

- `template(t)`: the chat template whose rendered image markers become each image's full sequence (as
  the family's processor expands the text before tokenising it: Gemma 3's `<start_of_image>`,
  Idefics3's `<image>`, whose sequence depends on the picture's tiles);
- `batch_tiles(ids, images)`: pairs each tile of each image with its run of image tokens and
  preprocesses it; `root(tiles)`: what a sequence's KV blocks are keyed under besides its tokens (the
  images' SHA-256: image tokens are one id whatever the picture), so prefix reuse needs the same images;
- `chunk_end(tiles, start, end)`: prefill chunks that never cut an image whose rows attend each other;
- `stage_chunk(tiles, start, end)`: the tower over the chunk's tiles and its rows staged; a tile whose
  rows go on past the chunk has its features kept (`KEPT` tiles, least recently used first out) and
  copied into the features buffer for its later chunks, so its tower runs once per request.
"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from ..errors import InvalidRequestError, ModelFormatError, UnsupportedChatOptionError, UnsupportedModelError
from ..gpu import IN_BROWSER
from ..kernels.vision import NONE
from ..loaders.chat_template import ChatTemplate
from . import gemma3, idefics3, llava, phi3v, qwen25vl
from .config import FAMILIES, VisionConfig
from .config import patches as square_patches
from .requests import images_of

MAX_TILES = 64                           # tiles (Gemma 3: images) of one request, at most
FEATURE_BYTES = 64 << 20                 # and at most this many bytes of their features
KEPT = 2                                 # tiles whose features wait for their next prefill chunk


FAMILY_MODULES = {"gemma3": gemma3, "idefics3": idefics3, "llava": llava, "phi3v": phi3v, "qwen25vl": qwen25vl}    # VisionConfig.kind -> its host side


def read_vision_config(folder) -> VisionConfig | None:
    """The image side of a vision-language folder; None for a text-only folder."""
    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    v = c.get("vision_config")
    if not isinstance(v, dict):
        return None
    archs = c.get("architectures") or []
    kind = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if kind is None:
        raise UnsupportedModelError(f"{folder}: images run for {sorted(FAMILIES)}, not {archs}")
    return FAMILY_MODULES[kind].read_config(folder, c, v)


def _family(cfg: VisionConfig):
    return FAMILY_MODULES[cfg.kind]


def takes_images(path) -> bool:
    """Whether the model at `path` is a folder with a vision tower (config.json's vision_config)."""
    import json
    f = Path(path) / "config.json"
    try:
        return f.is_file() and isinstance(json.loads(f.read_text(encoding="utf-8")).get("vision_config"), dict)
    except (OSError, ValueError):
        return False


def _own_tower(path: Path, mmproj):
    """`mmproj`, or a model GGUF itself where it holds its vision tower (Ollama's one-GGUF layout,
    vision/mmproj.py) and no projector GGUF is given."""
    if mmproj is None and path.is_file():
        from .mmproj import holds_tower
        return path if holds_tower(path) else None
    return mmproj


def capacity(cfg: VisionConfig, ctx: int) -> int:
    """Tiles one request may bring to a load of `ctx` positions: at least one picture's most, at
    most MAX_TILES and FEATURE_BYTES of features."""
    n = cfg.tokens_per_image
    return max(_family(cfg).max_tiles(cfg), min(MAX_TILES, ctx // (n + 6), FEATURE_BYTES // (n * cfg.text_hidden * 4)))


def memory(path, est, ctx: int, mmproj=None, chunk: int = 0):
    """`est` (a decoder's MemoryEstimate) with the vision tower of the folder at `path` (or of the
    projector GGUF `mmproj`) added: its weights as uploaded (the position table and Gemma 3's
    projection in f32) and its activations for one tile plus the features buffers a load of `ctx`
    positions allocates (those of KEPT tiles cut by a chunk's edge included; Qwen2.5-VL's largest
    image is MAX_TOKENS' whatever the prefill `chunk`); `est` as it is for a text-only model."""
    from dataclasses import replace
    if mmproj is None and (Path(path) / "mlc-chat-config.json").is_file():
        return _mlc_memory(Path(path), est, ctx)
    mmproj = _own_tower(Path(path), mmproj)
    if mmproj is None and not takes_images(path):
        return est
    from ..loaders.safetensors import SafetensorsFolder
    from ..loaders.tensor_info import tensor_nbytes
    from ..models.siglip import vision_tensors
    if mmproj is not None:
        from .mmproj import MmprojFile
        files = MmprojFile(mmproj, None)
        cfg = files.cfg
    else:
        cfg, files = read_vision_config(path), SafetensorsFolder(path)
    try:
        if cfg.kind == "qwen25vl":
            from .qwen25vl_gpu import tower_bytes
            cfg = qwen25vl.fit_chunk(cfg, qwen25vl.MAX_TOKENS)
            weights, acts = tower_bytes(cfg, files.tensors)
            feats = 4 * (capacity(cfg, ctx) + KEPT) * cfg.tokens_per_image * cfg.text_hidden
            return replace(est, weights=est.weights + weights, activations=est.activations + acts + feats)
        shapes = {n: (t.qtype, tuple(t.shape)) for n, t in vision_tensors(files.tensors).items()}
    finally:
        files.close()
    f32 = {"embeddings.position_embedding.weight", "mm_input_projection_weight"}
    weights = sum(tensor_nbytes("f32" if n in f32 else q, s) for n, (q, s) in shapes.items())
    C, F, N, n = cfg.hidden_size, cfg.intermediate_size, cfg.patches_per_side ** 2, cfg.tokens_per_image
    acts = 4 * (N * (3 * cfg.patch_size ** 2 + 3 * C + 3 * C + F) + n * (2 * C * cfg.scale ** 2 + cfg.text_hidden))
    if cfg.pinpoints:                    # LLaVA-NeXT's tiles and their rows' table (vision/llava_gpu.py)
        from .llava_gpu import buffer_bytes
        acts += buffer_bytes(cfg)
    feats = 4 * (capacity(cfg, ctx) + KEPT) * n * cfg.text_hidden
    return replace(est, weights=est.weights + weights, activations=est.activations + acts + feats)


def _mlc_memory(path: Path, est, ctx: int):
    """`est` with Phi-3.5-vision's image side (an MLC phi3_v artifact's vision_embed_tokens.*, its
    activations and features: vision/phi3v_gpu.py's buffers) added; `est` for a text artifact."""
    from dataclasses import replace

    from ..loaders.mlc import MLCArtifact
    art = MLCArtifact(path)
    try:
        if art.model_type != phi3v.MODEL_TYPE:
            return est
        cfg = phi3v.read_config(str(path), art.chat_config.get("model_config") or {}, None)
        weights = sum(t.data.nbytes for n, t in art.tensors.items() if n.startswith(phi3v.VISION_PREFIX))
    finally:
        art.close()
    C, F, T, M = cfg.hidden_size, cfg.intermediate_size, cfg.text_hidden, cfg.tokens_per_image
    N, K = cfg.patches_per_side ** 2 + 1, phi3v.HD_NUM + 1
    acts = 4 * (N * (3 * cfg.patch_size ** 2 + 7 * C + F) + K * N * (3 * cfg.patch_size ** 2 + C)
                + M * (4 * C + 2 + 2 * T) + 4 * M * C)
    feats = 4 * (capacity(cfg, ctx) + KEPT) * M * T
    return replace(est, weights=est.weights + weights + 4 * N * C, activations=est.activations + acts + feats)


def build_tower(dev, cfg: VisionConfig, files, owner: str):
    """The family's GPU tower from `files` (a folder's safetensors, an mmproj, an MLC artifact), its
    op lists built now (prepare: within a load that compiles at load, their pipelines compile with
    the decoder's, so a first picture compiles nothing)."""
    from ..models.siglip import SiglipTower
    if cfg.kind == "phi3v":
        from .phi3v_gpu import Phi3vTower
        tower = Phi3vTower(dev, cfg, files, owner=owner)
    elif cfg.pinpoints:                  # LLaVA-NeXT: its tiles' rows gathered with image_newline rows
        from .llava_gpu import LlavaNextTower
        tower = LlavaNextTower(dev, cfg, files.tensors, owner=owner)
    elif cfg.kind == "qwen25vl":
        from .qwen25vl_gpu import Qwen25VLTower
        tower = Qwen25VLTower(dev, cfg, files.tensors, owner=owner)
    else:                                # built whole at construction
        return SiglipTower(dev, cfg, files.tensors, owner=owner)
    tower.prepare()
    return tower


class _ExpandingTemplate(ChatTemplate):
    """A chat template whose rendered image markers become each image's full sequence, in order."""

    def __init__(self, inner: ChatTemplate, cfg: VisionConfig):
        self.__dict__.update(inner.__dict__)
        self._cfg = cfg

    def render(self, messages, **kwargs) -> str:
        images = iter(images_of(messages))
        expand = _family(self._cfg).full_image_sequence

        def sub(m):
            im = next(images, None)
            return expand(self._cfg, im.image) if im is not None else m.group()
        return re.sub(re.escape(self._cfg.marker), sub, super().render(messages, **kwargs))


class VisionInputs:
    def __init__(self, dev, cfg: VisionConfig, tower, model, max_tiles: int):
        self.dev, self.cfg, self.tower, self.model = dev, cfg, tower, model
        self.max_tiles = max_tiles
        self.max_images = max_tiles // _family(cfg).max_tiles(cfg)
        self.conv: dict | None = None        # an MLC artifact's conv_template (Phi-3.5-vision's prompt)
        self.kept: dict = {}                 # (sha256, tile) -> slot of `kept_feats`, oldest use first
        self.kept_feats = None               # (KEPT * tokens_per_image, text width) f32: tiles cut by a chunk
        self.tower_runs = 0                  # tiles through the tower so far

    @classmethod
    def load(cls, dev, path, model, owner: str, mmproj=None, tokenizer=None) -> "VisionInputs | None":
        """The image side of the model at `path` (an HF folder with a vision tower, or a GGUF with the
        projector GGUF `mmproj` beside it: vision/mmproj.py, its image token from `tokenizer`), else None."""
        path = Path(path)
        if (path / "mlc-chat-config.json").is_file():
            return cls._load_mlc(dev, path, model, owner, tokenizer)
        mmproj = _own_tower(path, mmproj)
        if mmproj is not None:
            from .mmproj import MmprojFile
            files = MmprojFile(mmproj, tokenizer)
            cfg = files.cfg
            if cfg.text_hidden != model.cfg.hidden_size:
                files.close()
                raise ModelFormatError(f"{mmproj}: the projector gives rows of {cfg.text_hidden}, the text "
                                       f"model's width is {model.cfg.hidden_size}: they do not belong together")
        elif not path.is_dir() or not (path / "config.json").is_file():
            return None
        else:
            cfg, files = read_vision_config(path), None
            if cfg is None:
                return None
        try:
            return cls._load(dev, path, model, owner, cfg, files)
        finally:
            if files is not None:
                files.close()

    @classmethod
    def _load_mlc(cls, dev, path: Path, model, owner: str, tokenizer) -> "VisionInputs | None":
        """An MLC artifact's image side: Phi-3.5-vision's (model_type phi3_v, vision/phi3v.py)."""
        from ..loaders.mlc import MLCArtifact
        art = MLCArtifact(path)
        try:
            if art.model_type != phi3v.MODEL_TYPE:
                return None
            cfg = phi3v.read_config(str(path), art.chat_config.get("model_config") or {}, tokenizer)
            vision = cls._load(dev, path, model, owner, cfg, art)
            vision.conv = art.chat_config.get("conv_template")
            return vision
        finally:
            art.close()

    @classmethod
    def _load(cls, dev, path, model, owner: str, cfg: VisionConfig, files) -> "VisionInputs":
        if cfg.kind == "qwen25vl":           # images scaled down to at most MAX_TOKENS
            cfg = qwen25vl.fit_chunk(cfg, qwen25vl.MAX_TOKENS)
        # causal image rows may span prefill chunks (Phi-3.5-vision's and LLaVA-NeXT's largest pictures'
        # 2653 and 2928 rows, WebLLM's chunks of 2048): stage_chunk runs the tower once and keeps the
        # features for the next chunks; Gemma 3's rows attend each other both ways, in one chunk
        if cfg.tokens_per_image > model.chunk and cfg.bidirectional:
            raise UnsupportedChatOptionError(
                "prefill_chunk_size", model.chunk, f"an image's {cfg.tokens_per_image} tokens run in one "
                f"prefill chunk: load with prefill_chunk_size >= {cfg.tokens_per_image}")
        from ..loaders.safetensors import SafetensorsFolder
        opened = files is None               # a folder's safetensors, opened only for the tower
        files = SafetensorsFolder(path) if opened else files
        try:
            tower = build_tower(dev, cfg, files, owner)
        finally:
            if opened:
                files.close()
        n = capacity(cfg, model.ctx)
        model.enable_images(n * cfg.tokens_per_image, cfg.text_hidden, bidirectional=cfg.bidirectional)
        if cfg.kind == "qwen25vl":          # M-RoPE's rotations of the prompt rows (models/image_rows.py)
            model.images.enable_offsets(model, owner)
        vision = cls(dev, cfg, tower, model, n)
        if not cfg.bidirectional:            # a causal image's rows may span chunks (chunk_end)
            from ..kernels.common import new_tensor
            vision.kept_feats = new_tensor(dev, (KEPT * cfg.tokens_per_image, cfg.text_hidden), "f32",
                                           owner=owner, label="image_feats_kept")
        return vision

    def template(self, template):
        if self.cfg.kind == "phi3v":
            return phi3v.template(template, self.cfg, self.conv)
        if template is None or not isinstance(template, ChatTemplate):
            return template
        return _ExpandingTemplate(template, self.cfg)

    # ------------------------------------------------------------------ a request
    def blocks(self, ids: list[int]) -> list[tuple[int, int]]:
        """(start, end) positions of each run of image tokens in ids."""
        tok, out, start = self.cfg.image_token_id, [], None
        for p, t in enumerate(ids):
            if t == tok and start is None:
                start = p
            elif t != tok and start is not None:
                out.append((start, p))
                start = None
        if start is not None:
            out.append((start, len(ids)))
        return out

    def pair(self, ids: list[int], images: list) -> list:
        """(start, end, sha256, image, tile) of each tile of each image of a request, paired with its
        run of image tokens in `ids` (each image part placed once, whole, or a 400)."""
        blocks = self.blocks(ids)
        n, count = self.cfg.tokens_per_image, _family(self.cfg).n_tiles
        size = getattr(_family(self.cfg), "n_tokens", lambda cfg, image: n)     # a tile's tokens
        owners = [(im, j) for im in images for j in range(count(self.cfg, im.image))]
        sizes = [size(self.cfg, im.image) for im, _ in owners]
        if len(owners) > self.max_tiles:
            raise InvalidRequestError(f"The images make {len(owners)} tiles of {n} tokens; this model takes "
                                      f"{self.max_tiles} per request.", param="messages")
        if len(blocks) != len(owners) or [e - s for s, e in blocks] != sizes:
            raise InvalidRequestError(f"The prompt holds {len(blocks)} runs of image tokens "
                                      f"{[e - s for s, e in blocks]} for {len(owners)} tiles of {sizes} tokens: "
                                      f"the chat template must place each image part once (and the text may "
                                      f"not carry image tokens itself).", param="messages")
        return [(s, e, im.sha256, im, j) for (s, e), (im, j) in zip(blocks, owners)]

    def _patches(self, todo: list) -> list:
        """The patch rows of each (.., image, tile) of `todo`, each image cut into tiles once."""
        cfg, fam, cut = self.cfg, _family(self.cfg), {}
        for *_, im, _ in todo:
            if id(im) not in cut:
                cut[id(im)] = fam.tiles(cfg, im.image)
        unfold = getattr(fam, "patches", square_patches)
        return [unfold(cfg, cut[id(im)][j]) for *_, im, j in todo]

    async def _run_tower(self, runs: list, end: int | None = None) -> dict:
        """The features of each (start, end, sha256, patch rows, tile) of `runs` submitted into the k-th
        slot of the features buffer: the tower's, or those kept from an earlier chunk of the tile; a tile
        whose rows go on past `end` keeps them (each batch's pipelines that are not compiled yet compile
        off the event loop first: Device.ready). {position: (feature row, the run's end)}."""
        n, rows, feats = self.cfg.tokens_per_image, {}, self.model.images.feats
        width = 4 * self.cfg.text_hidden
        for k, (s, e, h, r, t) in enumerate(runs):
            at, size, key = feats.offset + k * n * width, (e - s) * width, (h, t)
            slot = self.kept.pop(key, None)
            if slot is not None:             # cut by an earlier chunk: its kept features
                batch = self.dev.batch().copy(self.kept_feats.buf, feats.buf, size,
                                              self.kept_feats.offset + slot * n * width, at)
            else:
                self.tower.write_patches(r)
                batch = self.tower.record(self.dev.batch(), feats, k)
                self.tower_runs += 1
            if end is not None and e > end and self.kept_feats is not None:   # its rows go on: kept
                if slot is None:
                    slot = self._slot()
                    batch.copy(feats.buf, self.kept_feats.buf, size, at, self.kept_feats.offset + slot * n * width)
                self.kept[key] = slot        # most recently used last
            await self.dev.ready(batch)
            self.dev.submit(batch)
            for j in range(e - s):
                rows[s + j] = (k * n + j, e)
        return rows

    def _slot(self) -> int:
        """A free slot of `kept_feats`, the least recently used tile's where all are taken."""
        free = set(range(KEPT)) - set(self.kept.values())
        if free:
            return min(free)
        return self.kept.pop(next(iter(self.kept)))

    # ------------------------------------------------------------------ the paged batch (causal families)
    async def batch_tiles(self, ids: list[int], images: list) -> list:
        """A batched sequence's tiles: (start, end, sha256, patch rows, tile of its image) each,
        preprocessed now."""
        pairs = self.pair(ids, images)
        pixels = self._patches(pairs) if IN_BROWSER else await asyncio.to_thread(self._patches, pairs)
        return [(s, e, h, r, j) for (s, e, h, _, j), r in zip(pairs, pixels)]

    @staticmethod
    def root(tiles: list) -> bytes:
        """What a sequence's KV blocks are keyed under besides its tokens: its images' contents."""
        import hashlib
        return hashlib.sha256(b"images:" + "".join(h for _, _, h, *_ in tiles).encode()).digest()

    @staticmethod
    def shift(tiles: list, keep: int, drop: int) -> tuple[int, int, list]:
        """A context shift of a batched sequence that drops its rows keep .. keep+drop-1 (scheduler
        `_shift`): an image (its tiles from its first to its last, the rows between them too) that
        the shift would cut goes whole, the rows before it and after it staying; the kept images'
        tiles move with their rows (their features are computed again from their pixels, as for a
        prompt of the kept tokens). (keep, drop, tiles) of the shift that cuts no image."""
        images: list[list] = []
        for t in tiles:                  # (start, end, sha256, patch rows, tile of its image)
            if t[4] == 0 or not images:
                images.append([])
            images[-1].append(t)
        lo, hi = keep, keep + drop
        for image in images:
            s, e = image[0][0], image[-1][1]
            lo = s if s < lo < e else lo
            hi = e if s < hi < e else hi
        n = hi - lo
        kept = [t for t in tiles if t[1] <= lo] + [(t[0] - n, t[1] - n, *t[2:]) for t in tiles if t[0] >= hi]
        return lo, n, kept

    def chunk_end(self, tiles: list, start: int, end: int) -> int:
        """The end of a batched prefill chunk of rows start .. end-1 that cuts no image whose rows
        attend each other both ways (Gemma 3): `end`, or the start of the image it would cut (`start`
        where the rest of that image does not fit in the chunk)."""
        if self.cfg.bidirectional:
            for s, e, *_ in tiles:
                if s < end < e:
                    return max(s, start)
        return end

    async def stage_chunk(self, tiles: list, start: int, end: int) -> None:
        """A batched prefill chunk of rows start .. end-1: the features of the tiles it holds rows of
        (before the chunk, in queue order) and its rows staged (the decoder stays causal, so a tile
        cut by a chunk's edge runs through the tower in its first chunk and is kept for the next)."""
        runs = [t for t in tiles if t[0] < end and t[1] > start]
        if len(runs) > self.max_tiles:
            raise InvalidRequestError(f"A prefill chunk holds {len(runs)} tiles; at most {self.max_tiles}.")
        rows = await self._run_tower(runs, end)
        self.model.images.pending = [rows.get(p, (NONE, 0)) for p in range(start, end)]
        if self.cfg.kind == "qwen25vl":
            self.model.images.pending_offsets = qwen25vl.offsets(self.cfg, [(s, e, r) for s, e, _, r, _ in tiles], start, end)
