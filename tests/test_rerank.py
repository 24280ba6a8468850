"""Rerankers: a tiny cross-encoder (BertForSequenceClassification made by transformers) scored on the
real adapter against sentence-transformers' CrossEncoder.predict (tests/fixtures/make_cross_encoder.py),
pair tokenisation against `tokenizers`, and /v1/rerank through the server."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from webgpu_engine.config import ChatConfig
from webgpu_engine.loaders.pairs import PairTemplate, longest_first
from webgpu_engine.pipelines.embedding import EmbeddingPipeline
from webgpu_engine.server.app import ServerOptions, ServerThread

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CROSS = FIXTURES / "tiny_cross_encoder"
REF = json.loads((FIXTURES / "cross_encoder_reference.json").read_text())


# --------------------------------------------------------------------------- pair tokenisation
@pytest.mark.parametrize("post", ["template", "bert", "roberta"])
def test_pair_template_and_truncation_equal_tokenizers(post):
    """Our join and longest_first truncation give the ids and types `tokenizers` gives for pairs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {f"w{i}": i for i in range(200)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = {
        "template": processors.TemplateProcessing(single="w1 $A w2", pair="w1 $A w2 $B:1 w2:1",
                                                  special_tokens=[("w1", 1), ("w2", 2)]),
        "bert": processors.BertProcessing(("w2", 2), ("w1", 1)),
        "roberta": processors.RobertaProcessing(("w2", 2), ("w1", 1)),
    }[post]
    tpl = PairTemplate.from_tokenizer_json(json.loads(tk.to_str()))
    rng = np.random.default_rng(0)
    for _ in range(60):
        n1, n2, max_len = int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.integers(8, 50))
        a = [int(x) for x in rng.integers(3, 200, n1)]
        b = [int(x) for x in rng.integers(3, 200, n2)]
        tk.enable_truncation(max_len, strategy="longest_first")
        want = tk.encode(" ".join(f"w{i}" for i in a), " ".join(f"w{i}" for i in b))
        ids, types = tpl.encode(a, b, max_len)
        assert ids == want.ids, (n1, n2, max_len)
        if post != "roberta":           # RoBERTa models have one token type: the pipeline sends zeros
            assert types == want.type_ids
    assert longest_first(3, 100, 10) == (3, 7) and longest_first(100, 3, 10) == (7, 3)
    assert longest_first(30, 40, 11) == (5, 6) and longest_first(4, 4, 10) == (4, 4)


# --------------------------------------------------------------------------- scores vs CrossEncoder
@pytest.fixture(scope="module")
def reranker(device):
    import asyncio
    pipe = asyncio.run(EmbeddingPipeline.load(device, CROSS, ChatConfig(max_batch_size=4)))
    yield pipe
    pipe.dispose()


async def test_scores_and_token_ids_equal_cross_encoder(reranker):
    assert reranker.is_reranker and reranker.max_seq_length == REF["max_length"]
    pairs = REF["pairs"]
    query = pairs[0][0]
    same = [i for i, p in enumerate(pairs) if p[0] == query]
    other = [i for i, p in enumerate(pairs) if p[0] != query]
    assert other, "the fixture holds a pair with another (over-long) query"
    # token ids and types, incl. truncation of an over-long document and of an over-long query
    for i, (q, d) in enumerate(pairs):
        q_ids = reranker._plain_ids([q])[0]
        ((ids, types),) = reranker._pairs(q_ids, [d])
        assert ids == REF["token_ids"][i] and types == REF["token_type_ids"][i], i
    res = await reranker.rerank_step(query, [pairs[i][1] for i in same])
    got = dict(zip(same, res.scores))
    for i in other:
        got[i] = (await reranker.rerank_step(pairs[i][0], [pairs[i][1]])).scores[0]
    want = np.asarray(REF["scores"])
    out = np.asarray([got[i] for i in range(len(pairs))])
    assert np.abs(out - want).max() < 1e-4, np.abs(out - want).max()
    assert res.prompt_tokens == sum(len(REF["token_ids"][i]) for i in same)
    assert len(set(np.round(want, 3))) > 3          # the scores differ: the check can tell them apart


async def test_reranker_refuses_embeddings(reranker):
    from webgpu_engine.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="reranker"):
        await reranker.embed_step("a cat")
    assert (await reranker.rerank_step("a", ["b"])).scores       # still serves


# --------------------------------------------------------------------------- /v1/rerank
def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(device, minilm_dir):
    s = ServerThread(ServerOptions(models=[str(CROSS), str(minilm_dir)], port=0))
    yield s.url.rsplit("/v1", 1)[0]
    s.stop()


def test_rerank_route(server):
    pairs = REF["pairs"]
    query, docs = pairs[0][0], [p[1] for p in pairs if p[0] == pairs[0][0]]
    st, body = _post(server + "/v1/rerank", {"model": "tiny_cross_encoder", "query": query,
                                             "documents": [docs[0], {"text": docs[1]}, *docs[2:]], "top_n": 3})
    assert st == 200, body
    assert body["model"] == "tiny_cross_encoder" and body["id"].startswith("rerank-")
    res = body["results"]
    want = sorted(range(len(docs)), key=lambda i: -REF["scores"][i])[:3]
    assert [r["index"] for r in res] == want
    for r in res:
        assert abs(r["relevance_score"] - REF["scores"][r["index"]]) < 1e-4
        assert r["document"] == {"text": docs[r["index"]]}
    assert body["usage"]["total_tokens"] == sum(len(REF["token_ids"][i]) for i in range(len(docs)))
    st, body = _post(server + "/v1/rerank", {"query": query, "documents": docs[:2], "return_documents": False,
                                             "model": "tiny_cross_encoder"})
    assert st == 200 and len(body["results"]) == 2 and all("document" not in r for r in body["results"])


@pytest.mark.parametrize("body,param", [
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "", "documents": ["a"]}, "query"),
    ({"query": "q", "documents": ["a", 5]}, "documents[1]"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ({"query": "q", "documents": ["a"], "model": "all-MiniLM-L6-v2"}, "model"),       # not a reranker
])
def test_rerank_route_errors(server, body, param):
    st, err = _post(server + "/v1/rerank", {"model": "tiny_cross_encoder", **body})
    assert st == 400 and err["error"]["param"] == param, err
    st, err = _post(server + "/v1/embeddings", {"model": "tiny_cross_encoder", "input": "a"})
    assert st == 400 and "reranker" in err["error"]["message"]


def test_sync_engine_rerank():
    """MLCEngine.rerank (the blocking facade) on a model reference (the fixture folder)."""
    from webgpu_engine.engine import MLCEngine
    eng = MLCEngine()
    try:
        eng.reload(str(CROSS))
        pairs = REF["pairs"][:3]
        res = eng.rerank(query=pairs[0][0], documents=[d for _, d in pairs], top_n=2, return_documents=False)
        want = sorted(range(3), key=lambda i: -REF["scores"][i])[:2]
        assert [r.index for r in res.results] == want and "document" not in res.results[0]
        assert abs(res.results[0].relevance_score - REF["scores"][want[0]]) < 1e-4
    finally:
        eng.close()
