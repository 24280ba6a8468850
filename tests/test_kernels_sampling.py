"""GPU sampler (shaders/sampling.wgsl) vs a numpy reference: greedy, logprobs, seeds, distribution,
exact top-k/top-p/min-p cuts, top logprobs up to 20, penalties, logit_bias, f16 logits, history updates."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.config import SamplingParams
from webgpu_engine.kernels.common import Tensor, run_ops
from webgpu_engine.kernels.sampling import RESULT_BYTES, SEED_WORD, Sampler, uniform_draw

WG = 256


# --------------------------------------------------------------------------- numpy reference
def ref_z(logits, cfg, counts=None, seen=None):
    """Penalised, biased, temperature-scaled logits (float64), as the kernel computes them."""
    x = logits.astype(np.float64).copy()
    v = x.size
    counts = np.zeros(v, np.int64) if counts is None else counts
    seen = np.zeros(v, bool) if seen is None else seen
    rp = cfg.get("repetition_penalty", 1.0)
    x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
    x -= counts * cfg.get("frequency_penalty", 0.0) + (counts > 0) * cfg.get("presence_penalty", 0.0)
    for k, b in cfg.get("logit_bias", {}).items():
        x[k] += b
    t = cfg.get("temperature", 1.0)
    return x if t == 0 else x / t


def ref_kept(z, cfg):
    """Token ids (best first) that survive top-k, top-p, then min-p (HF order), with ties to the
    lower id."""
    order = np.lexsort((np.arange(z.size), -z))
    e = np.exp(z[order] - z.max())
    k = cfg.get("top_k", 0)
    n = min(k, z.size) if k else z.size
    p = cfg.get("top_p", 1.0)
    if p < 1.0:
        cum_before = np.concatenate([[0.0], np.cumsum(e[:n])[:-1]])
        n = int(np.sum(cum_before < p * e[:n].sum()))
    mp = cfg.get("min_p", 0.0)
    if mp > 0:     # p_i >= min_p * p_max: a ratio no earlier cut's renormalisation changes
        n = max(1, min(n, int(np.sum(z[order[:n]] - z.max() >= np.log(mp)))))
    return order[:n], e[:n]


def ref_sample(logits, cfg, u, counts=None, seen=None):
    z = ref_z(logits, cfg, counts, seen)
    if cfg.get("temperature", 1.0) == 0:
        return int(np.argmax(z))
    if cfg.get("top_k", 0) or cfg.get("top_p", 1.0) < 1.0 or cfg.get("min_p", 0.0) > 0:
        ids, e = ref_kept(z, cfg)
    else:   # the kernel walks the vocabulary in its strided per-invocation order
        ids = np.concatenate([np.arange(t, z.size, WG) for t in range(min(WG, z.size))])
        e = np.exp(z[ids] - z.max())
    c = np.cumsum(e)
    return int(ids[min(int(np.searchsorted(c, u * c[-1], side="right")), len(ids) - 1)])


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


# --------------------------------------------------------------------------- helpers
def make(device, logits, dtype="f32"):
    arr = logits.astype(np.float16 if dtype == "f16" else np.float32)
    t = Tensor(device.upload(arr), (arr.size,), dtype)
    s = Sampler(device, arr.size, owner="test:sampling")
    return s, t


def draws(device, s, t, n):
    """n consecutive sampling steps in one submit; after each, its token is copied to its own slot."""
    out = device.buffer(4 * n, owner="test:sampling", label="draws")
    op = s.op(t)
    b = device.batch()
    for i in range(n):
        op.record(b)
        b.copy(s.io, out, 4, 0, 4 * i)
    device.submit(b)
    ids = np.frombuffer(device.read_sync(out), np.uint32).copy()
    out.release()
    return ids


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:sampling")


def rand_logits(v, scale=3.0, seed=0):
    return (np.random.default_rng(seed).standard_normal(v) * scale).astype(np.float32)


# --------------------------------------------------------------------------- tests
def test_greedy_and_logprobs_full_vocab(device):
    x = rand_logits(49152)
    x[123] = x[4567] = x.max() + 1.0       # a tie: the lower index wins, like numpy.argmax
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5))
    s.reset_history()
    run_ops(device, s.op(t))
    r = s.read_sync()
    assert r.token == int(np.argmax(x)) == 123
    lp = log_softmax(x)
    ref_top = np.lexsort((np.arange(x.size), -lp))[:5]
    assert [i for i, _ in r.top] == list(ref_top)
    np.testing.assert_allclose([v for _, v in r.top], lp[ref_top], atol=1e-4)
    assert abs(r.logprob - lp[123]) < 1e-4


def test_f16_logits_and_next_ids(device):
    x = rand_logits(5000, seed=3)
    s, t = make(device, x, "f16")
    nxt = Tensor(device.buffer(16, owner="test:sampling"), (4,), "u32")
    s.configure(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2))
    s.reset_history()
    run_ops(device, s.op(t, nxt))
    r = s.read_sync()
    xh = x.astype(np.float16).astype(np.float32)
    assert r.token == int(np.argmax(xh))
    assert np.frombuffer(device.read_sync(nxt.buf), np.uint32)[0] == r.token
    assert len(r.top) == 2 and abs(r.top[1][1] - np.sort(log_softmax(xh))[-2]) < 1e-3


def test_same_seed_same_tokens(device):
    x = rand_logits(3000, scale=1.0, seed=1)
    s, t = make(device, x)
    runs = []
    for seed in (7, 7, 8):
        s.configure(SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
        s.reset_history()
        runs.append(list(draws(device, s, t, 24)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("cfg", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_k=20),
    dict(temperature=0.8, top_k=50, top_p=0.8),
    dict(temperature=1.5, min_p=0.1),
    dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05),
])
def test_tokens_match_reference_per_draw(device, cfg):
    """Given the shader's u for each step, the GPU picks the reference token (exact cut masks)."""
    x = rand_logits(2000, scale=2.0, seed=2)
    s, t = make(device, x)
    s.configure(SamplingParams(seed=1234, **cfg))
    s.reset_history()
    n = 300
    got = draws(device, s, t, n)
    want = np.array([ref_sample(x, cfg, uniform_draw(1234, i)) for i in range(n)])
    assert np.mean(got == want) >= 0.99, np.nonzero(got != want)
    if "top_k" in cfg or "top_p" in cfg or "min_p" in cfg:
        kept, _ = ref_kept(ref_z(x, cfg), cfg)
        assert set(got.tolist()) <= set(kept.tolist())


def test_distribution_chi_square(device):
    x = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=1.0, seed=99))
    s.reset_history()
    n = 4000
    got = draws(device, s, t, n)
    p = np.exp(x - x.max())
    p /= p.sum()
    obs = np.bincount(got, minlength=x.size)
    chi2 = float(((obs - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 24.32, (chi2, obs, n * p)          # df 7, p = 0.001
    # top-k 3 / top-p: the empirical distribution is the renormalised kept set
    s.configure(SamplingParams(temperature=1.0, top_k=3, seed=5))
    got = draws(device, s, t, 3000)
    kept = [0, 6, 1]
    q = p[kept] / p[kept].sum()
    obs = np.array([np.sum(got == k) for k in kept])
    assert obs.sum() == 3000
    assert float(((obs - 3000 * q) ** 2 / (3000 * q)).sum()) < 13.82   # df 2


def test_min_p_exact_mask_and_greedy_at_one(device):
    """min_p keeps exactly the tokens with p >= min_p * p_max; min_p 1 keeps the best token alone,
    so sampling at any temperature gives the greedy token."""
    pr = np.array([0.4, 0.3, 0.2, 0.1 - 4e-6] + [1e-6] * 4)
    x = np.log(pr).astype(np.float32)
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=1.0, min_p=0.6, seed=3))   # 0.3 >= 0.24, 0.2 < 0.24
    s.reset_history()
    got = draws(device, s, t, 800)
    assert set(got.tolist()) == {0, 1}
    assert abs(np.mean(got == 0) - 0.4 / 0.7) < 0.06
    y = rand_logits(49152, scale=1.0, seed=12)
    s2, t2 = make(device, y)
    for seed in (1, 2, 3):
        s2.configure(SamplingParams(temperature=1.5, min_p=1.0, seed=seed))
        s2.reset_history()
        assert set(draws(device, s2, t2, 16).tolist()) == {int(np.argmax(y))}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_twenty_top_logprobs(device, temperature):
    """top_logprobs up to 20 (OpenAI's limit): the 20 best raw log-softmax entries, best first,
    ties to the lower id, whether the step is greedy or sampled."""
    x = rand_logits(49152, seed=13)
    x[77] = x[78] = x.max() + 0.5                 # a tie at the top
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=temperature, seed=4, logprobs=True, top_logprobs=20))
    s.reset_history()
    run_ops(device, s.op(t))
    r = s.read_sync()
    lp = log_softmax(x)
    ref_top = np.lexsort((np.arange(x.size), -lp))[:20]
    assert [i for i, _ in r.top] == list(ref_top) and ref_top[0] == 77
    np.testing.assert_allclose([v for _, v in r.top], lp[ref_top], atol=1e-4)
    assert abs(r.logprob - lp[r.token]) < 1e-4


def test_top_p_exact_mask(device):
    # probabilities 0.4, 0.3, 0.2, 0.1 (and a tail): top_p 0.65 keeps exactly the first two
    pr = np.array([0.4, 0.3, 0.2, 0.1 - 4e-6] + [1e-6] * 4)
    x = np.log(pr).astype(np.float32)
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=1.0, top_p=0.65, seed=3))
    s.reset_history()
    got = draws(device, s, t, 800)
    assert set(got.tolist()) == {0, 1}
    assert abs(np.mean(got == 0) - 0.4 / 0.7) < 0.06


def test_penalties_and_history(device):
    x = np.array([5.0, 4.9, 4.8, -1.0, 0.5], np.float32)
    cfg = dict(temperature=0.0, frequency_penalty=0.15, presence_penalty=0.0, repetition_penalty=1.0)
    s, t = make(device, x)
    s.configure(SamplingParams(**cfg))
    s.reset_history()
    got = draws(device, s, t, 6)
    counts = np.zeros(5, np.int64)
    want = []
    for _ in range(6):
        tok = ref_sample(x, cfg, 0.0, counts=counts)
        want.append(tok)
        counts[tok] += 1
    assert got.tolist() == want and len(set(want)) > 1
    # repetition penalty on prompt tokens (seen) divides positive logits: 5.0 / 1.1 < 4.9
    s.configure(SamplingParams(temperature=0.0, repetition_penalty=1.1))
    s.reset_history([0, 3])
    seen = np.zeros(5, bool)
    seen[[0, 3]] = True
    assert draws(device, s, t, 1)[0] == ref_sample(x, dict(temperature=0, repetition_penalty=1.1), 0, seen=seen) == 1
    # presence penalty: each generated token is penalised once
    s.configure(SamplingParams(temperature=0.0, presence_penalty=1.0))
    s.reset_history()
    assert draws(device, s, t, 3).tolist() == [0, 1, 2]


def test_logit_bias(device):
    x = rand_logits(1000, seed=4)
    top = int(np.argmax(x))
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=0.0, logit_bias={top: -100.0, 17: 3.0}))
    s.reset_history()
    want = ref_sample(x, dict(temperature=0, logit_bias={top: -100.0, 17: 3.0}), 0)
    assert draws(device, s, t, 1)[0] == want != top
    s.configure(SamplingParams(temperature=0.0, logit_bias={5: 100.0}))
    assert draws(device, s, t, 1)[0] == 5
    s.configure(SamplingParams(temperature=0.0))    # bias cleared
    assert draws(device, s, t, 1)[0] == top
    # sampled, a huge bias concentrates everything on its token
    s.configure(SamplingParams(temperature=1.0, top_p=0.9, logit_bias={42: 50.0}, seed=1))
    assert set(draws(device, s, t, 20).tolist()) == {42}


@pytest.mark.parametrize("v", [49152, 300, 7])
def test_greedy_without_logprobs_barrier_free_path(device, v):
    """Greedy without logprobs takes the two-pass argmax (argmax_partial + argmax_final): the same
    token as numpy.argmax of the penalised, biased logits (ties to the lower index), the same
    history, counter and next-id updates as the full kernel; vocabularies smaller than its 1024
    partials included. Switching to logprobs on the same op switches to the full kernel."""
    x = rand_logits(v, seed=v)
    top = int(np.argmax(x))
    x[v - 1] = x[top]                      # a tie with a higher index: the lower one wins
    s, t = make(device, x)
    nxt = Tensor(device.buffer(16, owner="test:sampling"), (4,), "u32")
    op = s.op(t, nxt)
    s.configure(SamplingParams(temperature=0.0))
    s.reset_history()
    assert s.greedy_fast and len(op.greedy.dispatches) == 2
    run_ops(device, op)
    assert s.read_sync().token == top == np.frombuffer(device.read_sync(nxt.buf), np.uint32)[0]
    if v > 8:
        # bias and repetition penalty on the winner move the argmax (a second step: counter 1)
        cfg = dict(temperature=0.0, repetition_penalty=1.5, logit_bias={top: -5.0, 3: 1.0})
        s.configure(SamplingParams(**cfg))
        s.reset_history([top, 5])
        run_ops(device, op)
        seen = np.zeros(v, bool)
        seen[[top, 5]] = True
        want = int(np.argmax(ref_z(x, cfg, seen=seen).astype(np.float32)))
        r = s.read_sync()
        assert r.token == want
        hist = np.frombuffer(device.read_sync(s.hist), np.uint32)
        assert hist[want] == 0x80000001        # seen bit | one generation
        io = np.frombuffer(device.read_sync(s.io), np.uint32)
        assert io[3] == 0 and io[SEED_WORD + 2] == 1   # the RNG counter advances as in the full kernel
        s.configure(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1))
        run_ops(device, op)
        r = s.read_sync()
        assert r.top and r.top[0][0] == int(np.argmax(x))


def test_sampled_with_logprobs(device):
    """Sampling (top-p) with top logprobs: the token is the reference draw, its logprob and the top-N
    are the raw log-softmax (OpenAI semantics), whatever the temperature."""
    x = rand_logits(3000, scale=2.0, seed=6)
    cfg = dict(temperature=0.6, top_p=0.9)
    s, t = make(device, x)
    s.configure(SamplingParams(seed=42, logprobs=True, top_logprobs=3, **cfg))
    s.reset_history()
    lp = log_softmax(x)
    ref_top = np.lexsort((np.arange(x.size), -lp))[:3]
    op = s.op(t)
    for i in range(4):
        run_ops(device, op)
        r = s.read_sync()
        assert r.token == ref_sample(x, cfg, uniform_draw(42, i))
        assert abs(r.logprob - lp[r.token]) < 1e-4
        assert [k for k, _ in r.top] == list(ref_top)
        np.testing.assert_allclose([v for _, v in r.top], lp[ref_top], atol=1e-4)


def test_candidate_overflow_fallbacks(device):
    """More than CAP = 1024 tokens in the cut range: with top-k 2000 the range shrinks to the top
    buckets that fit (draws stay among the 1024 most probable tokens); with a nearly flat row even the
    first bucket overflows and the whole distribution is sampled (the strided inverse CDF)."""
    x = rand_logits(49152, scale=3.0, seed=8)
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=1.0, top_k=2000, seed=3))
    s.reset_history()
    got = draws(device, s, t, 40)
    top1024 = set(np.argsort(-x.astype(np.float64), kind="stable")[:1024].tolist())
    assert set(got.tolist()) <= top1024
    flat = rand_logits(49152, scale=0.01, seed=9)
    s2, t2 = make(device, flat)
    s2.configure(SamplingParams(temperature=1.0, top_p=0.5, seed=11))
    s2.reset_history()
    got = draws(device, s2, t2, 30)
    want = [ref_sample(flat, dict(temperature=1.0), uniform_draw(11, i)) for i in range(30)]
    assert np.mean(got == np.array(want)) >= 0.95


def test_sampling_params_of_a_generation_config():
    """GenerationConfig.sampling(): the sampler's fields as they are (logit_bias ids included),
    top_logprobs only with logprobs."""
    from dataclasses import fields, replace

    from webgpu_engine.config import GenerationConfig
    assert {f.name for f in fields(SamplingParams)} <= {f.name for f in fields(GenerationConfig)}
    gen = GenerationConfig(temperature=0.5, top_p=0.8, top_k=4, repetition_penalty=1.2, frequency_penalty=0.1,
                           presence_penalty=-0.3, logit_bias={7: -2.0}, top_logprobs=3, seed=9, max_tokens=5)
    assert gen.sampling() == SamplingParams(temperature=0.5, top_p=0.8, top_k=4, repetition_penalty=1.2,
                                            frequency_penalty=0.1, presence_penalty=-0.3,
                                            logit_bias={7: -2.0}, seed=9)
    assert replace(gen, logprobs=True).sampling().top_logprobs == 3


@pytest.mark.parametrize("logprobs", [False, True])
def test_copied_result_parses_as_read(device, logprobs):
    """copy_result puts RESULT_BYTES of the step's result at an offset; result() of that slice is
    what read() gives (the batch scheduler reads its samplers' results this way)."""
    x = rand_logits(3000, seed=12)
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=0.7, seed=5, logprobs=logprobs, top_logprobs=3 if logprobs else 0))
    s.reset_history()
    dst = device.buffer(3 * RESULT_BYTES, owner="test:sampling", label="results")
    b = device.batch()
    s.op(t).record(b)
    s.copy_result(b, dst, 2 * RESULT_BYTES)
    device.submit(b)
    raw = device.read_sync(dst)
    r = s.result(raw[2 * RESULT_BYTES:])
    assert r == s.read_sync() and len(r.top) == (3 if logprobs else 0)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs /proc")
def test_sampling_steps_keep_host_memory_flat(device):
    """300 sampled steps (top-p, logprobs, penalties) leave the host RSS flat: lavapipe leaked about
    0.65 MiB per dispatch of the former one-workgroup kernel (~200 MiB here); see bench/dispatch_leak.py."""
    x = rand_logits(32000, seed=10)
    s, t = make(device, x)
    s.configure(SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, logprobs=True,
                               top_logprobs=2, seed=1))
    s.reset_history([1, 2, 3])
    draws(device, s, t, 20)
    before = _rss_mib()
    for _ in range(3):
        draws(device, s, t, 100)
    assert _rss_mib() - before < 24.0
