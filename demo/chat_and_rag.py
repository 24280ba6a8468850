"""Demo: the default chat LLM and the default embedder in one engine — a streamed chat answer, then a
small retrieval-augmented answer (embed passages, embed the question, pick the best passage, answer
with it). Run: `python demo/chat_and_rag.py [--max-tokens N] [--reranker MODEL]` (`make demo` runs it
without a reranker). With --reranker (a cross-encoder: a folder or a Hugging Face repo id such as
BAAI/bge-reranker-base), the three passages the embedder retrieved are reranked by it and the answer
uses its first."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from webgpu_engine.engine import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL, EngineConfig, create_mlc_engine

PASSAGES = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889 for the World's Fair.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen.",
    "The Great Wall of China stretches for thousands of kilometres across northern China.",
    "Honey never spoils: archaeologists have found edible honey in ancient Egyptian tombs.",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level on Earth.",
    "WebGPU is a web standard that gives browsers and native programs access to the GPU for "
    "graphics and general-purpose compute.",
]
QUESTION = "How tall is the highest mountain on Earth?"


def progress(report: dict) -> None:
    bar = "#" * int(report["progress"] * 30)
    print(f"\r[{bar:30s}] {report['time_elapsed']:5.1f}s {report['text'][:70]:70s}", end="", flush=True)
    if report["progress"] >= 1.0:
        print()


def cosine(a: list[float], b: list[float]) -> float:
    num = sum(x * y for x, y in zip(a, b))
    den = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return num / den if den else 0.0


async def stream_answer(engine, messages, max_tokens: int) -> dict:
    stream = await engine.chat.completions.create(
        model=DEFAULT_CHAT_MODEL, messages=messages, stream=True, temperature=0, max_tokens=max_tokens,
        stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            usage = chunk.usage
    print()
    return usage


async def main(max_tokens: int, reranker: str | None = None) -> None:
    t0 = time.perf_counter()
    models = [DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL] + ([reranker] if reranker else [])
    engine = await create_mlc_engine(models, EngineConfig(init_progress_callback=progress))
    rerank_id = list(engine.models)[-1] if reranker else None
    print(f"loaded {' + '.join(engine.models)} in {time.perf_counter() - t0:.1f}s\n")
    try:
        # 1. a short streamed chat answer
        q = "In one sentence, what is a GPU?"
        print(f"== chat\nuser: {q}\nassistant: ", end="", flush=True)
        u = await stream_answer(engine, [{"role": "user", "content": q}], max_tokens)
        print(f"   ({u.completion_tokens} tokens, first token after {u.extra.time_to_first_token_s:.2f}s, "
              f"{u.extra.decode_tokens_per_s:.1f} tokens/s)\n")

        # 2. retrieval: embed the passages and the question, pick the closest passage
        print(f"== retrieval over {len(PASSAGES)} passages\nquestion: {QUESTION}")
        docs = await engine.embeddings.create(model=DEFAULT_EMBED_MODEL, input=PASSAGES)
        qv = (await engine.embeddings.create(model=DEFAULT_EMBED_MODEL, input=QUESTION)).data[0].embedding
        scores = sorted(((cosine(qv, d.embedding), d.index) for d in docs.data), reverse=True)
        for s, i in scores[:3]:
            print(f"  {s:.3f}  {PASSAGES[i][:80]}")
        best = PASSAGES[scores[0][1]]
        if rerank_id:
            # 2b. the reranker reads question and passage together: a finer order for the top few
            top = [PASSAGES[i] for _, i in scores[:3]]
            res = await engine.rerank(model=rerank_id, query=QUESTION, documents=top)
            print(f"reranked by {rerank_id}:")
            for r in res.results:
                print(f"  {r.relevance_score:.3f}  {top[r.index][:80]}")
            best = top[res.results[0].index]

        # 3. answer with the retrieved passage as context
        messages = [
            {"role": "system", "content": "Answer the question using only the given context, in one sentence."},
            {"role": "user", "content": f"Context: {best}\n\nQuestion: {QUESTION}"},
        ]
        print("answer: ", end="", flush=True)
        await stream_answer(engine, messages, max_tokens)
        print(f"\n{await engine.runtime_stats_text(DEFAULT_CHAT_MODEL)}")
    finally:
        await engine.unload()


if __name__ == "__main__":
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=40, help="tokens per answer (default 40)")
    ap.add_argument("--reranker", default=None, help="a cross-encoder to rerank the retrieved passages")
    args = ap.parse_args()
    try:
        asyncio.run(main(args.max_tokens, args.reranker))
    except KeyboardInterrupt:
        sys.exit(130)
