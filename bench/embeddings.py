"""Embedding throughput: sentences/s and tokens/s of EmbeddingPipeline (f32 and f16 activations) on
the current adapter, a per-kernel time breakdown of one batch, and sentence-transformers when present.

    python bench/embeddings.py [--n 256] [--words 32] [--batch 32] [--dtypes f32,f16] [--model DIR]
                               [--st-python PYTHON_WITH_SENTENCE_TRANSFORMERS] [--families]
    python bench/embeddings.py --concurrent 8x32 [--words 32] [--repeats 3] [--model DIR]
    python bench/embeddings.py --smoke [--model DIR] [--concurrent 2x2] [--out PATH]

Prints a table and writes bench/results/embeddings.json. The workload: `n` sentences of about `words`
English words each (fixed seed), embedded in one request with max_batch_size `batch`. --families adds a
row per family's tiny model (tests' fixtures: BERT, XLM-RoBERTa, NomicBert, ModernBERT, Qwen3 decoder
embedders; BERT and XLM-R cross-encoders reranking the sentences against the first), f32, each beside
sentence-transformers on the same inputs where it can load the model (not NomicBert: its code is
remote code on the hub).

--concurrent CxN runs only its own section and writes bench/results/embeddings_concurrent.json: C callers
of N sentences each (distinct sentences per caller) through the engine's embeddings.create, served one
after another (no coalescing window, so each request runs alone at once) and then all at once (the
engine coalesces them into shared, length-sorted batches); best of --repeats wall times, and whether
every caller got the same vectors both ways.

--smoke: 8 sentences of ~8 words, batch 4, one repeat (in either mode): checks that the script runs
to the end; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

WORDS = ("the of and to in is was for on that with as by at from his her they this which be are an "
         "not or have one had were their but all there can been has more when who will would up out "
         "into about time only new some could these two may first then do any like other than now "
         "people over such city world years made after system music river history between school "
         "government during university number company water under family known game model engine "
         "light network language computer science energy market report study north south village "
         "embedding vector graphics browser kernel memory shader device quantum bread garden").split()


def sentences(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = max(1, words + rng.randint(-4, 4))
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(s[0].upper() + s[1:] + ".")
    return out


def kernel_breakdown(pipe, seqs: list[list[int]]) -> list[dict]:
    """Time each dispatch of one forward alone (submit + wait), summed per kernel: where time goes."""
    model, dev = pipe.model, pipe.dev
    B = len(seqs)
    plan = pipe.plan_batches(sorted((len(s) for s in seqs), reverse=True))
    S = max(S for _, _, _, S in plan)          # padded as the pipeline pads them
    dst = dev.buffer(B * pipe.dim * 4, owner=pipe.owner, label="bench_dst")
    model.run(seqs, B, S, dst)
    dev.read_sync(dst, 0, 4)
    agg: dict[str, list] = {}
    for p, bg, x, y, z in model._bucket_ops(B, S).dispatches:
        b = dev.batch().dispatch(p, bg, x, y, z)
        t = time.perf_counter()
        dev.submit(b)
        dev.read_sync(dst, 0, 4)
        a = agg.setdefault(p.name, [0, 0.0])
        a[0] += 1
        a[1] += time.perf_counter() - t
    dst.release()
    total = sum(v[1] for v in agg.values())
    return [{"kernel": k, "dispatches": n, "ms": round(1e3 * s, 2), "share": round(s / total, 3)}
            for k, (n, s) in sorted(agg.items(), key=lambda kv: -kv[1][1])] + \
           [{"kernel": "(sum)", "dispatches": sum(v[0] for v in agg.values()), "ms": round(1e3 * total, 2),
             "share": 1.0, "B": B, "S": S}]


async def bench_engine(dev, folder: Path, dtype: str, texts: list[str], batch: int, repeats: int) -> dict:
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.pipelines.embedding import EmbeddingPipeline
    t = time.perf_counter()
    pipe = await EmbeddingPipeline.load(dev, folder, ChatConfig(dtype=dtype, max_batch_size=batch))
    load_s = time.perf_counter() - t
    try:
        t = time.perf_counter()
        ids = pipe.tokenize(texts)
        tok_s = time.perf_counter() - t
        n_tok = sum(len(i) for i in ids)
        await pipe.embed_step(texts[:batch])                  # compiles pipelines, builds one bucket
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            res = await pipe.embed_step(texts)
            runs.append(time.perf_counter() - t)
        best = min(runs)
        plan = pipe.plan_batches(sorted((len(i) for i in ids), reverse=True))
        breakdown = kernel_breakdown(pipe, ids[:batch])
        return {"engine": "webgpu_engine", "dtype": dtype, "load_s": round(load_s, 2),
                "sentences": len(texts), "tokens": n_tok, "prompt_tokens": res.prompt_tokens,
                "seconds": round(best, 3), "runs_s": [round(r, 3) for r in runs],
                "sentences_per_s": round(len(texts) / best, 2), "tokens_per_s": round(n_tok / best, 1),
                "tokenize_s": round(tok_s, 3), "batches": [(e - s, B, S) for s, e, B, S in plan],
                "kernels": breakdown}
    finally:
        pipe.dispose()


_ST_SCRIPT = r"""
import json, sys, time
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
folder, batch, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rerank = len(sys.argv) > 4 and sys.argv[4] == "rerank"
texts = json.load(sys.stdin)
if rerank:                          # the first text is the query, every text a document
    model = CrossEncoder(folder, device="cpu")
    pairs = [[texts[0], t] for t in texts]
    work = lambda items: model.predict(items, batch_size=batch)
    items = pairs
else:
    model = SentenceTransformer(folder, device="cpu")
    work = lambda items: model.encode(items, batch_size=batch)
    items = texts
work(items[:batch])
runs = []
for _ in range(repeats):
    t = time.perf_counter()
    work(items)
    runs.append(time.perf_counter() - t)
if rerank:
    n_tok = sum(len(i) for i in model.tokenizer([p[0] for p in pairs], [p[1] for p in pairs],
                                                truncation=True)["input_ids"])
else:
    n_tok = sum(len(model.tokenize([s])["input_ids"][0]) for s in texts)
print(json.dumps({"seconds": min(runs), "tokens": n_tok, "torch": torch.__version__,
                  "torch_threads": torch.get_num_threads()}))
"""


def bench_sentence_transformers(folder: Path, texts: list[str], batch: int, repeats: int,
                                python: str | None, mode: str = "embed") -> dict | None:
    """sentence-transformers on the CPU, in this interpreter when it imports it, else in `python`
    (a separate environment with torch, so this project's environment stays free of it)."""
    import subprocess
    if python is None:
        try:
            import sentence_transformers  # noqa: F401
        except ImportError:
            return None
        python = sys.executable
    p = subprocess.run([python, "-c", _ST_SCRIPT, str(folder), str(batch), str(repeats), mode],
                       input=json.dumps(texts), capture_output=True, text=True, check=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    best = r["seconds"]
    return {"engine": "sentence-transformers", "dtype": "f32", "torch": r["torch"],
            "torch_threads": r["torch_threads"], "sentences": len(texts), "tokens": r["tokens"],
            "seconds": round(best, 3), "sentences_per_s": round(len(texts) / best, 2),
            "tokens_per_s": round(r["tokens"] / best, 1)}


def family_models(tmp: Path) -> list[tuple[str, Path, str, bool]]:
    """(family, folder, "embed" | "rerank", sentence-transformers can load it) of each tiny model."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_encoders import write_tiny_nomic
    from tinymodels import write_tiny_bert
    fixtures = ROOT / "tests" / "fixtures"
    write_tiny_bert(tmp / "tiny-bert", pooling="mean", normalize=True, max_seq_length=64)
    write_tiny_nomic(tmp / "tiny-nomic")
    return [("bert (tiny)", tmp / "tiny-bert", "embed", True),
            ("xlm-roberta (tiny)", fixtures / "tiny_xlmr", "embed", True),
            ("nomic_bert (tiny)", tmp / "tiny-nomic", "embed", False),
            ("modernbert (tiny)", fixtures / "tiny_modernbert", "embed", True),
            ("qwen3 decoder embedder (tiny)", fixtures / "tiny_qwen3_embedding", "embed", True),
            ("bert cross-encoder (tiny)", fixtures / "tiny_cross_encoder", "rerank", True),
            ("xlm-r cross-encoder (tiny)", fixtures / "tiny_xlmr_reranker", "rerank", True)]


async def bench_family(dev, family: str, folder: Path, mode: str, texts: list[str], batch: int,
                       repeats: int) -> dict:
    from webgpu_engine.config import ChatConfig
    from webgpu_engine.pipelines.embedding import EmbeddingPipeline
    pipe = await EmbeddingPipeline.load(dev, folder, ChatConfig(max_batch_size=batch))
    try:
        async def work(items):
            if mode == "rerank":
                return await pipe.rerank_step(texts[0], items)
            return await pipe.embed_step(items)
        await work(texts[:batch])
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            res = await work(texts)
            runs.append(time.perf_counter() - t)
        best = min(runs)
        return {"engine": "webgpu_engine", "family": family, "mode": mode, "dtype": "f32",
                "sentences": len(texts), "tokens": res.prompt_tokens, "seconds": round(best, 3),
                "sentences_per_s": round(len(texts) / best, 2), "tokens_per_s": round(res.prompt_tokens / best, 1)}
    finally:
        pipe.dispose()


async def bench_concurrent(folder: Path, callers: int, per_caller: int, words: int, repeats: int) -> dict:
    """C callers one after another vs all at once, through the engine (see the module docstring)."""
    from webgpu_engine.engine import EngineConfig, create_mlc_engine
    from webgpu_engine.engine.coalesce import WINDOW_S, coalescer_of
    engine = await create_mlc_engine(str(folder), EngineConfig())
    lm = next(iter(engine.models.values()))
    co = coalescer_of(lm)
    texts = [sentences(per_caller, words, seed=1 + k) for k in range(callers)]

    async def call(k):
        return await engine.embeddings.create(model=lm.model_id, input=texts[k])

    async def one_after_another():
        co.window_s = 0.0
        try:
            return [await call(k) for k in range(callers)]
        finally:
            co.window_s = WINDOW_S

    async def all_at_once():
        return await asyncio.gather(*[call(k) for k in range(callers)])
    try:
        await call(0)                   # compiles, builds the buckets
        await all_at_once()
        seq, conc, same = [], [], True
        for _ in range(repeats):
            for runs, fn in ((seq, one_after_another), (conc, all_at_once)):
                t, g = time.perf_counter(), co.groups
                res = await fn()
                runs.append((time.perf_counter() - t, co.groups - g))
                if fn is one_after_another:
                    alone = res
                else:
                    same &= all([d.embedding for d in a.data] == [d.embedding for d in b.data]
                                for a, b in zip(res, alone))
        n_tok = sum(r.usage.prompt_tokens for r in alone)
        s_best, c_best = min(r[0] for r in seq), min(r[0] for r in conc)
        return {"model": lm.model_id, "callers": callers, "sentences_per_caller": per_caller,
                "tokens": n_tok, "one_after_another_s": [round(r[0], 3) for r in seq],
                "all_at_once_s": [round(r[0], 3) for r in conc],
                "groups_all_at_once": [r[1] for r in conc], "best_one_after_another_s": round(s_best, 3),
                "best_all_at_once_s": round(c_best, 3), "ratio": round(s_best / c_best, 3),
                "sentences_per_s_one_after_another": round(callers * per_caller / s_best, 1),
                "sentences_per_s_all_at_once": round(callers * per_caller / c_best, 1),
                "same_vectors": same, "window_s": WINDOW_S}
    finally:
        await engine.unload()


async def main_concurrent(a, folder: Path) -> None:
    callers, per_caller = (int(x) for x in a.concurrent.lower().split("x"))
    load_start = os.getloadavg()[0]
    r = await bench_concurrent(folder, callers, per_caller, a.words, max(1, a.repeats))
    print(f"\n{callers} callers x {per_caller} sentences of ~{a.words} words on {r['model']} "
          f"({r['tokens']} tokens); load average {load_start:.1f} -> {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    print(f"{'served':20s} {'best s':>8s} {'sent/s':>8s}  runs (s)")
    print(f"{'one after another':20s} {r['best_one_after_another_s']:8.3f} "
          f"{r['sentences_per_s_one_after_another']:8.1f}  {r['one_after_another_s']}")
    print(f"{'all at once':20s} {r['best_all_at_once_s']:8.3f} {r['sentences_per_s_all_at_once']:8.1f}  "
          f"{r['all_at_once_s']} in {r['groups_all_at_once']} groups")
    print(f"ratio {r['ratio']:.3f}x; same vectors both ways: {r['same_vectors']}")
    out = a.out.with_name("embeddings_concurrent.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    from webgpu_engine.gpu import request_device
    dev = await request_device()
    out.write_text(json.dumps({"adapter": dev.info.__dict__, "host": platform.platform(),
                               "cpus": os.cpu_count(), "load_average_1m": [load_start, os.getloadavg()[0]],
                               "words": a.words, "result": r}, indent=2))
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--words", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtypes", default="f32,f16")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--st-python", default=None,
                    help="python of an environment with sentence-transformers, when this one lacks it")
    ap.add_argument("--families", action="store_true", help="also each family's tiny model (see above)")
    ap.add_argument("--concurrent", default=None, metavar="CxN",
                    help="only C concurrent callers of N sentences vs the same one after another (see above)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "embeddings.json")
    ap.add_argument("--smoke", action="store_true",
                    help="8 short sentences, batch 4, one repeat: checks the script, measures nothing")
    a = ap.parse_args()
    if a.smoke:
        a.n, a.words, a.batch, a.repeats = 8, 8, 4, 1
    from webgpu_engine import cache
    from webgpu_engine.gpu import request_device
    folder = a.model or Path(cache.default_model_path("all-MiniLM-L6-v2"))
    if a.concurrent:
        return await main_concurrent(a, folder)
    texts = sentences(a.n, a.words)
    load_start = os.getloadavg()[0]       # the CPU may be shared: lavapipe timings scale with it
    dev = await request_device()
    rows = []
    for dt in a.dtypes.split(","):
        if dt == "f16" and not dev.has_f16:
            print("skipping f16: this adapter lacks shader-f16")
            continue
        rows.append(await bench_engine(dev, folder, dt, texts, a.batch, a.repeats))
    st = bench_sentence_transformers(folder, texts, a.batch, a.repeats, a.st_python)
    if st:
        rows.append(st)
        for r in rows[:-1]:
            r["ratio_vs_sentence_transformers"] = round(r["sentences_per_s"] / st["sentences_per_s"], 3)
    if a.families:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            for family, fdir, mode, st_ok in family_models(Path(tmp)):
                ours = await bench_family(dev, family, fdir, mode, texts, a.batch, a.repeats)
                rows.append(ours)
                ref = bench_sentence_transformers(fdir, texts, a.batch, a.repeats, a.st_python, mode) \
                    if st_ok else None
                if ref:
                    ours["ratio_vs_sentence_transformers"] = round(ours["sentences_per_s"] / ref["sentences_per_s"], 3)
                    rows.append({**ref, "family": family, "mode": mode})

    print(f"\nadapter: {dev.info.name} ({dev.info.backend}); {a.n} sentences of ~{a.words} words, "
          f"batch {a.batch}; load average {load_start:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':33s} {'engine':22s} {'dtype':5s} {'sent/s':>8s} {'tok/s':>9s} {'seconds':>8s} {'vs ST':>6s}")
    for r in rows:
        ratio = r.get("ratio_vs_sentence_transformers")
        name = r.get("family", folder.name) + (" rerank" if r.get("mode") == "rerank" else "")
        print(f"{name:33s} {r['engine']:22s} {r['dtype']:5s} {r['sentences_per_s']:8.2f} {r['tokens_per_s']:9.1f} "
              f"{r['seconds']:8.2f} {'' if ratio is None else f'{ratio:6.3f}'}")
    for r in rows:
        if "kernels" in r:
            k = r["kernels"]
            print(f"\nper-kernel time of one {k[-1]['B']}x{k[-1]['S']} forward, {r['dtype']} "
                  f"(each dispatch submitted alone):")
            for e in k:
                print(f"  {e['kernel']:36s} {e['dispatches']:4d} {e['ms']:10.1f} ms {100 * e['share']:5.1f}%")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "adapter": dev.info.__dict__, "host": platform.platform(), "cpus": os.cpu_count(),
        "load_average_1m": [load_start, os.getloadavg()[0]], "workload": {"sentences": a.n, "words": a.words,
                                                            "batch": a.batch},
        "sentence_transformers_available": st is not None, "results": rows}, indent=2))
    print(f"\nwrote {a.out.relative_to(ROOT) if a.out.is_relative_to(ROOT) else a.out}")


if __name__ == "__main__":
    asyncio.run(main())
