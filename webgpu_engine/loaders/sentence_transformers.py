"""Reads a sentence-transformers model folder's module stack: pooling mode, normalisation, max length.

A sentence-transformers folder holds `modules.json` (the module stack: Transformer → Pooling →
optional Normalize), `1_Pooling/config.json` (which pooling), and `sentence_bert_config.json`
(`max_seq_length`, `do_lower_case`). The Transformer's own files (config.json, weights, tokenizer,
sentence_bert_config.json) sit at the top in recent saves and in the folder its module names
(`0_Transformer/`) in older ones; both layouts load alike. A bare Hugging Face BERT folder (no `modules.json`) gets what
sentence-transformers itself would build for it: mean pooling, no normalisation, the model's own
maximum length. Plain stdlib JSON parsing: this runs in the browser too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import ModelFormatError, UnsupportedModelError

POOLING_MODES = ("mean", "cls", "max", "lasttoken", "weightedmean")

# Pooling config keys → our mode names. Modes we cannot run are listed so the error can name them.
_POOL_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class SentenceTransformerConfig:
    """How to turn the encoder's hidden states into one vector per input."""

    model_folder: Path                  # where config.json / model.safetensors / tokenizer.json live
    pooling: str = "mean"               # one of POOLING_MODES (sentence-transformers' names)
    normalize: bool = False             # an L2 Normalize module follows pooling
    max_seq_length: int | None = None   # truncation length incl. [CLS]/[SEP]; None: the model's
    do_lower_case: bool = False         # sentence-transformers lower-cases the text before tokenizing
    is_sentence_transformers: bool = False
    matryoshka: bool = False            # trained so that the first k dimensions are an embedding too
    # config_sentence_transformers.json: named instruction prompts (Qwen3-Embedding's "query") and the
    # one sentence-transformers' encode prepends when given no prompt_name
    prompts: dict = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def default_prompt(self) -> str:
        return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""


def model_card_says_matryoshka(folder: Path) -> bool:
    """Whether the model card (README.md front matter: `tags`, `loss:MatryoshkaLoss` as
    sentence-transformers' trainer writes it, or a table with an "MRL Support" column saying "Yes", as
    Qwen3-Embedding's card has) says the model was trained for truncated vectors. Prose that merely
    mentions Matryoshka models does not count."""
    card = Path(folder) / "README.md"
    if not card.is_file():
        return False
    lines = card.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines:
        return False
    for line in lines[1:] if lines[0].strip() == "---" else ():
        if line.strip() == "---":
            break
        item = line.strip().lstrip("-").strip().strip("'\"").lower()
        if item in ("matryoshka", "mrl", "loss:matryoshkaloss", "loss:matryoshka2dloss"):
            return True
    return _table_says_mrl(lines)


def _table_says_mrl(lines: list[str]) -> bool:
    """A markdown table whose "MRL Support" column holds "Yes" in some row."""
    col = None
    for line in lines:
        cells = [c.strip().lower() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") \
            else None
        if cells is None:
            col = None                                  # the table ended
        elif col is None:
            col = cells.index("mrl support") if "mrl support" in cells else None
        elif col < len(cells) and cells[col] == "yes":
            return True
    return False


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path.name} in {path.parent} is not valid JSON: {e}") from None


def pooling_mode(pool_cfg: dict, where: str = "1_Pooling/config.json") -> str:
    """The single pooling mode of a sentence-transformers Pooling config."""
    if isinstance(pool_cfg.get("pooling_mode"), str):       # newer configs may name it directly
        on = [pool_cfg["pooling_mode"].replace("_tokens", "").replace("_token", "")]
    else:
        on = [mode for key, mode in _POOL_KEYS.items() if pool_cfg.get(key)]
    if len(on) != 1:
        raise UnsupportedModelError(
            f"{where}: expected exactly one pooling mode, found {on or 'none'}; this engine runs one of "
            f"{list(POOLING_MODES)} (concatenated pooling modes are not supported).")
    if on[0] not in POOLING_MODES:
        raise UnsupportedModelError(
            f"{where}: pooling mode {on[0]!r} is not supported; this engine runs {list(POOLING_MODES)}.")
    return on[0]


def _module_stack(modules: object, where: str) -> tuple[list[dict], list[str]]:
    """(modules sorted by idx, each with a checked relative `path`; their kinds: "Transformer", ...)."""
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModelError(f"{where} should be a non-empty JSON list of modules.")
    modules = sorted(modules, key=lambda m: m.get("idx", 0))
    for m in modules:
        path = m.get("path") or ""
        if not isinstance(path, str) or path.startswith("/") or "\\" in path or ".." in path.split("/"):
            raise ModelFormatError(f"{where}: module path {path!r} must be a folder inside the model folder.")
        m["path"] = "/".join(PurePosixPath(path).parts)
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds[0] != "Transformer":
        raise UnsupportedModelError(f"{where}: the first module must be a Transformer, got {kinds[0]!r}.")
    return modules, kinds


def transformer_subfolder(modules: object, where: str = "modules.json") -> str:
    """Where a modules.json (parsed) keeps the Transformer's files, relative to the model folder:
    "" for the flat layout of recent saves, "0_Transformer" for older ones (config.json, the weights
    and the tokenizer sit there, 1_Pooling/ beside it)."""
    return _module_stack(modules, where)[0][0]["path"]


def load_sentence_transformer_config(folder: str | Path) -> SentenceTransformerConfig:
    """Parse the module stack of `folder`; see the module docstring for the defaults."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UnsupportedModelError(f"Embedding model folder {folder} does not exist or is not a folder.")
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return SentenceTransformerConfig(model_folder=folder, matryoshka=model_card_says_matryoshka(folder))

    modules, kinds = _module_stack(_read_json(modules_path), str(modules_path))
    model_folder = folder / modules[0]["path"]

    pooling, normalize = "mean", False
    for m, kind in zip(modules[1:], kinds[1:]):
        if kind == "Pooling":
            cfg_path = folder / m.get("path", "") / "config.json"
            pooling = pooling_mode(_read_json(cfg_path) if cfg_path.is_file() else {"pooling_mode_mean_tokens": True},
                                   f"{m.get('path', '')}/config.json")
        elif kind == "Normalize":
            # Normalize has no parameters; its folder is often absent from downloads.
            normalize = True
        else:
            raise UnsupportedModelError(
                f"{modules_path}: module {kind!r} is not supported; this engine runs "
                f"Transformer → Pooling → optional Normalize.")
    if normalize and kinds.index("Normalize") != len(kinds) - 1:
        raise UnsupportedModelError(f"{modules_path}: Normalize must be the last module.")

    max_len, lower = None, False
    # The Transformer module's own settings live next to its weights (or at the top for path "").
    for sb in (model_folder / "sentence_bert_config.json", folder / "sentence_bert_config.json"):
        if sb.is_file():
            sbc = _read_json(sb)
            if sbc.get("max_seq_length") is not None:
                max_len = int(sbc["max_seq_length"])
            lower = bool(sbc.get("do_lower_case", False))
            break
    prompts, default_prompt = _prompts(folder / "config_sentence_transformers.json")
    return SentenceTransformerConfig(model_folder=model_folder, pooling=pooling, normalize=normalize,
                                     max_seq_length=max_len, do_lower_case=lower,
                                     is_sentence_transformers=True,
                                     matryoshka=model_card_says_matryoshka(folder),
                                     prompts=prompts, default_prompt_name=default_prompt)


def _prompts(path: Path) -> tuple[dict, str | None]:
    """(prompts, default_prompt_name) of a config_sentence_transformers.json ({} and None without one)."""
    cfg = _read_json(path) if path.is_file() else {}
    prompts = cfg.get("prompts") if isinstance(cfg, dict) else None
    prompts = {str(k): v for k, v in prompts.items() if isinstance(v, str)} if isinstance(prompts, dict) else {}
    name = cfg.get("default_prompt_name") if isinstance(cfg, dict) else None
    if name is not None and name not in prompts:
        raise UnsupportedModelError(f"{path}: default_prompt_name {name!r} is not one of its prompts "
                                    f"{sorted(prompts)}.")
    return prompts, name

