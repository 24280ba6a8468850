"""MLC-LLM's BERT artifacts as embedders (WebLLM's snowflake-arctic-embed-{m,s}-q0f32-MLC): an
`mlc-chat-config.json` with model_type "bert", opened by loaders.mlc.MLCArtifact, read here into what
models/bert.py runs.

    cfg = bert_config(art)           # BertConfig from model_config (MLC's BertConfig fields)
    w = bert_weights(art)            # {HF BertModel name: TensorInfo}, the names models/bert.py maps
    st = embedder_settings(art)      # pooling, normalisation, the longest input

mlc-llm's BertModel (python/mlc_llm/model/bert/) keeps HF's parameter names, no `bert.` prefix and no
pooler, with query, key and value fused as `encoder.layer.{i}.attention.self.qkv` (weight (3C, C) rows
q | k | v, bias (3C,)): split here into zero-copy views under HF's names. Its position table has
context_window_size rows and its forward numbers positions from 0 with token type 0, as BERT does.
Its converter writes float32 tensors as bf16 records (f32-to-bf16), which MLCArtifact hands on as bf16.

The vector: the chat config's `embedding_metadata` when it has one (mlc-llm writes `pooling_strategy`
cls / mean / last and `normalize`), else the first token's hidden state L2-normalised, which is what
mlc-llm declares for bert and sentence-transformers runs for snowflake-arctic-embed (CLS pooling,
Normalize). WebLLM's embedding.ts returns that row without normalising it: the same direction.
"""
from __future__ import annotations

import re

from ..errors import ModelFormatError, UnsupportedModelError
from .model_config import BertConfig
from .sentence_transformers import SentenceTransformerConfig
from .tensor_info import TensorInfo, split_rows, split_vector

_QKV = re.compile(r"^(encoder\.layer\.\d+\.attention\.self)\.qkv\.(weight|bias)$")
_POOLING = {"cls": "cls", "mean": "mean", "last": "lasttoken"}   # mlc-llm's pooling_strategy -> ours


def _model_config(art) -> dict:
    mc = art.chat_config.get("model_config")
    if not isinstance(mc, dict) or not mc:
        raise ModelFormatError(f"{art.folder / 'mlc-chat-config.json'} has no model_config object")
    return mc


def bert_config(art) -> BertConfig:
    """BertConfig of an MLC bert artifact (mlc-llm's BertConfig: HF's names, context_window_size as
    the position table's length)."""
    mc, where = _model_config(art), str(art.folder / "mlc-chat-config.json")
    try:
        C, H = int(mc["hidden_size"]), int(mc["num_attention_heads"])
        if int(mc.get("head_dim") or C // H) * H != C:
            raise UnsupportedModelError(f"{where}: head_dim {mc['head_dim']} x {H} heads is not hidden_size {C}")
        F = mc.get("intermediate_size")
        positions = int(mc.get("context_window_size") or art.chat_config.get("context_window_size") or 0)
        if positions <= 0:
            raise ModelFormatError(f"{where}: model_config has no context_window_size (the position table's rows)")
        return BertConfig(
            arch="bert", vocab_size=int(mc["vocab_size"]), hidden_size=C, n_layers=int(mc["num_hidden_layers"]),
            n_heads=H, intermediate_size=4 * C if F in (None, -1) else int(F), max_position=positions,
            type_vocab_size=int(mc.get("type_vocab_size", 2)), layer_norm_eps=float(mc.get("layer_norm_eps", 1e-12)),
            hidden_act=str(mc.get("hidden_act", "gelu")), pad_id=int(mc.get("pad_token_id") or 0),
            name=art.folder.name)
    except KeyError as e:
        raise ModelFormatError(f"{where}: model_config lacks {e.args[0]}") from e
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{where}: model_config does not read as a BERT config: {e}") from e


def bert_weights(art) -> dict[str, TensorInfo]:
    """{HF BertModel name: TensorInfo}: MLC's names, its fused q|k|v split into query, key, value."""
    C = int(_model_config(art)["hidden_size"])
    out: dict[str, TensorInfo] = {}
    for name, t in art.tensors.items():
        m = _QKV.match(name)
        if m is None:
            out[name] = t
            continue
        base, part = m.groups()
        names = [f"{base}.{p}.{part}" for p in ("query", "key", "value")]
        try:
            out.update(zip(names, (split_rows if part == "weight" else split_vector)(t, [C, C, C], names)))
        except ValueError as e:
            raise ModelFormatError(f"{art.cache_path}: {e} (q | k | v of hidden_size {C})") from e
    return out


def embedder_settings(art) -> SentenceTransformerConfig:
    """How the hidden states become a vector: `embedding_metadata`'s pooling and normalisation, else
    CLS, normalised; inputs up to the position table's length."""
    meta = art.chat_config.get("embedding_metadata") or {}
    where = art.folder / "mlc-chat-config.json"
    if not isinstance(meta, dict):
        raise ModelFormatError(f"{where}: embedding_metadata is not an object")
    strategy = meta.get("pooling_strategy", "cls")
    if strategy not in _POOLING:
        raise UnsupportedModelError(f"{where}: embedding_metadata.pooling_strategy {strategy!r} is not "
                                    f"supported ({', '.join(_POOLING)})")
    return SentenceTransformerConfig(model_folder=art.folder, pooling=_POOLING[strategy],
                                     normalize=bool(meta.get("normalize", True)),
                                     max_seq_length=bert_config(art).max_position)


__all__ = ["bert_config", "bert_weights", "embedder_settings"]
