"""A multimodal projector GGUF (llama.cpp's `--mmproj`, Ollama's projector layer): a second GGUF,
`general.architecture` "clip", holding the vision tower and its projector beside a text model's GGUF.

Its `clip.*` metadata becomes a VisionConfig (the tower's sizes, the preprocessing's image size and
mean / std, the projector's kind from clip.projector_type) and its tensors get the Hugging Face names
models/siglip.py reads (one table, MMPROJ_TO_HF), so a GGUF pair runs the same tower as a folder:

    projector type   family    tower                    projector
    gemma3           gemma3    SigLIP (v.blk.N.*)       avg-pool (clip.vision.projector.scale_factor,
                                                        default 4), RMSNorm mm.soft_emb_norm (1 + w
                                                        stored), mm.input_projection (C, C_text)
    idefics3         idefics3  SigLIP                   pixel shuffle (projector.scale_factor),
                                                        mm.model.fc; tiles from a picture resized to
                                                        clip.vision.preproc_image_size (SmolVLM)
    mlp              llava     CLIP: v.class_embd,      mm.0 (linear), GELU, mm.2 (linear); the
                               v.pre_ln, quick_gelu     converter keeps the layers up to the selected
                               (clip.use_gelu false)    one (LLaVA: the second to last), no v.post_ln
                                                        LLaVA 1.6: clip.vision.image_grid_pinpoints,
                                                        model.image_newline (vision/llava_gpu.py)
    qwen2.5vl_merger qwen25vl  Qwen2.5-VL's ViT         the 2x2 merger (v.post_ln, mm.0, GELU, mm.2);
                                                        read by vision/qwen25vl.py, run by qwen25vl_gpu.py

What the pair does not carry comes from the text model: the image token's id (its tokenizer) and the
chat template's image marker (the family's module).

Ollama's gemma3 blobs carry no projector file: the model's own GGUF holds the tower and projector
(its converter's names, OLLAMA_TO_HF, and `gemma3.vision.*` keys); MmprojFile reads them the same way.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import ModelFormatError, UnsupportedModelError
from ..loaders.gguf import GGUFFile
from ..loaders.tensor_info import TensorInfo
from .config import VisionConfig

# clip.projector_type -> the family whose host side (prompt expansion, tiles) the images take
PROJECTORS = {"gemma3": "gemma3", "idefics3": "idefics3", "mlp": "llava", "qwen2.5vl_merger": "qwen25vl"}

# mmproj tensor names ({i}: a tower layer) -> the Hugging Face names models/siglip.py reads
MMPROJ_TO_HF = {
    "v.patch_embd.weight": "vision_tower.embeddings.patch_embedding.weight",    # (C, 3, p, p)
    "v.patch_embd.bias": "vision_tower.embeddings.patch_embedding.bias",
    "v.class_embd": "vision_tower.embeddings.class_embedding",                # (C,)
    "model.image_newline": "image_newline", "v.image_newline": "image_newline",  # LLaVA-NeXT's (C_text,)
    "v.pre_ln.weight": "vision_tower.pre_layrnorm.weight",
    "v.pre_ln.bias": "vision_tower.pre_layrnorm.bias",
    "v.position_embd.weight": "vision_tower.embeddings.position_embedding.weight",  # (N, C)
    "v.blk.{i}.ln1.weight": "vision_tower.encoder.layers.{i}.layer_norm1.weight",
    "v.blk.{i}.ln1.bias": "vision_tower.encoder.layers.{i}.layer_norm1.bias",
    "v.blk.{i}.ln2.weight": "vision_tower.encoder.layers.{i}.layer_norm2.weight",
    "v.blk.{i}.ln2.bias": "vision_tower.encoder.layers.{i}.layer_norm2.bias",
    "v.blk.{i}.attn_q.weight": "vision_tower.encoder.layers.{i}.self_attn.q_proj.weight",
    "v.blk.{i}.attn_q.bias": "vision_tower.encoder.layers.{i}.self_attn.q_proj.bias",
    "v.blk.{i}.attn_k.weight": "vision_tower.encoder.layers.{i}.self_attn.k_proj.weight",
    "v.blk.{i}.attn_k.bias": "vision_tower.encoder.layers.{i}.self_attn.k_proj.bias",
    "v.blk.{i}.attn_v.weight": "vision_tower.encoder.layers.{i}.self_attn.v_proj.weight",
    "v.blk.{i}.attn_v.bias": "vision_tower.encoder.layers.{i}.self_attn.v_proj.bias",
    "v.blk.{i}.attn_out.weight": "vision_tower.encoder.layers.{i}.self_attn.out_proj.weight",
    "v.blk.{i}.attn_out.bias": "vision_tower.encoder.layers.{i}.self_attn.out_proj.bias",
    "v.blk.{i}.ffn_up.weight": "vision_tower.encoder.layers.{i}.mlp.fc1.weight",   # (F, C)
    "v.blk.{i}.ffn_up.bias": "vision_tower.encoder.layers.{i}.mlp.fc1.bias",
    "v.blk.{i}.ffn_down.weight": "vision_tower.encoder.layers.{i}.mlp.fc2.weight",  # (C, F)
    "v.blk.{i}.ffn_down.bias": "vision_tower.encoder.layers.{i}.mlp.fc2.bias",
    "v.post_ln.weight": "vision_tower.post_layernorm.weight",
    "v.post_ln.bias": "vision_tower.post_layernorm.bias",
    # Gemma 3's projector: the converter stores the RMSNorm's 1 + w (siglip.py reads either form)
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.one_plus_weight",
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",  # (C, C_text)
    "mm.model.fc.weight": "connector.modality_projection.proj.weight",        # SmolVLM: (C_text, C s^2)
    # LLaVA's projector (llava_surgery's mm.0 / mm.2: linear_1, linear_2)
    "mm.0.weight": "multi_modal_projector.linear_1.weight",                  # (C_text, C)
    "mm.0.bias": "multi_modal_projector.linear_1.bias",
    "mm.2.weight": "multi_modal_projector.linear_2.weight",                  # (C_text, C_text)
    "mm.2.bias": "multi_modal_projector.linear_2.bias",
}
# Ollama's one-GGUF layout (its convert/convert_gemma3.go: the vision tower and projector in the model's
# own GGUF, Hugging Face's names through its Replacements, `{arch}.vision.*` keys): its names -> ours
OLLAMA_TO_HF = {
    "v.patch_embedding.weight": "vision_tower.embeddings.patch_embedding.weight",
    "v.patch_embedding.bias": "vision_tower.embeddings.patch_embedding.bias",
    "v.position_embedding.weight": "vision_tower.embeddings.position_embedding.weight",
    "v.post_layernorm.weight": "vision_tower.post_layernorm.weight",
    "v.post_layernorm.bias": "vision_tower.post_layernorm.bias",
    **{f"v.blk.{{i}}.{n}.{p}": f"vision_tower.encoder.layers.{{i}}.{hf}.{p}" for p in ("weight", "bias")
       for n, hf in (("layer_norm1", "layer_norm1"), ("layer_norm2", "layer_norm2"), ("mlp.fc1", "mlp.fc1"),
                     ("mlp.fc2", "mlp.fc2"), ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                     ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.out_proj"))},
    # its converter adds 1 to every *_norm.weight outside v.* (as llama.cpp's mmproj stores 1 + w)
    "mm.mm_soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.one_plus_weight",
    "mm.mm_input_projection.weight": "multi_modal_projector.mm_input_projection_weight",    # (C, C_text)
}
EMBEDDED = {"gemma3"}                    # the architectures whose one-GGUF tower is read
_BLOCK = re.compile(r"^v\.blk\.(\d+)\.(.+)$")


def hf_name(name: str, table: dict = MMPROJ_TO_HF) -> str | None:
    """The Hugging Face name of an mmproj tensor (`table`: Ollama's names), or None when the tower
    does not read it."""
    m = _BLOCK.match(name)
    if m is None:
        return table.get(name)
    hf = table.get("v.blk.{i}." + m.group(2))
    return hf.replace("{i}", m.group(1)) if hf else None


def embedded_tower(g: GGUFFile) -> str | None:
    """The architecture of a model GGUF that holds its vision tower in Ollama's one-GGUF layout
    (`{arch}.vision.block_count`, `v.*` tensors), or None."""
    arch = g.architecture
    if arch == "clip" or f"{arch}.vision.block_count" not in g.metadata or not any(n.startswith("v.") for n in g.tensors):
        return None
    return arch


class MmprojFile:
    """An open mmproj GGUF: `cfg` (VisionConfig; its image token from the text model's `tokenizer`)
    and `tensors` {Hugging Face name: TensorInfo}."""

    def __init__(self, path, tokenizer):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"no multimodal projector GGUF at {path} (mmproj)")
        self._gguf = GGUFFile(self.path)
        try:
            embedded = embedded_tower(self._gguf)
            self.cfg = read_config(self._gguf, tokenizer) if embedded is None else \
                embedded_config(self._gguf, embedded, tokenizer)
            table = MMPROJ_TO_HF if embedded is None else OLLAMA_TO_HF
            self.tensors: dict[str, TensorInfo] = {}
            for name, t in self._gguf.tensors.items():
                hf = hf_name(name, table)
                if hf is not None:
                    self.tensors[hf] = t
            _legacy_ffn(self.tensors, self.cfg)
            if self.cfg.kind == "qwen25vl":      # its tower reads llama.cpp's names (vision/qwen25vl_gpu.py)
                self.tensors = dict(self._gguf.tensors)
        except BaseException:
            self._gguf.close()
            raise

    def close(self) -> None:
        self.tensors = {}
        self._gguf.close()


def read_config(g: GGUFFile, tokenizer) -> VisionConfig:
    """The VisionConfig of an mmproj GGUF `g`, the image token's id from the text model's `tokenizer`
    (None: -1)."""
    where = g.where
    if g.architecture != "clip":
        raise ModelFormatError(f"{where} is not a multimodal projector GGUF (general.architecture "
                               f"{g.architecture!r}, not 'clip'); give the mmproj file llama.cpp's "
                               f"--mmproj converter writes")
    if not g.metadata.get("clip.has_vision_encoder", False):
        raise UnsupportedModelError(f"{where}: the projector has no vision encoder (audio projectors are not read)")
    kind = str(g.metadata.get("clip.projector_type", ""))
    family = PROJECTORS.get(kind)
    if family is None:
        raise UnsupportedModelError(f"{where}: projector type {kind!r} is not implemented "
                                    f"(this engine reads {sorted(PROJECTORS)})")

    if family == "qwen25vl":             # images of any size: vision/qwen25vl.py
        from .qwen25vl import mmproj_config
        return mmproj_config(g, tokenizer)

    def meta(key: str, default=None):
        v = g.metadata.get("clip.vision." + key, default)
        if v is None:
            raise ModelFormatError(f"{where}: mmproj metadata lacks clip.vision.{key}")
        return v
    size, patch = int(meta("image_size")), int(meta("patch_size"))
    side = size // patch
    if family == "gemma3":
        from . import gemma3 as fam
        per_side = side // int(meta("projector.scale_factor", 4))
        tokens, marker, image_token = per_side * per_side, fam.BOI, fam.IMAGE
        text_hidden, extra = int(meta("projection_dim")), {}
    elif family == "idefics3":           # SmolVLM: s x s patches per token, tiles of the tower's square
        from . import idefics3 as fam
        scale = int(meta("projector.scale_factor", 2))
        tokens, marker, image_token = (side // scale) ** 2, fam.IMAGE, fam.IMAGE
        text_hidden = int(meta("projection_dim"))
        extra = {"scale": scale, "longest_edge": int(meta("preproc_image_size", 4 * size)), "splitting": True,
                 "resample": 1}          # Idefics3ImageProcessor: LANCZOS
    else:                                # LLaVA: a token per patch; the text width is mm.2's
        from . import llava as fam
        tokens, marker, image_token = side * side, fam.IMAGE, fam.IMAGE
        last = g.tensors.get("mm.2.weight")
        if last is None:
            raise ModelFormatError(f"{where}: the mlp projector lacks mm.2.weight")
        text_hidden, extra = int(last.shape[0]), {"resample": fam.BICUBIC}
    # no tokenizer: the header alone, as the memory estimate reads it (the image token unknown, -1)
    token_id = tokenizer.token_to_id(image_token) if tokenizer is not None else -1
    if token_id is None:
        hint = (" (a LLaVA text GGUF converted from the original checkpoints has none: use one converted from "
                "llava-hf's, whose vocabulary holds <image>)" if family == "llava" else "")
        raise ModelFormatError(f"{where}: the text model's vocabulary has no {image_token} token, which "
                               f"{kind} images take: the text GGUF and the projector do not belong together{hint}")
    cfg = VisionConfig(
        kind=family, hidden_size=int(meta("embedding_length")), intermediate_size=int(meta("feed_forward_length")),
        n_layers=int(meta("block_count")), n_heads=int(meta("attention.head_count")),
        image_size=size, patch_size=patch, eps=float(meta("attention.layer_norm_epsilon", 1e-6)),
        text_hidden=text_hidden, tokens_per_image=tokens, image_token_id=int(token_id),
        marker=marker, size=(size, size),
        mean=tuple(float(x) for x in meta("image_mean", [0.5] * 3)),
        std=tuple(float(x) for x in meta("image_std", [0.5] * 3)),
        # llama.cpp's tower: GELU (its tanh form) where clip.use_gelu, else CLIP's quick_gelu
        act="gelu_tanh" if g.metadata.get("clip.use_gelu", False) else "quick_gelu",
        class_token="v.class_embd" in g.tensors, pre_norm="v.pre_ln.weight" in g.tensors,
        post_norm="v.post_ln.weight" in g.tensors, **extra)
    if tokens < 1 or side % max(1, round(tokens ** 0.5)):
        raise ModelFormatError(f"{where}: {tokens} image tokens do not pool a {side}x{side} patch grid")
    pins = g.metadata.get("clip.vision.image_grid_pinpoints")
    if family == "llava" and pins:       # LLaVA-NeXT: any-resolution tiles, their padding cut off
        merge = g.metadata.get("clip.vision.mm_patch_merge_type", "spatial_unpad")
        if merge != "spatial_unpad":
            raise UnsupportedModelError(f"{where}: LLaVA-NeXT's mm_patch_merge_type {merge!r} is not implemented "
                                        f"(spatial_unpad is, as transformers runs it)")
        return fam.any_resolution(cfg, pins, str(where))
    return cfg


def embedded_config(g: GGUFFile, arch: str, tokenizer) -> VisionConfig:
    """The VisionConfig of a model GGUF holding its tower (Ollama's `{arch}.vision.*` keys: widths,
    layers, heads, image and patch size, the LayerNorms' epsilon; `{arch}.mm.tokens_per_image`, else
    256; the text width for the projection; SigLIP's mean / std 0.5, as Ollama's image processor)."""
    where = g.where
    if arch not in EMBEDDED:
        raise UnsupportedModelError(f"{where}: a {arch} GGUF with its vision tower inside (Ollama's layout) is "
                                    f"not read (this engine reads it for {sorted(EMBEDDED)}; give a "
                                    f"projector GGUF instead)")

    def meta(key: str, default=None):
        v = g.metadata.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelFormatError(f"{where}: the model GGUF's vision tower lacks {arch}.{key}")
        return v
    from . import gemma3 as fam
    size, patch = int(meta("vision.image_size")), int(meta("vision.patch_size"))
    tokens, side = int(meta("mm.tokens_per_image", 256)), size // patch
    per_side = round(tokens ** 0.5)
    if tokens < 1 or per_side * per_side != tokens or side % per_side:
        raise ModelFormatError(f"{where}: {tokens} image tokens do not pool a {side}x{side} patch grid")
    token_id = tokenizer.token_to_id(fam.IMAGE) if tokenizer is not None else -1
    if token_id is None:
        raise ModelFormatError(f"{where}: the vocabulary has no {fam.IMAGE} token, which its images take")
    return VisionConfig(
        kind="gemma3", hidden_size=int(meta("vision.embedding_length")),
        intermediate_size=int(meta("vision.feed_forward_length")), n_layers=int(meta("vision.block_count")),
        n_heads=int(meta("vision.attention.head_count")), image_size=size, patch_size=patch,
        eps=float(meta("vision.attention.layer_norm_epsilon", 1e-6)), text_hidden=int(meta("embedding_length")),
        tokens_per_image=tokens, image_token_id=int(token_id), marker=fam.BOI, size=(size, size))


def _legacy_ffn(tensors: dict, cfg: VisionConfig) -> None:
    """llama.cpp's legacy LLaVA converter names fc1 ffn_down and fc2 ffn_up (clip.cpp swaps them back
    by shape): fc1 is (F, C)."""
    C, F = cfg.hidden_size, cfg.intermediate_size
    for i in range(cfg.n_layers):
        mlp = f"vision_tower.encoder.layers.{i}.mlp."
        fc1 = tensors.get(mlp + "fc1.weight")
        if fc1 is not None and C != F and tuple(fc1.shape) == (C, F):
            for part in ("weight", "bias"):
                tensors[mlp + "fc1." + part], tensors[mlp + "fc2." + part] = \
                    tensors[mlp + "fc2." + part], tensors[mlp + "fc1." + part]


_HOLDS: dict[tuple, bool] = {}     # (path, size, mtime) -> holds_tower's answer


def holds_tower(path) -> bool:
    """Whether `path` is a model GGUF holding its vision tower (Ollama's one-GGUF layout), read from
    its header once per file version (a load asks for its memory estimate and again for its inputs;
    parsing a header with its vocabulary takes ~80 ms)."""
    try:
        st = Path(path).stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in _HOLDS:
            with GGUFFile(path) as g:
                _HOLDS[key] = embedded_tower(g) in EMBEDDED  # others' towers are not read: their text runs
        return _HOLDS[key]
    except (ModelFormatError, UnsupportedModelError, OSError):
        return False


def is_mmproj(path) -> bool:
    """Whether `path` is a projector GGUF (general.architecture 'clip'), read from its header."""
    try:
        with GGUFFile(path) as g:
            return g.architecture == "clip"
    except (ModelFormatError, UnsupportedModelError, OSError):
        return False


def split_projector(ggufs: list) -> tuple[list, Path | None]:
    """(the model GGUFs, the projector GGUF or None) of a folder's GGUF files: a folder may hold a
    text model and its mmproj, as llama.cpp's and the hub's GGUF repos do."""
    projectors = [g for g in ggufs if is_mmproj(g)]
    if len(projectors) != 1 or len(ggufs) == 1:
        return ggufs, None
    return [g for g in ggufs if g != projectors[0]], projectors[0]
