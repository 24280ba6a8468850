"""Shared fixtures: one real WebGPU device for the session (no adapter = failure, never a skip),
the default models from the cache, and the golden reference data."""
from __future__ import annotations

import json
import os
import resource
import time
import weakref
from pathlib import Path

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = Path(__file__).resolve().parent / "reference"


_SESSION_DEVICE: list = []


@pytest.fixture(scope="session")
def device():
    """The real adapter's device. Fails loudly when WebGPU is missing."""
    from webgpu_engine.gpu import request_device_sync
    dev = request_device_sync()
    assert dev is not None
    _SESSION_DEVICE.append(dev)
    ask = dev.pipeline

    def pipeline(*args, **kw):           # what each module asks for, for _pipelines_per_module
        p = ask(*args, **kw)
        _ASKED_HERE.add(p.key)
        _ASKED_BY_TEST.add(p.key)
        return p
    dev.pipeline = pipeline
    yield dev


# Cached pipelines a run of tests may leave on the session device before they are dropped: on
# lavapipe each keeps ~10 MB of JIT code (a tiled matmul's more), and one kernel module compiles
# hundreds (a module-end release alone let test_kernels_matmul reach several GiB). A release after a
# test keeps the pipelines that test asked for (its next parametrisation likely asks again).
PIPELINE_CAP = 40
_CACHED_SINCE = [0]      # the session device's compile_count at its last release
# Pipelines kept through releases: those that two modules of this process or more asked for (the
# default models' kernels, which most model modules compile again otherwise), at most SHARED_CAP,
# those the latest module asked for first. A kernel module's own variants go at its end as before.
SHARED_CAP = 64
_MODULES_ASKING: dict = {}      # pipeline key -> how many modules of this process asked for it
_ASKED_HERE: set = set()        # keys the running module asked the session device for
_ASKED_BY_TEST: set = set()     # ... and the running test
_SHARED: list = []              # the keys kept, the most recently asked first


def _return_host_memory() -> None:
    """Collect reference cycles (an engine, its models and device stay in them after a test) and
    hand the freed heap back to the system (glibc keeps it otherwise: the RSS would not fall)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _release_pipelines(dev, keep: set = frozenset()) -> None:
    """Forget the device's pipelines and let the driver free them: pipelines that live ops hold
    (a module's loaded engine) stay alive through them; the rest compile again when next asked."""
    import gc
    # the device drops its whole cache; the shared pipelines and those of `keep` (compiled, and
    # warmed where they were) are put back into it (a test-only reach into the cache: pipeline()
    # would compile them again)
    kept = {k: p for k, p in dev._pipelines.items() if (k in keep or k in _SHARED) and p.ready}
    warmed = dev.warmed_pipelines & kept.keys()
    dev.forget_pipelines()
    gc.collect()
    probe = dev.buffer(16, owner="test:trim")
    dev.read_sync(probe, 0, 4)          # a round trip: the driver frees what was dropped
    dev.release_owner("test:trim")
    _return_host_memory()
    dev._pipelines.update(kept)
    dev.warmed_pipelines |= warmed
    _CACHED_SINCE[0] = dev.compile_count


def _live_session_device():
    return _SESSION_DEVICE[0] if _SESSION_DEVICE and not _SESSION_DEVICE[0].lost else None


# Every device made in this process (weakly): one a test leaves open (an engine made without a device
# and only unloaded, a server's engine) holds its compiled pipelines and threads to the process's end,
# as each of its own threads keeps it alive.
_DEVICES_MADE: weakref.WeakSet = weakref.WeakSet()


def _record_devices() -> None:
    from webgpu_engine.gpu.base import Device
    init = Device.__init__

    def recorded(self, *args, **kw):
        init(self, *args, **kw)
        _DEVICES_MADE.add(self)
    Device.__init__ = recorded


@pytest.fixture(scope="module", autouse=True)
def _pipelines_per_module():
    """After each module (its own fixtures torn down first): close the devices its tests left open,
    release the session device's pipelines but the shared ones."""
    yield
    for dev in list(_DEVICES_MADE):
        if dev not in _SESSION_DEVICE and not dev.lost:
            dev.close()
    _DEVICES_MADE.clear()
    for key in _ASKED_HERE:
        _MODULES_ASKING[key] = _MODULES_ASKING.get(key, 0) + 1
    shared = [k for k in _ASKED_HERE if _MODULES_ASKING[k] >= 2]
    _SHARED[:] = (shared + [k for k in _SHARED if k not in _ASKED_HERE])[:SHARED_CAP]
    _ASKED_HERE.clear()
    if (dev := _live_session_device()) is not None:
        _release_pipelines(dev)


@pytest.fixture(autouse=True)
def _pipeline_cap():
    """After a test that leaves more than PIPELINE_CAP pipelines cached since the last release:
    release them but the test's own (a kernel module's tests mostly compile pipelines of their own)."""
    _ASKED_BY_TEST.clear()
    yield
    if (dev := _live_session_device()) is not None and dev.compile_count - _CACHED_SINCE[0] > PIPELINE_CAP:
        _release_pipelines(dev, keep=_ASKED_BY_TEST)


@pytest.fixture
def return_host_memory():
    """After the test: its garbage collected and the heap trimmed at once, not at the module's end
    (for tests that each leave devices of their own with their compiled pipelines, ~0.3 GiB each
    on lavapipe, behind)."""
    yield
    _return_host_memory()


@pytest.fixture
def fresh_device():
    """A device of its own, for tests that destroy it."""
    from webgpu_engine.gpu import request_device_sync
    dev = request_device_sync()
    yield dev
    if not dev.lost:
        dev.close()


# The parallel phase's longest modules, longest first (seconds in a full `make test`, module table).
# xdist hands a worker its next module in collection order; its own order (most tests first) left
# the long modules of few tests (a browser, a Ray instance, lost devices, load cycles) for the end,
# where one worker ran them alone while the other had finished, each beside a worker grown by a
# hundred modules. Longest first, the short modules fill the end and the two finish together.
LONGEST_MODULES = ("test_kernels_matmul", "test_bench_scripts", "test_browser", "test_kernels_matmul_tiled",
                   "test_correctness", "test_device_loss", "test_kv_cache_dtype", "test_ray", "test_llama",
                   "test_batching", "test_memory", "test_server", "test_gemma4", "test_speculation",
                   "test_llm_pipeline", "test_phi3v", "test_anthropic", "test_cli", "test_families",
                   "test_engine")


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False      # the collection's order below, not xdist's


def pytest_collection_modifyitems(session, config, items):
    """Modules in LONGEST_MODULES' order, then the others by their number of tests (xdist's own
    order); a module's tests keep theirs."""
    if not hasattr(config, "workerinput"):
        return
    rank = {m: i for i, m in enumerate(LONGEST_MODULES)}
    count: dict[str, int] = {}
    for item in items:
        count[item.path.stem] = count.get(item.path.stem, 0) + 1
    items.sort(key=lambda it: (rank.get(it.path.stem, len(rank)), -count[it.path.stem], it.path.stem))


def _default_model(model_id: str) -> Path:
    from webgpu_engine import cache
    return Path(cache.default_model_path(model_id))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    p = _default_model("SmolLM2-135M-Instruct-Q4_1")
    assert p.is_file(), f"default chat model missing at {p}: run `make setup`"
    return p


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    p = _default_model("all-MiniLM-L6-v2")
    assert (p / "model.safetensors").is_file(), f"default embedder missing at {p}: run `make setup`"
    return p


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    return json.loads((REFERENCE / "smollm2_q4_1_transformers.json").read_text())


@pytest.fixture(scope="session")
def minilm_reference() -> dict:
    return json.loads((REFERENCE / "minilm_sentence_transformers.json").read_text())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skipped test is a failure here: a skip would hide a missing adapter, browser or model.
    A teardown's report carries the RSS of the process that ran the test (an xdist worker sends it
    with the report), for the module table."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = f"test skipped, which this suite treats as a failure: {rep.longrepr}"
    if call.when == "teardown":
        rep.user_properties.append(("process_rss_gib", _own_rss_gib()))


def _own_rss_gib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024 ** 3


_SUITE_T0 = time.perf_counter()      # reset when the session starts (below)
# test module -> [seconds, RSS GiB before its first test, peak RSS GiB after a test, the largest RSS GiB
# of the process running it after one of its tests]
_MODULES: dict[str, list[float]] = {}
_TREE_RSS = [0.0, 0.0]                 # RSS GiB of this process and its descendants: now, peak (sampled)


def _tree_rss_gib() -> float:
    """The resident set of this process and all its descendants together (xdist workers, the servers
    and browsers tests start), from /proc."""
    parent, rss = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(d)], rss[int(d)] = int(fields[1]), int(fields[21])
    tree, todo = set(), [os.getpid()]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [c for c, pp in parent.items() if pp == p and c not in tree]
    return sum(rss.get(p, 0) for p in tree) * os.sysconf("SC_PAGE_SIZE") / 1024 ** 3


def _sample_tree_rss() -> None:
    while True:
        try:
            _TREE_RSS[0] = _tree_rss_gib()
            _TREE_RSS[1] = max(_TREE_RSS[1], _TREE_RSS[0])
        except (OSError, ValueError):
            pass
        time.sleep(0.5)


def pytest_runtest_logstart(nodeid, location):
    mod = nodeid.split("::")[0]
    if mod not in _MODULES:
        _MODULES[mod] = [0.0, _TREE_RSS[0], 0.0, 0.0]


def pytest_runtest_logreport(report):
    m = _MODULES.get(report.nodeid.split("::")[0])
    if m is not None:
        m[0] += report.duration
        if report.when == "teardown":
            m[2] = max(m[2], _TREE_RSS[0])
            m[3] = max(m[3], dict(report.user_properties).get("process_rss_gib", 0.0))


def pytest_sessionstart(session):
    global _SUITE_T0
    _SUITE_T0 = time.perf_counter()
    _record_devices()
    if not hasattr(session.config, "workerinput"):      # the main process (an xdist worker: not)
        import threading
        _TREE_RSS[0] = _TREE_RSS[1] = _tree_rss_gib()
        threading.Thread(target=_sample_tree_rss, name="rss-sampler", daemon=True).start()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line on what the run cost, after the other summaries: wall time since the session
    started and the peak RSS of this process and its descendants together (xdist workers too),
    sampled every 0.5 s, and of the largest single process (ru_maxrss is KiB on Linux). With
    workers, the module table's seconds are each module's own; its RSS is all processes'."""
    if len(_MODULES) > 1:
        terminalreporter.write_line("slowest test modules (s; RSS GiB of all the suite's processes before -> "
                                    "peak after a test; the largest RSS GiB of the process running it "
                                    "after one of its tests):")
        for mod, (sec, before, peak, own) in sorted(_MODULES.items(), key=lambda kv: -kv[1][0])[:20]:
            terminalreporter.write_line(f"  {sec:7.1f}  {before:5.2f} -> {peak:5.2f}  {own:5.2f}  {mod}")
        largest = sorted(_MODULES.items(), key=lambda kv: -kv[1][3])[:8]
        terminalreporter.write_line("the largest process after a test of: " + ", ".join(
            f"{mod.rsplit('/', 1)[-1]} {m[3]:.2f}" for mod, m in largest))
    gib = 1024 ** 2
    one = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / gib
    tree = max(_TREE_RSS[1], _TREE_RSS[0])
    terminalreporter.write_line(f"suite: wall {time.perf_counter() - _SUITE_T0:.1f} s, peak RSS {tree:.2f} GiB "
                                f"(all its processes together; the largest one {one:.2f} GiB)")
