"""What images were once refused with and now run: a projector GGUF quantised whole (its position
table and Gemma 3's projection, read on the host, dequantised as ggml does)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from _nn_util import get
from webgpu_engine.errors import UnsupportedModelError
from webgpu_engine.kernels.common import Tensor
from webgpu_engine.loaders.gguf import GGUFFile
from webgpu_engine.vision import gemma3
from webgpu_engine.vision.config import patches
from webgpu_engine.vision.images import decode_bytes
from webgpu_engine.vision.mmproj import MmprojFile

FIXTURES = Path(__file__).parent / "fixtures"
PAIR, IMAGES = FIXTURES / "mmproj_gguf", FIXTURES / "vision_images"
TEXT, PROJ = PAIR / "tiny-gemma3.gguf", PAIR / "mmproj-tiny-gemma3.gguf"
HOST_TABLES = ("v.position_embd.weight", "mm.input_projection.weight")


def rewrite_gguf(src: Path, dst: Path, tensor=None, *, meta: dict | None = None, extra=()) -> Path:
    """A copy of GGUF `src` at `dst`: each tensor as `tensor(name, data, type)` returns it ((data, type)
    for gguf-py's writer, None: dropped), metadata values replaced by `meta`, then the GGUFs `extra`'s
    metadata and tensors added (the gguf package)."""
    import gguf
    readers = [gguf.GGUFReader(str(src))] + [gguf.GGUFReader(str(e)) for e in extra]
    arch = str(bytes(readers[0].fields["general.architecture"].parts[-1]), "utf-8")
    w, seen = gguf.GGUFWriter(str(dst), arch), set()
    for r in readers:
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name in seen or name in ("general.architecture", "general.alignment"):
                continue
            seen.add(name)
            vtype, value = f.types[0], (meta or {}).get(name, f.contents())
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(name, value, vtype, sub_type=f.types[-1])
            else:
                w.add_key_value(name, value, vtype)
    for key, value in (meta or {}).items():
        if key not in seen:
            w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for r in readers:
        for t in r.tensors:
            got = tensor(t.name, t.data, t.tensor_type) if tensor else (t.data, t.tensor_type)
            if got is not None:
                w.add_tensor(t.name, got[0], raw_dtype=got[1])
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return dst


def _as_floats(data, t):
    import gguf
    return np.asarray(gguf.quants.dequantize(data, t), np.float32)


def _features(device, proj: Path) -> np.ndarray:
    """The tower's projected features for each fixture picture, from projector file `proj`."""
    from webgpu_engine.models.siglip import SiglipTower
    with GGUFFile(TEXT) as g:
        f = MmprojFile(proj, g.tokenizer())
    try:
        cfg, tower = f.cfg, SiglipTower(device, f.cfg, f.tensors, owner="test:refusals")
    finally:
        f.close()
    try:
        names, n = sorted(p.name for p in IMAGES.glob("*.png")), cfg.tokens_per_image
        out = Tensor(device.buffer(len(names) * n * cfg.text_hidden * 4, owner="test:refusals"),
                     (len(names) * n, cfg.text_hidden), "f32")
        for i, name in enumerate(names):
            picture = decode_bytes((IMAGES / name).read_bytes(), name).image
            tower.write_patches(patches(cfg, gemma3.preprocess(cfg, picture)))
            device.submit(tower.record(device.batch(), out, i))
        return get(device, out)
    finally:
        tower.dispose()
        device.release_owner("test:refusals")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_quantised_host_tables_read_as_their_values(device, tmp_path, qtype):
    """An mmproj whose position table and Gemma 3 projection are stored as Q8_0 / Q4_0 / F16 (gguf-py's
    quantiser, ggml's blocks) gives the features of a file holding the same values in f32, and
    stays near the original file's."""
    import gguf
    T = gguf.GGMLQuantizationType

    def stored(name, data, t):
        if name in HOST_TABLES:
            return gguf.quants.quantize(_as_floats(data, t), T[qtype]), T[qtype]
        return data, t

    def as_f32(name, data, t):
        if name in HOST_TABLES:
            return _as_floats(gguf.quants.quantize(_as_floats(data, t), T[qtype]), T[qtype]), T.F32
        return data, t

    quantised = rewrite_gguf(PROJ, tmp_path / f"mmproj-{qtype}.gguf", stored)
    with GGUFFile(quantised) as g:
        assert {g.tensors[n].qtype for n in HOST_TABLES} == {qtype.lower()}
    got = _features(device, quantised)
    want = _features(device, rewrite_gguf(PROJ, tmp_path / "mmproj-f32.gguf", as_f32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    original = _features(device, PROJ)
    assert 0 < np.abs(got - original).max() < (0.2 if qtype == "Q4_0" else 0.02) * np.abs(original).max()


def test_a_host_table_in_a_type_not_dequantised_is_refused_by_name(device):
    """A position table in a type the engine has no dequantiser for: a typed error naming the tensor."""
    from webgpu_engine.models.siglip import SiglipTower
    with GGUFFile(TEXT) as g:
        f = MmprojFile(PROJ, g.tokenizer())
    try:
        name = "vision_tower.embeddings.position_embedding.weight"
        f.tensors[name] = replace(f.tensors[name], qtype="tq1_0")
        with pytest.raises(UnsupportedModelError, match="v.position_embd.weight is tq1_0, which this engine"):
            SiglipTower(device, f.cfg, f.tensors, owner="test:refusals")
    finally:
        f.close()
        device.release_owner("test:refusals")
