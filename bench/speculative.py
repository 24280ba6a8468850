"""Speculative decoding (prompt lookup, a draft model): decode speed with and without it, in the same run, on five
tasks: a RAG-style answer asked to quote its retrieved passages, the quote-first RAG prompt (copy the
relevant sentences, then answer), passages repeated word for word (the best case), a code edit that
copies its input, and free chat. Greedy, one request at a time, the default chat model (or --model:
a file or folder); each answer runs to its end of sequence (at most --tokens), as a user gets it.

    python bench/speculative.py [--model PATH] [--tokens 192] [--k K ...] [--n 8] [--repeats 3]
                                [--tasks T ...] [--ignore-eos] [--draft REF|self] [--out PATH]
    python bench/speculative.py --smoke [--model PATH] [--out PATH]
    python bench/speculative.py --concurrent 4 [--tokens 192] [--repeats 3] [--k K] [--no-auto-off]

For each task: decode tok/s of the default path (the scheduler's decode rows, no speculation), of one
token per forward through the prefill's row-invariant kernels (`k 0`; one run), and of speculation
with each k (default: the automatic k the pipeline picks, and 2k + 1); the acceptance rate (accepted
/ proposed guesses), tokens per forward, and whether each speculative answer equals the default
path's token for token (it must: verify rows are decode rows, pipelines/speculation.py) and the
row-invariant one's. Each speculation setting runs on a pipeline of its own over the one loaded model
(the speculation is its scheduler's). Every configuration runs once untimed, then --repeats rounds in turn
(the host's speed drifts: a lone run of a few seconds is not a figure); the median round is reported.
Exact runs have auto_off off; one more run per task (prompt lookup, the first k) has it on, as a
user gets it by default: how close to the fused path it stays where guessing does not pay. With
--draft, the same runs with a draft model guessing (`self`: the model guesses itself, which shows
the mechanics and the acceptance ceiling, not a speed-up).
Prints a table and writes bench/results/speculative.json. --smoke: 8 tokens (past the end of
sequence), k 2, one round (checks the script). --concurrent N: N copy-the-passage requests at once
through continuous batching (speculation per sequence, pipelines/batch_speculation.py) against the
same N without speculation: aggregate tok/s and whether every answer is the same
(bench/results/speculative_concurrent.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PASSAGES = (
    "Passage 1: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower from "
    "1887 to 1889.\n"
    "Passage 2: The tower is 330 metres tall, about the same height as an 81-storey building, and the "
    "tallest structure in Paris. Its base is square, measuring 125 metres on each side.\n"
    "Passage 3: The Eiffel Tower was the tallest man-made structure in the world until the Chrysler "
    "Building in New York City was finished in 1930.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
TASKS = {
    "rag": [{"role": "system", "content": "Answer using only the passages. Quote the sentences you use."},
            {"role": "user", "content": PASSAGES + "\n\nQuestion: Who built the Eiffel Tower, when, and how "
                                                   "tall is it? Quote the passages."}],
    # the quote-first RAG prompt (copy the relevant sentences word for word, then answer)
    "rag_quote": [{"role": "system", "content": "You answer questions from retrieved passages. Copy the relevant "
                                                "sentences word for word, then answer."},
                  {"role": "user", "content": PASSAGES + "\n\nQuestion: Who built the Eiffel Tower, and when?"}],
    "quote": [{"role": "user", "content": PASSAGES + "\n\nRepeat Passage 1 and Passage 2 word for word."}],
    "code_edit": [{"role": "user", "content": "Rewrite this code with the parameter `items` renamed to `products`. "
                                              "Reply with the code only.\n\n```python\n" + CODE + "```"}],
    "chat": [{"role": "user", "content": "Tell me a short story about a robot who learns to paint."}],
}


_SIBLINGS: dict = {}


def _speculating(pipe, spec):
    """A pipeline over `pipe`'s loaded model speculating as `spec` says (None: not at all): the
    speculation is the scheduler's, fixed when it is made, so each setting has a scheduler (and a
    pool) of its own, made once; a draft is `pipe`'s."""
    from dataclasses import replace

    from webgpu_engine.pipelines.llm import LLMChatPipeline
    key = (id(pipe), None if spec is None else tuple(sorted(spec.describe().items())))
    if key not in _SIBLINGS:
        sib = LLMChatPipeline(pipe.dev, pipe.model, pipe.tokenizer, pipe.template,
                              replace(pipe.chat_config, speculation=None if spec is None else spec.describe()),
                              pipe.owner, pipe.plan)
        if spec is not None and spec.method == "draft":
            sib.draft = pipe.draft
            sib.scheduler.spec.use_draft(pipe.draft, pipe.plan.kv_pool_blocks, pipe.plan.kv_block_size)
        _SIBLINGS[key] = sib
    return _SIBLINGS[key]


async def run_task(pipe, messages, tokens: int, spec, row_invariant: bool = False, ignore_eos: bool = False):
    """(output ids, decode tok/s, forwards, SpeculationStats or None) of one greedy generation from
    an empty conversation, to its end of sequence (or `tokens`). spec: a Speculation or None.
    row_invariant: one token per PREFILL forward (forward_tokens_and_sample: the conversation's cached
    blocks and the rows after them)."""
    from webgpu_engine.config import GenerationConfig
    pipe = _speculating(pipe, spec)
    pipe.reset_chat(keep_stats=True)
    gen = GenerationConfig(temperature=0.0, max_tokens=tokens, ignore_eos=ignore_eos)
    if row_invariant:
        ids = pipe.prompt_ids(messages, None)
        out = [await pipe.forward_tokens_and_sample(ids, True, gen)]
        t0 = time.perf_counter()
        while len(out) < tokens and (ignore_eos or out[-1] not in pipe.eos_ids):
            out.append(await pipe.forward_tokens_and_sample([out[-1]], False, gen))
        dt = time.perf_counter() - t0
        return out, (len(out) - 1) / dt, len(out) - 1, None
    await pipe.prefill_step(messages, gen)
    t0 = time.perf_counter()
    steps = 0
    while not pipe.stopped:
        await pipe.decode_step()
        steps += 1
    dt = time.perf_counter() - t0
    out = list(pipe.output_ids)
    return out, (len(out) - 1) / dt, steps, pipe._req.spec


async def timed(runs: list, repeats: int) -> list:
    """Each run (a zero-argument coroutine function) once untimed (its ops built, its kernels warm),
    then `repeats` rounds of all of them in turn, so the host's drifts fall on every run alike; per run
    the result of the round with the median tok/s."""
    for run in runs:
        await run()
    results = [[] for _ in runs]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            results[i].append(await run())
    return [sorted(rs, key=lambda r: r[1])[len(rs) // 2] for rs in results]


async def main_async(a) -> dict:
    from webgpu_engine import cache, gpu
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.pipelines.llm import LLMChatPipeline
    from webgpu_engine.pipelines.speculation import Speculation
    dev = await gpu.request_device()
    path = a.model or str(cache.default_model_path("SmolLM2-135M-Instruct-Q4_1"))
    # one pipeline (every kernel compiled at load): each run below sets its speculation and starts
    # from an empty KV cache
    pipe = await LLMChatPipeline.load(dev, path, ChatConfig(context_window_size=2048))
    if not a.k:
        auto_k = Speculation().with_k(pipe.model.verify_rows_per_pass).k
        a.k = [auto_k, 2 * auto_k + 1]
    ks = a.k
    dpipe = None
    if a.draft:
        draft = path if a.draft == "self" else a.draft
        dpipe = await LLMChatPipeline.load(dev, path, ChatConfig(context_window_size=2048, speculation={
            "method": "draft", "model": str(draft)}))
    rows = []

    def spec_row(method, k, auto_off, out, tps, steps, st, fused, fused_tps, ref, ref_tps):
        return {"method": method, "k": k, "n": a.n, "auto_off": auto_off, "turned_off": bool(st.off),
                "tok_s": tps, "speedup_vs_fused": tps / fused_tps,
                "speedup_vs_row_invariant": tps / ref_tps, "forwards": steps,
                "tokens_per_forward": (len(out) - 1) / max(steps, 1), "proposed": st.proposed,
                "accepted": st.accepted, "acceptance": st.accepted / st.proposed if st.proposed else 0.0,
                "equals_row_invariant": out == ref, "equals_fused": out == fused}

    def run(p, msgs, spec, **kw):
        return lambda: run_task(p, msgs, a.tokens, spec, ignore_eos=a.ignore_eos, **kw)
    try:
        for name, msgs in TASKS.items():
            if a.tasks and name not in a.tasks:
                continue
            ref, ref_tps, _, _ = await run_task(pipe, msgs, a.tokens, None, row_invariant=True,
                                                ignore_eos=a.ignore_eos)       # one run: a reference
            configs = [("fused", None, None)]
            configs += [("ngram", k, False) for k in ks] + [("ngram", ks[0], True)]
            if dpipe is not None:
                configs += [("draft", k, False) for k in ks]
            runs = [run(dpipe if m == "draft" else pipe, msgs, None if m == "fused" else Speculation(
                m, k=k, n=a.n, model=dpipe.speculation.model if m == "draft" else None, auto_off=off))
                for m, k, off in configs]
            res = await timed(runs, a.repeats)
            fused, fused_tps = res[0][0], res[0][1]
            row = {"task": name, "tokens": len(fused), "fused_tok_s": fused_tps, "row_invariant_tok_s": ref_tps,
                   "row_invariant_equals_fused": ref == fused, "speculative": []}
            base = (fused, fused_tps, ref, ref_tps)
            for (m, k, off), r in zip(configs[1:], res[1:]):
                row["speculative"].append(spec_row(m, k, off, *r, *base))
            rows.append(row)
    finally:
        for sib in _SIBLINGS.values():
            sib.scheduler.close()
        _SIBLINGS.clear()
        pipe.dispose()
        if dpipe is not None:
            dpipe.dispose()
    return {"adapter": dev.info.name, "platform": platform.platform(), "model": Path(path).name,
            "tokens": a.tokens, "ignore_eos": a.ignore_eos, "repeats": a.repeats, "rows": rows}


COPY_TASKS = ("quote", "rag_quote", "code_edit", "quote")      # --concurrent: copy-the-passage requests


async def concurrent_async(a) -> dict:
    """--concurrent N: N requests at once (the copy tasks in turn) through continuous batching, with
    speculation per sequence (prompt lookup, or with --draft the draft model's guesses for all of
    them at once) and without it, in the same run: aggregate tok/s (every
    answer's tokens over the wall time of the N together), median of --repeats interleaved rounds
    after one untimed; every speculative answer must equal the same request's without guesses."""
    from webgpu_engine import cache, gpu
    from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
    dev = await gpu.request_device()
    path = a.model or str(cache.default_model_path("SmolLM2-135M-Instruct-Q4_1"))
    tasks = [TASKS[COPY_TASKS[i % len(COPY_TASKS)]] for i in range(a.concurrent)]
    spec = {"method": "draft", "model": str(a.draft)} if a.draft else {"method": "ngram", "n": a.n}
    spec = {**spec, "auto_off": not a.no_auto_off, **({"k": a.k[0]} if a.k else {})}
    engines = {}
    for name, extra in (("plain", {}), ("speculation", {"speculation": spec})):
        mid = f"bench-{name}"
        app = default_app_config().with_records(ModelRecord(mid, path, "llm"))
        eng = AsyncMLCEngine(EngineConfig(device=dev, app_config=app))
        await eng.reload(mid, {"context_window_size": 2048, "max_num_sequences": a.concurrent, **extra})
        engines[name] = (eng, mid)

    async def one(name, msgs):
        eng, mid = engines[name]
        r = await eng.chat.completions.create(model=mid, messages=msgs, temperature=0, max_tokens=a.tokens,
                                              ignore_eos=a.ignore_eos)
        return r.choices[0].message.content, r.usage.completion_tokens, r.usage.extra.model_dump()

    async def together(name):
        t0 = time.perf_counter()
        res = await asyncio.gather(*[one(name, m) for m in tasks])
        dt = time.perf_counter() - t0
        return res, sum(n for _, n, _ in res) / dt

    try:
        for name in engines:                       # untimed: ops built, kernels warm
            await together(name)
        rounds = {name: [] for name in engines}
        for _ in range(a.repeats):
            for name in engines:
                rounds[name].append(await together(name))
        med = {name: sorted(rs, key=lambda r: r[1])[len(rs) // 2] for name, rs in rounds.items()}
        plain, specd = med["plain"], med["speculation"]
        ex = [e for _, _, e in specd[0]]
        sched = engines["speculation"][0].models[engines["speculation"][1]].pipeline.scheduler
        return {"adapter": dev.info.name, "platform": platform.platform(), "model": Path(path).name,
                "concurrent": a.concurrent, "tokens": a.tokens, "repeats": a.repeats, "speculation": spec,
                "k": sched.spec.spec.k, "rows_per_step": sched.fwd.max_rows,
                "plain_tok_s": plain[1], "speculation_tok_s": specd[1], "speedup": specd[1] / plain[1],
                "rounds_plain": [r[1] for r in rounds["plain"]],
                "rounds_speculation": [r[1] for r in rounds["speculation"]],
                "answers_equal": all(x[0] == y[0] for rs in (rounds["speculation"],) for r in rs
                                     for x, y in zip(r[0], plain[0])),
                "proposed": sum(e.get("speculation_proposed_tokens", 0) for e in ex),
                "accepted": sum(e.get("speculation_accepted_tokens", 0) for e in ex),
                "turned_off": sum(bool(e.get("speculation_turned_off")) for e in ex)}
    finally:
        for eng, _ in engines.values():
            await eng.unload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a chat model file or folder (default: SmolLM2-135M-Instruct-Q4_1)")
    ap.add_argument("--tokens", type=int, default=192, help="the most tokens an answer takes")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer takes --tokens tokens (past its "
                    "end of sequence: what the model makes up there)")
    ap.add_argument("--k", type=int, nargs="+", default=None,
                    help="guesses per step (default: the pipeline's automatic k and 2k + 1)")
    ap.add_argument("--n", type=int, default=8, help="longest n-gram matched")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (after one untimed): the median")
    ap.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS))
    ap.add_argument("--draft", default=None, help="also speculate with this draft model (a file or folder; "
                    "self: the model itself)")
    ap.add_argument("--smoke", action="store_true", help="8 tokens, k 2, one round: checks the script")
    ap.add_argument("--concurrent", type=int, default=0, help="N copy-the-passage requests at once through "
                    "continuous batching, with and without speculation (aggregate tok/s)")
    ap.add_argument("--no-auto-off", action="store_true", help="--concurrent: speculation never turns itself off")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.smoke:
        a.tokens, a.k, a.repeats, a.ignore_eos = 8, [2], 1, True
    if a.concurrent:
        data = asyncio.run(concurrent_async(a))
        print(f"{data['concurrent']} concurrent requests, {data['model']}, k {data['k']} "
              f"({data['rows_per_step']} rows a step at most), {data['adapter']}")
        print(f"{'':24} {'aggregate tok/s':>15}  rounds")
        print(f"{'without speculation':24} {data['plain_tok_s']:15.2f}  "
              + " ".join(f"{x:.2f}" for x in data["rounds_plain"]))
        print(f"{'with speculation':24} {data['speculation_tok_s']:15.2f}  "
              + " ".join(f"{x:.2f}" for x in data["rounds_speculation"]))
        print(f"speed-up {data['speedup']:.2f}x; guesses kept {data['accepted']} of {data['proposed']}; "
              f"answers equal: {data['answers_equal']}; turned off in {data['turned_off']} of "
              f"{data['concurrent']} requests")
        out = a.out or ROOT / "bench" / "results" / "speculative_concurrent.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2))
        print(f"wrote {out}")
        return
    a.out = a.out or ROOT / "bench" / "results" / "speculative.json"
    data = asyncio.run(main_async(a))
    print(f"{'task':10} {'fused tok/s':>11} {'row-inv tok/s':>13} {'method':>14} {'k':>3} {'spec tok/s':>10} {'x fused':>7} "
          f"{'accept':>6} {'tok/fwd':>7} {'= row-inv':>9} {'= fused':>7}")
    for r in data["rows"]:
        for s in r["speculative"]:
            m = s["method"] + (" auto_off" + ("*" if s["turned_off"] else "") if s["auto_off"] else "")
            print(f"{r['task']:10} {r['fused_tok_s']:11.2f} {r['row_invariant_tok_s']:13.2f} {m:>14} {s['k']:3d} "
                  f"{s['tok_s']:10.2f} {s['speedup_vs_fused']:7.2f} {s['acceptance']:6.2f} "
                  f"{s['tokens_per_forward']:7.2f} {str(s['equals_row_invariant']):>9} {str(s['equals_fused']):>7}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=2))
    print("auto_off* : speculation turned itself off during the run")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
