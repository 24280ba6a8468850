"""LLM benchmark: prefill and decode speed of LLMChatPipeline on a GGUF (default SmolLM2), where the time
goes (host encoding vs GPU wait vs readback, GPU time per kernel kind), and llama.cpp on the same file
when `llama_cpp` imports (`pip install -e '.[bench]'`). Prints a table and writes bench/results/llm.json.

The comparison table sets like beside like: each program's own greedy decode loop (the pipeline's
prefill_step / decode_step, what a user of the engine gets; llama.cpp's eval of one token at a time)
decoding the same number of tokens after the same prompt, and each program's prefill of the same
prompt from an empty cache. The engine's hand-written step loop (record, submit, read; no sampler
state, no stop rules) is a diagnostic below it, never set beside llama.cpp.

    python bench/llm.py [--model PATH] [--dtype f32|f16|auto] [--decode 128] [--prompts 128,512]
                        [--sampling temperature=0.7,top_p=0.95]
    python bench/llm.py --json-schema [SCHEMA_JSON] [--decode 128] [--rounds 3]
    python bench/llm.py --smoke [--model PATH] [--json-schema | --ab A B] [--out PATH]

--smoke: one 16-token prompt, 4 decode steps, one repetition / round (in each mode): checks that
the script runs to the end; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# the prompt both decode loops continue (a raw prompt of ~10 tokens)
DECODE_PROMPT = "The history of the city on the river begins with"

# like-for-like rows: (label, the engine's key, llama.cpp's key)
COMPARE = [("decode tok/s, each program's own greedy loop", "decode_loop_ahead_tokens_per_s",
            "decode_tokens_per_s")]


def _compare_rows(prompts: list[int]) -> list[tuple[str, str, str]]:
    return COMPARE + [(f"prefill {n} tok/s, from an empty cache", f"prefill_{n}_tokens_per_s",
                       f"prefill_{n}_tokens_per_s") for n in prompts]


LLAMA_CPP_MISSING = ("llama-cpp-python is not installed in this environment (pip install -e '.[bench]' "
                     "builds it from source: ~20 min on 2 cores)")


def _prompt_ids(tok, n: int) -> list[int]:
    text = ("The history of the city begins with a small settlement on the river, where traders met "
            "to exchange salt, grain and stories. ") * (n // 8 + 8)
    return tok.encode(text)[:n]


async def bench_engine(path: Path, dtype: str, prompts: list[int], n_decode: int, reps: int,
                       skip_prefill: bool = False, sampling: dict | None = None) -> dict:
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.gpu import request_device
    from webgpu_engine.models.experts import decode_weight_bytes
    from webgpu_engine.pipelines.llm import LLMChatPipeline

    dev = await request_device()
    ctx = max(prompts + [32]) + n_decode + 8     # the decode run follows a 32-token prompt
    t0 = time.perf_counter()
    pipe = await LLMChatPipeline.load(dev, path, ChatConfig(dtype=dtype, context_window_size=ctx,
                                                            prefill_chunk_size=256))
    out = {"adapter": dev.info.name, "dtype": pipe.model.dtype, "load_s": time.perf_counter() - t0,
           # the forms a step at this context records (attention's short form up to its max_keys)
           "dispatches_per_decode_step": _n_dispatches(pipe.scheduler.fwd.ops("decode", 1), 33) + 1}
    # weight bytes a decode step's kernels read (a MoE: its k experts' rows, not all E)
    read, experts = decode_weight_bytes(pipe.model)
    out.update({"weight_MB_per_decode_token": read / 1e6, **({"expert_MB_all": experts / 1e6} if experts else {})})
    gen = GenerationConfig(**{"temperature": 0.0, **(sampling or {})}, ignore_eos=True)
    if skip_prefill:
        prompts = []
    # forward_tokens_and_sample appends to the KV cache (as WebLLM's does): every prefill below
    # starts from an empty cache (reset_chat, outside the timed part), so each measures a prompt of
    # n tokens at positions 0..n-1 and the runs never add up past the context window
    # warm-up: compiles every pipeline of the shapes used below
    for n in prompts:
        pipe.reset_chat()
        await pipe.forward_tokens_and_sample(_prompt_ids(pipe.tokenizer, n), True, gen)
    for n in prompts:
        ids = _prompt_ids(pipe.tokenizer, n)
        best = 1e9
        for _ in range(reps):
            pipe.reset_chat()
            t = time.perf_counter()
            await pipe.forward_tokens_and_sample(ids, True, gen)
            best = min(best, time.perf_counter() - t)
        out[f"prefill_{n}_tokens_per_s"] = n / best
        out[f"time_to_first_token_{n}_s"] = best
    # the hand-written step loop (a diagnostic): host encoding vs submit vs GPU wait + readback,
    # per step, after a 32-token prompt
    loop = await _HandLoop.start(pipe, _prompt_ids(pipe.tokenizer, 32))
    enc = sub = wait = 0.0
    t_all, c_all = time.perf_counter(), time.process_time()
    for i in range(n_decode):
        t = time.perf_counter()
        b = loop.step()
        t1 = time.perf_counter()
        dev.submit(b)
        t2 = time.perf_counter()
        await loop.read()
        t3 = time.perf_counter()
        enc, sub, wait = enc + t1 - t, sub + t2 - t1, wait + t3 - t2
    total, cpu = time.perf_counter() - t_all, time.process_time() - c_all
    pos = loop.close()
    # process CPU time: on a CPU adapter the driver's threads are ours, so this does not depend on
    # what else the machine runs (wall time does)
    out.update({"step_loop_tokens_per_s": n_decode / total, "step_loop_step_ms": 1e3 * total / n_decode,
                "step_loop_step_cpu_ms": 1e3 * cpu / n_decode,
                "host_record_ms": 1e3 * enc / n_decode, "host_submit_encode_ms": 1e3 * sub / n_decode,
                "gpu_wait_and_readback_ms": 1e3 * wait / n_decode})
    out.update(await _decode_loop_ab(pipe, n_decode, sampling, max(reps, 2)))
    # readback alone (a 4-byte read after an empty submit)
    t = time.perf_counter()
    for _ in range(20):
        await dev.read(loop.slot.sampler.io, 0, 4)
    out["readback_only_ms"] = 1e3 * (time.perf_counter() - t) / 20
    fwd = pipe.scheduler.fwd
    out["gpu_ms_by_kernel_decode"], out["cpu_ms_by_kernel_decode"] = \
        _by_kind(dev, fwd.ops("decode", 1) + [loop.slot.op], fwd.step, n_keys=pos)
    if not skip_prefill:
        out["gpu_ms_by_kernel_prefill_128"], out["cpu_ms_by_kernel_prefill_128"] = \
            _by_kind(dev, fwd.ops("prefill", min(128, pipe.model.chunk)), fwd.step)
    pipe.dispose()
    return out


class _HandLoop:
    """The engine's hand-written step loop over the scheduler's paged forward (a diagnostic: record,
    submit, read; no sampler state, no stop rules): one sequence of the pool, slot 0's greedy sampler."""

    @classmethod
    async def start(cls, pipe, ids: list[int]) -> "_HandLoop":
        from webgpu_engine.config import GREEDY
        self = cls()
        sched = pipe.scheduler
        self.dev, self.fwd, self.pool, self.slot = pipe.dev, sched.fwd, sched.pool, sched.slots[0]
        self.V, self.sid = pipe.model.cfg.vocab_size, "bench.hand_loop"
        self.slot.sampler.configure(GREEDY)
        self.pool.add_sequence(self.sid, [])
        P = pipe.model.chunk
        for s in range(0, len(ids), P):           # the prompt by prefill chunks, its last row sampled
            e = min(s + P, len(ids))
            self.pool.reserve(self.sid, e)
            b = self.dev.batch()
            self.fwd.record_prefill(b, ids[s:e], s, self.pool.slots(self.sid, s, e - s),
                                    self.pool.block_table(self.sid), with_head=e == len(ids))
            if e == len(ids):
                self._sample(b, 0)
            self.dev.submit(b)
            self.pool.append_tokens(self.sid, ids[s:e])
        await self.read()
        return self

    @classmethod
    def at(cls, pipe, pos: int, token: int) -> "_HandLoop":
        """A sequence whose cache counts `pos` positions, none computed (a decode step's time depends
        on how many keys it reads, not on their values), its next input `token`."""
        from webgpu_engine.config import GREEDY
        self = cls()
        sched = pipe.scheduler
        self.dev, self.fwd, self.pool, self.slot = pipe.dev, sched.fwd, sched.pool, sched.slots[0]
        self.V, self.sid, self.tok = pipe.model.cfg.vocab_size, "bench.hand_loop", token
        self.slot.sampler.configure(GREEDY)
        self.pool.add_sequence(self.sid, [])
        self.pool.reserve(self.sid, pos)
        self.pool.append_tokens(self.sid, [token] * pos, decoded=True)
        return self

    def _sample(self, b, row: int) -> None:
        self.slot.copy_in(b, self.fwd.logits, row, self.V)
        self.slot.op.record(b)

    def step(self, token: int | None = None):
        """A recorded decode step feeding `token` (default the last one read), its sampler after it."""
        tok = self.tok if token is None else token
        self.pool.reserve(self.sid, self.pool.num_tokens(self.sid) + 1)
        b = self.dev.batch()
        self.fwd.record_decode(b, [tok], self.pool.decode_inputs([self.sid], 1, self.fwd.max_blocks))
        self._sample(b, 0)
        self.pool.append_tokens(self.sid, [tok], decoded=True)
        return b

    async def read(self) -> int:
        self.tok = (await self.slot.sampler.read(False)).token
        return self.tok

    def close(self) -> int:
        """The sequence leaves the pool; returns its length."""
        n = self.pool.num_tokens(self.sid)
        self.pool.free(self.sid)
        return n


async def _decode_loop_ab(pipe, n_decode: int, sampling: dict | None, rounds: int) -> dict:
    """The pipeline's own decode loop (prefill_step, then decode_step until max_tokens) with steps
    one ahead of the host (ChatConfig.decode_ahead) and without, in alternating rounds (best of
    each), and the GPU's step time alone: steps recorded and submitted back to back, one wait at the
    end (no readback, no host work between steps but the next step's recording). Host ms per step:
    recording a one-row step of the scheduler's paged forward, which decode_ahead overlaps with the
    GPU's previous step (the scheduler's `ahead_steps` count such steps)."""
    from webgpu_engine.config import GenerationConfig
    dev = pipe.dev
    text = DECODE_PROMPT
    gen = GenerationConfig(**{"temperature": 0.0, **(sampling or {})}, max_tokens=n_decode + 1, ignore_eos=True)
    best = {True: 0.0, False: 0.0}
    cpu_ms = {True: 1e9, False: 1e9}       # process CPU per token (lavapipe's threads are ours)
    tokens = {}
    sched = pipe.scheduler
    base = sched.decode_ahead
    try:
        for _ in range(rounds):
            for ahead in (True, False):
                sched.decode_ahead = ahead
                pipe.reset_chat()
                await pipe.prefill_step(None, gen, prompt=text)
                t, c = time.perf_counter(), time.process_time()
                while not pipe.stopped:
                    await pipe.decode_step()
                dt, dc = time.perf_counter() - t, time.process_time() - c
                steps = len(pipe.output_ids) - 1
                best[ahead] = max(best[ahead], steps / dt)
                cpu_ms[ahead] = min(cpu_ms[ahead], 1e3 * dc / steps)
                tokens[ahead] = list(pipe.output_ids)
    finally:
        sched.decode_ahead = base
    pipe.reset_chat()
    loop = await _HandLoop.start(pipe, pipe.prompt_ids(None, text))
    t, rec = time.perf_counter(), 0.0
    for i in range(n_decode):           # steps back to back: the input id does not change the work
        t0 = time.perf_counter()
        b = loop.step(loop.tok)
        rec += time.perf_counter() - t0
        await dev.submit_async(b)
    await dev.sync()
    gpu_ms = 1e3 * (time.perf_counter() - t) / n_decode
    host_ms = 1e3 * rec / n_decode      # recording a step: what decode_ahead overlaps with the GPU's step
    loop.close()
    pipe.reset_chat()
    ahead_ms = 1e3 / best[True]
    return {"decode_loop_ahead_tokens_per_s": best[True], "decode_loop_serial_tokens_per_s": best[False],
            "decode_loop_ahead_cpu_ms_per_token": cpu_ms[True], "decode_loop_serial_cpu_ms_per_token": cpu_ms[False],
            "decode_loop_ahead_over_serial": best[True] / best[False],
            "decode_loop_ahead_step_ms": ahead_ms, "gpu_bound_step_ms": gpu_ms,
            "decode_loop_ahead_over_gpu_bound": ahead_ms / gpu_ms, "decode_loop_tokens": n_decode,
            "host_ms_per_step": host_ms, "decode_loop_same_tokens": tokens[True] == tokens[False]}


BENCH_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"], "additionalProperties": False}}


async def bench_grammar(path: Path, dtype: str, n_decode: int, rounds: int, schema: dict) -> dict:
    """Decode speed with and without a JSON Schema on the same pipeline: rounds alternate a free and
    a constrained answer of up to `n_decode` tokens to one chat prompt; best round of each (the
    machine may be shared). The constrained rate includes the per-step mask (computed on the host
    while the GPU runs the model, then uploaded and applied before sampling)."""
    from webgpu_engine.config import ChatConfig, GenerationConfig
    from webgpu_engine.gpu import request_device
    from webgpu_engine.pipelines.llm import LLMChatPipeline

    dev = await request_device()
    pipe = await LLMChatPipeline.load(dev, path, ChatConfig(dtype=dtype, context_window_size=n_decode + 128))
    msgs = [{"role": "user", "content": "List five people with their name, age and city as a JSON array."}]
    t0 = time.perf_counter()
    grammar = pipe.grammars.compile({"type": "json_schema", "schema": schema})
    compile_s = time.perf_counter() - t0
    best = {"free": [0.0, 0], "json_schema": [0.0, 0]}
    cpu_ms = {"free": 1e9, "json_schema": 1e9}     # process CPU per decode step (lavapipe's threads
    mask_s = []                                    # are ours: steadier than wall time on a busy host)
    for _ in range(rounds + 1):                   # the first round warms up (not counted)
        for name, g in (("free", None), ("json_schema", grammar)):
            gen = GenerationConfig(temperature=0.0, max_tokens=n_decode, ignore_eos=True, grammar=g)
            pipe.reset_chat()
            await pipe.prefill_step(msgs, gen)
            c0 = time.process_time()
            while not pipe.stopped:
                await pipe.decode_step()
            r = pipe._req
            if _ > 0 and r.decode_tokens:
                cpu_ms[name] = min(cpu_ms[name], 1e3 * (time.process_time() - c0) / r.decode_tokens)
            rate = r.decode_tokens / r.decode_s if r.decode_s else 0.0
            if _ > 0 and rate > best[name][0]:
                best[name] = [rate, r.decode_tokens]
            if g is not None and _ > 0:
                mask_s.append(r.grammar_mask_s / max(r.grammar_steps, 1))
    pipe.dispose()
    free, con = best["free"][0], best["json_schema"][0]
    return {"adapter": dev.info.name, "dtype": pipe.model.dtype, "rounds": rounds,
            "decode_tokens_per_s_free": free, "decode_tokens_per_s_json_schema": con,
            "decode_tokens_free": best["free"][1], "decode_tokens_json_schema": best["json_schema"][1],
            "constrained_over_free": con / free if free else 0.0, "grammar_compile_s": compile_s,
            "decode_step_cpu_ms_free": cpu_ms["free"],
            "decode_step_cpu_ms_json_schema": cpu_ms["json_schema"],
            "grammar_mask_ms_per_token": 1e3 * min(mask_s) if mask_s else 0.0}


def _n_dispatches(ops, n_keys: int) -> int:
    """Dispatches a decode step with n_keys live keys records (ops' short forms where they apply)."""
    return sum(len(op.short if op.short and n_keys <= op.max_keys else op.dispatches) for op in ops)


def _by_kind(dev, ops, sync_buf, n_keys: int | None = None) -> tuple[dict, dict]:
    """GPU time per kernel kind: each kind's dispatches submitted alone (best of 3), as wall and as
    process CPU milliseconds; `n_keys`: record the forms a decode step with that many keys takes."""
    kinds = defaultdict(list)
    for op in ops:
        kinds[(op.name or "op").split("[")[0]].append(op)
    res, cpu = {}, {}
    for name, group in kinds.items():
        best, best_c = 1e9, 1e9
        for _ in range(3):
            b = dev.batch()
            for op in group:
                op.record(b, n_keys=n_keys)
            t, c = time.perf_counter(), time.process_time()
            dev.submit(b)
            dev.read_sync(sync_buf, 0, 4)
            best, best_c = min(best, time.perf_counter() - t), min(best_c, time.process_time() - c)
        res[name], cpu[name] = round(1e3 * best, 2), round(1e3 * best_c, 2)
    return res, cpu


async def bench_ab(path: Path, dtype: str, variants: list[str], n_steps: int, rounds: int) -> dict:
    """Interleaved A/B of matmul strategies on whole decode steps: one pipeline per variant (ops are
    built under that variant's overrides), then rounds of `n_steps` steps per variant in turn; reports
    the best round's wall and process-CPU ms per step (the machine may be shared: interleaving and
    taking the best keep the comparison fair)."""
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.gpu import request_device
    from webgpu_engine.kernels import matmul as mm
    from webgpu_engine.pipelines.llm import LLMChatPipeline

    dev = await request_device()
    pipes = []
    for v in variants:
        mm.CONFIG_OVERRIDES.clear()
        ov = _overrides(v)
        dt = ov.pop("dtype", dtype)
        mm.CONFIG_OVERRIDES.update(ov)
        pipe = await LLMChatPipeline.load(dev, path, ChatConfig(dtype=dt, context_window_size=
                                                                64 + rounds * n_steps + 8))
        pipes.append((pipe, await _HandLoop.start(pipe, _prompt_ids(pipe.tokenizer, 32))))
    mm.CONFIG_OVERRIDES.clear()
    best = {v: [1e9, 1e9] for v in variants}
    for _ in range(rounds):
        for v, (pipe, loop) in zip(variants, pipes):
            t, c = time.perf_counter(), time.process_time()
            for _ in range(n_steps):     # one-row decode steps of the paged forward and their sampler
                pipe.dev.submit(loop.step())
                await loop.read()
            dt, dc = (time.perf_counter() - t) / n_steps, (time.process_time() - c) / n_steps
            best[v] = [min(best[v][0], 1e3 * dt), min(best[v][1], 1e3 * dc)]
    out = {"adapter": dev.info.name}
    for v, (pipe, loop) in zip(variants, pipes):
        out[v or "default"] = {"dtype": pipe.model.dtype, "step_ms": round(best[v][0], 2),
                               "step_cpu_ms": round(best[v][1], 2),
                               "dispatches": _n_dispatches(pipe.scheduler.fwd.ops("decode", 1), 33) + 1}
        loop.close()
        pipe.dispose()
    return out


def _overrides(spec: str) -> dict:
    """"fuse=0,unroll=1" -> {"fuse": False, "unroll": True} (fields of MatmulConfig); "dtype=f32"
    sets the activation dtype of that variant."""
    from webgpu_engine.kernels import matmul as mm
    res = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        res[k] = v if k == "dtype" else type(getattr(mm.MatmulConfig(), k))(int(v))
    return res


def bench_llama_cpp(path: Path, prompts: list[int], n_decode: int) -> dict | None:
    """llama.cpp's figures (llama-cpp-python, CPU) on the same GGUF, measured in a child process so
    that a crash of the native library is reported instead of ending this benchmark; None when
    llama_cpp does not import."""
    import subprocess
    import sys
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    cmd = [sys.executable, __file__, "--llama-cpp-child", "--model", str(path),
           "--prompts", ",".join(map(str, prompts)), "--decode", str(n_decode)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    note = None
    if r.returncode < 0:
        # A native build for this CPU may include the AMX matmul (an "extra buffer type"), which
        # crashes where the kernel does not grant AMX to the process: measure without those.
        r = subprocess.run(cmd + ["--no-extra-bufts"], capture_output=True, text=True)
        note = "extra buffer types (AMX) off: with them llama.cpp crashed on this machine"
    if r.returncode != 0:
        why = f"signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
        return {"error": f"llama.cpp failed ({why}): {r.stderr.strip()[-300:]}"}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if note:
        out["note"] = note
    return out


def _llama_cpp_figures(path: Path, prompts: list[int], n_decode: int, extra_bufts: bool = True) -> dict:
    import llama_cpp
    if not extra_bufts:
        import llama_cpp.llama_cpp as lc
        default_params = lc.llama_model_default_params

        def params():
            p = default_params()
            p.use_extra_bufts = False
            return p
        lc.llama_model_default_params = params
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(prompts + [32]) + n_decode + 8, n_threads=2,
                          verbose=False)
    out = {"version": getattr(llama_cpp, "__version__", "?")}

    class Tok:       # llama.cpp's own tokenizer behind the interface _prompt_ids expects
        def encode(self, text):
            return llm.tokenize(text.encode(), add_bos=False)
    for n in prompts:
        ids = _prompt_ids(Tok(), n)
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        out[f"prefill_{n}_tokens_per_s"] = n / (time.perf_counter() - t)
        out[f"time_to_first_token_{n}_s"] = time.perf_counter() - t
    llm.reset()                  # decode after the prompt the engine's own loop continues
    llm.eval(llm.tokenize(DECODE_PROMPT.encode()))
    t = time.perf_counter()
    for _ in range(n_decode):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())     # greedy, like the engine run
        llm.eval([tok])
    out["decode_tokens_per_s"] = n_decode / (time.perf_counter() - t)
    return out


def _print_tables(e: dict, ref: dict, pairs: list, n_decode: int) -> None:
    """The like-for-like table (llama.cpp's column empty, and why, where it was not measured), then
    the engine's own figures: the diagnostics, which have no llama.cpp counterpart."""
    head = f"webgpu_engine ({e['dtype']}, {e['adapter']})"
    w = max(len(label) for label, _, _ in pairs)
    print(f"same GGUF, same run; decode: {n_decode} greedy tokens after the same prompt")
    print(f"{'':<{w}}  {'webgpu_engine':>13}  {'llama.cpp':>9}  {'ratio':>6}")
    for label, ek, lk in pairs:
        other = None if ref.get("error") else ref.get(lk)
        print(f"{label:<{w}}  {e[ek]:>13.2f}  " +
              (f"{other:>9.2f}  {e[ek] / other:>6.2f}" if other else f"{'-':>9}  {'-':>6}"))
    if ref.get("error"):
        print(f"llama.cpp: not measured: {ref['error']}")
    elif ref.get("note"):
        print(f"llama.cpp: {ref['note']}")
    rows = [(k, e[k]) for k in e if isinstance(e[k], (int, float)) and not isinstance(e[k], bool)]
    w = max(len(k) for k, _ in rows)
    print(f"\n{'engine diagnostics':<{w}}  {head}")
    for k, v in rows:
        print(f"{k:<{w}}  {v:>12.2f}")
    for kind in ("gpu_ms_by_kernel_decode", "cpu_ms_by_kernel_decode", "gpu_ms_by_kernel_prefill_128",
                 "cpu_ms_by_kernel_prefill_128"):
        if kind in e:
            print(kind + ": " + ", ".join(f"{k} {v}" for k, v in e[kind].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the SmolLM2 default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "llm.json"))
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill measurements")
    ap.add_argument("--sampling", default="", help="GenerationConfig fields for the runs, e.g. "
                    "temperature=0.7,top_p=0.95 (default: greedy)")
    ap.add_argument("--matmul", default="", help="matmul strategy overrides for A/B runs, e.g. "
                    "fuse=0,unroll=0 (fields of kernels.matmul.MatmulConfig)")
    ap.add_argument("--ab", nargs="+", default=None, metavar="SPEC",
                    help="interleaved A/B of decode steps between matmul strategies, e.g. "
                         "--ab unroll=0,fuse=0 fuse=1 (prints per-step wall and CPU ms)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json-schema", nargs="?", const="default", default=None, metavar="SCHEMA_JSON",
                    help="decode tok/s with and without a JSON Schema (default: an array of people) "
                         "in one run; writes bench/results/llm_grammar.json")
    ap.add_argument("--llama-cpp-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-extra-bufts", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="one short prompt, 4 decode steps, one repetition: checks the script, measures nothing")
    a = ap.parse_args()
    if a.smoke:
        a.prompts, a.decode, a.reps, a.rounds = "16", 4, 1, 1
    if a.llama_cpp_child:       # see bench_llama_cpp
        print(json.dumps(_llama_cpp_figures(Path(a.model), [int(x) for x in a.prompts.split(",")],
                                            a.decode, not a.no_extra_bufts)))
        return
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    if a.ab:
        from webgpu_engine import cache
        path = Path(a.model or cache.default_model_path("SmolLM2-135M-Instruct-Q4_1"))
        res = asyncio.run(bench_ab(path, a.dtype, [v if v != "default" else "" for v in a.ab], 8,
                                   a.rounds))
        for k, v in res.items():
            print(f"{k:24} {v}")
        return
    if a.json_schema:
        from webgpu_engine import cache
        path = Path(a.model or cache.default_model_path("SmolLM2-135M-Instruct-Q4_1"))
        schema = BENCH_SCHEMA if a.json_schema == "default" else json.loads(a.json_schema)
        res = {"model": path.name, "schema": schema,
               "engine": asyncio.run(bench_grammar(path, a.dtype, a.decode, min(a.rounds, 3), schema))}
        for k, v in res["engine"].items():
            print(f"{k:34} {v:.4g}" if isinstance(v, float) else f"{k:34} {v}")
        out = Path(a.out).with_name("llm_grammar.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))
        print(f"wrote {out}")
        return
    if a.matmul:
        from webgpu_engine.kernels import matmul as mm
        mm.CONFIG_OVERRIDES.update(_overrides(a.matmul))
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    if a.model:
        path = Path(a.model)
    else:
        from webgpu_engine import cache
        path = Path(cache.default_model_path("SmolLM2-135M-Instruct-Q4_1"))
    prompts = [int(x) for x in a.prompts.split(",")]
    sampling = {k: float(v) if "." in v else int(v) for k, v in
                (kv.split("=", 1) for kv in a.sampling.split(",") if kv)}
    res = {"model": path.name, "sampling": sampling,
           "engine": asyncio.run(bench_engine(path, a.dtype, prompts, a.decode, a.reps, a.decode_only,
                                              sampling))}
    ref = bench_llama_cpp(path, prompts, a.decode)
    res["llama_cpp"] = ref if ref is not None else {"error": LLAMA_CPP_MISSING}
    failed = res["llama_cpp"].get("error")
    e, pairs = res["engine"], [r for r in _compare_rows(prompts) if r[1] in res["engine"]]
    if not failed:
        res["ratio_engine_over_llama_cpp"] = {lk: e[ek] / ref[lk] for _, ek, lk in pairs if lk in ref}
    _print_tables(e, res["llama_cpp"], pairs, a.decode)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
