"""This adapter's ceilings and where the default models' hot kernels stand against them (issue 48):
`python bench/kernels.py --ceilings` (and the end of its default run).

Ceilings: the bytes a kernel streams per second, the fastest of the copy kernel (read + write,
bench/kernels.py's two sizes) and a read probe (bench/read_probe.wgsl: reads much, writes little, as
decode's matmuls do; 64 and 16 MiB), and an FMA probe's GFLOP/s (bench/fma_probe.wgsl: long
independent chains of fma on act4 in registers, 2, 4 or 8 chains per invocation, the best; f32, and
f16 where the device has shader-f16). Each ceiling is the fastest probe, by wall time and by CPU time
separately, so that a kernel's fraction is of the most this adapter was seen to do.
Kernels: every kernel kind of a SmolLM2-135M-Instruct-Q4_1 decode step (one sequence after a
128-token prompt, its greedy sampler included), of its prefill of 128 and of 512 tokens (the engine's chunks of
prefill_chunk_size 256: the last chunk, rows 256-511, is timed; the head is left out, the decode step
has it) and the four GEMMs of an all-MiniLM-L6-v2 batch (32 sentences of ~16 words, B x S as the
engine pads them), built by the engine itself: the chat model is loaded as `serve` loads it (its
chat options, max_num_sequences 0: the width this adapter takes), and its ops are the scheduler's
paged forward (models/paged.py: the paged KV pool and its attention, kernels/attention_paged.py), one
row a step, the inputs written by a step of the forward itself; the embedder's its matmul calls on its
own weights. (The contiguous cache's forward, models/llama.py, runs only for decoder embedders now.)
A kind's dispatches for every layer are recorded together (each layer's own weights, as a forward
streams them), many times into one submit, then a blocking readback; best of --runs
(bench/kernels.py time_op).
Bound: the larger of a kernel's two least times: the bytes it must move at least once (weights,
activations, the KV rows it reads) at the bytes ceiling, and its FLOPs at the f32 FMA peak (matmul and
attention accumulate in f32, f16 activations too). %bound is that time over the measured wall time;
%cpu the same per second of this process's CPU time (a CPU adapter's threads are ours: it does not
depend on what else runs, where %bound does: "cores", CPU over wall time, says how many cores a row
had, and a shared machine may give the probes two and a kernel one). GEMM rows count what the kernel
computes (padding included).
"""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np

from webgpu_engine import cache
from webgpu_engine.config import ChatConfig
from webgpu_engine.kernels import matmul as mm
from webgpu_engine.kernels.common import DTYPE_SIZE, Op, act_header, params
from webgpu_engine.pipelines.embedding import EmbeddingPipeline
from embeddings import sentences
from kernels import OWNER, bench_copy, time_op

BENCH = Path(__file__).resolve().parent
UNROLL = 8                    # fma per chain per loop step
DECODE_POS = 128              # the decode step after a 128-token prompt: 129 keys
CHAT, EMBEDDER = "SmolLM2-135M-Instruct-Q4_1", "all-MiniLM-L6-v2"


# --------------------------------------------------------------------------- ceilings
def probe_header(dtype: str, chains: int) -> str:
    """fma_probe.wgsl's header: `chains` act4 values, UNROLL fma each per chains_step."""
    names = [f"c{j}" for j in range(chains)]
    # distinct starting components: equal ones would be one value to the compiler
    init = ", ".join(f"act4(s, s + act(0.125), s + act(0.25), s + act(0.375)) + act4(act({j}) * act(0.0625))"
                     for j in range(chains))
    step = "\n".join("    " + " ".join(f"c.{n} = fma(c.{n}, a, b);" for n in names) for _ in range(UNROLL))
    return (f"{act_header(dtype)}struct Chains {{ {', '.join(f'{n}: act4' for n in names)} }}\n"
            f"fn chains_init(s: act) -> Chains {{ return Chains({init}); }}\n"
            f"fn chains_step(c_in: Chains, a: act4, b: act4) -> Chains {{\n    var c = c_in;\n{step}\n"
            f"    return c;\n}}\n"
            f"fn chains_sum(c: Chains) -> act4 {{ return {' + '.join(f'c.{n}' for n in names)}; }}\n")


def bench_fma(dev, dtype: str, chains: int, groups: int, iters: int, min_s: float, runs: int) -> dict:
    """GFLOP/s of fma_probe with `chains` chains over `groups` workgroups of 64, `iters` steps each."""
    out = dev.buffer(groups * 64 * 4 * DTYPE_SIZE[dtype], owner=OWNER)
    p = params(dev, [iters, 0, 0, 0], owner=OWNER)
    pipe = dev.pipeline(str(BENCH / "fma_probe.wgsl"), "fma_probe", header=probe_header(dtype, chains))
    op = Op().add(pipe, dev.bind(pipe, [p, out]), groups)
    t, cpu = time_op(dev, op, out, min_s, runs)
    flops = 2 * 4 * chains * UNROLL * iters * groups * 64
    p.release()
    out.release()
    return {"kernel": "fma_probe", "dtype": dtype, "chains": chains, "flops": flops, "ms": t * 1e3,
            "cpu_ms": cpu * 1e3, "GFLOP/s": flops / t / 1e9, "GFLOP/cpu-s": flops / cpu / 1e9}


def bench_read(dev, nbytes: int, min_s: float, runs: int, per: int = 1024) -> dict:
    """GB/s of read_probe over `nbytes`, `per` vec4 words per workgroup (bench_copy's row)."""
    src = dev.upload(np.random.default_rng(0).integers(0, 2 ** 31, nbytes // 4, dtype=np.uint32), owner=OWNER)
    groups = nbytes // 16 // per
    sums = dev.buffer(groups * 64 * 4, owner=OWNER)
    p = params(dev, [per, 0, 0, 0], owner=OWNER)
    pipe = dev.pipeline(str(BENCH / "read_probe.wgsl"), "read_probe")
    t, cpu = time_op(dev, Op().add(pipe, dev.bind(pipe, [p, src, sums]), groups), sums, min_s, runs)
    for b in (p, src, sums):
        b.release()
    return {"kernel": "read_probe", "bytes": nbytes, "ms": t * 1e3, "cpu_ms": cpu * 1e3, "GB/s": nbytes / t / 1e9}


def measure_ceilings(dev, a, copies: list[dict] | None = None) -> dict:
    """The fastest stream (the copies given, else measured at a.copy_sizes, and the read probe at
    a.read_sizes) by wall and by CPU time, and the best FMA probe per dtype."""
    streams = (copies or [bench_copy(dev, nb, a.min_s, a.runs) for nb in a.copy_sizes]) + \
        [bench_read(dev, nb, a.min_s, a.runs) for nb in a.read_sizes]
    for r in streams:
        r["GB/cpu-s"] = r["GB/s"] * r["ms"] / r["cpu_ms"]
    groups, iters, chain_counts = (16, 4, (4,)) if a.smoke else (1024, 64, (2, 4, 8))
    fma = {}
    for dtype in ["f32"] + (["f16"] if dev.has_f16 else []):
        probes = [bench_fma(dev, dtype, c, groups, iters, a.min_s, a.runs) for c in chain_counts]
        fma[dtype] = {k: max(p[k] for p in probes) for k in ("GFLOP/s", "GFLOP/cpu-s")} | {"probes": probes}
    return {"streams": streams, "GB/s": max(r["GB/s"] for r in streams),
            "GB/cpu-s": max(r["GB/cpu-s"] for r in streams), "fma": fma}


# --------------------------------------------------------------------------- a kind's dispatches
class Group:
    """One kernel kind's ops over a forward's layers, recorded together as the forward records
    them (`n_keys`: the short attention form where a decode step takes it)."""

    def __init__(self, ops: list[Op], n_keys: int | None = None):
        self.ops, self.n_keys = ops, n_keys

    def record(self, batch) -> None:
        for op in self.ops:
            op.record(batch, n_keys=self.n_keys)


def kind_of(name: str) -> str:
    """An op's kind: its name without the layer ('matmul[layers.3.qkv]' -> 'matmul[qkv]')."""
    return re.sub(r"layers\.\d+\.", "", name)


def rate_row(section: str, kind: str, ops: list[Op], rows: int, cost: tuple, timed: tuple, ceil: dict) -> dict:
    """A table row: the kind's wall and CPU ms per forward, its rates and its fraction of the bound."""
    (nbytes, flops), (t, cpu) = cost, timed
    fma = ceil["fma"]["f32"]
    least = {"bytes": nbytes / (ceil["GB/s"] * 1e9), "flops": flops / (fma["GFLOP/s"] * 1e9)}
    least_cpu = max(nbytes / (ceil["GB/cpu-s"] * 1e9), flops / (fma["GFLOP/cpu-s"] * 1e9))
    bound = max(least, key=least.get)
    return {"section": section, "kernel": kind, "ops": len(ops), "rows": rows, "ms": t * 1e3,
            "cpu_ms": cpu * 1e3, "bytes": nbytes, "flops": flops, "GB/s": nbytes / t / 1e9,
            "GFLOP/s": flops / t / 1e9, "bound": bound if least[bound] else "-",
            "least_ms": least[bound] * 1e3, "least_cpu_ms": least_cpu * 1e3,
            "pct_bound": 100 * least[bound] / t, "pct_bound_cpu": 100 * least_cpu / cpu}


def time_groups(dev, section: str, groups: dict, costs: dict, rows: int, sync_buf, a, ceil: dict,
                n_keys: int | None = None) -> list[dict]:
    out = []
    for kind, ops in groups.items():
        timed = time_op(dev, Group(ops, n_keys), sync_buf, a.min_s, a.runs)
        out.append(rate_row(section, kind, ops, rows, costs[kind], timed, ceil))
        print_row(out[-1])
    # the whole forward: its kinds' least times over their measured times
    tot = {k: sum(r[k] for r in out) for k in ("ms", "cpu_ms", "bytes", "flops", "least_ms", "least_cpu_ms")}
    out.append({"section": section, "kernel": "(all of the above)", "ops": sum(r["ops"] for r in out), "rows": rows,
                **tot, "GB/s": tot["bytes"] / tot["ms"] / 1e6, "GFLOP/s": tot["flops"] / tot["ms"] / 1e6,
                "bound": "both", "pct_bound": 100 * tot["least_ms"] / tot["ms"],
                "pct_bound_cpu": 100 * tot["least_cpu_ms"] / tot["cpu_ms"]})
    print_row(out[-1])
    for r in out:
        r["share"] = r["ms"] / tot["ms"]
    return out


# --------------------------------------------------------------------------- the chat model
def llm_cost(m, weights: dict, name: str, T: int, pos0: int) -> tuple[int, int]:
    """(bytes moved at least once, FLOPs) of one op of the decoder's paged forward of T rows at pos0;
    `weights` by label."""
    c, act = m.cfg, DTYPE_SIZE[m.dtype]
    kind, _, label = name.rstrip("]").partition("[")
    if kind.startswith("matmul"):
        w = weights[label]
        rows = 1 if w is m.lm_head else T          # the head: the last row
        return w.nbytes + rows * (w.k + w.n) * act, 2 * rows * w.n * w.k
    if kind in ("paged_decode", "paged_prefill"):  # causal: row t sees pos0 + t + 1 keys
        pairs = T * pos0 + T * (T + 1) // 2
        kv = 0 if m.kv_cache_dtype else 2 * (pos0 + T) * c.kv_dim * act      # quantised caches: not counted
        return kv + 2 * T * c.q_dim * act, 4 * pairs * c.q_dim
    rw = {"rms_norm": 2 * c.hidden_size * act, "silu_mul": 3 * c.ffn_size * act,
          "rope_kv_paged": 2 * c.qkv_dim * act, "embedding": m.embed.nbytes // c.vocab_size + c.hidden_size * act,
          "sample": c.vocab_size * act}
    return T * rw.get(kind, 0), 0


class PagedSteps:
    """The scheduler's paged forward of a pipeline loaded as `serve` loads it, and a sequence of its
    pool whose step inputs (ids, positions, slots, lens, tables) a step of the forward writes."""

    def __init__(self, pipe):
        from webgpu_engine.config import GREEDY
        sched = pipe.scheduler
        self.pipe, self.dev, self.fwd, self.pool, self.slot = pipe, pipe.dev, sched.fwd, sched.pool, sched.slots[0]
        self.m, self.sid = pipe.model, "bench.ceilings"
        self.slot.sampler.configure(GREEDY)              # the greedy pair, as a greedy request runs

    def decode(self, pos: int) -> list[Op]:
        """The ops of one row's decode step at position `pos` (`pos` keys before it), the slot's
        sampler last; its inputs written."""
        pool, fwd = self.pool, self.fwd
        pool.add_sequence(self.sid, [])
        pool.reserve(self.sid, pos + 1)
        pool.append_tokens(self.sid, [1] * pos, decoded=True)
        b = self.dev.batch()
        fwd.record_decode(b, [1], pool.decode_inputs([self.sid], 1, fwd.max_blocks))
        self.dev.submit(b)
        pool.free(self.sid)
        return list(fwd.ops("decode", 1)) + [self.slot.op]

    def prefill(self, T: int, pos0: int) -> list[Op]:
        """The body ops (no head) of a prefill chunk of T rows at pos0; its inputs written."""
        pool, fwd = self.pool, self.fwd
        pool.add_sequence(self.sid, [])
        pool.reserve(self.sid, pos0 + T)
        b = self.dev.batch()
        fwd.record_prefill(b, [1] * T, pos0, pool.slots(self.sid, pos0, T), pool.block_table(self.sid),
                           with_head=False)
        self.dev.submit(b)
        pool.free(self.sid)
        return fwd.ops("prefill", T).body()


def llm_rows(dev, steps: PagedSteps, a, ceil: dict) -> list[dict]:
    """The decode step's and each prefill's kinds (a.prefill tokens: the last chunk of each)."""
    m = steps.m
    weights = {w.label: w for L in m.layers for w in (L.qkv, L.o, L.gate_up, L.down)} | {m.lm_head.label: m.lm_head}
    head = f"matmul[{m.lm_head.label}]"           # 'matmul[embed]' where the head is the tied embedding

    def section(name: str, ops: list[Op], T: int, pos0: int) -> list[dict]:
        groups, costs = {}, {}
        for op in ops:
            kind = kind_of(op.name).replace(head, "matmul[lm_head]")
            groups.setdefault(kind, []).append(op)
            b, f = llm_cost(m, weights, op.name, T, pos0)
            costs[kind] = tuple(x + y for x, y in zip(costs.get(kind, (0, 0)), (b, f)))
        return time_groups(dev, name, groups, costs, T, steps.fwd.logits.buf, a, ceil, n_keys=pos0 + T)

    rows = section(f"decode @{DECODE_POS}", steps.decode(DECODE_POS), 1, DECODE_POS)
    for n in a.prefill:
        T = min(n, m.chunk)
        pos0 = n - T                              # the last chunk: its attention sees all n keys
        rows += section(f"prefill {n}" + (f" @{pos0}" if pos0 else ""), steps.prefill(T, pos0), T, pos0)
    return rows


# --------------------------------------------------------------------------- the embedder
def embed_rows(dev, pipe, a, ceil: dict) -> list[dict]:
    """The embedder's four GEMMs per layer, called as BertModel._encoder_ops calls them."""
    m = pipe.model
    lengths = sorted((len(i) for i in pipe.tokenize(sentences(a.embed_batch, a.embed_words))), reverse=True)
    B, S = max(((b, s) for _, _, b, s in pipe.plan_batches(lengths)), key=lambda bs: bs[0] * bs[1])
    ar, T, C, F = m._ensure_arena(B, S), B * S, m.cfg.hidden_size, m.cfg.intermediate_size
    G = 1 if m.cfg.ffn == "gelu" else 2
    x, x1, tmp, ctx = (t.view((T, C)) for t in (ar.x, ar.x1, ar.tmp, ar.ctx))
    calls = {"matmul[qkv]": lambda L: (x, L.qkv, ar.qkv.view((T, 3 * C)), L.qkv_b),
             "matmul[o]": lambda L: (ctx, L.o, tmp, L.o_b),
             "matmul[ff1]": lambda L: (x1, L.ff1, ar.ff.view((T, G * F)), L.ff1_b),
             "matmul[ff2]": lambda L: (ar.ffg.view((T, F)), L.ff2, tmp, L.ff2_b)}
    groups, costs = {}, {}
    act = DTYPE_SIZE[m.act_dtype]
    for kind, call in calls.items():
        args = [call(L) for L in m.layers]
        groups[kind] = [mm.matmul(dev, xi, w, y, bias=b) for xi, w, y, b in args]
        costs[kind] = (sum(w.nbytes + T * (w.k + w.n) * act + 4 * w.n for _, w, _, _ in args),
                       sum(2 * T * w.n * w.k for _, w, _, _ in args))
    rows = time_groups(dev, f"embed {B}x{S}", groups, costs, T, ar.lengths.buf, a, ceil)
    for ops in groups.values():
        for op in ops:
            op.release()
    return rows


# --------------------------------------------------------------------------- the table
HEAD = (f"{'section':16} {'kernel':22} {'ops':>4} {'rows':>5} {'ms':>9} {'cpu ms':>9} {'cores':>5} {'GB/s':>8} "
        f"{'GFLOP/s':>8} {'bound':>5} {'%bound':>6} {'%cpu':>5}")


def print_row(r: dict) -> None:
    print(f"{r['section']:16} {r['kernel']:22} {r['ops']:>4} {r['rows']:>5} {r['ms']:9.3f} {r['cpu_ms']:9.3f} "
          f"{r['cpu_ms'] / r['ms']:5.2f} {r['GB/s']:8.2f} {r['GFLOP/s']:8.2f} {r['bound']:>5} "
          f"{r['pct_bound']:5.1f}% {r['pct_bound_cpu']:4.1f}%", flush=True)


def print_ceilings(ceil: dict) -> None:
    for r in ceil["streams"]:
        print(f"ceiling {r['kernel']:10} {r['bytes'] >> 20:>3} MiB: {r['GB/s']:7.2f} GB/s "
              f"{r['GB/cpu-s']:7.2f} GB/cpu-s  {r['cpu_ms'] / r['ms']:4.2f} cores")
    for dtype, f in ceil["fma"].items():
        for p in f["probes"]:
            print(f"ceiling fma_probe {dtype} x{p['chains']}: {p['GFLOP/s']:7.2f} GFLOP/s {p['GFLOP/cpu-s']:7.2f} "
                  f"GFLOP/cpu-s  {p['cpu_ms'] / p['ms']:4.2f} cores")
    f = ceil["fma"]["f32"]
    print(f"bounds: bytes {ceil['GB/s']:.2f} GB/s ({ceil['GB/cpu-s']:.2f} GB/cpu-s), FLOPs (f32) {f['GFLOP/s']:.2f} "
          f"GFLOP/s ({f['GFLOP/cpu-s']:.2f} GFLOP/cpu-s): the fastest probe of each")


def run(dev, a, copies: list[dict] | None = None) -> dict:
    """Measure the ceilings, then every hot kernel of the default models against them; print the
    table and return it (the JSON's content)."""
    print(f"adapter: {dev.info.name} ({dev.info.backend}, {dev.info.description}); ms = wall, cpu = process CPU")
    ceil = measure_ceilings(dev, a, copies)
    print_ceilings(ceil)
    print(HEAD)

    async def models() -> list[dict]:
        from webgpu_engine.cli.commands import serve_chat_opts
        from webgpu_engine.pipelines.llm import LLMChatPipeline
        chat = await LLMChatPipeline.load(dev, a.chat_model or cache.default_model_path(CHAT),
                                          ChatConfig(**serve_chat_opts(None)))
        try:
            print(f"chat: {chat.model.dtype}, width {chat.scheduler.max_seqs} (fused rows: "
                  f"{chat.scheduler.fwd.fused_rows}), the scheduler's paged forward, one row")
            rows = llm_rows(dev, PagedSteps(chat), a, ceil)
        finally:
            chat.dispose()
        emb = await EmbeddingPipeline.load(dev, a.embed_model or cache.default_model_path(EMBEDDER),
                                           ChatConfig(compile_at_load=False, max_batch_size=a.embed_batch))
        try:
            return rows + embed_rows(dev, emb, a, ceil)
        finally:
            emb.dispose()
    rows = asyncio.run(models())
    return {"adapter": dev.info.__dict__, "runs": a.runs, "ceilings": ceil, "rows": rows}


def add_arguments(ap) -> None:
    ap.add_argument("--ceilings", action="store_true",
                    help="only the ceilings and the default models' kernels against them (bench/ceilings.py)")
    ap.add_argument("--chat-model", default="", help=f"--ceilings: the chat model (default {CHAT})")
    ap.add_argument("--embed-model", default="", help=f"--ceilings: the embedder (default {EMBEDDER})")


def configure(a) -> None:
    """The workload of a run, smaller with --smoke (a.smoke, a.runs and a.min_s set by the caller)."""
    a.read_sizes = (4 << 20,) if a.smoke else (64 << 20, 16 << 20)
    a.prefill = (16,) if a.smoke else (128, 512)
    a.embed_batch, a.embed_words = (4, 8) if a.smoke else (32, 16)
