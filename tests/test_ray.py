"""Scaling out on Ray (webgpu_engine.ray): one local Ray instance for the module (2 CPUs, four
`webgpu` devices declared: two replicas plus the Ray Data actors), tiny models written here.

Online: the server's app served from two Ray Serve replicas, answers compared with an engine in
this process; prefix affinity, spreading, streaming, typed errors and the API key through the
front; a replica killed with SIGKILL; `serve --ray-replicas` stopped by SIGTERM leaves no Ray
process. Batch: embed_dataset / generate_dataset equal the engine's own answers.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import ray

from tinymodels import write_tiny_bert, write_tiny_llama_gguf
from webgpu_engine.ray import embed_dataset, generate_dataset
from webgpu_engine.ray.host import EngineSpec, connect, open_engine
from webgpu_engine.ray.launch import RayOptions, ray_server_options
from webgpu_engine.ray.proxy import REPLICA_HEADER
from webgpu_engine.server.app import ServerOptions, ServerThread

LOAD = {"compile_at_load": False}
KEY = "ray-test-key"
LONG_SYSTEM = ("You are the support assistant of a small bakery. Answer in one short sentence, politely, "
               "and never invent opening hours, prices or ingredients that are not listed here. " * 3)


@pytest.fixture(scope="module")
def cluster():
    started = connect(None, num_devices=4, num_cpus=2)
    assert started, "a Ray instance was already initialised in this test process"
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    chat = write_tiny_llama_gguf(d / "tiny.gguf", qtype="q8_0", context_length=1024)["path"]
    write_tiny_bert(d / "tiny-bert")
    return {"chat": str(chat), "embed": str(d / "tiny-bert")}


@pytest.fixture(scope="module")
async def local(models, device):
    """The same models in this process: what the replicas' answers must equal."""
    eng = await open_engine(EngineSpec([models["chat"], models["embed"]], chat_opts=[LOAD, None],
                                       engine_kwargs={"device": device}))
    yield eng
    await eng.unload()


@pytest.fixture(scope="module")
def served(cluster, models):
    spec = EngineSpec([models["chat"]], chat_opts=[LOAD])
    s = ServerThread(ray_server_options(ServerOptions(models=["tiny"], port=0, api_key=KEY), spec,
                                        RayOptions(replicas=2)))
    yield s
    s.stop()


def _post(server, path, body, key=KEY):
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def _chat(server, messages, **kw):
    status, headers, text = _post(server, "/v1/chat/completions",
                                  {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, **kw})
    assert status == 200, text
    return json.loads(text)["choices"][0]["message"]["content"], headers[REPLICA_HEADER]


async def _local_answer(local, messages, **kw):
    res = await local.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, **kw)
    return res.choices[0].message.content


# --------------------------------------------------------------------------- serve --ray-replicas
# First in the module: its own Ray instance stops before the module's cluster starts (the two
# together held the module's peak RSS).
def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in children.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_serve_ray_replicas_stops_its_ray_instance_on_sigterm(models, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(tmp_path / "serve.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "webgpu_engine", "serve", "--ray-replicas", "1", "--model",
                          models["chat"], "--port", str(port), "--chat-opts", json.dumps(LOAD)],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert p.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve --ray-replicas did not get ready"
            time.sleep(0.5)
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(),
                headers={"Content-Type": "application/json"}), timeout=60) as r:
            assert r.status == 200 and r.headers[REPLICA_HEADER]
        ray_procs = _descendants(p.pid)
        assert ray_procs                # gcs_server, raylet, the Serve controller and replica, ...
        p.send_signal(signal.SIGTERM)
        assert p.wait(90) == 0
        deadline = time.monotonic() + 20
        while any(_running(k) for k in ray_procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [k for k in ray_procs if _running(k)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- batch
async def test_embed_dataset_equals_the_engines_embeddings(cluster, models, local):
    texts = [f"passage {i}: the {['cat', 'dog', 'bird'][i % 3]} sat on mat {i}" for i in range(300)]
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
    rows = embed_dataset(ds, model=models["embed"], batch_size=64, concurrency=1).take_all()
    assert len(rows) == 300
    got = {r["id"]: r["embedding"] for r in rows}
    ref = (await local.embeddings.create(model="tiny-bert", input=texts)).data
    a = np.stack([got[i] for i in range(300)]).astype(np.float64)
    b = np.asarray([d.embedding for d in ref], np.float64)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() >= 0.9999, cos.min()


async def test_generate_dataset_equals_greedy_answers(cluster, models, local):
    convs = [[{"role": "user", "content": f"question {i}: name a colour"}] for i in range(5)]
    ds = ray.data.from_items([{"id": i, "messages": c} for i, c in enumerate(convs)])
    rows = generate_dataset(ds, model=models["chat"], messages_column="messages", chat_opts=LOAD,
                            concurrency=1, max_tokens=6, temperature=0).take_all()
    got = {r["id"]: r["output"] for r in rows}
    assert [got[i] for i in range(5)] == [await _local_answer(local, c) for c in convs]
    prompts = ["Once upon a time", "The quick brown fox"]
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    rows = generate_dataset(ds, model=models["chat"], prompt_column="prompt", chat_opts=LOAD,
                            concurrency=1, max_tokens=6, temperature=0).take_all()
    got = {r["id"]: r["output"] for r in rows}
    for i, p in enumerate(prompts):
        ref = await local.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
        assert got[i] == ref.choices[0].text


def test_generate_dataset_wants_one_column(cluster, models):
    ds = ray.data.from_items([{"p": "x", "m": []}])
    with pytest.raises(ValueError, match="exactly one"):
        generate_dataset(ds, model=models["chat"], messages_column="m", prompt_column="p")
    with pytest.raises(ValueError, match="no column 'text'"):
        embed_dataset(ds, model=models["embed"])


# --------------------------------------------------------------------------- routing (no cluster)
def _router_and_replicas(n: int):
    from types import SimpleNamespace
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
    from webgpu_engine.ray.router import PrefixAffinityRouter
    dep = DeploymentID(name="engine", app_name="app")
    router = PrefixAffinityRouter(dep, DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    reps = [SimpleNamespace(replica_id=ReplicaID(unique_id=f"r{i}", deployment_id=dep)) for i in range(n)]
    return router, reps


def _pending(i: int, key: str):
    from types import SimpleNamespace
    return SimpleNamespace(kwargs={"affinity": key}, metadata=SimpleNamespace(internal_request_id=f"req{i}"))


async def test_a_burst_of_new_conversations_spreads_evenly_before_any_is_routed():
    router, reps = _router_and_replicas(2)
    picks = [(await router.choose_replicas(reps, _pending(i, f"conv{i}")))[0][0].replica_id for i in range(16)]
    assert [picks.count(r.replica_id) for r in reps] == [8, 8]
    # routed where picked, then the conversation's next turn goes back to its replica, even though busy
    for i, rid in enumerate(picks):
        router.on_request_routed(_pending(i, f"conv{i}"), rid, None)
    assert (await router.choose_replicas(reps, _pending(99, "conv3")))[0][0].replica_id == picks[3]
    # requests completing on r0 make it the least loaded for a new conversation
    for i, rid in enumerate(picks):
        if rid == reps[0].replica_id:
            router.on_request_completed(rid, f"req{i}")
    assert (await router.choose_replicas(reps, _pending(100, "new")))[0][0].replica_id == reps[0].replica_id


async def test_a_replica_whose_device_is_lost_and_not_recovered_fails_its_health_check(models):
    """Ray Serve replaces a replica whose check_health raises: a lost device without auto_recover
    does; with auto_recover (the next request reloads) it does not."""
    from webgpu_engine import gpu
    from webgpu_engine.ray.deployment import EngineReplica
    for auto in (False, True):
        eng = await open_engine(EngineSpec([models["chat"]], chat_opts=[LOAD],
                                           engine_kwargs={"device": await gpu.request_device()}))
        eng.config.auto_recover = auto
        replica = object.__new__(EngineReplica)
        replica.engine = eng
        replica.check_health()                                  # healthy
        eng.device.destroy()
        with pytest.raises(Exception):
            await eng.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert eng.state == "device_lost"
        if auto:
            replica.check_health()                              # the next request reloads: stay
        else:
            with pytest.raises(RuntimeError, match="device was lost"):
                replica.check_health()
        await eng.unload()


# --------------------------------------------------------------------------- online
# Last in the module: the two replicas live to its end; Ray Data's actors (a model each) and the
# health check's engines are gone before they start.
async def test_two_replicas_answer_as_the_engine_and_conversations_spread(served, local):
    replicas = set()
    for i in range(6):
        conv = [{"role": "user", "content": f"conversation {i}: what is {i} plus {i}?"}]
        text, replica = _chat(served, conv)
        assert text == await _local_answer(local, conv)
        replicas.add(replica)
    assert len(replicas) == 2           # six different conversations on an idle pair: both serve


def test_a_shared_long_system_prompt_stays_on_one_replica(served):
    replicas = [_chat(served, [{"role": "system", "content": LONG_SYSTEM},
                               {"role": "user", "content": q}])[1]
                for q in ("Do you sell rye bread?", "When do you open?", "Is there a cafe?", "Thanks!")]
    assert len(set(replicas)) == 1, replicas


async def test_streaming_through_ray_equals_the_plain_answer(served, local):
    conv = [{"role": "user", "content": "stream this please"}]
    c = openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0)
    with c.chat.completions.with_streaming_response.create(model="tiny", messages=conv, max_tokens=6,
                                                           temperature=0, stream=True) as resp:
        assert resp.headers.get(REPLICA_HEADER)
        chunks = list(resp.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(chunks) >= 2
    assert text == await _local_answer(local, conv)


def test_errors_and_the_api_key_are_the_servers(served):
    status, _, text = _post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                            key="wrong")
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    status, headers, text = _post(served, "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x"}], "max_tokens": -4})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
    assert headers.get(REPLICA_HEADER)          # the replica that refused it
    status, _, text = _post(served, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}], "max_tokens": -4, "stream": True})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"   # before any SSE
    status, _, text = _post(served, "/v1/responses", {"model": "tiny", "input": "hi"})
    assert status == 400 and json.loads(text)["error"]["type"] == "feature_unsupported"
    # the front still serves
    assert _chat(served, [{"role": "user", "content": "still there?"}])[0] is not None


def test_a_replica_killed_with_sigkill_loses_no_later_request(served):
    info = served.engine.handle.describe.remote().result(timeout_s=60)
    os.kill(info["pid"], signal.SIGKILL)
    answers = [_chat(served, [{"role": "user", "content": f"after the kill {i}"}]) for i in range(6)]
    assert len(answers) == 6
    assert info["replica"] not in {r for _, r in answers}
