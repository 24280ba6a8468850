"""A Hugging Face download that fails or is interrupted leaves nothing half-written in the HF cache
(cache/hf.py): no `*.incomplete` part of its own, while the parts of other downloads stay. A local
hub (tests/hf_hub_server.py, through HF_ENDPOINT) serves a file whose connection drops midway; the
behaviour of huggingface_hub releases that keep the part to resume it (before 1.x) is reproduced by
standing in for the one function that writes it. No network."""
from __future__ import annotations

from pathlib import Path

import pytest
from filelock import FileLock

from hf_hub_server import HubServer
from test_references import _folder_files
from tinymodels import write_tiny_bert
from webgpu_engine import errors as E
from webgpu_engine.cache import hf
from webgpu_engine.engine.records import EMBEDDING
from webgpu_engine.engine.references import resolve_model_reference

WEIGHTS = bytes(range(256)) * 800           # 200 KiB, cut after 50 000 bytes


def _parts(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*.incomplete"))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("WEBGPU_ENGINE_OFFLINE", raising=False)
        monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path / "artifacts"))
        yield server


def test_a_download_cut_midway_leaves_no_part_and_the_next_one_completes(hub, tmp_path):
    cache = tmp_path / "hub-cache"
    hub.add_repo("hub-org/flaky", {"config.json": b"{}", "model.safetensors": WEIGHTS})
    hub.break_after("hub-org/flaky", "model.safetensors", 50_000)
    assert hf.download_file("hub-org/flaky", "config.json").read_bytes() == b"{}"
    with pytest.raises(E.ArtifactFetchError, match="hub-org/flaky: fetching model.safetensors failed"):
        hf.download_file("hub-org/flaky", "model.safetensors")
    assert hub.downloads("hub-org/flaky", "model.safetensors") >= 1
    assert _parts(cache) == []
    blobs = sorted(p.stat().st_size for p in (cache / "models--hub-org--flaky" / "blobs").iterdir())
    assert blobs == [2]                                              # config.json alone, whole
    del hub.broken["hub-org/flaky/model.safetensors"]               # the hub recovers
    assert hf.download_file("hub-org/flaky", "model.safetensors").read_bytes() == WEIGHTS
    assert _parts(cache) == []


def test_a_folder_reference_cut_midway_leaves_no_part(hub, tmp_path):
    bert = write_tiny_bert(tmp_path / "tiny-bert")["folder"]
    files = {name: p.read_bytes() for name, p in _folder_files(bert).items()}
    hub.add_repo("hub-org/tiny-minilm", files)
    hub.break_after("hub-org/tiny-minilm", "model.safetensors", len(files["model.safetensors"]) // 3)
    with pytest.raises(E.ArtifactFetchError, match="fetching the files of hub-org/tiny-minilm failed"):
        resolve_model_reference("hub-org/tiny-minilm")
    assert _parts(tmp_path / "hub-cache") == []
    hub.broken.clear()
    rec = resolve_model_reference("hub-org/tiny-minilm")
    assert rec.model_type == EMBEDDING
    assert (Path(rec.model) / "model.safetensors").read_bytes() == files["model.safetensors"]


@pytest.mark.parametrize("failure", [OSError("connection reset"), KeyboardInterrupt()])
def test_only_this_downloads_parts_are_removed(hub, tmp_path, monkeypatch, failure):
    """As huggingface_hub before 1.x: the part `<etag>.incomplete` is kept on failure, to resume."""
    import huggingface_hub.file_download as fd
    cache = tmp_path / "hub-cache"
    hub.add_repo("hub-org/flaky", {"config.json": b"{}", "model.safetensors": WEIGHTS})
    hf.download_file("hub-org/flaky", "config.json")
    blobs, locks = cache / "models--hub-org--flaky" / "blobs", cache / ".locks" / "models--hub-org--flaky"
    (blobs / "stale.incomplete").write_bytes(b"left by an earlier run")    # not this download's
    busy = FileLock(str(locks / "busy.lock"))
    seen = []

    def keeps_its_part(*, incomplete_path: Path, **kw):
        with open(incomplete_path, "ab") as f:
            f.write(WEIGHTS[:1000])
        (blobs / "busy.incomplete").write_bytes(b"another download, writing now")
        seen.append(incomplete_path.name)
        raise failure
    monkeypatch.setattr(fd, "_download_to_tmp_and_move", keeps_its_part)
    with busy:                                  # the other download holds its lock throughout
        with pytest.raises(type(failure) if isinstance(failure, KeyboardInterrupt) else E.ArtifactFetchError):
            hf.download_file("hub-org/flaky", "model.safetensors")
        assert seen and seen[0] not in _parts(cache)
        assert _parts(cache) == ["busy.incomplete", "stale.incomplete"]
