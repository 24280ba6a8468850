"""Qwen3.5's recurrent states as sequences share and step them back: the kernels' state snapshots
(a row's state saved into another slot, a slot copied back: kernels/deltanet.py) against their numpy
references, and the paged batch (models/recurrent_snapshots.py): prefix reuse from a snapshot,
speculation (prompt lookup, a draft model) whose rejected guesses roll the states back and context
shifts, each answer equal to the request alone without them, and transformers' greedy tokens
(tests/fixtures/qwen35_transformers.json)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from test_qwen35 import FIXTURES, _delta_inputs, _delta_ref, _rows
from tinyqwen35 import write_tiny_qwen35_safetensors
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
from webgpu_engine.kernels import deltanet, deltanet_ref
from _nn_util import TOL, empty, get, put, rounded, run


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_causal_conv1d_saves_the_state_after_chosen_rows(device, dtype):
    """Two sequences' rows in one call (slot 0 from position 5, slot 1 from 0), rows 2 and 6 saving
    their states into slots 3 and 2: each saved slot holds the state after its row, the outputs and
    the sequences' own states are those without saves."""
    rng = np.random.default_rng(11)
    C, K = 20, 4
    w, s0 = rng.standard_normal((C, K)), rng.standard_normal((4, C, K - 1))
    x = rng.standard_normal((8, C))
    state, wt = put(device, s0), put(device, w)
    xt, yt = put(device, x, dtype), empty(device, (8, C), dtype)
    slots = [deltanet.row_slot(0)] * 2 + [deltanet.row_slot(0, save=3)] + [deltanet.row_slot(0)] * 2 + \
        [deltanet.row_slot(1)] + [deltanet.row_slot(1, save=2), deltanet.row_slot(1)]
    run(device, deltanet.causal_conv1d(device, xt, wt, state, yt, channels=C,
                                       rows=_rows(device, [5, 6, 7, 8, 9, 0, 1, 2], slots)))
    got, st = get(device, yt), get(device, state)
    xr = rounded(x, dtype)
    want_a, sa = deltanet_ref.causal_conv1d(xr[:5], w, s0[0])
    want_b, sb = deltanet_ref.causal_conv1d(xr[5:], w, None)
    np.testing.assert_allclose(got, np.concatenate([want_a, want_b]), **TOL[dtype])
    np.testing.assert_allclose(st[0], sa, **TOL[dtype])
    np.testing.assert_allclose(st[1], sb, **TOL[dtype])
    np.testing.assert_allclose(st[3], deltanet_ref.causal_conv1d(xr[:3], w, s0[0])[1], **TOL[dtype])
    np.testing.assert_allclose(st[2], deltanet_ref.causal_conv1d(xr[5:7], w, None)[1], **TOL[dtype])


def test_gated_delta_rule_saves_the_state_after_chosen_rows(device):
    """A verify step's rows (slot 1: a decode row and three guesses at positions 9..12, the first
    three saving into slots 2..4) beside another sequence's row: each saved slot is the state after
    its row, bit for bit the state a call stopping there leaves; outputs and last states unchanged."""
    rng = np.random.default_rng(12)
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    qkv, proj, hw = _delta_inputs(rng, 5, Hk, Hv, Dk, Dv)
    s0 = rng.standard_normal((5, Hv, Dk, Dv)) * 0.3
    hwt = put(device, hw)

    def call(T, positions, slots):
        state = put(device, s0)
        yt = empty(device, (T, Hv * Dv))
        run(device, deltanet.gated_delta_rule(device, put(device, qkv[:T]), put(device, proj[:T]), hwt, state, yt,
                                              n_k_heads=Hk, n_v_heads=Hv, k_dim=Dk, v_dim=Dv, z_col=3, eps=1e-6,
                                              rows=_rows(device, positions, slots)))
        return get(device, yt), get(device, state)

    saves = [deltanet.row_slot(1, save=s) for s in (2, 3, 4)] + [deltanet.row_slot(1), deltanet.row_slot(0)]
    got, st = call(5, [9, 10, 11, 12, 3], saves)
    want, ws = _delta_ref(qkv[:4], proj[:4], hw, s0[1], Hk, Hv, Dk, Dv)
    np.testing.assert_allclose(got[:4], want, **TOL["f32"])
    np.testing.assert_allclose(st[1], ws, **TOL["f32"])
    np.testing.assert_allclose(st[0], _delta_ref(qkv[4:5], proj[4:5], hw, s0[0], Hk, Hv, Dk, Dv)[1], **TOL["f32"])
    for n, slot in ((1, 2), (2, 3), (3, 4)):
        np.testing.assert_allclose(st[slot], _delta_ref(qkv[:n], proj[:n], hw, s0[1], Hk, Hv, Dk, Dv)[1],
                                   **TOL["f32"])
        alone = call(n, [9, 10, 11][:n], [deltanet.row_slot(1)] * n)[1]
        np.testing.assert_array_equal(st[slot], alone[1])          # the state a shorter step leaves


def test_state_copy_copies_whole_slots(device):
    """Two pairs of a table of three (the third past the count): the destinations equal their
    sources exactly, every other slot is untouched (an odd slot size: a last partial group)."""
    rng = np.random.default_rng(13)
    s = rng.standard_normal((6, 3, 7, 5)).astype(np.float32)
    state = put(device, s)
    pairs = put(device, np.array([2, 4, 0, 5, 2, 1, 3]), "u32")
    run(device, deltanet.state_copy(device, state, pairs, max_pairs=3))
    np.testing.assert_array_equal(get(device, state), deltanet_ref.state_copy(s, [(4, 0), (5, 2)]))


# --------------------------------------------------------------------------- the batch
PROMPT_CHARS = 270              # the fixture's text[:270] is its 300 prompt ids
SUFFIXES = ["", " And then?", " Köln, 東京 🌍 again and again", " The lazy dog sleeps."]
OPTS = {"dtype": "f32", "compile_at_load": False, "context_window_size": 512, "prefill_chunk_size": 64,
        "max_num_sequences": 4, "kv_block_size": 16}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, ref):
    return str(write_tiny_qwen35_safetensors(tmp_path_factory.mktemp("qwen35b") / "qwen35", seed=ref["seed"])["folder"])


@pytest.fixture(scope="module")
def ref() -> dict:
    return json.loads((FIXTURES / "qwen35_transformers.json").read_text())


async def _engine(device, folder: str, model_id: str, **opts):
    app = default_app_config().with_records(ModelRecord(model_id, folder, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload(model_id, {**OPTS, **opts})
    return eng


def _sched(eng):
    return next(iter(eng.models.values())).pipeline.scheduler


async def _answer(eng, prompt: str, max_tokens: int = 16):
    r = await eng.completions.create(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                     logprobs=1)
    c = r.choices[0]
    return c.text, list(zip(c.logprobs.tokens, c.logprobs.token_logprobs)), r.usage.prompt_tokens


@pytest.fixture(scope="module")
async def alone(device, folder, ref):
    """Each prompt's answer alone, from a zero state (no snapshot is ever reusable, so no prefix is):
    the prompts sharing the fixture's, and for speculation prompts x + (x's answer) + x, whose
    answers prompt lookup sometimes guesses (the tiny random model repeats little), with theirs."""
    eng = await _engine(device, folder, "qwen35-alone")
    try:
        snaps = _sched(eng).snapshots
        snaps.reusable = lambda key: False
        prompts = [ref["text"][:PROMPT_CHARS] + s for s in SUFFIXES]
        out = [await _answer(eng, p) for p in prompts]
        t = ref["text"]
        spec = [x + (await _answer(eng, x, 24))[0] + x for x in (t[:60], t[100:150], "Hello there", t[:150])]
        spec_out = [await _answer(eng, p, 40) for p in spec]
        assert snaps.stats["restored"] == 0 and _sched(eng).pool.stats["hit_tokens"] == 0
        return prompts, out, spec, spec_out
    finally:
        await eng.unload()


async def test_four_sequences_sharing_a_prefix_start_from_its_snapshot(device, folder, ref, alone):
    """The fixture's prompt alone (its block ends' states saved), then four prompts sharing it at once:
    each takes the cached blocks up to a block whose state is kept and starts from that snapshot, and
    answers as alone without reuse (text and logprobs: bit for bit, the prefill rows being row
    invariant); the fixture's prompt gives transformers' 16 greedy tokens. A follow-up turn (prompt,
    answer, more) reuses its prefix too."""
    from webgpu_engine.loaders.tokenizer import load_tokenizer
    prompts, want = alone[:2]
    eng = await _engine(device, folder, "qwen35-reuse")
    try:
        sched = _sched(eng)
        snaps, pool = sched.snapshots, sched.pool
        first = await _answer(eng, prompts[0])
        assert first == want[0] and first[2] == ref["prompt_len"]
        assert first[0] == load_tokenizer(folder).decode(ref["greedy"])        # transformers' 16 tokens
        saved, hits = snaps.stats["saved"], pool.stats["hit_tokens"]
        assert saved >= ref["prompt_len"] // 16
        together = await asyncio.gather(*(_answer(eng, p) for p in prompts))
        assert list(together) == want
        assert snaps.stats["restored"] == 4
        assert pool.stats["hit_tokens"] - hits >= 4 * 16 * (ref["prompt_len"] // 16 - 1)
        follow = prompts[1] + want[1][0] + " Tell me more."
        again = await _answer(eng, follow)
        assert snaps.stats["restored"] == 5
        snaps.reusable = lambda key: False
        assert again == await _answer(eng, follow) and snaps.stats["restored"] == 5
        pool.check()
        assert not sched.running
    finally:
        await eng.unload()


async def test_speculation_rolls_the_states_back_past_rejected_guesses(device, folder, alone):
    """Prompt lookup guesses for four sequences at once (and two alone): a verify step's rows advance
    the states token by token, each row but a sequence's last saving its state; a rejected guess rolls
    them back to the state after the kept rows, and every answer equals the request without
    speculation (text and logprobs)."""
    prompts, want = alone[2:]
    eng = await _engine(device, folder, "qwen35-spec",
                        speculation={"method": "ngram", "k": 3, "n_min": 1, "auto_off": False})
    try:
        sched = _sched(eng)
        assert sched.spec is not None and len(sched.snapshots.verify) == sched.spec.rows_cap - 1
        assert [await _answer(eng, p, 40) for p in prompts[:2]] == want[:2]
        assert list(await asyncio.gather(*(_answer(eng, p, 40) for p in prompts))) == want
        stats = sched.pipe.spec_stats
        assert 0 < stats.accepted < stats.proposed and sched.snapshots.stats["rolled_back"] > 0
        sched.pool.check()
    finally:
        await eng.unload()


def test_memory_estimate_counts_the_snapshots(folder):
    """The paged batch's estimate counts every state slot it allocates: one per sequence and the
    prefix snapshots beside them."""
    from webgpu_engine.models.memory import estimate_llm
    from webgpu_engine.models.plan import DecoderPlan
    from webgpu_engine.models.recurrent_snapshots import snapshot_slots
    from webgpu_engine.models.registry import open_model
    opened = open_model(folder)
    try:
        cfg, plan = opened.config, DecoderPlan("f32", 512, 128, 4, 16, 64)
        state = cfg.extra["mixer_memory"]["state_bytes"]
        with_states = estimate_llm(cfg, opened.weights, plan, max_binding=1 << 27).activations
        cfg.extra = {**cfg.extra, "mixer_memory": {**cfg.extra["mixer_memory"], "state_bytes": 0}}
        without = estimate_llm(cfg, opened.weights, plan, max_binding=1 << 27).activations
        assert state * (4 + snapshot_slots(4)) <= with_states - without <= state * (5 + snapshot_slots(4))
        assert snapshot_slots(4) >= 16
    finally:
        opened.close()


async def _long(eng, prompt: str):
    r = await eng.completions.create(prompt=prompt, max_tokens=120, ignore_eos=True, temperature=0, logprobs=1)
    c = r.choices[0]
    return c.logprobs.tokens, c.finish_reason, r.usage.extra.model_dump().get("context_shifts", 0)


async def test_context_shift_computes_the_kept_tokens_from_a_snapshot_or_zeros(device, folder, ref):
    """context_overflow "shift" (a 64-token window, n_keep 20): generations of 120 tokens, two at once
    and each alone, shift several times; each shift's kept tokens start from the snapshot at the kept
    prefix's full block (or from zero states) and are computed again, so every answer equals the one
    whose shifts compute all the kept tokens from zero states (no snapshot reusable: a cold prefill
    of exactly those tokens)."""
    prompts = [ref["text"][:20], ref["text"][40:90]]
    opts = dict(context_overflow="shift", n_keep=20, context_window_size=64, prefill_chunk_size=32)
    cold = await _engine(device, folder, "qwen35-shift-cold", **opts)
    try:
        _sched(cold).snapshots.reusable = lambda key: False
        want = [await _long(cold, p) for p in prompts]
    finally:
        await cold.unload()
    assert all(len(toks) == 120 and shifts >= 3 for toks, _, shifts in want)
    eng = await _engine(device, folder, "qwen35-shift", **opts)
    try:
        snaps = _sched(eng).snapshots
        assert [await _long(eng, p) for p in prompts] == want
        assert list(await asyncio.gather(*(_long(eng, p) for p in prompts))) == want
        assert snaps.stats["restored"] >= 2 * 3
    finally:
        await eng.unload()


async def test_a_draft_model_with_recurrent_states_is_refused(device, folder):
    """A draft model's cache is cut back to each step's context, which a recurrent state cannot
    follow: such a draft is refused at load, naming the option (the target may be one)."""
    from webgpu_engine.errors import UnsupportedChatOptionError
    with pytest.raises(UnsupportedChatOptionError, match="speculation.*draft model's layers keep a recurrent"):
        await _engine(device, folder, "qwen35-draft", speculation={"method": "draft", "model": folder, "k": 2})


def test_snapshot_slots_fit_a_binding():
    """Prefix snapshots per sequence and a slot per verify row but one; where a layer's state buffer
    would pass the device's binding limit, fewer prefix snapshots; where the verify rows alone would,
    speculation is refused by name."""
    from webgpu_engine.errors import UnsupportedChatOptionError
    from webgpu_engine.models.recurrent_snapshots import PREFIX_SNAPSHOTS, snapshot_slots
    assert snapshot_slots(4) == 4 * PREFIX_SNAPSHOTS and snapshot_slots(4, 16) == 4 * PREFIX_SNAPSHOTS + 15
    assert snapshot_slots(4, 16, 1 << 20, 64 << 20) == 4 * PREFIX_SNAPSHOTS + 15
    assert snapshot_slots(4, 16, 1 << 20, 30 << 20) == (30 - 4 - 15) + 15
    with pytest.raises(UnsupportedChatOptionError, match="speculation"):
        snapshot_slots(4, 16, 1 << 20, 16 << 20)


async def test_a_draft_model_guesses_for_qwen35(device, folder, alone, tmp_path):
    """speculation "draft" with a Qwen3.5 target: a tiny Llama with the same vocabulary guesses for two
    sequences at once; the verify rows and the rollback are prompt lookup's, and every answer equals
    the request without speculation."""
    from tinymodels import write_tiny_llama_gguf
    draft = str(write_tiny_llama_gguf(tmp_path / "draft.gguf", vocab_size=300, context_length=512)["path"])
    prompts, want = alone[2:]
    eng = await _engine(device, folder, "qwen35-draft-llama",
                        speculation={"method": "draft", "model": draft, "k": 3, "auto_off": False})
    try:
        sched = _sched(eng)
        assert sched.spec.draft is not None
        assert list(await asyncio.gather(*(_answer(eng, p, 40) for p in prompts[::2]))) == want[::2]
        assert sched.pipe.spec_stats.proposed > 0 and sched.snapshots.stats["rolled_back"] > 0
        sched.pool.check()
    finally:
        await eng.unload()


def test_the_snapshot_pool_saves_block_ends_and_evicts_the_least_recently_used(device):
    """StateSnapshots over state buffers of 9 slots for 2 sequences and 4 verify rows: slots 2..4 for
    the verify rows, 5..8 for prefix snapshots. A prefill of 96 rows saves at its first 4 block ends
    (then none is free), kept under their blocks' keys; another sequence's saves evict the least
    recently used; a sequence that left keeps none of its saves."""
    from types import SimpleNamespace
    from webgpu_engine.models.recurrent_snapshots import StateSnapshots
    fwd = SimpleNamespace(dev=device, owner="test:snapshots", max_seqs=2,
                          mixer_states=[None, [SimpleNamespace(shape=(9, 4, 4, 4)), SimpleNamespace(shape=(9, 8, 3))]])
    snaps = StateSnapshots(fwd, 16, verify_rows=4)
    assert snaps.verify == [2, 3, 4]
    rows = snaps.prefill_slots("a", 0, 0, 96)
    saves = {p: r >> deltanet.SAVE_SHIFT for p, r in enumerate(rows) if r >> deltanet.SAVE_SHIFT}
    assert saves == {15: 6, 31: 7, 47: 8, 63: 9} and all(r & 0xFFFF == 0 for r in rows)
    keys = [bytes([i]) * 32 for i in range(6)]
    snaps.prefilled("a", keys)
    assert [snaps.reusable(k) for k in keys] == [True] * 4 + [False] * 2
    rows = snaps.prefill_slots("b", 1, 16, 48)
    assert [r >> deltanet.SAVE_SHIFT for r in rows if r >> deltanet.SAVE_SHIFT] == [6, 7]   # keys 0, 1's slots
    snaps.prefilled("b", [b"x" * 32, b"y" * 32, b"z" * 32])
    assert [snaps.reusable(k) for k in keys[:4] + [b"y" * 32, b"z" * 32]] == [False, False, True, True, True, True]
    assert snaps.prefill_slots("c", 0, 0, 16)[15] >> deltanet.SAVE_SHIFT == 7 + 1       # key 2's, evicted
    snaps.prefilled("c", None)                            # left the pool: the slot it took is free again
    assert not snaps.reusable(keys[2]) and snaps.prefill_slots("d", 0, 0, 16)[15] >> deltanet.SAVE_SHIFT == 7 + 1
