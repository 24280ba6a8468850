"""A loaded vision-language model's image side, as its chat pipeline uses it (pipelines/llm.py):

- `template(t)`: the chat template whose rendered `<start_of_image>` becomes the model's full image
  sequence (as Gemma3Processor expands the text before tokenising it);
- `prepare(ids, images)`: pairs each image with its run of image tokens;
- `reusable(kv_ids, keep)`: prefix reuse keys the cache's images by content (SHA-256 of the bytes:
  image tokens are one id whatever the picture), so it stops at the first image that differs;
- `encode(keep)`: runs the tower over the images whose rows are computed (features into the
  decoder's ImageRows) and maps each of their positions to its feature row and its image's end;
- `spans(n, pos0, chunk)`: prefill chunks that never cut an image (its rows attend each other);
- `stage(pos0, T)`: the rows of the chunk about to be recorded.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from ..errors import InvalidRequestError, UnsupportedChatOptionError
from ..gpu import IN_BROWSER
from ..kernels.vision import NONE
from ..loaders.chat_template import ChatTemplate
from .gemma3 import BOI, VisionConfig, patches, preprocess, read_vision_config

MAX_IMAGES = 16                          # per request, as the features buffer is sized


def takes_images(path) -> bool:
    """Whether the model at `path` is a folder with a vision tower (config.json's vision_config)."""
    import json
    f = Path(path) / "config.json"
    try:
        return f.is_file() and isinstance(json.loads(f.read_text(encoding="utf-8")).get("vision_config"), dict)
    except (OSError, ValueError):
        return False


class _ExpandingTemplate(ChatTemplate):
    """A chat template whose rendered image markers become the model's full image sequence."""

    def __init__(self, inner: ChatTemplate, marker: str, full: str):
        self.__dict__.update(inner.__dict__)
        self._marker, self._full = marker, full

    def render(self, messages, **kwargs) -> str:
        return super().render(messages, **kwargs).replace(self._marker, self._full)


class VisionInputs:
    def __init__(self, dev, cfg: VisionConfig, tower, model, max_images: int):
        self.dev, self.cfg, self.tower, self.model = dev, cfg, tower, model
        self.max_images = max_images
        self.unavailable = ""            # why this load takes no images (set by the pipeline), else ""
        self._rows: dict[int, tuple[int, int]] = {}     # position -> (feature row, image's key end)
        self._request: list | None = None    # this request's images: (start, end, sha256, ImageInput)
        self._cached: list = []              # the KV cache's images: (start, end, sha256)

    @classmethod
    def load(cls, dev, path, model, owner: str) -> "VisionInputs | None":
        """The image side of the model at `path` (an HF folder with a vision tower), else None."""
        path = Path(path)
        if not path.is_dir() or not (path / "config.json").is_file():
            return None
        cfg = read_vision_config(path)
        if cfg is None:
            return None
        if cfg.tokens_per_image > model.chunk:
            raise UnsupportedChatOptionError(
                "prefill_chunk_size", model.chunk, f"an image's {cfg.tokens_per_image} tokens run in one "
                f"prefill chunk: load with prefill_chunk_size >= {cfg.tokens_per_image}")
        why = ("a KV cache in another dtype than the activations (kv_cache_dtype) has no image "
               "attention yet: load without kv_cache_dtype" if model.kv_cache_dtype else
               "a sliding window's ring (sliding_window_size) has no image attention yet" if model.ring else "")
        if why:                          # the text model runs; image requests are refused by name
            vision = cls(dev, cfg, None, model, 0)
            vision.unavailable = why
            return vision
        from ..loaders.safetensors import SafetensorsFolder
        from ..models.siglip import SiglipTower
        files = SafetensorsFolder(path)
        try:
            tower = SiglipTower(dev, cfg, files.tensors, owner=owner)
        finally:
            files.close()
        n = max(1, min(MAX_IMAGES, model.ctx // (cfg.tokens_per_image + 6)))
        model.enable_images(n * cfg.tokens_per_image, cfg.text_hidden)
        return cls(dev, cfg, tower, model, n)

    def template(self, template):
        if template is None or not isinstance(template, ChatTemplate):
            return template
        return _ExpandingTemplate(template, BOI, self.cfg.full_image_sequence())

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

    def prepare(self, ids: list[int], images: list) -> None:
        """Pair each image of the request with its run of image tokens in `ids` (one full image per
        image part, or a 400); `reusable` and `encode` read the pairs."""
        blocks = self.blocks(ids)
        n = self.cfg.tokens_per_image
        if len(blocks) != len(images) or any(e - s != n for s, e in blocks):
            raise InvalidRequestError(f"The prompt holds {len(blocks)} image(s) of {[e - s for s, e in blocks]} "
                                      f"tokens for {len(images)} image(s) of {n} tokens: the chat template "
                                      f"must place each image part once (and the text may not carry image "
                                      f"tokens itself).", param="messages")
        self._request = [(s, e, im.sha256, im) for (s, e), im in zip(blocks, images)]
        self._rows = {}

    def reusable(self, kv_ids: list[int], keep: int) -> int:
        """The cached prefix (`keep` ids shared with the request) that may be reused: up to the first
        image of the cache that the request does not hold at the same place with the same content
        (SHA-256 of its bytes: one token id stands for any image)."""
        same = {(s, e, h) for s, e, h, _ in self._request or ()}
        for s, e, h in self._cached:
            if s >= keep:
                break
            if (s, e, h) not in same:
                return s
        return keep

    async def encode(self, keep: int) -> None:
        """Run the tower over the request's images whose rows are computed (from `keep` on), each image's
        features submitted before the prefill that reads them, and map their rows."""
        todo = [(s, e, im) for s, e, _, im in self._request or () if e > keep]
        if not todo:
            return
        cfg, n = self.cfg, self.cfg.tokens_per_image

        def rows():
            return [patches(cfg, preprocess(cfg, im.image)) for _, _, im in todo]
        pixels = rows() if IN_BROWSER else await asyncio.to_thread(rows)    # resizing is CPU work
        for k, ((s, e, _), r) in enumerate(zip(todo, pixels)):
            self.tower.write_patches(r)
            self.dev.submit(self.tower.record(self.dev.batch(), self.model.images.feats, k))
            for j in range(n):
                self._rows[s + j] = (k * n + j, e)

    def spans(self, n: int, pos0: int, chunk: int) -> list[tuple[int, int]]:
        """[a, b) row spans of a prefill of n rows at pos0.. of at most `chunk` rows, none cutting an image."""
        out, a = [], 0
        while a < n:
            b = min(a + chunk, n)
            if b < n and pos0 + b in self._rows and pos0 + b - 1 in self._rows:
                start = pos0 + b
                while start - 1 in self._rows and self._rows[start - 1][1] == self._rows[pos0 + b][1]:
                    start -= 1
                b = start - pos0 if start - pos0 > a else b
            out.append((a, b))
            a = b
        return out

    def stage(self, pos0: int, T: int) -> None:
        """The image rows of the forward of T rows at pos0.. about to be recorded."""
        if self._rows:
            self.model.images.pending = [self._rows.get(pos0 + t, (NONE, 0)) for t in range(T)]

    def done(self) -> None:
        """The request's prefill is over: the cache holds its images; later forwards carry none."""
        self._cached = [(s, e, h) for s, e, h, _ in self._request or ()]
        self._request, self._rows = None, {}
