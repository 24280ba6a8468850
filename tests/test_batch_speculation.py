"""Speculative decoding inside continuous batching (pipelines/batch_speculation.py) on the real
adapter: each sequence guesses its own tokens (prompt lookup) and one decode step checks every
sequence's guesses; greedy answers of 4 sequences decoding together with speculation equal each
request alone without it, token for token (logprobs too); guesses are taken; the pool gives back
the rejected rows' slots; max_tokens, stop strings, sampled and penalised requests behave as without
guesses; under a JSON schema each row is masked with the grammar's state after the guesses before it;
a draft model guesses for all the sequences of a step at once (pipelines/batch_draft.py), with the
same answers. A tiny Llama keeps the steps cheap."""
from __future__ import annotations

import asyncio

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config

REPEAT = "Hello world! The quick brown fox jumps over the lazy dog. "
PROMPTS = [REPEAT * 3, "user assistant system " * 4 + "Hello", "one two three four " * 5,
           "Grüße aus Köln! " * 4 + REPEAT]
OPTS = {"compile_at_load": False, "context_window_size": 512, "prefill_chunk_size": 64, "max_num_sequences": 4}
SPEC = {"method": "ngram", "k": 3, "n_min": 1, "auto_off": False}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("bspec") / "m.gguf", qtype="q8_0",
                                     context_length=512)["path"])


async def _engine(device, path, model_id: str, **opts):
    app = default_app_config().with_records(ModelRecord(model_id, path, "llm"))   # its own buffers' owner
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload(model_id, {**OPTS, **opts})
    return eng


async def _answer(eng, prompt: str, max_tokens: int = 40, **kw):
    r = await eng.completions.create(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                     temperature=kw.pop("temperature", 0), logprobs=1, **kw)
    c = r.choices[0]
    return (c.text, list(zip(c.logprobs.tokens, c.logprobs.token_logprobs)), c.finish_reason,
            r.usage.completion_tokens), r.usage.extra.model_dump()


@pytest.fixture(scope="module")
async def reference(device, path):
    """Each prompt's greedy answer alone, without speculation, in the same batching setup."""
    eng = await _engine(device, path, "tiny-plain")
    try:
        return [(await _answer(eng, p))[0] for p in PROMPTS]
    finally:
        await eng.unload()


@pytest.fixture(scope="module")
async def spec_engine(device, path):
    eng = await _engine(device, path, "tiny-spec", speculation=SPEC)
    yield eng
    await eng.unload()


def _sched(eng):
    return next(iter(eng.models.values())).pipeline.scheduler


async def test_four_sequences_with_guesses_equal_each_alone_without(spec_engine, reference):
    sched = _sched(spec_engine)
    assert sched.spec is not None and sched.fwd.max_rows == 16 and sched.max_seqs == 4
    before = sched.pipe.spec_stats.accepted
    alone = [await _answer(spec_engine, p) for p in PROMPTS]
    assert [a for a, _ in alone] == reference
    together = await asyncio.gather(*[_answer(spec_engine, p) for p in PROMPTS])
    assert [a for a, _ in together] == reference
    for _, ex in alone + list(together):
        assert ex["speculation_steps"] >= 1 and ex["speculation_accepted_tokens"] <= ex["speculation_proposed_tokens"]
    assert sched.pipe.spec_stats.accepted > before          # guesses were taken, not only rejected
    assert sum(ex["speculation_accepted_tokens"] for _, ex in together) > 0
    sched.pool.check()                                      # rejected rows' blocks went back
    assert not sched.running


async def test_max_tokens_stops_sampled_and_penalised(spec_engine, reference):
    for n in (1, 2, 5, 17):                                 # a step's guesses never pass max_tokens
        (text, lps, finish, count), _ = await _answer(spec_engine, PROMPTS[0], max_tokens=n)
        assert count == n == len(lps) and finish == "length" and lps == reference[0][1][:n]
    full = reference[0][0]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = await spec_engine.completions.create(prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop],
                                             ignore_eos=True)
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    # penalties: decoded without guesses; sampled: guesses, and a seed answers the same every run
    _, ex = await _answer(spec_engine, PROMPTS[1], max_tokens=8, frequency_penalty=0.5)
    assert "speculation_steps" not in ex
    a = await _answer(spec_engine, PROMPTS[1], max_tokens=12, temperature=0.9, seed=7)
    b = await _answer(spec_engine, PROMPTS[1], max_tokens=12, temperature=0.9, seed=7)
    assert a[0] == b[0] and "speculation_steps" in a[1]
    _sched(spec_engine).pool.check()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                    "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "tags", "ok"], "additionalProperties": False}


LONG_JSON_PROMPT = PROMPTS[2] * 4       # prefilled in several chunks while others decode


async def _json_answer(eng, prompt: str):
    r = await eng.chat.completions.create(
        messages=[{"role": "user", "content": prompt}], max_tokens=80, temperature=0, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}})
    c = r.choices[0]
    return (c.message.content, [t.logprob for t in c.logprobs.content], c.finish_reason), r.usage.extra.model_dump()


async def test_grammar_rows_are_masked_in_the_batch(device, path, spec_engine, reference):
    """JSON-schema requests speculate in the batch: the grammar's forced tokens are guessed first,
    each row is masked with the grammar's state after the guesses before it; two of them decoding
    beside two plain requests give each one's answer of a model without speculation, valid JSON,
    with guesses kept (the forced keys at least)."""
    import json
    plain = await _engine(device, path, "tiny-plain-json")
    try:
        ref = [(await _json_answer(plain, p))[0] for p in PROMPTS[:2]]
        long_ref = (await _json_answer(plain, LONG_JSON_PROMPT))[0]
    finally:
        await plain.unload()
    got = await asyncio.gather(*[_json_answer(spec_engine, p) for p in PROMPTS[:2]],
                               *[_answer(spec_engine, p) for p in PROMPTS[2:]])
    assert [a for a, _ in got[:2]] == ref
    assert [a for a, _ in got[2:]] == reference[2:]
    for (text, _, finish), ex in got[:2]:
        obj = json.loads(text)
        assert finish == "stop" and set(obj) == {"name", "tags", "ok"}
        assert 0 < ex["speculation_accepted_tokens"] <= ex["speculation_proposed_tokens"]
    # plain requests guessing while a long JSON prompt's last chunk waits for its mask made beside the
    # forwards: that step takes no guesses (a guess row's logits would overwrite row 0's before its
    # sampler: the plain answers changed before the scheduler gave such a step's guesses back)
    sched = _sched(spec_engine)
    early = [asyncio.ensure_future(_answer(spec_engine, p)) for p in PROMPTS[2:]]
    while not any(r.decoding for r in sched.running):
        await asyncio.sleep(0.002)
    assert (await _json_answer(spec_engine, LONG_JSON_PROMPT))[0] == long_ref
    assert [(await t)[0] for t in early] == reference[2:]
    sched.pool.check()


@pytest.mark.parametrize("draft", ["itself", "other"])
async def test_a_draft_model_guesses_for_every_sequence_of_the_batch(device, path, reference, draft,
                                                                   tmp_path_factory):
    """speculation "draft" with continuous batching: the draft (the model itself: mostly right; other
    weights of the same vocabulary: mostly wrong) keeps a paged cache of its own and guesses for
    the 4 sequences of a step at once; each answer equals the request alone without speculation;
    the draft's rows of a finished sequence go back to its pool."""
    if draft == "other":
        draft = str(write_tiny_llama_gguf(tmp_path_factory.mktemp("bdraft") / "d.gguf", qtype="q8_0", seed=1,
                                          n_layers=1, context_length=512)["path"])
    else:
        draft = path
    eng = await _engine(device, path, "tiny-draft",
                        speculation={"method": "draft", "model": draft, "k": 3, "auto_off": False})
    try:
        sched = _sched(eng)
        guesser = sched.spec.draft
        assert guesser is not None and sched.pipe.draft is not None
        alone = [await _answer(eng, p) for p in PROMPTS]
        assert [a for a, _ in alone] == reference
        together = await asyncio.gather(*[_answer(eng, p) for p in PROMPTS])
        assert [a for a, _ in together] == reference
        for _, ex in alone + list(together):
            assert ex["speculation_steps"] >= 1
            assert ex["speculation_accepted_tokens"] <= ex["speculation_proposed_tokens"]
        accepted = sum(ex["speculation_accepted_tokens"] for _, ex in together)
        proposed = sum(ex["speculation_proposed_tokens"] for _, ex in together)
        if draft == path:                                   # the model guessing itself
            assert accepted >= proposed // 2, (accepted, proposed)
        else:
            assert proposed > 0
        assert not sched.running and not guesser.pool._seqs  # every draft sequence left with its own
        guesser.pool.check()
        sched.pool.check()
    finally:
        await eng.unload()
