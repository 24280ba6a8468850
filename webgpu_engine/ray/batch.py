"""Batch inference on Ray Data: embed a text column, or answer a column of conversations / prompts,
with one engine per actor of a `map_batches` actor pool (one actor per WebGPU device).

    import ray, webgpu_engine.ray as wr
    ds = ray.data.read_parquet("corpus.parquet")
    ds = wr.embed_dataset(ds, model="all-MiniLM-L6-v2", column="text", batch_size=64)
    ds.write_parquet("vectors/")

The returned dataset is lazy (Ray Data plans it; nothing runs until it is consumed). Rows keep
their columns and gain `embedding` (float32 vectors) or `output` (the answer's text).
"""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..protocol.objects import to_dict
from .host import RESOURCE, EngineSpec, engine_loop, open_engine


def _spec(model: str | list[str] | EngineSpec, chat_opts: dict | None) -> EngineSpec:
    if isinstance(model, EngineSpec):
        return model
    refs = [model] if isinstance(model, str) else list(model)
    return EngineSpec(models=refs, chat_opts=[chat_opts] * len(refs) if chat_opts else None)


def _pool_options(concurrency: int | None) -> dict:
    """map_batches options: one actor per declared `webgpu` device (each actor takes one), or a
    single actor on a cluster that declares none."""
    import ray
    devices = int(ray.cluster_resources().get(RESOURCE, 0))
    if devices:
        return {"concurrency": concurrency or devices, "resources": {RESOURCE: 1}, "num_cpus": 0}
    return {"concurrency": concurrency or 1}


class _EngineActor:
    """One engine on a loop of its own (map_batches calls __call__ from the actor's thread)."""

    def __init__(self, spec: EngineSpec):
        self._loop = engine_loop()
        self.engine = self._loop.run(open_engine(spec))
        self.model_id = next(iter(self.engine.models))

    def run(self, coro):
        return self._loop.run(coro)


class _Embedder(_EngineActor):
    def __init__(self, spec: EngineSpec, column: str, dimensions: int | None):
        super().__init__(spec)
        self.column, self.dimensions = column, dimensions

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch[self.column]]
        req: dict[str, Any] = {"model": self.model_id, "input": texts}
        if self.dimensions:
            req["dimensions"] = self.dimensions
        res = to_dict(self.run(self.engine.embeddings.create(req)))
        batch["embedding"] = np.asarray([d["embedding"] for d in res["data"]], np.float32)
        return batch


def _plain(v: Any) -> Any:
    """A Ray Data cell as plain Python (Arrow lists arrive as numpy arrays of dicts / values)."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items() if x is not None}
    if isinstance(v, np.generic):
        return v.item()
    return v


class _Generator(_EngineActor):
    def __init__(self, spec: EngineSpec, messages_column: str | None, prompt_column: str | None,
                 sampling: dict):
        super().__init__(spec)
        self.messages_column, self.prompt_column, self.sampling = messages_column, prompt_column, sampling

    async def _one(self, cell) -> str:
        if self.messages_column:
            res = to_dict(await self.engine.chat.completions.create(
                {"model": self.model_id, "messages": _plain(cell), **self.sampling}))
            return res["choices"][0]["message"].get("content") or ""
        res = to_dict(await self.engine.completions.create(
            {"model": self.model_id, "prompt": str(cell), **self.sampling}))
        return res["choices"][0]["text"]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cells = batch[self.messages_column or self.prompt_column]

        async def all_rows():
            # submitted together: a chat model with max_num_sequences > 1 decodes them as one batch
            return await asyncio.gather(*(self._one(c) for c in cells))
        batch["output"] = np.asarray(self.run(all_rows()), dtype=object)
        return batch


def embed_dataset(ds, model: str | list[str] | EngineSpec, column: str = "text", batch_size: int = 64,
                  dimensions: int | None = None, concurrency: int | None = None):
    """`ds` with an `embedding` column: the embedding model's vector of each row's `column` text
    (as engine.embeddings.create gives it). One engine per actor; `concurrency` actors (default:
    the cluster's `webgpu` devices)."""
    if column not in ds.columns():
        raise ValueError(f"The dataset has no column {column!r}; its columns are {ds.columns()}.")
    return ds.map_batches(_Embedder, fn_constructor_args=(_spec(model, None), column, dimensions),
                          batch_size=batch_size, batch_format="numpy", **_pool_options(concurrency))


def generate_dataset(ds, model: str | list[str] | EngineSpec, messages_column: str | None = None,
                     prompt_column: str | None = None, batch_size: int = 16, chat_opts: dict | None = None,
                     concurrency: int | None = None, **sampling):
    """`ds` with an `output` column: the chat model's answer to each row's conversation
    (`messages_column`: a list of {role, content}) or its completion of the row's text
    (`prompt_column`, no chat template). `sampling`: request fields (max_tokens, temperature,
    seed, ...) applied to every row; `chat_opts`: load options (e.g. max_num_sequences)."""
    if (messages_column is None) == (prompt_column is None):
        raise ValueError("Give exactly one of messages_column (conversations) or prompt_column (raw text).")
    col = messages_column or prompt_column
    if col not in ds.columns():
        raise ValueError(f"The dataset has no column {col!r}; its columns are {ds.columns()}.")
    return ds.map_batches(_Generator, fn_constructor_args=(_spec(model, chat_opts), messages_column,
                                                           prompt_column, dict(sampling)),
                          batch_size=batch_size, batch_format="numpy", **_pool_options(concurrency))
