"""WebLLM's sliding window with attention sinks (kernels/common.py Ring) over the paged pool: each
sequence's block table is a ring of max_blocks * block_size rows (attention_paged.ring_row: sinks
fixed, the rest modulo the ring); paged_rope_kv writes a position's rows at its ring slot and the
sink queries; paged_prefill chunks and ragged paged_decode batches attend, per row, what the
contiguous ring attends: nn_ref.ring_attention by positions, and the contiguous kernels' bits."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
from webgpu_engine.kernels import attention_paged as ap
from webgpu_engine.kernels.common import Ring
from webgpu_engine.models.kv_pool import KVPool

from _nn_util import NP, TOL, empty, get, put, set_step, step_buf
from test_kernels_attention_ring import BASE, RingRun, _reference


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


class PagedRing:
    """Sequences of raw qkv rows (each (N, Hq+2Hkv, D)) fed through paged_rope_kv + paged attention
    with a ring: prefill chunks of one sequence (at most `rows` rows) and decode steps of several."""

    def __init__(self, device, xs, hq, hkv, d, ring, bs, max_blocks, rows, dtype="f32", **decode):
        self.dev, self.xs, self.hq, self.d, self.dtype, self.ring = device, xs, hq, d, dtype, ring
        self.bs, self.max_blocks, self.rows, self.cap = bs, max_blocks, rows, bs * max_blocks
        n_seq = len(xs)
        n_blocks = n_seq * max_blocks + 3
        self.tables = np.random.default_rng(11).permutation(n_blocks)[:n_seq * max_blocks].reshape(
            n_seq, max_blocks).astype(np.uint32)           # shuffled, never shared
        shape = (n_blocks, bs, hkv, d)
        self.kp, self.vp = empty(device, shape, dtype, fill=0), empty(device, shape, dtype, lead=8, fill=0)
        n_h, heads = hq + 2 * hkv, dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
        att = dict(scale=d ** -0.5, max_blocks=max_blocks, ring=ring, **heads)
        # a prefill chunk of one sequence
        self.qkv, self.sink = put(device, np.zeros((rows, n_h, d)), dtype), empty(device, (rows, hq, d), dtype)
        self.pos, self.slots = (put(device, np.zeros(rows, np.uint32), "u32") for _ in range(2))
        self.table, self.step = put(device, np.zeros(max_blocks, np.uint32), "u32"), step_buf(device, 0, rows)
        self.out = empty(device, (rows, hq * d), dtype)
        self.prefill = (ap.paged_rope_kv(device, self.qkv, self.kp, self.vp, self.pos, self.slots, self.step,
                                         **heads, base=BASE, ring=ring, q_sink=self.sink),
                        ap.paged_prefill(device, self.qkv, self.kp, self.vp, self.out, self.step, self.table,
                                         max_t=rows, q_sink=self.sink, **att))
        # a decode step of every sequence (lens 0: idle)
        self.dqkv = put(device, np.zeros((n_seq, n_h, d)), dtype)
        self.dsink = empty(device, (n_seq, hq, d), dtype)
        self.dpos, self.dslots, self.lens = (put(device, np.zeros(n_seq, np.uint32), "u32") for _ in range(3))
        self.dout = empty(device, (n_seq, hq * d), dtype)
        self.decode = (ap.paged_rope_kv(device, self.dqkv, self.kp, self.vp, self.dpos, self.dslots, **heads,
                                        base=BASE, ring=ring, q_sink=self.dsink),
                       ap.paged_decode(device, self.dqkv, self.kp, self.vp, self.dout, self.lens,
                                       put(device, self.tables, "u32"), max_seqs=n_seq, q_sink=self.dsink,
                                       **att, **decode))

    def slot(self, q: int, pos: int) -> int:
        row = ap.ring_row(self.ring, pos, self.cap)
        return int(self.tables[q, row // self.bs]) * self.bs + row % self.bs

    def _write(self, t, a):
        self.dev.write(t.buf, np.ascontiguousarray(a), t.offset)

    def feed(self, plan, short: bool = True) -> list:
        """Outputs (N_q, Hq*D) of every sequence, fed by `plan`: (q, n) a prefill chunk of n rows of
        sequence q, or a tuple of sequences decoding one row each."""
        np_dt = NP[self.dtype]
        at, outs = [0] * len(self.xs), [[] for _ in self.xs]
        for item in plan:
            b = self.dev.batch()
            if not isinstance(item[0], tuple):
                q, n = item
                p0 = at[q]
                self._write(self.qkv, self.xs[q][p0:p0 + n].astype(np_dt))
                self._write(self.pos, np.arange(p0, p0 + n, dtype=np.uint32))
                self._write(self.slots, np.array([self.slot(q, p) for p in range(p0, p0 + n)], np.uint32))
                self._write(self.table, self.tables[q])
                set_step(self.dev, self.step, p0, n)
                for op in self.prefill:
                    op.record(b)
                self.dev.submit(b)
                outs[q].append(get(self.dev, self.out)[:n])
                at[q] += n
                continue
            seqs = item[0]
            x = np.zeros((len(self.xs),) + self.xs[0].shape[1:])
            pos, slots, lens = (np.zeros(len(self.xs), np.uint32) for _ in range(3))
            for q in seqs:
                x[q], pos[q], slots[q], lens[q] = self.xs[q][at[q]], at[q], self.slot(q, at[q]), at[q] + 1
            for t, a in ((self.dqkv, x.astype(np_dt)), (self.dpos, pos), (self.dslots, slots), (self.lens, lens)):
                self._write(t, a)
            self.decode[0].record(b)
            longest = min(int(lens.max()), self.cap)
            self.decode[1].record(b, n_keys=longest if short else None)
            self.dev.submit(b)
            got = get(self.dev, self.dout)
            for q in seqs:
                outs[q].append(got[q:q + 1])
                at[q] += 1
        return [np.concatenate(o) for o in outs]


def _plan():
    """Three sequences: prefill chunks (some crossing the ring's end), ragged decode batches, a
    sequence idle while the others decode; 100, 90 and 70 positions."""
    plan = [(0, 16), (1, 16), (1, 9), (2, 5)]
    plan += [((0, 1, 2),)] * 20                              # 0: 36, 1: 45, 2: 25
    plan += [(0, 16), (0, 16), (2, 16), ((0, 1),), ((0, 1),)]   # 0: 70, 1: 47, 2: 41
    plan += [((0, 1, 2),)] * 29                              # 0: 99, 1: 76, 2: 70
    plan += [(1, 13), ((0,),)]                               # 0: 100, 1: 89
    plan += [((1,),)]
    return plan


@pytest.mark.parametrize("dtype,sinks,window,short", [("f32", 4, 40, True), ("f16", 4, 40, False),
                                                      ("f32", 0, 33, False), ("f16", 20, 24, True)])
def test_paged_ring_matches_the_reference(device, dtype, sinks, window, short):
    """Every row of every sequence, prefill or decode (short or split form), equals the reference's
    ring attention at its position; the window's end is crossed in both."""
    hq, hkv, d, bs, rows = 6, 2, 32, 16, 16
    ring = Ring(sinks, window)
    max_blocks = -(-(window + rows) // bs)                   # the window plus one forward's rows
    rng = np.random.default_rng(sinks + window)
    xs = [rng.standard_normal((n, hq + 2 * hkv, d)) for n in (100, 90, 70)]
    r = PagedRing(device, xs, hq, hkv, d, ring, bs, max_blocks, rows, dtype, min_chunk=16,
                  **({} if short else dict(short_keys=0)))
    got = r.feed(_plan(), short)
    for q, x in enumerate(xs):
        np.testing.assert_allclose(got[q], _reference(x, hq, hkv, d, ring, dtype), **TOL[dtype], err_msg=f"seq {q}")


def test_paged_ring_equals_the_contiguous_ring(device):
    """Bit for bit the contiguous kernels' output for a ring of as many rows (the same rows folded in
    the same blocks and splits), whatever the sequence's neighbours in the batch."""
    hq, hkv, d, bs, rows, ring = 9, 3, 64, 16, 16, Ring(4, 48)
    max_blocks = (ring.window + rows) // bs
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((n, hq + 2 * hkv, d)) for n in (100, 90, 70)]
    r = PagedRing(device, xs, hq, hkv, d, ring, bs, max_blocks, rows, "f16", min_chunk=16)
    got = r.feed(_plan())
    alone = RingRun(device, xs[0], hq, hkv, d, ring, bs * max_blocks, rows, "f16", min_chunk=16)
    sizes = [16] + [1] * 20 + [16, 16, 1, 1] + [1] * 29 + [1]
    assert (alone.feed(sizes) == got[0]).all()


def test_ring_rows_and_errors(device):
    """ring_row keeps sinks in place and wraps the rest; a quantised pool or a window beside the ring
    is refused by name."""
    ring = Ring(4, 40)
    assert [ap.ring_row(ring, p, 64) for p in (0, 3, 63, 64, 65, 123, 124)] == [0, 3, 63, 4, 5, 63, 4]
    hq, hkv, d = 4, 2, 16
    qkv, out = put(device, np.zeros((2, hq + 2 * hkv, d))), empty(device, (2, hq * d))
    kp, vp = (empty(device, (4, 16, hkv, d), fill=0) for _ in range(2))
    sink, lens, tables = empty(device, (2, hq, d)), put(device, np.zeros(2, np.uint32), "u32"), \
        put(device, np.zeros(8, np.uint32), "u32")
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, max_seqs=2, max_blocks=4, scale=0.25, ring=ring)
    with pytest.raises(ValueError, match="window"):
        ap.paged_decode(device, qkv, kp, vp, out, lens, tables, q_sink=sink, window=8, **kw)
    with pytest.raises(ValueError, match="q_sink"):
        ap.paged_decode(device, qkv, kp, vp, out, lens, tables, **kw)


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("paged_ring") / "m.gguf", qtype="q8_0",
                                     context_length=512, n_heads=2, n_kv_heads=1)["path"])


RING = dict(context_window_size=-1, sliding_window_size=64, attention_sink_size=2, prefill_chunk_size=16)
PROMPTS = ["Tell me about foxes.", "Count: one two three four five six seven eight nine ten eleven twelve "
           "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty, and on?",
           "Hi", "Why is the sky blue? Answer in a few words, then more words."]


async def _engine(device, path, **opts):
    app = default_app_config().with_records(ModelRecord("tiny", path, "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny", {"compile_at_load": False, **RING, **opts})
    return eng


async def _ask(eng, prompt, n):
    r = await eng.chat.completions.create(messages=[{"role": "user", "content": prompt}], max_tokens=n,
                                          temperature=0, ignore_eos=True, logprobs=True)
    return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content], r.usage


async def test_four_ring_sequences_in_a_batch_answer_as_alone(device, path):
    """4 requests at once through the scheduler with a ring (W = 64, S = 2, chunks of 16: a table of
    80 rows), generations of 90-120 tokens past the window: each answer (text and logprobs) equals the
    same request alone, and alone through a scheduler of one slot; /v1/models shows the batch and the window."""
    lengths = [120, 100, 90, 110]        # each one past the 80 rows: its ring wraps
    eng = await _engine(device, path, max_num_sequences=4, kv_block_size=16)
    try:
        sched = eng.models["tiny"].pipeline.scheduler
        assert sched is not None and sched.pool.ring_rows == 80 and not sched.pool.share
        info = eng.models["tiny"].describe(device)          # /v1/models: the batch and the window
        assert info["batching"]["max_num_sequences"] == 4 and info["context_window"] == 80
        assert info["sliding_window"] == {"sliding_window_size": 64, "attention_sink_size": 2}
        together = await asyncio.gather(*(_ask(eng, p, n) for p, n in zip(PROMPTS, lengths)))
        # in one batch: far fewer iterations than tokens (each iteration decodes every running sequence)
        assert sched.stats["decode_rows"] >= sum(lengths) - 4 and sched.stats["iterations"] < 0.5 * sum(lengths), \
            sched.stats
        alone = [await _ask(eng, p, n) for p, n in zip(PROMPTS, lengths)]
    finally:
        await eng.unload()
    for (text, lps, usage), n in zip(together, lengths):
        assert usage.completion_tokens == n
    assert [a[:2] for a in together] == [a[:2] for a in alone]
    one = await _engine(device, path)
    try:
        assert one.models["tiny"].pipeline.scheduler.max_seqs == 1
        single = [await _ask(one, p, n) for p, n in zip(PROMPTS, lengths)]
    finally:
        await one.unload()
    assert [a[:2] for a in together] == [a[:2] for a in single]
    # the ring changes the answers: a plain context of 512 answers otherwise (one request is enough:
    # each generation runs past the ring's 80 rows, so its later logprobs read other keys)
    plain = await _engine(device, path, context_window_size=512, sliding_window_size=-1, attention_sink_size=0)
    try:
        full = await _ask(plain, PROMPTS[0], lengths[0])
    finally:
        await plain.unload()
    assert full[1] != single[0][1]


def test_a_ring_pool_holds_its_window_and_shares_nothing():
    """KVPool with a ring of 48 rows (3 blocks of 16, 4 sinks): a sequence never holds more than its
    ring's blocks however far its positions go; a position's slot is its ring row's (sinks in place);
    full prompt blocks are not offered to the next sequence."""
    pool = KVPool(8, 16, ring_rows=48, ring_sinks=4)
    assert not pool.share
    prompt = list(range(40))
    assert pool.add_sequence("a", prompt) == 0
    pool.reserve("a", 40)
    pool.append_tokens("a", prompt)
    for pos in range(40, 200):
        pool.reserve("a", pos + 1)
        assert pool.decode_inputs(["a"], 2, 3)["lens"] == [pos + 1, 0]
        pool.append_tokens("a", [pos], decoded=True)
    table = pool.block_table("a")
    assert len(table) == 3 and pool.n_free == 5
    want = {0: 0, 3: 3, 47: 47, 48: 4, 49: 5, 91: 47, 92: 4, 199: 4 + (199 - 4) % 44}
    for pos, row in want.items():
        assert pool.row(pos) == row
        assert pool.slots("a", pos, 1) == [table[row // 16] * 16 + row % 16]
    assert pool.add_sequence("b", prompt) == 0              # nothing cached for sharing
    pool.check()
    with pytest.raises(ValueError, match="ring"):
        KVPool(8, 16, ring_rows=40, ring_sinks=4)            # not a whole number of blocks


async def test_preempted_ring_sequences_and_long_prompts_answer_as_alone(device, path):
    """A window of 60 (ctx 76, a table of 80 rows), a
    pool of 10 blocks for 4 sequences of 5 each (the newest are preempted and recomputed: prompt rows by
    prefill, decoded rows replayed) and a prompt of over twice the table prefilled in chunks round
    the ring: each answer equals the same request alone, and the tokens of a scheduler of one slot (its
    logprobs within rounding)."""
    long = " ".join(f"word{i}" for i in range(90))
    prompts, lengths = [long] + PROMPTS[1:], [90, 110, 70, 100]
    opts = dict(sliding_window_size=60, max_num_sequences=4, kv_block_size=16, kv_pool_tokens=160)
    eng = await _engine(device, path, **opts)
    try:
        sched = eng.models["tiny"].pipeline.scheduler
        assert sched.pool.ring_rows == 80 and sched.pool.n_blocks == 10 and sched.model.ctx == 76
        together = await asyncio.gather(*(_ask(eng, p, n) for p, n in zip(prompts, lengths)))
        assert sched.describe()["preemptions"] > 0
        assert together[0][2].prompt_tokens > 160
        alone = [await _ask(eng, p, n) for p, n in zip(prompts, lengths)]
    finally:
        await eng.unload()
    assert [a[:2] for a in together] == [a[:2] for a in alone]
    one = await _engine(device, path, sliding_window_size=60)
    try:
        single = [await _ask(one, p, n) for p, n in zip(prompts, lengths)]
    finally:
        await one.unload()
    # other rows, other fold order: the same tokens, logprobs within rounding (measured 1.9e-3)
    assert [a[0] for a in together] == [a[0] for a in single]
    assert max(abs(x - y) for a, b in zip(together, single) for x, y in zip(a[1], b[1])) < 1e-2
