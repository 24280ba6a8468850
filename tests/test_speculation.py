"""Speculative decoding of a lone request (pipelines/speculation.py's guessers, the scheduler's verify
rows: batch_speculation.py) on the real adapter: greedy answers equal decoding without guesses, for
several prompts and k (a tiny Llama, a tiny Qwen 3 with q/k norms, SmolLM2 on a RAG-style prompt);
guesses are accepted (the path is exercised) and rejected ones leave no trace in the cached tokens
(the next request reuses them as its prefix); stop strings, max_tokens and logprobs behave as without
guesses; the engine reports the figures in usage.extra and decodes other requests as before. The
batch's own checks (several sequences guessing at once) are tests/test_batch_speculation.py's."""
from __future__ import annotations

import pytest

from tinymodels import write_tiny_llama_gguf
from webgpu_engine.config import ChatConfig, GenerationConfig
from webgpu_engine.errors import ChatOptionTypeError, UnsupportedChatOptionError
from webgpu_engine.pipelines.llm import LLMChatPipeline
from webgpu_engine.pipelines.speculation import Speculation, propose

REPEAT = "Hello world! The quick brown fox jumps over the lazy dog. "
PROMPTS = [REPEAT * 3, "user assistant system " * 4 + "Hello"]


def test_propose_takes_the_longest_match_and_stops_where_its_occurrences_disagree():
    ctx = [1, 2, 3, 9, 9, 4, 1, 2, 3, 7, 8, 5, 4, 1, 2, 3]
    assert propose(ctx, 3, n=4) == [7, 8, 5]            # [4, 1, 2, 3] occurred once: what followed it
    assert propose(ctx, 3, n=3) == []                    # [1, 2, 3] went on as 9 and as 7: unsure
    assert propose(ctx, 1, n=4) == [7]
    # "from 1887 to 1889 ... from 18": both years match "18" and agree on one more token only
    years = [50, 1, 8, 8, 7, 60, 1, 8, 8, 9, 70, 50, 1, 8]
    assert propose(years, 3, n=8) == [8, 7, 60]          # "50 1 8" is the longer match: 1887's
    assert propose(years[1:], 3, n=8) == [8]             # without "50": agree on "8", then 7 or 9
    assert propose([5, 6, 7], 4, n=2) == []              # no earlier occurrence
    assert propose([4, 1, 2, 4], 2, n=3) == [1, 2]       # falls back to the 1-gram [4]
    assert propose([4, 1, 2, 4], 2, n=3, n_min=2) == []
    assert propose([1, 1, 1, 1], 5, n=2) == [1]          # what followed stops at the end of the context
    assert propose([1, 2], 0, n=2) == []
    assert propose([3], 2, n=2) == []


def test_k_is_chosen_for_the_verify_kernels_unless_given():
    auto = Speculation.parse({"method": "ngram"})
    assert auto.k is None and (auto.n, auto.n_min) == (8, 2)
    assert auto.with_k(4).k == 3                         # one fused pass over 4 rows
    assert auto.with_k(None).k == 4
    assert Speculation.parse({"k": 6}).with_k(4).k == 6
    assert Speculation.parse({"n": 1}).n_min == 1        # n_min's default follows a smaller n


@pytest.mark.parametrize("opt", [{"method": "draft"}, {"method": "draft", "model": ""}, {"model": "m.gguf"},
                                 {"k": 0}, {"k": 17}, {"n": True}, {"x": 1}, {"auto_off": 1}, {"probe": 0},
                                 {"n": 2, "n_min": 3}, 5, "lookahead"])
def test_bad_speculation_options_are_refused_by_name(opt):
    with pytest.raises(ChatOptionTypeError) as e:
        Speculation.parse(opt)
    assert e.value.param == "speculation"


def test_speculation_option_forms():
    assert Speculation.parse(None) is None
    assert Speculation.parse("ngram") == Speculation()
    assert Speculation.parse({"k": 6, "n": 3}).describe() == {"method": "ngram", "k": 6, "n": 3, "n_min": 2,
                                                              "auto_off": True, "probe": 4}
    assert Speculation.parse({"method": "draft", "model": "d.gguf", "auto_off": False}).with_k(4).describe() == {
        "method": "draft", "k": 3, "model": "d.gguf", "auto_off": False, "probe": 4}


def _sibling(pipe, speculation):
    """A pipeline over `pipe`'s loaded model (the same weights) speculating as `speculation` says
    (None: not at all), with a scheduler and pool of its own; a draft is `pipe`'s. Close it with
    `.scheduler.close()` (its buffers go with `pipe`'s)."""
    from dataclasses import replace
    sib = LLMChatPipeline(pipe.dev, pipe.model, pipe.tokenizer, pipe.template,
                          replace(pipe.chat_config, speculation=speculation), pipe.owner, pipe.plan)
    if sib.speculation is not None and sib.speculation.method == "draft":
        sib.draft = pipe.draft
        sib.scheduler.spec.use_draft(pipe.draft, pipe.plan.kv_pool_blocks, pipe.plan.kv_block_size)
    return sib


async def _reference(pipe, messages, n: int, **gen) -> list[int]:
    """n tokens of the same model without guesses (its decode rows: those the verify rows go through)."""
    ref = _sibling(pipe, None)
    try:
        return await _generate(ref, messages, max_tokens=n, ignore_eos=True, **gen)
    finally:
        ref.scheduler.close()


async def _generate(pipe, messages, **gen):
    await pipe.prefill_step(messages, GenerationConfig(**{"temperature": 0.0, **gen}))
    while not pipe.stopped:
        await pipe.decode_step()
    return list(pipe.output_ids)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, device, tmp_path_factory):
    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("spec") / "m.gguf", arch=request.param,
                                 qtype="q8_0", context_length=512)["path"]
    return path


async def test_greedy_answers_equal_one_token_per_forward(device, tiny):
    pipe = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=512, compile_at_load=False,
                                                               prefill_chunk_size=64))
    accepted = 0
    try:
        for p in PROMPTS:
            msgs = [{"role": "user", "content": p}]
            ref = await _reference(pipe, msgs, 32)
            for k in (1, 3, 6):
                spec = _sibling(pipe, {"k": k, "n": 3, "n_min": 1, "auto_off": False})
                try:
                    got = await _generate(spec, msgs, max_tokens=32, ignore_eos=True)
                    assert got == ref, (p[:20], k)
                    st = spec._req.spec      # a token per verify step and per plain step, and each accepted guess
                    assert st.steps + st.accepted + st.plain == 31 and st.accepted <= st.proposed
                    accepted += st.accepted
                    # the cache holds exactly prompt + answer less the last token: a follow-up request
                    # reuses it as its prefix and answers as from a cold cache
                    assert len(spec.kv_ids) == len(spec.prompt_ids(msgs, None)) + 31
                finally:
                    spec.scheduler.close()
    finally:
        pipe.dispose()
    assert accepted > 0                      # guesses were taken, not only rejected


async def test_a_speculating_model_compiles_its_verify_kernels_at_load(fresh_device, tiny):
    """speculation k: the scheduler's decode forwards of 1 .. k + 1 rows (a lone sequence's verify
    rows) are built and run at load, so a speculating request creates no pipeline (on a device of its
    own: nothing cached before)."""
    dev = fresh_device
    pipe = await LLMChatPipeline.load(dev, tiny, ChatConfig(context_window_size=512, compile_in_background=False,
                                                            speculation={"k": 3, "n_min": 1, "auto_off": False}))
    try:
        count = dev.compile_count
        got = await _generate(pipe, [{"role": "user", "content": PROMPTS[0]}], max_tokens=24, ignore_eos=True)
        st = pipe._req.spec
        assert len(got) == 24 and st.proposed > 0 and dev.compile_count == count
        assert pipe.scheduler.fwd.max_rows == 4 and ("decode", 4) in pipe.scheduler.compile_ops()
    finally:
        pipe.dispose()


async def test_stop_strings_max_tokens_and_logprobs(device, tiny):
    pipe = await LLMChatPipeline.load(device, tiny, ChatConfig(context_window_size=512, compile_at_load=False,
                                                               speculation={"k": 5, "auto_off": False}))
    try:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        ref = await _reference(pipe, msgs, 30)
        for n in (1, 2, 7, 13):             # max_tokens inside, at and past a verify step's guesses
            assert await _generate(pipe, msgs, max_tokens=n, ignore_eos=True) == ref[:n]
            assert pipe.finish_reason == "length"
        text = pipe.tokenizer.decode(ref[:30])
        stop = text[len(text) // 2:len(text) // 2 + 3]
        got = await _generate(pipe, msgs, max_tokens=30, ignore_eos=True, stop=[stop])
        assert got == ref[:len(got)] and pipe.finish_reason == "stop" and stop not in pipe.get_message()
        # logprobs: the same entries as one-guess speculation gives (both check every token alike)
        await _generate(pipe, msgs, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
        many = list(pipe.token_logprobs)
        one = _sibling(pipe, {"k": 1, "auto_off": False})
        try:
            await _generate(one, msgs, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
            assert one.token_logprobs == many and len(many) == 12
        finally:
            one.scheduler.close()
    finally:
        pipe.dispose()


async def test_smollm2_rag_prompt(device, smollm2_gguf):
    """The default model quoting a passage: the guesses are mostly right, the answer is the same."""
    passage = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is named "
               "after the engineer Gustave Eiffel, whose company designed and built the tower.")
    msgs = [{"role": "user", "content": passage + "\nRepeat the first sentence word for word."}]
    pipe = await LLMChatPipeline.load(device, smollm2_gguf, ChatConfig(context_window_size=512,
                                                                       compile_at_load=False,
                                                                       speculation={"k": 6, "auto_off": False}))
    try:
        ref = await _reference(pipe, msgs, 20)
        got = await _generate(pipe, msgs, max_tokens=20, ignore_eos=True)
        assert got == ref
        st = pipe._req.spec
        assert st.accepted >= 8 and st.steps <= 12, st
    finally:
        pipe.dispose()


async def test_engine_reports_speculation_and_decodes_other_requests_as_before(device, tiny):
    from webgpu_engine.engine import AsyncMLCEngine, EngineConfig, ModelRecord, default_app_config
    app = default_app_config().with_records(ModelRecord("tiny-spec", str(tiny), "llm"))
    eng = AsyncMLCEngine(EngineConfig(device=device, app_config=app))
    await eng.reload("tiny-spec", {"compile_at_load": False, "speculation": {"method": "ngram", "k": 4,
                                                                             "n_min": 1, "auto_off": False}})
    try:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        r = await eng.chat.completions.create(messages=msgs, max_tokens=16, temperature=0, ignore_eos=True)
        ex = r.usage.extra.model_dump()
        assert ex["speculation_steps"] >= 1 and ex["speculation_proposed_tokens"] >= ex["speculation_accepted_tokens"]
        assert ex["speculation_steps"] + ex["speculation_accepted_tokens"] <= 15    # and plain steps
        s = await eng.chat.completions.create(messages=msgs, max_tokens=4, temperature=0.8, seed=1,
                                              frequency_penalty=0.5)
        assert "speculation_steps" not in s.usage.extra.model_dump()    # penalties: decoded as before
        s = await eng.chat.completions.create(messages=msgs, max_tokens=4, temperature=0.8, seed=1)
        assert "speculation_steps" in s.usage.extra.model_dump()      # sampled: speculates
        with pytest.raises(ChatOptionTypeError):
            await eng.reload("tiny-spec", {"compile_at_load": False, "speculation": {"method": "draft"}})
        # a draft model by reference (here a path; an id, URL or Hub repo resolve as a model's do)
        await eng.reload("tiny-spec", {"compile_at_load": False, "speculation": {
            "method": "draft", "model": str(tiny), "k": 3, "auto_off": False}})
        d = await eng.chat.completions.create(messages=msgs, max_tokens=16, temperature=0, ignore_eos=True)
        assert d.choices[0].message.content == r.choices[0].message.content
        ex = d.usage.extra.model_dump()
        assert ex["speculation_accepted_tokens"] >= 1 and ex["speculation_turned_off"] is False
    finally:
        await eng.unload()


# ------------------------------------------------------------------ grammars
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                    "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "tags", "ok"], "additionalProperties": False}


async def test_grammar_masks_every_verified_row(device, tiny_llama, drafts):
    """Under a JSON schema the guesses (the grammar's forced tokens, prompt lookup's, a draft's) are
    checked row by row with each row's own mask: greedy answers equal one-token-per-forward decoding
    with the grammar (no guesses), greedy and sampled answers match the schema, and guesses were
    accepted."""
    import json
    for spec in ({"k": 4, "auto_off": False},
                 {"method": "draft", "model": str(drafts["other"]), "k": 3, "auto_off": False}):
        pipe = await LLMChatPipeline.load(device, tiny_llama, ChatConfig(context_window_size=512, compile_at_load=False,
                                                                         speculation=spec))
        try:
            g = pipe.grammars.compile({"type": "json_schema", "schema": SCHEMA})
            msgs = [{"role": "user", "content": PROMPTS[0]}]
            for sampling in ({}, {"temperature": 0.8, "top_k": 8, "seed": 3}):
                plain = _sibling(pipe, None)             # the reference: every step is one row
                try:
                    ref = await _generate(plain, msgs, max_tokens=80, grammar=g, **sampling)
                    ref_text = plain.get_message()
                finally:
                    plain.scheduler.close()
                got = await _generate(pipe, msgs, max_tokens=80, grammar=g, **sampling)
                st = pipe._req.spec
                # sampled: the same distribution, not the same draws (refused rows use some up)
                assert got == ref or sampling, (spec, sampling)
                assert pipe.finish_reason == "stop"
                for text in (ref_text, pipe.get_message()):
                    obj = json.loads(text)
                    assert set(obj) == {"name", "tags", "ok"} and len(obj["name"]) <= 12
                    assert set(obj["tags"]) <= {"red", "green", "blue"}
                assert st.accepted > 0 and st.steps < len(got), st      # the forced keys at least
        finally:
            pipe.dispose()


# ------------------------------------------------------------------ sampled requests
def _chi2_999(dof: int) -> float:
    """The chi-square critical value at p = 0.001 (Wilson-Hilferty; within 2% of the tables from
    3 degrees of freedom on, 10.83 / 13.82 below)."""
    if dof <= 2:
        return (10.83, 13.82)[dof - 1]
    z = 3.0902                     # the normal quantile of 0.999
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _chi2_two_samples(a: list, b: list) -> tuple[float, int]:
    """Pearson's chi-square of two samples of categories (categories with fewer than 10 draws over
    both pooled into one), and its degrees of freedom."""
    from collections import Counter
    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c]))
    big = [c for c in cats if ca[c] + cb[c] >= 10]
    rest = [c for c in cats if c not in big]
    rows = [(ca[c], cb[c]) for c in big] + ([(sum(ca[c] for c in rest), sum(cb[c] for c in rest))] if rest else [])
    na, nb = len(a), len(b)
    chi = 0.0
    for x, y in rows:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        chi += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return chi, len(rows) - 1


async def test_speculative_sampling_keeps_the_distribution(device, tiny_llama):
    """Sampled requests speculate (here the model drafts for itself: its greedy token is the guess,
    so rows accept with the probability of that token): over many seeds the tokens at positions
    reached through verify rows (accepted guesses and tokens drawn where a guess was refused) are
    distributed as without speculation (two-sample chi-square at p = 0.001 per position), guesses
    are accepted and refused, and a seed repeats its answer."""
    pipe = await LLMChatPipeline.load(device, tiny_llama, ChatConfig(
        context_window_size=512, compile_at_load=False,
        speculation={"method": "draft", "model": str(tiny_llama), "k": 3, "auto_off": False}))
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    n, runs = 4, 240
    sampling = dict(max_tokens=n, ignore_eos=True, temperature=0.7, top_k=4)
    plain = _sibling(pipe, None)
    try:
        samples = {}
        accepted = proposed = 0
        for name, p in (("plain", plain), ("spec", pipe)):
            outs = []
            for seed in range(runs):
                outs.append(tuple(await _generate(p, msgs, seed=seed, **sampling)))
                if p is pipe:
                    accepted += pipe._req.spec.accepted
                    proposed += pipe._req.spec.proposed
            samples[name] = outs
        assert runs // 4 < accepted < proposed, (accepted, proposed)   # both outcomes, often
        for i in range(1, n):
            chi, dof = _chi2_two_samples([o[i] for o in samples["plain"]], [o[i] for o in samples["spec"]])
            assert dof >= 1 and chi < _chi2_999(dof), (i, chi, dof)
        # the test tells distributions apart: the greedy token at every position is another one
        greedy = await _generate(plain, msgs, max_tokens=n, ignore_eos=True)
        chi, dof = _chi2_two_samples([o[1] for o in samples["plain"]], [greedy[1]] * runs)
        assert chi > _chi2_999(dof)
        assert tuple(await _generate(pipe, msgs, seed=7, **sampling)) == samples["spec"][7]
    finally:
        plain.scheduler.close()
        pipe.dispose()


# ------------------------------------------------------------------ a draft model
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("spec") / "llama.gguf", arch="llama",
                                 qtype="q8_0", context_length=512)["path"]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Draft models for the tiny Llama: other weights (seed 1, fewer layers), and another vocabulary."""
    d = tmp_path_factory.mktemp("drafts")
    return {"other": write_tiny_llama_gguf(d / "other.gguf", "llama", "q8_0", seed=1, n_layers=1,
                                           context_length=512)["path"],
            "vocab": write_tiny_llama_gguf(d / "vocab.gguf", "llama", "q8_0", seed=1, vocab_size=280,
                                           context_length=512)["path"]}


async def test_draft_model_greedy_answers_equal_one_token_per_forward(device, tiny_llama, drafts):
    """Guesses of another model (mostly wrong) and of the same model (mostly right: the draft's rows
    go through whatever kernels its batch picks, the target verifies as it decodes): the same answers."""
    for draft, k in ((drafts["other"], 3), (tiny_llama, 4)):
        pipe = await LLMChatPipeline.load(device, tiny_llama, ChatConfig(
            context_window_size=512, compile_at_load=False,
            speculation={"method": "draft", "model": str(draft), "k": k, "auto_off": False}))
        try:
            assert pipe.draft is not None and pipe.draft.owner != pipe.owner
            for p in PROMPTS:
                msgs = [{"role": "user", "content": p}]
                ref = await _reference(pipe, msgs, 24)
                got = await _generate(pipe, msgs, max_tokens=24, ignore_eos=True)
                assert got == ref, (draft, p[:20])
                st = pipe._req.spec
                assert st.steps + st.accepted + st.plain == 23 and 0 < st.proposed <= 3 * k * st.steps
                assert len(pipe.kv_ids) == len(pipe.prompt_ids(msgs, None)) + 23
                if draft == tiny_llama:
                    assert st.accepted >= st.proposed // 2, st     # the model guessing itself
            draft_owner = pipe.draft.owner
        finally:
            pipe.dispose()
        assert draft_owner not in device.allocations()           # the draft is freed with the model


async def test_draft_model_with_another_vocabulary_is_refused(device, tiny_llama, drafts):
    before = set(device.allocations())
    with pytest.raises(UnsupportedChatOptionError, match="vocabulary"):
        await LLMChatPipeline.load(device, tiny_llama, ChatConfig(
            context_window_size=512, compile_at_load=False,
            speculation={"method": "draft", "model": str(drafts["vocab"])}))
    assert set(device.allocations()) <= before                   # nothing of either model is left


async def test_auto_off_switches_to_the_fused_path(device, tiny_llama):
    """auto_off's rule per sequence, with the plain decode step's time set (the scheduler's yardstick,
    timed on steps without guesses): faster than the verify steps -> off after `probe` steps (the rest
    decodes in plain rows, the answer completes); slower -> speculation stays on; not timed yet ->
    speculation goes on until a step without guesses times it."""
    pipe = await LLMChatPipeline.load(device, tiny_llama, ChatConfig(context_window_size=512, compile_at_load=False,
                                                               speculation={"k": 3, "n_min": 1, "probe": 2}))
    try:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        ref = await _reference(pipe, msgs, 20)
        spec = pipe.scheduler.spec
        # the yardstick stays as the test sets it: a plain step timed on a busy host moved it past the
        # verify steps' time (seen with two suites on 2 cores)
        timed, spec.timed = spec.timed, lambda *a: None
        spec.plain_step_s = 1e-9                            # plain steps "instant": turn off
        got = await _generate(pipe, msgs, max_tokens=20, ignore_eos=True)
        st = pipe._req.spec
        assert st.off == 1 and st.steps == 2 and len(got) == 20 and pipe.finish_reason == "length"
        assert pipe.usage()["extra"]["speculation_turned_off"] is True
        assert got == ref                                   # verify rows are decode rows: the same tokens
        spec.plain_step_s = 1e9                             # plain steps "slow": speculation stays
        await _generate(pipe, msgs, max_tokens=20, ignore_eos=True)
        st = pipe._req.spec
        assert st.off == 0 and st.steps + st.accepted + st.plain == 19
        spec.timed = timed
        spec.plain_step_s = None                            # never timed: no judgement until a plain step
        got = await _generate(pipe, msgs, max_tokens=20, ignore_eos=True)
        st = pipe._req.spec
        assert got == ref and st.steps >= 2 and (spec.plain_step_s is not None or st.off == 0)
    finally:
        pipe.dispose()


def test_cli_draft_model_flag():
    """serve/chat/complete --draft-model REF: speculation by that model, per model or for all."""
    from webgpu_engine.cli.models import chat_opts_for
    from webgpu_engine.cli.parser import build_parser
    args = build_parser().parse_args(["serve", "--model", "a.gguf", "--draft-model", "d.gguf"])
    assert chat_opts_for(args, 1) == [{"speculation": {"method": "draft", "model": "d.gguf"}}]
    args = build_parser().parse_args(["serve", "--speculation", "ngram"])
    assert chat_opts_for(args, 1) == [{"speculation": "ngram"}]
