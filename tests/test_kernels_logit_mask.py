"""The allowed-token mask kernel (shaders/logit_mask.wgsl) vs its numpy reference, and masked
logits through the real sampler: greedy and sampled tokens always come from the allowed set."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.config import SamplingParams
from webgpu_engine.kernels.common import Tensor, run_ops
from webgpu_engine.kernels.logit_mask import MASKED, LogitMask, logit_mask_ref
from webgpu_engine.kernels.sampling import Sampler

OWNER = "test:logit_mask"


def _bits(allowed: np.ndarray) -> bytes:
    words = (allowed.size + 31) // 32
    padded = np.zeros(words * 32, bool)
    padded[:allowed.size] = allowed
    return np.packbits(padded, bitorder="little").tobytes()


@pytest.mark.parametrize("dtype,vocab", [("f32", 1000), ("f16", 300), ("f32", 64), ("f32", 49152)])
def test_mask_matches_reference(device, dtype, vocab):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal(vocab) * 5).astype(np.float16 if dtype == "f16" else np.float32)
    allowed = rng.random(vocab) < 0.3
    allowed[:32] = True                           # a full word: the kernel's early exit
    allowed[32:64] = False                        # an empty word
    bits = _bits(allowed) + b"\xff" * 4           # llguidance's masks may carry extra words
    buf = device.upload(logits.tobytes() + b"\0" * (-logits.nbytes % 4), owner=OWNER)
    lm = LogitMask(device, vocab, owner=OWNER)
    lm.write(bits)
    run_ops(device, lm.op(Tensor(buf, (vocab,), dtype)))
    got = np.frombuffer(device.read_sync(buf, 0, logits.nbytes), logits.dtype).astype(np.float32)
    want = logit_mask_ref(logits.astype(np.float32), bits, dtype)
    np.testing.assert_array_equal(got, want)
    assert (got[~allowed] == MASKED[dtype]).all() and (got[allowed] == logits[allowed]).all()
    lm.release()
    device.release_owner(OWNER)


@pytest.mark.parametrize("cfg", [dict(temperature=0.0), dict(temperature=1.0, seed=3),
                                 dict(temperature=1e-5, repetition_penalty=1.3, seed=1),
                                 dict(temperature=2.0, top_p=0.9, top_k=5, seed=2,
                                      logit_bias={0: 100.0}, logprobs=True, top_logprobs=5)])
def test_sampler_picks_only_allowed_tokens(device, cfg):
    vocab = 500
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    logits[0] = 50.0                               # the favourite (and biased) token is masked
    allowed = np.zeros(vocab, bool)
    allowed[rng.choice(vocab, 7, replace=False)] = True
    allowed[0] = False
    buf = device.upload(logits.tobytes(), owner=OWNER)
    t = Tensor(buf, (vocab,), "f32")
    lm, s = LogitMask(device, vocab, owner=OWNER), Sampler(device, vocab, owner=OWNER)
    lm.write(_bits(allowed))
    s.configure(SamplingParams(**cfg))
    s.reset_history(range(0, vocab, 2))
    mask_op, sample_op = lm.op(t), s.op(t)
    seen = set()
    for _ in range(40):
        device.write(buf, logits.tobytes())
        run_ops(device, mask_op, sample_op)
        tok = s.read_sync().token
        assert allowed[tok], tok
        seen.add(tok)
    if cfg["temperature"] == 0.0:
        assert seen == {int(np.flatnonzero(allowed)[np.argmax(logits[allowed])])}
    lm.release()
    s.release()
    device.release_owner(OWNER)
