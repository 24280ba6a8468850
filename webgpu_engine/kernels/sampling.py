"""GPU sampling: one token id per step from a logits row (penalties, logit_bias, temperature, top-k,
top-p, min-p, seeded counter-based RNG, logprobs), so the host reads back 4 bytes per decode step.

Usage (one `Sampler` per loaded model; buffers belong to the model's owner):

    s = Sampler(dev, vocab_size, owner="model:X")
    op = s.op(logits, next_ids)            # prebuilt once: logits (V,) f32|f16, next_ids (>=1,) u32
    s.configure(gen.sampling())            # once per request (uniform write): a config.SamplingParams
    s.reset_history(prompt_ids)            # once per request: counts := 0, seen := prompt tokens
    op.record(batch); dev.submit(batch)    # every step, after the LM head
    res = await s.read(with_logprobs)      # SampleResult(token, logprob, top)

The kernel (shaders/sampling.wgsl) also writes the token into `next_ids[0]`, bumps the generated
count of the token (frequency/presence penalties), marks it seen (repetition penalty), and advances
the RNG counter, all on the GPU. The RNG is a PCG hash of (seed, counter): the same seed and the same
logits give the same tokens. Exactness of top-k/top-p: see the header of the WGSL file.
"""
from __future__ import annotations

import random
import struct
from array import array
from dataclasses import dataclass, field

from ..config import GREEDY, SamplingParams
from ..gpu import UNIFORM, Device
from ..protocol.rules import MAX_TOP_LOGPROBS
from .common import Op, Tensor, act_header, check

CANDIDATES = 1024          # CAP in the shader: top-k/top-p candidate set size
IO_WORDS = 64
NPART = 1024               # NPART in the shader: partial argmaxes of the barrier-free greedy path
NS = 256                   # NS in the shader: vocabulary slices of the sampling passes
WORK_WORDS = 16144         # WORK in the shader: state carried between the sampling passes
COUNT_WORDS = 512 + 1      # NB + 1 in the shader: the cut histogram, then the candidate count
SEEN = 0x80000000          # SEEN in the shader: the top bit of a token's history word
# The io words (binding 5 in the shader): [0, 4 + 2 TOPN) the step's result (0 token, 1 its logprob,
# 2 top count, 3 the step's RNG counter, then TOPN top ids, then TOPN top logprobs), read back by
# read() or copied out by copy_result(); SEED_WORD, +1 the seed (lo, hi), +2 the RNG counter.
TOPN = MAX_TOP_LOGPROBS    # TOPN in the shader
RESULT_BYTES = (4 + 2 * TOPN) * 4
SEED_WORD = 48


class _SampleOp(Op):
    """The sampler's prebuilt op: records the barrier-free greedy pair (argmax_partial +
    argmax_final) when the current request is greedy without logprobs, the sampling passes without
    the candidate sort when it asks for neither top-k nor top-p, else all of them (`full`), so the
    pipeline records one op per step whatever the request asks."""

    def __init__(self, sampler: "Sampler", full: Op, uncut: Op, greedy: Op):
        super().__init__(full.dispatches, [], "sample")
        self.sampler, self.full, self.uncut, self.greedy = sampler, full, uncut, greedy

    def record(self, batch, n_keys: int | None = None):
        s = self.sampler
        op = self.greedy if s.greedy_fast else self.full if s.needs_cut else self.uncut
        self.dispatches = op.dispatches
        return op.record(batch, n_keys)


@dataclass
class SampleResult:
    token: int
    logprob: float = 0.0                      # log-softmax of the raw logits at `token`
    top: list = field(default_factory=list)   # [(token, logprob)] best first, len n_top


def pcg_hash(v: int) -> int:
    """The shader's PCG hash (for references and tests)."""
    s = (v * 747796405 + 2891336453) & 0xFFFFFFFF
    w = (((s >> ((s >> 28) + 4)) ^ s) * 277803737) & 0xFFFFFFFF
    return ((w >> 22) ^ w) & 0xFFFFFFFF


def uniform_draw(seed: int, counter: int) -> float:
    """The shader's u in [0, 1) for (seed, counter), exactly (24-bit)."""
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    x = pcg_hash((counter & 0xFFFFFFFF) ^ pcg_hash(lo ^ pcg_hash(hi)))
    return (x >> 8) / 16777216.0


class Sampler:
    """GPU state of the sampler for one model: params, dense bias, history, scratch, io."""

    def __init__(self, dev: Device, vocab_size: int, *, owner: str, label: str = "sampler"):
        check(vocab_size > 0, "sampling", "vocab_size must be positive")
        self.dev, self.vocab, self.owner = dev, int(vocab_size), owner
        v = self.vocab
        self.params = dev.buffer(64, usage=UNIFORM, owner=owner, label=f"{label}.params")
        self.bias = dev.buffer(v * 4, owner=owner, label=f"{label}.bias")
        self.hist = dev.buffer(v * 4, owner=owner, label=f"{label}.hist")   # SEEN bit | count per token
        self.scratch = dev.buffer(max(v, 2 * NPART) * 4, owner=owner, label=f"{label}.scratch")
        self.io = dev.buffer(IO_WORDS * 4, owner=owner, label=f"{label}.io")
        self.work = dev.buffer(WORK_WORDS * 4, owner=owner, label=f"{label}.work")
        self.counts = dev.buffer(COUNT_WORDS * 4, owner=owner, label=f"{label}.counts")
        self._dummy_ids = None
        self._bias_ids: list[int] = []
        self.want_logprobs = False
        self.n_top = 0
        self.greedy_fast = True     # greedy without logprobs: the two-pass argmax
        self.needs_cut = False      # sampled with top-k or top-p: the candidate passes too
        self.configure(GREEDY)

    # ------------------------------------------------------------------ per request
    def configure(self, params: SamplingParams) -> None:
        """Write the request's settings (one small uniform write; dense bias only when it changes)
        and restart the RNG stream at (params.seed, 0). The request was validated before `params`
        was built (protocol/rules.py, engine/requests.py): the checks here are the sampler's contract."""
        p = params
        check(p.temperature >= 0.0, "sampling", f"temperature must be >= 0, got {p.temperature}")
        check(0.0 < p.top_p <= 1.0 or p.temperature == 0.0, "sampling", f"top_p must be in (0, 1], got {p.top_p}")
        check(p.top_k >= 0, "sampling", f"top_k must be >= 0, got {p.top_k}")
        check(0.0 <= p.min_p <= 1.0, "sampling", f"min_p must be in [0, 1], got {p.min_p}")
        check(p.repetition_penalty > 0.0, "sampling", "repetition_penalty must be > 0")
        check(0 <= p.top_logprobs <= MAX_TOP_LOGPROBS, "sampling",
              f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
        for k in p.logit_bias:
            check(0 <= k < self.vocab, "sampling", f"logit_bias token {k} outside the vocabulary")
        greedy = p.greedy
        use_pen = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self.want_logprobs = bool(p.logprobs or p.top_logprobs)
        self.n_top = int(p.top_logprobs) if self.want_logprobs else 0
        self.greedy_fast = greedy and not self.want_logprobs
        self.needs_cut = not greedy and (int(p.top_k) > 0 or float(p.top_p) < 1.0 or float(p.min_p) > 0.0)
        raw = struct.pack("<4I5f3If", self.vocab, 0 if greedy else 1,
                          0 if greedy else int(p.top_k), self.n_top,
                          0.0 if greedy else 1.0 / p.temperature, 1.0 if greedy else float(p.top_p),
                          float(p.repetition_penalty), float(p.frequency_penalty), float(p.presence_penalty),
                          int(self.want_logprobs), int(use_pen), int(bool(p.logit_bias)),
                          0.0 if greedy else float(p.min_p))
        self.dev.write(self.params, raw + b"\0" * (64 - len(raw)))
        self._write_bias(p.logit_bias)
        seed = p.seed
        if seed is None:
            seed = random.getrandbits(64)
        seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.seed = seed
        self.dev.write(self.io, struct.pack("<3I", seed & 0xFFFFFFFF, seed >> 32, 0), offset=SEED_WORD * 4)

    def _write_bias(self, bias: dict) -> None:
        # Sparse updates of the dense bias row: clear the previous request's entries, set the new.
        for k in self._bias_ids:
            if k not in bias:
                self.dev.write(self.bias, b"\0\0\0\0", offset=4 * k)
        for k, v in bias.items():
            self.dev.write(self.bias, struct.pack("<f", v), offset=4 * k)
        self._bias_ids = list(bias)

    def reset_history(self, seen_ids=()) -> None:
        """Generated counts := 0 and seen := `seen_ids` (the prompt), at the start of a request."""
        words = array("I", bytes(4 * self.vocab))
        for t in seen_ids:
            t = int(t)
            if 0 <= t < self.vocab:
                words[t] = SEEN
        self.dev.write(self.hist, words.tobytes())

    # ------------------------------------------------------------------ per step
    def op(self, logits: Tensor, next_ids: Tensor | None = None) -> Op:
        """Prebuilt dispatch sampling from `logits` (V,) (f32 or f16); writes the token into
        `next_ids[0]` (u32) when given."""
        check(logits.numel == self.vocab, "sampling", f"logits has {logits.numel} entries, vocab is {self.vocab}")
        if next_ids is None:
            if self._dummy_ids is None:
                self._dummy_ids = self.dev.buffer(16, owner=self.owner, label="sampler.next_ids")
            ids_binding = self._dummy_ids
        else:
            check(next_ids.dtype == "u32", "sampling", "next_ids must be u32")
            ids_binding = (next_ids.buf, next_ids.offset, 4)
        hdr = act_header(logits.dtype)
        # binding -> buffer; each pass binds the ones it uses (pipelines get automatic layouts)
        b = {0: self.params, 1: logits.binding(), 2: self.bias, 3: self.hist, 4: self.scratch,
             5: self.io, 6: ids_binding, 7: self.work, 8: self.counts}

        def step(entry: str, uses: tuple, groups: int):
            pipe = self.dev.pipeline("sampling.wgsl", entry, header=hdr)
            return pipe, self.dev.bind(pipe, {k: b[k] for k in uses}), groups

        scan = step("sample_scan", (0, 1, 2, 3, 4, 7, 8), NS // 64)
        merge = step("sample_merge", (0, 5, 7), 1)
        sums = step("sample_sums", (0, 1, 4, 7, 8), NS // 64)
        cut = step("sample_cut", (0, 4, 5, 7, 8), 1)
        collect = step("sample_collect", (0, 4, 7, 8), NS // 64)
        rank = step("sample_rank", (7, 8), CANDIDATES // 64)
        finish = step("sample_finish", (0, 1, 3, 5, 6, 7, 8), 1)
        full, uncut = Op(name="sample"), Op(name="sample")
        for d in (scan, merge, sums, cut, collect, rank, finish):
            full.add(*d)
        for d in (scan, merge, sums, cut, finish):
            uncut.add(*d)
        greedy = Op(name="sample")
        for d in (step("argmax_partial", (0, 1, 2, 3, 4), NPART // 64),
                  step("argmax_final", (3, 4, 5, 6), 1)):
            greedy.add(*d)
        return _SampleOp(self, full, uncut, greedy)

    async def read(self, with_logprobs: bool | None = None) -> SampleResult:
        """Read the last step's result: 4 bytes, or RESULT_BYTES with logprobs."""
        n = self._result_size(with_logprobs)
        return self.result(await self.dev.read(self.io, 0, n), n > 4)

    def read_sync(self, with_logprobs: bool | None = None) -> SampleResult:
        n = self._result_size(with_logprobs)
        return self.result(self.dev.read_sync(self.io, 0, n), n > 4)

    def _result_size(self, with_logprobs: bool | None) -> int:
        lp = self.want_logprobs if with_logprobs is None else with_logprobs
        return RESULT_BYTES if lp else 4

    def copy_result(self, batch, dst, offset: int) -> None:
        """Record a copy of the last step's result (RESULT_BYTES) into `dst` at byte `offset` (a
        multiple of 4), for `result()` of that slice after a readback of `dst`."""
        batch.copy(self.io, dst, RESULT_BYTES, 0, offset)

    def result(self, raw: bytes, with_logprobs: bool | None = None) -> SampleResult:
        """The SampleResult in `raw`: the start of a copy of the io words (RESULT_BYTES of them with
        logprobs, else the token's 4). with_logprobs: None as the current request asks."""
        lp = self.want_logprobs if with_logprobs is None else with_logprobs
        if not lp:
            return SampleResult(struct.unpack("<I", raw[:4])[0])
        w = struct.unpack("<4I", raw[:16])
        (lp,) = struct.unpack("<f", raw[4:8])
        ids = struct.unpack(f"<{TOPN}I", raw[16:16 + 4 * TOPN])
        lps = struct.unpack(f"<{TOPN}f", raw[16 + 4 * TOPN:RESULT_BYTES])
        n = min(w[2], TOPN)
        return SampleResult(w[0], lp, [(ids[i], lps[i]) for i in range(n)])

    def release(self) -> None:
        for b in (self.params, self.bias, self.hist, self.scratch, self.io, self.work, self.counts,
                  self._dummy_ids):
            if b is not None:
                b.release()
