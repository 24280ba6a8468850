"""safetensors reader (and a tiny writer) in pure Python: zero-copy tensor views, sharded HF folders.

Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the data; offsets are relative to the end of the header. Parses paths (mmapped) or any buffer,
so the browser can hand fetched bytes over. Weights keep their dtype (f32/f16/bf16 go to the GPU
as stored).
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from ..errors import ModelFormatError
from .gguf import MappedFile, _as_buffer
from .tensor_info import TensorInfo

# safetensors dtype -> (our name, bytes per element)
DTYPES = {
    "F32": ("f32", 4), "F16": ("f16", 2), "BF16": ("bf16", 2), "F64": ("f64", 8),
    "I64": ("i64", 8), "I32": ("i32", 4), "I16": ("i16", 2), "I8": ("i8", 1), "U8": ("u8", 1),
    "BOOL": ("bool", 1), "U16": ("u16", 2), "U32": ("u32", 4), "U64": ("u64", 8),
}
_TO_ST = {ours: st for st, (ours, _) in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"


class SafetensorsFile(MappedFile):
    """One .safetensors file: `tensors` {name: TensorInfo} in header order, `metadata` (__metadata__)."""

    def __init__(self, source):
        self._buf, self._mmap, self.where = _as_buffer(source)
        if len(self._buf) < 8:
            raise ModelFormatError(f"{self.where}: too short for a safetensors file")
        (n,) = struct.unpack_from("<Q", self._buf, 0)
        if 8 + n > len(self._buf):
            raise ModelFormatError(f"{self.where}: header length {n} runs past the end of the file "
                                   f"({len(self._buf)} bytes): not safetensors, or truncated")
        try:
            header = json.loads(str(self._buf[8:8 + n], "utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFormatError(f"{self.where}: safetensors header is not JSON: {e}") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            try:
                dtype, size = DTYPES[h["dtype"]]
                shape = tuple(int(d) for d in h["shape"])
                a, b = (int(x) for x in h["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ModelFormatError(f"{self.where}: bad header entry for {name}: {h!r}") from e
            if b - a != math.prod(shape) * size or start + b > len(self._buf) or a < 0:
                raise ModelFormatError(f"{self.where}: tensor {name} ({h['dtype']} {list(shape)}) has offsets "
                                       f"[{a}, {b}] that do not fit its size or the file: truncated?")
            self.tensors[name] = TensorInfo(name, dtype, shape, self._buf[start + a:start + b], start + a)


class SafetensorsFolder:
    """A Hugging Face model folder: one model.safetensors, or shards listed by model.safetensors.index.json.
    `tensors` {file name of tensor: TensorInfo}; `weights(kind)` maps them to our names (hf_config)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
            files = list(dict.fromkeys(weight_map.values()))
        elif (self.folder / "model.safetensors").is_file():
            weight_map, files = None, ["model.safetensors"]
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
            if not files:
                raise ModelFormatError(f"{self.folder} holds no .safetensors file")
        self.files = {f: SafetensorsFile(self.folder / f) for f in files}
        self.tensors: dict[str, TensorInfo] = {}
        for fname, sf in self.files.items():
            for name, t in sf.tensors.items():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue
                self.tensors[name] = t
        if weight_map is not None:
            missing = set(weight_map) - set(self.tensors)
            if missing:
                raise ModelFormatError(f"{index}: tensors {sorted(missing)[:5]} are missing from their shards")

    def weights(self, kind: str = "llama") -> dict[str, TensorInfo]:
        """{our name: TensorInfo}; kind "llama" (Llama/Qwen2/Mistral) or "bert"."""
        from .hf_config import map_hf_names
        return map_hf_names(self.tensors, kind)

    def close(self) -> None:
        for sf in self.files.values():
            sf.close()


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write {name: (dtype "f32"|"f16"|"bf16"|..., shape, bytes-like)} as a .safetensors file."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, pos = [], 0
    for name, (dtype, shape, data) in tensors.items():
        data = memoryview(data).cast("B")
        header[name] = {"dtype": _TO_ST[dtype], "shape": list(shape), "data_offsets": [pos, pos + data.nbytes]}
        blobs.append(data)
        pos += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)                 # data stays 8-byte aligned, as the reference writer does
    with open(os.fspath(path), "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def load_safetensors_folder(folder) -> dict[str, TensorInfo]:
    """{HF tensor name: TensorInfo} of a model folder (single file or sharded). The views keep their
    files mapped for as long as they live."""
    return dict(SafetensorsFolder(folder).tensors)
