"""Paged attention kernels on the real adapter against numpy: the KV write's scatter through slots,
ragged-batch decode (block boundaries, GQA, windows, soft-cap, sequences sharing prefix blocks, idle
slots), chunked prefill through a block table, and equality with the contiguous kernels."""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.models.kv_pool import SKIP_SLOT, KVPool
from webgpu_engine.kernels import attention_paged as ap
from webgpu_engine.kernels import nn, nn_ref

from _nn_util import NP, TOL, empty, get, put, rounded, run, set_step, step_buf

BS = 16
SMOL = dict(hq=9, hkv=3, d=64)           # SmolLM2-135M heads


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner("test:nn")


def _gather(pool, table, n):
    """(Hkv, n, D): keys 0..n-1 of a sequence read through its block table (the reference's view)."""
    bs = pool.shape[1]
    rows = [pool[table[j // bs], j % bs] for j in range(n)]
    return np.stack(rows, 1) if rows else np.zeros((pool.shape[2], 0, pool.shape[3]))


def _pools(device, rng, dtype, n_blocks, hkv, d, bs=BS):
    kp = rng.standard_normal((n_blocks, bs, hkv, d)) * 1.5
    vp = rng.standard_normal((n_blocks, bs, hkv, d))
    return (rounded(kp, dtype), rounded(vp, dtype)), (put(device, kp, dtype), put(device, vp, dtype, lead=8))


def _tables(rng, lens, n_blocks, max_blocks, bs=BS, share=()):
    """Distinct shuffled blocks per sequence; (a, b, n) in share: b's first n blocks are a's."""
    ids = list(rng.permutation(n_blocks))
    tables = np.zeros((len(lens), max_blocks), np.uint32)
    for q, n in enumerate(lens):
        for i in range(-(-n // bs)):
            tables[q, i] = ids.pop()
    for a, b, n in share:
        tables[b, :n] = tables[a, :n]
    return tables


def _decode_ref(qkv, kp, vp, tables, lens, hq, scale, **kw):
    out = np.full((len(lens), hq * qkv.shape[-1]), np.nan, np.float32)
    for q, n in enumerate(lens):
        if n:
            out[q] = nn_ref.causal_attention(qkv[q:q + 1, :hq], _gather(kp, tables[q], n),
                                             _gather(vp, tables[q], n), n - 1, scale, **kw)[0]
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_kv_write_scatters_rows_into_blocks(device, dtype):
    rng = np.random.default_rng(1)
    hq, hkv, d, t, n_blocks = 4, 2, 32, 7, 5
    qkv = rng.standard_normal((t, hq + 2 * hkv, d))
    slots = np.array([17, 18, 3, ap.SKIP_SLOT, 79, 0, 40], np.uint32)    # rows across blocks 0, 1, 2, 4
    kp, vp = (put(device, np.full((n_blocks, BS, hkv, d), 9.0), dtype, lead=lead) for lead in (0, 4))
    run(device, ap.paged_kv_write(device, put(device, qkv, dtype, lead=4), kp, vp, put(device, slots, "u32", lead=3),
                                  n_q_heads=hq, n_kv_heads=hkv, head_dim=d))
    want_k, want_v = np.full((n_blocks * BS, hkv, d), 9.0), np.full((n_blocks * BS, hkv, d), 9.0)
    for r, s in enumerate(slots):
        if s != ap.SKIP_SLOT:
            want_k[s], want_v[s] = qkv[r, hq:hq + hkv], qkv[r, hq + hkv:]
    assert np.array_equal(get(device, kp).reshape(-1, hkv, d), rounded(want_k, dtype))
    assert np.array_equal(get(device, vp).reshape(-1, hkv, d), rounded(want_v, dtype))


@pytest.mark.parametrize("dtype,neox,rot", [("f32", False, 32), ("f16", False, 32), ("f32", True, 16)])
def test_rope_kv_paged_rotates_at_row_positions_and_scatters(device, dtype, neox, rot):
    """Each row at a position of its own (a ragged decode batch); q and k heads rotated in place as
    nn_ref.rope, rotated k and v rows in their pool slots; a skipped slot rotates only."""
    rng = np.random.default_rng(2)
    hq, hkv, d, n_blocks = 4, 2, 32, 4
    qkv = rng.standard_normal((6, hq + 2 * hkv, d))
    pos = np.array([0, 5, 17, 3, 100, 40], np.uint32)
    slots = np.array([3, 20, ap.SKIP_SLOT, 63, 16, 0], np.uint32)
    qt = put(device, qkv, dtype, lead=2)
    kp, vp = (put(device, np.full((n_blocks, BS, hkv, d), 9.0), dtype, lead=6) for _ in range(2))
    run(device, ap.paged_rope_kv(device, qt, kp, vp, put(device, pos, "u32"), put(device, slots, "u32"),
                                 n_q_heads=hq, n_kv_heads=hkv, head_dim=d, rot_dim=rot, base=500.0, neox=neox))
    want = nn_ref.rope(rounded(qkv, dtype), pos, n_heads=hq + hkv, rot_dim=rot, base=500.0, neox=neox)
    np.testing.assert_allclose(get(device, qt), want, **TOL[dtype])
    k_all, v_all = get(device, kp).reshape(-1, hkv, d), get(device, vp).reshape(-1, hkv, d)
    written = slots != ap.SKIP_SLOT
    np.testing.assert_allclose(k_all[slots[written]], want[written, hq:hq + hkv], **TOL[dtype])
    np.testing.assert_allclose(v_all[slots[written]], rounded(qkv, dtype)[written, hq + hkv:], **TOL[dtype])
    rest = np.setdiff1d(np.arange(n_blocks * BS), slots[written])
    assert (k_all[rest] == 9.0).all() and (v_all[rest] == 9.0).all()


CASES = {  # name: (lens, shape, window, softcap, share)
    "boundaries": ([1, BS - 1, BS, BS + 1, 3 * BS + 5, 0, 200], SMOL, 0, 0.0, ()),
    "shared_prefix": ([40, 45, 33], dict(hq=8, hkv=2, d=32), 0, 0.0, ((0, 1, 2), (0, 2, 2))),
    "window_softcap": ([5, 30, 100, 250], dict(hq=6, hkv=2, d=32), 37, 2.0, ((2, 3, 3),)),
    "mha_heads": ([17, 64], dict(hq=4, hkv=4, d=16), 0, 0.0, ()),
}


@pytest.mark.parametrize("case,dtype", [(c, "f32") for c in CASES] + [("boundaries", "f16"),
                                                                    ("window_softcap", "f16")])
def test_paged_decode_ragged_batch(device, case, dtype):
    """S sequences of their own lengths and tables in one op, each sequence by the short form (one
    lane over all its keys) where its own keys fit op.max_keys and split-key + combine beyond, bit
    for bit as the op that takes that form for every sequence; an idle slot (length 0) leaves its
    output row alone. Recorded with the longest sequence's keys, the op dispatches the lanes those
    keys need (the short form's lanes alone; the splits they reach), with the same outputs as every
    lane of every split."""
    lens, sh, window, softcap, share = CASES[case]
    hq, hkv, d = sh["hq"], sh["hkv"], sh["d"]
    rng = np.random.default_rng(len(lens) * d)
    max_blocks, n_blocks = 16, 60
    tables = _tables(rng, lens, n_blocks, max_blocks, share=share)
    (kp, vp), (kt, vt) = _pools(device, rng, dtype, n_blocks, hkv, d)
    qkv = rng.standard_normal((len(lens), hq + 2 * hkv, d)) * (3.0 if softcap else 1.0)
    lens_t = put(device, np.array(lens, np.uint32), "u32")
    out = empty(device, (len(lens), hq * d), dtype, lead=4, fill=7.0)
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, max_seqs=len(lens), max_blocks=max_blocks,
              scale=d ** -0.5, window=window, softcap=softcap, min_chunk=32)
    qt, tt = put(device, qkv, dtype, lead=4), put(device, tables, "u32")
    ref = _decode_ref(rounded(qkv, dtype), kp, vp, tables, lens, hq, d ** -0.5, window=window, softcap=softcap)
    if window or softcap:
        plain = _decode_ref(rounded(qkv, dtype), kp, vp, tables, lens, hq, d ** -0.5)
        assert np.nanmax(np.abs(plain - ref)) > 0.05                   # the window / cap matter
    live = np.array(lens) > 0
    got, groups = {}, []
    for short_keys in (None, 0, 10 ** 6):     # each sequence by its length; all split-key; all short
        op = ap.paged_decode(device, qt, kt, vt, out, lens_t, tt, **kw, short_keys=short_keys)
        assert len(op.dispatches) == 2 and len(op.short) == 1
        for n_keys in (None, max(lens)):      # the short dispatch alone where every sequence is short
            device.write(out.buf, np.full(out.numel, 7.0, NP[dtype]), out.offset)
            b = device.batch()
            op.record(b, n_keys=n_keys)
            groups.append([d[3] * d[4] for d in b.ops if d[0] == "d"])
            device.submit(b)
            if n_keys is None:
                got[short_keys] = get(device, out)
            else:
                assert np.array_equal(get(device, out), got[short_keys])
        if short_keys is None:
            limit = op.max_keys                # the device's bound (nn.attention's one-dispatch form)
        np.testing.assert_allclose(got[short_keys][live], ref[live], **TOL[dtype], err_msg=f"{short_keys=}")
        assert (got[short_keys][~live] == 7.0).all()
    # workgroups dispatched: every split, then the splits max(lens) reaches; short: a lane per head group
    (full, _), (some, _) = groups[2], groups[3]
    assert some <= full and len(groups[5]) == 1 and groups[5][0] < full
    if 2 * -(-max(lens) // 32) <= max_blocks * BS // 32:           # half the 32-key splits (min_chunk) or fewer
        assert some < full
    fits = np.array(lens) <= limit             # the short form where a sequence's own keys fit
    if case in ("boundaries", "window_softcap"):                     # both forms in one step
        assert fits[live].any() and (~fits).any()
    assert np.array_equal(got[None][fits], got[10 ** 6][fits])
    assert np.array_equal(got[None][~fits & live], got[0][~fits & live])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_paged_decode_equals_contiguous_decode(device, dtype):
    """The same keys in a contiguous cache (Hkv, ctx, D) and scattered over pool blocks give the same
    decode output, bit for bit: the paged op's form chosen by the sequence's length (short up to
    max_keys, split beyond) is the one the contiguous op chooses (record(n_keys=length)), and
    split-key everywhere (short_keys=0) is its split-key form."""
    rng = np.random.default_rng(5)
    hq, hkv, d, max_blocks, n_blocks = 9, 3, 64, 16, 40
    ctx = max_blocks * BS
    (kp, vp), (kt, vt) = _pools(device, rng, dtype, n_blocks, hkv, d)
    qkv = rng.standard_normal((1, hq + 2 * hkv, d))
    qt = put(device, qkv, dtype)
    for n in (1, BS, 100, 129, 250):
        tables = _tables(rng, [n], n_blocks, max_blocks)
        kc = np.zeros((hkv, ctx, d))
        vc = np.zeros((hkv, ctx, d))
        kc[:, :n], vc[:, :n] = _gather(kp, tables[0], n), _gather(vp, tables[0], n)
        out_c, out_p = empty(device, (1, hq * d), dtype), empty(device, (1, hq * d), dtype)
        cont = nn.attention(device, qt, put(device, kc, dtype), put(device, vc, dtype), out_c,
                            step_buf(device, n - 1, 1), n_q_heads=hq, n_kv_heads=hkv, head_dim=d, ctx=ctx,
                            scale=0.125, min_chunk=32, split_wg=8)
        for short_keys in (None, 0):          # the form by the sequence's length; split-key always
            paged = ap.paged_decode(device, qt, kt, vt, out_p, put(device, np.array([n], np.uint32), "u32"),
                                    put(device, tables, "u32"), n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                                    max_seqs=1, max_blocks=max_blocks, scale=0.125, min_chunk=32, split_wg=8,
                                    short_keys=short_keys)
            assert paged.max_keys == (cont.max_keys if short_keys is None else 0)
            n_keys = n if short_keys is None else None      # the contiguous op's choice of form
            for op in (paged, cont):
                b = device.batch()
                op.record(b, n_keys=n_keys if op is cont else n)
                device.submit(b)
            a, p = get(device, out_c), get(device, out_p)
            ref = nn_ref.causal_attention(rounded(qkv, dtype)[:, :hq], kc[:, :n], vc[:, :n], n - 1, 0.125)
            np.testing.assert_allclose(p, ref, **TOL[dtype])
            assert np.array_equal(a, p), f"n={n} {short_keys=}: max |diff| {np.abs(a - p).max()}"


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (24, 1.5)])
def test_chunked_prefill_through_the_pool(device, dtype, window, softcap):
    """Two sequences managed by KVPool (the second shares the first's full prompt blocks), prefilled in
    chunks of 20 rows: paged_kv_write then paged_prefill per chunk, then one batched decode step; every
    output matches causal attention over the whole sequence, and each chunk's rows equal those of
    nn.attention's causal kernel over a contiguous cache holding the same keys."""
    rng = np.random.default_rng(7 + window)
    hq, hkv, d, max_blocks, chunk, bs = 8, 2, 32, 8, 20, 8
    pool = KVPool(24, bs)
    prompts = {"a": list(range(50)), "b": list(range(40)) + [99] * 13}
    mag = 3.0 if softcap else 1.0
    xs = {s: rng.standard_normal((len(p) + 1, hq + 2 * hkv, d)) * mag for s, p in prompts.items()}
    xs["b"][:40] = xs["a"][:40]              # same tokens, same (already rotated) rows
    shape = (pool.n_blocks, bs, hkv, d)
    kt, vt = empty(device, shape, dtype, fill=0), empty(device, shape, dtype, lead=8, fill=0)
    qt, out = empty(device, (chunk, hq + 2 * hkv, d), dtype, lead=4), empty(device, (chunk, hq * d), dtype)
    slots, table, step = put(device, np.zeros(chunk, np.uint32), "u32"), put(device, np.zeros(max_blocks, np.uint32),
                                                                          "u32"), step_buf(device, 0, chunk)
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    write = ap.paged_kv_write(device, qt, kt, vt, slots, **kw)
    attend = ap.paged_prefill(device, qt, kt, vt, out, step, table, **kw, max_blocks=max_blocks, scale=d ** -0.5,
                              window=window, softcap=softcap)
    full = {}
    for s, x in xs.items():
        xr = rounded(x, dtype)
        full[s] = nn_ref.causal_attention(xr[:, :hq], xr[:, hq:hq + hkv].transpose(1, 0, 2),
                                          xr[:, hq + hkv:].transpose(1, 0, 2), 0, d ** -0.5, window=window,
                                          softcap=softcap)
    for s, prompt in prompts.items():
        pos = pool.add_sequence(s, prompt)
        assert pos == (0 if s == "a" else 40)            # b reuses a's 5 full blocks
        pool.reserve(s, len(prompt) + 1)
        device.write(table.buf, np.array(pool.block_table(s) + [0] * (max_blocks - len(pool.block_table(s))),
                                         np.uint32), table.offset)
        while pos < len(prompt):
            n = min(chunk, len(prompt) - pos)
            device.write(qt.buf, np.ascontiguousarray(xs[s][pos:pos + n]).astype(NP[dtype]), qt.offset)
            device.write(slots.buf, np.array(pool.slots(s, pos, n) + [ap.SKIP_SLOT] * (chunk - n), np.uint32),
                         slots.offset)
            set_step(device, step, pos, n)
            run(device, write, attend)
            np.testing.assert_allclose(get(device, out)[:n], full[s][pos:pos + n], **TOL[dtype], err_msg=f"{s}@{pos}")
            pool.append_tokens(s, prompt[pos:pos + n])
            pos += n
    assert pool.block_table("b")[:5] == pool.block_table("a")[:5]
    # one decode step for both: the new token's k/v written, then the batched decode
    q2 = put(device, np.stack([xs["a"][50], xs["b"][53]]), dtype)
    sl2 = put(device, np.array(pool.slots("a", 50, 1) + pool.slots("b", 53, 1), np.uint32), "u32")
    tabs = np.zeros((2, max_blocks), np.uint32)
    for i, s in enumerate("ab"):
        tabs[i, :len(pool.block_table(s))] = pool.block_table(s)
    out2 = empty(device, (2, hq * d), dtype)
    run(device, ap.paged_kv_write(device, q2, kt, vt, sl2, **kw),
        ap.paged_decode(device, q2, kt, vt, out2, put(device, np.array([51, 54], np.uint32), "u32"),
                        put(device, tabs, "u32"), **kw, max_seqs=2, max_blocks=max_blocks, scale=d ** -0.5,
                        window=window, softcap=softcap))
    np.testing.assert_allclose(get(device, out2), np.stack([full["a"][50], full["b"][53]]), **TOL[dtype])


def test_decode_steps_of_a_ragged_batch_from_the_pool(device):
    """Model-shaped decode steps: three sequences of different lengths joining at different steps,
    the last one reusing the first's two cached blocks (its first 8 tokens). Per step:
    KVPool.decode_inputs -> paged_rope_kv (rotate at each row's position, write the pool) ->
    paged_decode; each row matches attention over its whole rotated history."""
    assert SKIP_SLOT == ap.SKIP_SLOT
    rng = np.random.default_rng(17)
    hq, hkv, d, bs, max_seqs, max_blocks, base = 6, 2, 32, 4, 4, 8, 1000.0
    pool = KVPool(20, bs)
    hist = {s: rng.standard_normal((n, hq + 2 * hkv, d)) for s, n in (("a", 17), ("b", 17), ("c", 12))}
    hist["b"][:8] = hist["a"][:8]          # b's first two blocks are a's (same tokens)
    toks = {"a": list(range(17)), "b": list(range(8)) + [50] * 9, "c": [7] * 12}
    kt, vt = empty(device, (20, bs, hkv, d), fill=0), empty(device, (20, bs, hkv, d), fill=0)
    qt, out = empty(device, (max_seqs, hq + 2 * hkv, d)), empty(device, (max_seqs, hq * d))
    ins = {n: put(device, np.zeros(max_seqs * (max_blocks if n == "tables" else 1), np.uint32), "u32")
           for n in ("positions", "slots", "lens", "tables")}
    kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    rope = ap.paged_rope_kv(device, qt, kt, vt, ins["positions"], ins["slots"], **kw, base=base)
    attend = ap.paged_decode(device, qt, kt, vt, out, ins["lens"], ins["tables"], **kw, max_seqs=max_seqs,
                             max_blocks=max_blocks, scale=d ** -0.5, min_chunk=8)
    running = []
    joins = {0: ("a", 1, 0), 5: ("c", 1, 0), 9: ("b", 9, 8)}   # (seq, prompt tokens, cached)
    for step in range(18):
        if step in joins:                  # b joins once a's first two blocks are cached
            s, n, cached = joins[step]
            assert pool.add_sequence(s, toks[s][:n]) == cached
            running.append(s)
        running = [s for s in running if pool.num_tokens(s) < len(toks[s])]
        for s in running:
            pool.reserve(s, pool.num_tokens(s) + 1)
        inp = pool.decode_inputs(running, max_seqs, max_blocks)
        for n, t in ins.items():
            device.write(t.buf, np.array(inp[n], np.uint32), t.offset)
        rows = np.zeros((max_seqs, hq + 2 * hkv, d))
        for i, s in enumerate(running):
            rows[i] = hist[s][pool.num_tokens(s)]
        device.write(qt.buf, rows.astype(np.float32), qt.offset)
        run(device, rope, attend)
        got = get(device, out)
        for i, s in enumerate(running):
            n = pool.num_tokens(s) + 1
            rot = nn_ref.rope(hist[s][:n], np.arange(n), n_heads=hq + hkv, rot_dim=d, base=base, neox=False)
            ref = nn_ref.causal_attention(rot[n - 1:n, :hq], rot[:, hq:hq + hkv].transpose(1, 0, 2),
                                          rot[:, hq + hkv:].transpose(1, 0, 2), n - 1, d ** -0.5)
            np.testing.assert_allclose(got[i], ref[0], **TOL["f32"], err_msg=f"step {step} seq {s}")
            pool.append_tokens(s, [toks[s][n - 1]])
    pool.check()
    assert {s: pool.num_tokens(s) for s in "abc"} == {"a": 17, "b": 17, "c": 12}
    assert pool.block_table("b")[:2] == pool.block_table("a")[:2]


def test_prefill_rows_equal_the_contiguous_causal_kernel(device):
    """A chunk at pos0 > 0 through a shuffled table gives bit for bit nn.attention's causal output."""
    rng = np.random.default_rng(9)
    hq, hkv, d, t, pos0, max_blocks, n_blocks = 9, 3, 64, 30, 37, 8, 12
    n = pos0 + t
    (kp, vp), (kt, vt) = _pools(device, rng, "f32", n_blocks, hkv, d)
    tables = _tables(rng, [n], n_blocks, max_blocks)
    qkv = rng.standard_normal((t, hq + 2 * hkv, d))
    qt = put(device, qkv)
    kc, vc = _gather(kp, tables[0], n), _gather(vp, tables[0], n)
    out_c, out_p = empty(device, (t, hq * d)), empty(device, (t, hq * d))
    step = step_buf(device, pos0, t)
    run(device, nn.attention(device, qt, put(device, kc), put(device, vc), out_c, step, n_q_heads=hq, n_kv_heads=hkv,
                             head_dim=d, ctx=n, scale=0.125),
        ap.paged_prefill(device, qt, kt, vt, out_p, step, put(device, tables[0], "u32"), n_q_heads=hq,
                         n_kv_heads=hkv, head_dim=d, max_blocks=max_blocks, scale=0.125))
    np.testing.assert_allclose(get(device, out_p), nn_ref.causal_attention(qkv[:, :hq], kc, vc, pos0, 0.125),
                               **TOL["f32"])
    assert np.array_equal(get(device, out_c), get(device, out_p))


def test_shape_errors_are_clear(device):
    limit = device.limits["max-storage-buffer-binding-size"]
    assert ap.max_pool_blocks(device, BS, 3, 64, "f16") == limit // (BS * 3 * 64 * 2)
    kt, vt = empty(device, (4, BS, 2, 32)), empty(device, (4, BS, 2, 32))
    qt, out = empty(device, (2, 8, 32)), empty(device, (2, 4 * 32))
    lens, tabs = put(device, np.zeros(2, np.uint32), "u32"), put(device, np.zeros(2, np.uint32), "u32")
    with pytest.raises(ValueError, match="tables"):
        ap.paged_decode(device, qt, kt, vt, out, lens, tabs, n_q_heads=4, n_kv_heads=2, head_dim=32, max_seqs=2,
                        max_blocks=4, scale=1.0)
    with pytest.raises(ValueError, match="pool heads"):
        ap.paged_kv_write(device, qt, kt, vt, lens, n_q_heads=2, n_kv_heads=3, head_dim=32)
    with pytest.raises(ValueError, match="must not share"):
        ap.paged_prefill(device, qt, kt, vt, qt, step_buf(device, 0, 2), tabs, n_q_heads=4, n_kv_heads=2,
                         head_dim=32, max_blocks=2, scale=1.0)


def test_paged_attention_sinks(device):
    """gpt-oss's per-head sinks through the pool: a ragged decode batch (short and split-key forms)
    and a chunk's causal prefill through a block table, against numpy."""
    rng = np.random.default_rng(9)
    hq, hkv, d, max_blocks, n_blocks, lens = 8, 2, 32, 16, 40, [1, 17, 100, 250]
    (kp, vp), (kt, vt) = _pools(device, rng, "f32", n_blocks, hkv, d)
    sinks = rng.uniform(-1.0, 3.0, hq).astype(np.float32)
    st = put(device, sinks, "f32")
    qkv = rng.standard_normal((len(lens), hq + 2 * hkv, d))
    tables = _tables(rng, lens, n_blocks, max_blocks)
    out = empty(device, (len(lens), hq * d))
    op = ap.paged_decode(device, put(device, qkv, "f32"), kt, vt, out, put(device, np.array(lens, np.uint32), "u32"),
                         put(device, tables, "u32"), n_q_heads=hq, n_kv_heads=hkv, head_dim=d, max_seqs=len(lens),
                         max_blocks=max_blocks, scale=0.125, min_chunk=32, split_wg=8, sinks=st)
    run(device, op)
    ref = _decode_ref(qkv, kp, vp, tables, lens, hq, 0.125, sinks=sinks)
    np.testing.assert_allclose(get(device, out), ref, **TOL["f32"])
    t, pos0 = 30, 70
    pre = rng.standard_normal((t, hq + 2 * hkv, d))
    out = empty(device, (t, hq * d))
    run(device, ap.paged_prefill(device, put(device, pre, "f32"), kt, vt, out, step_buf(device, pos0, t),
                                 put(device, tables[3], "u32"), n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                                 max_blocks=max_blocks, scale=0.125, sinks=st))
    n = pos0 + t
    ref = nn_ref.causal_attention(pre[:, :hq], _gather(kp, tables[3], n), _gather(vp, tables[3], n), pos0, 0.125,
                                  sinks=sinks)
    np.testing.assert_allclose(get(device, out), ref, **TOL["f32"])
