"""The paged KV cache's block pool (models/kv_pool.py, no GPU): allocation and reference counts,
prefix sharing through the hash chain, LRU eviction, preemption; hypothesis drives random
schedules and checks the invariants after every step."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from webgpu_engine.models.kv_pool import SKIP_SLOT, KVPool, PoolExhaustedError, block_hash
from webgpu_engine.models.plan import DecoderPlan, pool_blocks


def _run(pool, seq, tokens):
    """Admit, reserve and write a whole prompt (what prefill does); returns the cached-token count."""
    hit = pool.add_sequence(seq, tokens)
    pool.reserve(seq, len(tokens))
    pool.append_tokens(seq, tokens[hit:])
    return hit


def test_plan_sizes_the_pool():
    """The load plan's KV bytes and pool blocks (models/plan.py: what the estimate, the scheduler's
    pool and /v1/models use)."""
    from types import SimpleNamespace
    smol = SimpleNamespace(n_layers=30, n_kv_heads=3, head_dim=64, max_head_dim=64,    # SmolLM2-135M
                           cache_head_dims=lambda: [64] * 30)           # (LlamaConfig's: every layer caches)
    plan = DecoderPlan("f16", 2048, 256, 4, 16, pool_blocks(4, 2048, 16))
    assert plan.kv_bytes_per_token(smol) == 2 * 30 * 3 * 64 * 2
    assert plan.kv_pool_blocks == 8192 // 16                 # 4 contexts, capped at max(2 contexts, 8192)
    assert plan.kv_cache_bytes(smol) == plan.kv_bytes_per_token(smol) * 16 * 512     # the pool: no contiguous cache
    assert pool_blocks(4, 512, 16, pool_tokens=100 * 16 + 5) == 101       # an asked size, whole blocks
    assert pool_blocks(4, 2048, 16, pool_tokens=64) == 2048 // 16 + 1     # never below one context + 1
    pool = KVPool(plan.kv_pool_blocks, plan.kv_block_size)
    assert (pool.n_blocks, pool.block_size, pool.n_free) == (512, 16, 512)


def test_block_table_slots_and_growth():
    pool = KVPool(8, 4)
    pool.add_sequence("a", [1, 2, 3, 4, 5, 6])
    assert pool.reserve("a", 6) == [0, 1]
    assert pool.slots("a", 3, 3) == [3, 4, 5]
    pool.append_tokens("a", [1, 2, 3, 4, 5, 6])
    assert pool.reserve("a", 8) == []                    # the partial block still has room
    assert pool.reserve("a", 9) == [2]
    assert pool.slots("a", 8, 1) == [8]
    with pytest.raises(ValueError, match="outside"):
        pool.slots("a", 10, 3)
    with pytest.raises(ValueError, match="reserve first"):
        pool.append_tokens("a", list(range(7)))
    with pytest.raises(ValueError, match="already"):
        pool.add_sequence("a", [1])
    pool.check()


def test_prefix_sharing_reuses_full_blocks_only():
    pool = KVPool(16, 4)
    sys_prompt = list(range(100, 110))                   # 2 full blocks + 2 tokens
    assert _run(pool, "a", sys_prompt + [1, 2, 3]) == 0
    ta = pool.block_table("a")
    # b shares the two full system blocks; its third block differs (tokens 108, 109, 7, 8)
    assert _run(pool, "b", sys_prompt + [7, 8, 9]) == 8
    tb = pool.block_table("b")
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [pool.ref[b] for b in ta[:2]] == [2, 2] and pool.ref[ta[2]] == 1
    # the whole prompt cached still leaves its last token to compute (its logits are needed)
    assert pool.add_sequence("c", sys_prompt[:8]) == 4
    assert pool.stats["hit_tokens"] == 12
    pool.check()


def test_a_prompt_takes_the_matching_rows_of_a_cached_block_by_a_copy():
    """`partial`: past the shared full blocks, a cached block (same parent key) whose first tokens match
    the prompt's next ones gives those rows by a copy into a block of the sequence's own (the source
    held until take_copy); the prompt's last token is still computed; without `partial`, whole blocks."""
    sys_prompt = list(range(100, 110))                   # 2 full blocks + 2 tokens
    for partial in (False, True):
        pool = KVPool(16, 4, partial=partial)
        _run(pool, "a", sys_prompt + [1, 2, 3])
        ta = pool.block_table("a")
        pool.free("a")
        hit = pool.add_sequence("b", sys_prompt + [1, 7, 8])
        assert hit == (11 if partial else 8) and pool.stats["copied_tokens"] == (3 if partial else 0)
        cp = pool.take_copy("b")
        assert cp == ((ta[2], pool.block_table("b")[2], 3) if partial else None)
        assert pool.block_table("b")[:2] == ta[:2]
        pool.check()
        pool.reserve("b", 13)
        pool.append_tokens("b", (sys_prompt + [1, 7, 8])[hit:])
        pool.check()
    # the whole prompt in a cached block: its last token computed; a sequence freed before its copy
    # gives the source back
    assert pool.add_sequence("c", sys_prompt + [1, 2]) == 11
    src = pool._seqs["c"].copy[0]
    assert pool.ref[src] == 1
    pool.check()
    pool.free("c")
    assert pool.ref[src] == 0
    pool.check()
    # a ring or an unshared pool copies nothing
    assert not KVPool(16, 4, share=False, partial=True).partial


def test_a_freed_sequences_last_prefilled_rows_are_copied_not_recomputed():
    """`partial`: a finished sequence's block holding its prompt's last rows, short of a full block,
    stays cached for those rows: the same prompt again copies them (only its last token computed),
    and a conversation's next turn (prompt + answer + more) copies the prompt's rows, never the
    decoded ones after them."""
    prompt = list(range(1, 11))                          # 2 full blocks + 2 rows
    pool = KVPool(16, 4, partial=True)
    _run(pool, "a", prompt)
    pool.free("a")
    assert pool.add_sequence("b", prompt) == 9 and pool.stats["copied_tokens"] == 1
    assert pool.take_copy("b")[2] == 1
    pool.free("b")
    assert pool.add_sequence("c", prompt + [5]) == 10 and pool.take_copy("c")[2] == 2
    pool.reserve("c", 11)
    pool.append_tokens("c", [5])
    pool.reserve("c", 14)
    pool.append_tokens("c", [11, 12, 13], decoded=True)  # an answer: rows 11 .. 13
    pool.free("c")
    pool.check()
    turn = prompt + [5, 11, 12, 13, 14]
    assert pool.add_sequence("d", turn) == 11            # 8 shared + the prompt's 3 prefilled rows
    src, dst, n = pool.take_copy("d")
    assert n == 3 and src != dst and pool.tokens("d") == turn[:11]
    pool.check()
    # the tail is evictable like any cached block; without `partial` nothing is kept
    pool.free("d")
    for i in range(16):
        pool.add_sequence(i + 100, [])
        pool.reserve(i + 100, 4)
    pool.check()
    assert pool.stats["evictions"] > 0
    plain = KVPool(16, 4)
    _run(plain, "a", prompt)
    plain.free("a")
    assert plain.add_sequence("b", prompt) == 8


def test_blocks_with_decoded_rows_are_never_shared():
    """Only blocks a prefill filled are shared (a decode step's rows are not a cold prefill's, bit
    for bit): the block a sequence's first decoded token lands in, and every block after it, stay
    private; a follow-up prompt that continues the conversation reuses the prefilled blocks."""
    pool = KVPool(16, 4)
    prompt = list(range(100, 106))                        # 1 full block + 2 tokens
    _run(pool, "a", prompt)
    for t in range(200, 208):                            # decode steps: blocks 1, 2, 3 fill
        pool.reserve("a", pool.num_tokens("a") + 1)
        pool.append_tokens("a", [t], decoded=True)
    conv = prompt + list(range(200, 208))
    assert pool.add_sequence("b", conv + [9]) == 4        # block 0 only: blocks 1.. hold decoded rows
    pool.check()


def test_prefix_key_is_the_whole_prefix():
    """Equal tokens after a different prefix are a different block."""
    pool = KVPool(16, 2)
    _run(pool, "a", [1, 2, 3, 4, 5])
    assert pool.add_sequence("b", [9, 9, 3, 4, 5]) == 0
    assert block_hash(b"", [3, 4]) != block_hash(block_hash(b"", [1, 2]), [3, 4])


def test_free_keeps_cached_blocks_until_evicted_lru_tail_first():
    pool = KVPool(4, 2)
    _run(pool, "a", [1, 2, 3, 4, 5])                     # blocks 0, 1 full; block 2 partial
    pool.free("a")
    assert pool.n_free == 4 and pool.ref == [0, 0, 0, 0]
    # the next conversation turn finds the cached prefix
    assert pool.add_sequence("a2", [1, 2, 3, 4, 5, 6, 7]) == 4
    pool.free("a2")
    # a fresh sequence needs 4 blocks: 2 free ones, then the idle cached ones, tail (block 1) first
    pool.add_sequence("x", [50] * 7)
    new = pool.reserve("x", 7)
    assert sorted(new[:2]) == [2, 3] and new[2:] == [1, 0]
    assert pool.stats["evictions"] == 2
    pool.free("x")
    assert pool.add_sequence("a3", [1, 2, 3, 4, 5]) == 0      # evicted: recomputed
    pool.check()


def test_eviction_never_takes_a_referenced_block():
    pool = KVPool(3, 2)
    _run(pool, "a", [1, 2, 3])                            # 2 blocks held
    pool.add_sequence("b", [7, 8, 9, 10, 11])
    with pytest.raises(PoolExhaustedError):
        pool.reserve("b", 5)                              # 3 blocks wanted, 1 available
    assert pool.block_table("b") == []                    # nothing half-allocated
    pool.check()


def test_preemption_frees_the_newest_sequence():
    pool = KVPool(6, 2)
    for i, s in enumerate("abc"):
        _run(pool, s, [10 * i + j for j in range(4)])     # 2 blocks each: the pool is full
    assert pool.n_free == 0
    assert pool.reserve_or_preempt("a", 5) == ["c"]       # a grows; c (newest) goes
    assert "c" not in pool and len(pool.block_table("a")) == 3
    assert pool.stats["preemptions"] == 1
    # c's full blocks stayed cached: its readmission is mostly hits (one block was evicted for a)
    assert pool.add_sequence("c", [20, 21, 22, 23, 24]) == 2
    pool.check()
    # an older sequence never makes way for a newer one: the newest growing goes itself
    pool.add_sequence("big", [0])
    assert pool.reserve_or_preempt("big", 100) == ["big"]
    assert "big" not in pool and pool.sequences_newest_first() == ["c", "b", "a"]   # c came back last
    # the oldest growing past what the pool holds preempts every newer one, then itself
    assert pool.reserve_or_preempt("a", 100) == ["c", "b", "a"]
    assert pool.n_free == 6 and pool.sequences_newest_first() == []
    assert pool.stats["preemptions"] == 5
    pool.check()


def test_decode_inputs_for_a_batch_step():
    pool = KVPool(8, 4)
    _run(pool, "a", [1, 2, 3, 4, 5])          # next token at position 5, in block 1
    _run(pool, "b", [1, 2, 3, 4, 9, 9, 9, 9])  # next token at position 8 needs a new block
    pool.reserve("a", 6)
    pool.reserve("b", 9)
    got = pool.decode_inputs(["b", "a"], max_seqs=3, max_blocks=3)
    ta, tb = pool.block_table("a"), pool.block_table("b")
    assert tb[0] == ta[0] and len(tb) == 3                 # b shares a's full first block
    assert got["positions"] == [8, 5, 0] and got["lens"] == [9, 6, 0]
    assert got["slots"] == [tb[2] * 4, ta[1] * 4 + 1, SKIP_SLOT]
    assert got["tables"] == tb + ta + [0] + [0, 0, 0]
    with pytest.raises(ValueError, match="exceed max_rows=1"):
        pool.decode_inputs(["a", "b"], max_seqs=1, max_blocks=3)
    with pytest.raises(ValueError, match="tables have 1"):
        pool.decode_inputs(["a"], max_seqs=1, max_blocks=1)


def test_verify_rows_and_trim():
    """A verify step: a sequence's rows at consecutive positions, each reading keys up to its own;
    the rejected rows' blocks go back free, never below what the sequence wrote."""
    pool = KVPool(8, 4)
    _run(pool, "a", [1, 2, 3, 4, 5])          # 5 tokens: next at position 5
    pool.reserve("a", 5 + 1 + 4)              # the fed token and 4 guesses: positions 5 .. 9, 3 blocks
    ta = pool.block_table("a")
    got = pool.decode_rows([("a", p) for p in range(5, 10)], 6, 3)
    assert got["positions"] == [5, 6, 7, 8, 9, 0] and got["lens"] == [6, 7, 8, 9, 10, 0]
    assert got["slots"] == [ta[1] * 4 + 1, ta[1] * 4 + 2, ta[1] * 4 + 3, ta[2] * 4, ta[2] * 4 + 1, SKIP_SLOT]
    assert got["tables"] == ta * 5 + [0, 0, 0]
    free = pool.n_free
    pool.append_tokens("a", [6, 7], decoded=True)    # the fed token and one guess kept
    pool.trim("a", 7 + 1)                     # room for the next token: 2 blocks
    assert pool.block_table("a") == ta[:2] and pool.n_free == free + 1
    pool.trim("a", 0)                         # never below the written tokens
    assert pool.block_table("a") == ta[:2]
    pool.check()



def test_truncate_takes_back_written_rows_of_private_blocks_only():
    """A draft's cache (share=False) forgets the rows of rejected guesses anywhere and gives back
    the blocks past them; nothing in it is registered for sharing; a shared pool refuses a cut
    inside a shared block but takes one at its end."""
    pool = KVPool(8, 4, share=False)
    _run(pool, "a", list(range(10)))          # 10 prefilled tokens, 3 blocks
    assert not pool._cache                    # nothing shared
    ta = pool.block_table("a")
    free = pool.n_free
    pool.truncate("a", 6)
    assert pool.tokens("a") == list(range(6)) and pool.block_table("a") == ta[:2] and pool.n_free == free + 1
    pool.reserve("a", 9)
    pool.append_tokens("a", [60, 70, 80], decoded=True)
    assert pool.tokens("a") == [0, 1, 2, 3, 4, 5, 60, 70, 80]
    pool.truncate("a", 0)
    assert pool.tokens("a") == [] and pool.block_table("a") == [] and pool.n_free == 8
    pool.check()
    shared = KVPool(8, 4)
    _run(shared, "b", list(range(10)))        # blocks 0 and 1 full and registered
    with pytest.raises(ValueError, match="shared block"):
        shared.truncate("b", 6)
    shared.truncate("b", 8)                   # at a shared block's end: the partial block goes
    assert shared.tokens("b") == list(range(8)) and len(shared.block_table("b")) == 2
    shared.check()


# ----------------------------------------------------------------------------- properties
OPS = st.lists(st.tuples(st.sampled_from(["add", "run", "grow", "free", "preempt"]),
                         st.integers(0, 3),                               # sequence slot
                         st.lists(st.integers(0, 1), min_size=1, max_size=9)), min_size=5, max_size=40)


HITS: list = []


@settings(max_examples=200, deadline=None, derandomize=True)   # the same schedules every run
@given(ops=OPS, n_blocks=st.integers(1, 10), block_size=st.integers(1, 3))
def test_random_schedules_keep_the_invariants(ops, n_blocks, block_size):
    """Reference counts match the tables and never go negative; a block is owned by two tables only
    when cached (full, shared); allocation never hands out a block some table holds; a sequence's
    reused prefix holds exactly the tokens its prompt starts with. A tiny token alphabet makes
    shared prefixes common."""
    pool = KVPool(n_blocks, block_size)
    written: dict = {}                     # seq -> tokens whose KV it has written or reused
    for op, slot, toks in ops:
        seq = f"s{slot}"
        if op in ("add", "run") and seq not in pool:
            hit = pool.add_sequence(seq, toks)
            assert hit % block_size == 0 and hit <= max(0, len(toks) - 1)
            written[seq] = toks[:hit]
            HITS.append(hit)
            if op == "run" and pool.blocks_needed(seq, len(toks)) <= pool.n_free:   # prefill it all
                pool.reserve(seq, len(toks))
                pool.append_tokens(seq, toks[hit:])
                written[seq] = list(toks)
        elif op == "grow" and seq in pool:
            held = {b for s in written for b in pool.block_table(s)}
            n = len(written[seq]) + len(toks)
            try:
                new = pool.reserve(seq, n)
            except PoolExhaustedError:
                assert pool.blocks_needed(seq, n) > pool.n_free
            else:
                assert not set(new) & held and len(set(new)) == len(new)
                pool.append_tokens(seq, toks)
                written[seq] += toks
        elif op == "free" and seq in pool:
            pool.free(seq)
            del written[seq]
        elif op == "preempt":
            victim = pool.preempt_newest()
            if victim is not None:
                del written[victim]
        pool.check()
        assert all(r >= 0 for r in pool.ref)
        for s, t in written.items():
            assert pool.num_tokens(s) == len(t)
    # blocks shared between two live sequences hold the same token prefix in both
    owners: dict = {}
    for s, t in written.items():
        for i, b in enumerate(pool.block_table(s)):
            if (i + 1) * block_size <= len(t):
                prefix = tuple(t[:(i + 1) * block_size])
                assert owners.setdefault(b, prefix) == prefix
    for s in list(written):
        pool.free(s)
    pool.check()
    assert pool.n_free == n_blocks and not any(pool.ref)


COPY_OPS = st.lists(st.tuples(st.sampled_from(["add", "run", "grow", "decode", "free", "preempt"]),
                              st.integers(0, 3),
                              st.lists(st.integers(0, 1), min_size=1, max_size=9)), min_size=5, max_size=40)
COPIED: list = []


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ops=COPY_OPS, n_blocks=st.integers(2, 10), block_size=st.integers(2, 4))
def test_random_schedules_with_copied_rows_read_only_prefilled_rows(ops, n_blocks, block_size):
    """`partial` pools (rows copied from cached blocks and freed sequences' tails) under random
    schedules, with the GPU's rows modelled: every row a sequence holds is the row it wrote itself
    or a prefill row of the same token at the same position, never another sequence's decoded row,
    whether it came from a shared block or a copy; the invariants hold after every step."""
    pool = KVPool(n_blocks, block_size, partial=True)
    rows: dict = {}                        # physical row -> (kind, position, token) last written there
    mine: dict = {}                        # seq -> {position: kind} of the rows it wrote itself

    def write(seq, start, toks, kind):
        for j, (slot, t) in enumerate(zip(pool.slots(seq, start, len(toks)), toks)):
            rows[slot] = (kind, start + j, t)
            mine[seq][start + j] = kind

    for op, slot, toks in ops:
        seq = f"s{slot}"
        if op in ("add", "run") and seq not in pool:
            hit = pool.add_sequence(seq, toks)
            assert hit <= max(0, len(toks) - 1) and pool.tokens(seq) == toks[:hit]
            mine[seq] = {}
            cp = pool.take_copy(seq)        # the scheduler records the copy before the first forward
            if cp is not None:
                src, dst, n = cp
                for r in range(n):
                    if src * block_size + r in rows:
                        rows[dst * block_size + r] = rows[src * block_size + r]
                COPIED.append(n)
            if op == "run" and pool.blocks_needed(seq, len(toks)) <= pool.n_free:
                pool.reserve(seq, len(toks))
                write(seq, hit, toks[hit:], "p")
                pool.append_tokens(seq, toks[hit:])
        elif op in ("grow", "decode") and seq in pool:
            n = pool.num_tokens(seq)
            try:
                pool.reserve(seq, n + len(toks))
            except PoolExhaustedError:
                continue
            write(seq, n, toks, op[0])
            pool.append_tokens(seq, toks, decoded=op == "decode")
        elif op == "free" and seq in pool:
            pool.free(seq)
        elif op == "preempt":
            pool.preempt_newest()
        pool.check()
        for s in list(mine):
            if s not in pool:
                del mine[s]
                continue
            for p, t in enumerate(pool.tokens(s)):
                kind = mine[s].get(p, "p")
                if kind == "g":
                    kind = "p"
                got = rows.get(pool.slots(s, p, 1)[0])
                assert got is not None and got[1:] == (p, t) and (got[0] in ("p", "g")) == (kind == "p"), (s, p)
    for s in list(mine):
        pool.free(s)
    pool.check()
    assert pool.n_free == n_blocks


def test_random_schedules_exercised_sharing():
    """The property tests above did reach prefix hits and copies (they run first, in file order)."""
    assert len(HITS) > 100 and sum(h > 0 for h in HITS) > 20, (len(HITS), sum(h > 0 for h in HITS))
    assert sum(n > 0 for n in COPIED) > 20, COPIED


def test_imports_without_compiled_dependencies():
    """The pool and the paged kernels' host code load where numpy and wgpu are absent (Pyodide)."""
    import subprocess
    import sys
    code = ("import sys\nfor m in ('numpy', 'wgpu'): sys.modules[m] = None\n"
            "import webgpu_engine.models.kv_pool, webgpu_engine.kernels.attention_paged\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
