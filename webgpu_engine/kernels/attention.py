"""Host functions of attention over contiguous KV caches (shaders/attention.wgsl,
attention_flash.wgsl): causal prefill, split-key decode (with a one-dispatch short form) and
BERT's bidirectional attention. qkv and the caches are bound read-only, so `out` must live in
another buffer (WebGPU forbids one buffer bound read-only and read_write in the same dispatch).
"""
from __future__ import annotations

from ..gpu import Device
from ..gpu.shaders import load_shader_source
from .common import Op, Ring, Tensor, act_header, check, params, ring_header, ring_query
from .kv_quant import QuantCache, check_quant_caches
from .nn_base import WG, _act, _grid, _op, _qkv_heads, _step_entry, _vec_entry, _window

_MAX_LANE_DIMS = 256      # attention: query dims one lane holds (heads_per_lane * head_dim)


def decode_splits(ctx: int, *, min_chunk: int = 32, max_splits: int = 128) -> tuple[int, int]:
    """(keys per split, number of splits) of the decode path for a cache of ctx rows: chunks of at
    least `min_chunk` keys (per-device tuning), at most `max_splits` partials to combine."""
    chunk = max(min_chunk, -(-ctx // max_splits))
    return chunk, -(-ctx // chunk)


def decode_geometry(dev: Device, ctx: int, n_hg: int, min_chunk: int | None, max_splits: int,
                    split_wg: int | None) -> tuple[int, int, int, int]:
    """The decode attention's (keys per split, splits, split workgroup size, short-form bound) over
    ctx keys for n_hg head groups, for the contiguous and the paged kernels alike. CPU adapters
    (lavapipe) default to 128-key splits in workgroups of 8 (fewer partials, spread over cores), others
    to 32 and 64. The short form (one lane per head group over all keys, no partials) serves live keys
    that fit the splits one workgroup holds: one split on a GPU, where the lanes of a workgroup run in
    parallel; SWG / head groups of them on a CPU adapter, whose lanes take turns (there several
    splits in one workgroup gain nothing)."""
    cpu = dev.info.adapter_type.upper() == "CPU"
    chunk, n_splits = decode_splits(ctx, min_chunk=min_chunk or (128 if cpu else 32), max_splits=max_splits)
    swg = split_wg or (8 if cpu else WG)
    return chunk, n_splits, swg, chunk * (max(1, swg // n_hg) if cpu else 1)


def _attn_header(dt: str, head_dim: int, g: int = 1, split_wg: int = WG, packed: bool = False,
                 windowed: bool = False, capped: bool = False, kv: tuple = ("kc", "vc"),
                 quant: QuantCache | None = None, ring: Ring | None = None, sinks: bool = False) -> str:
    """Constants plus the state of g heads unrolled into vec4 registers (see attention.wgsl), and
    attention_common.wgsl: the online softmax's part that attention.wgsl and attention_paged.wgsl share.
    packed: f16 keys and values are read as vec4<u32> (8 halves per load; kr, vr even).
    kv: the arrays keys and values are read from (attention_flash.wgsl: its workgroup tiles).
    quant: the caches are quantised (kernels/kv_quant.py: q8_0 or q4_0, of quant.rows head rows),
    read through kcq / vcq as the unrolled reads (unless kv names other arrays) and as kc_at / vc_at
    (row-vec4 r, dequantised: the flash tiles). ring: a sliding window with sinks (common.Ring).
    sinks: a learned logit per q head in every softmax's denominator (gpt-oss; binding 8, (Hq,) f32):
    sink_l(h, m) = exp(sinks[h] - m) joins a running sum l of max m; 0 without (the same bits)."""
    n = head_dim // 4
    r, gs = range(n), range(g)
    sv = "f32" if g == 1 else f"vec{g}<f32>"
    comp = (lambda v, j: v) if g == 1 else (lambda v, j: f"{v}[{j}]")
    out = [act_header(dt) + ring_header(ring), f"const D4: u32 = {n}u;", f"const G: u32 = {g}u;",
           f"const SWG: u32 = {split_wg}u;",
           f"const WINDOWED: bool = {str(bool(windowed)).lower()};", f"const CAPPED: bool = {str(bool(capped)).lower()};",
           f"alias sv = {sv};",
           "fn sv_get(v: sv, g: u32) -> f32 { return " + ("v" if g == 1 else "v[g]") + "; }",
           "var<private> sink_h0: u32;      // the first q head of the lane's heads (sink_l)",
           "@group(0) @binding(8) var<storage, read> sinks: array<f32>;   // (Hq) sink logits\n"
           "fn sink_l(h: u32, m: f32) -> f32 { return exp(sinks[h] - m); }" if sinks else
           "fn sink_l(h: u32, m: f32) -> f32 { return 0.0; }"]
    out += [f"var<private> q{j}_{i}: vec4<f32>;\nvar<private> a{j}_{i}: vec4<f32>;" for j in gs for i in r]
    out.append("fn load_q(qb: u32, qs: u32) {\n" + "".join(
        f"  q{j}_{i} = vec4<f32>(qkv[qb + {j}u * qs + {i}u]) * p.scale; a{j}_{i} = vec4<f32>(0.0);\n"
        for j in gs for i in r) + "  m_run = sv(-3.0e38); l_run = sv(0.0);\n}")
    # the query alone (RING's two: the row's and the sinks'); without a ring qsk is never read, so
    # that the kernels bind no sink queries
    for name, arr in (("set_q", "qkv"), ("set_q_sink", "qsk" if ring else None)):
        out.append(f"fn {name}(qb: u32, qs: u32) {{\n" + "".join(
            f"  q{j}_{i} = vec4<f32>({arr}[qb + {j}u * qs + {i}u]) * p.scale;\n"
            for j in gs for i in r if arr) + "}")
    quant_reads = quant is not None and kv == ("kc", "vc")
    if quant:
        out.append(quant.header(head_dim) + "".join(
            f"fn {c}_at(r: u32) -> vec4<f32> {{\n  let i = r % D4;\n"
            f"  return kv_unpack({c}q[r / KV_VPW], r % KV_VPW)"
            f" * unpack2x16float({c}q[KV_SOFF + (r / D4) * SW + i / 16u])[(i / 8u) % 2u];\n}}\n"
            for c in ("kc", "vc")))
    elif kv != ("kc", "vc"):       # the flash tiles' loads
        out.append("".join(f"fn {c}_at(r: u32) -> vec4<f32> {{ return vec4<f32>({c}[r]); }}\n" for c in ("kc", "vc")))

    blocks = [range(b, min(b + 8, n)) for b in range(0, n, 8)]      # quantised: the vec4s of one scale
    per = quant.kind.vec4s_per_word if quant else 1

    def scale(name, b):          # a quantised block b's scale (an f16 pair per word)
        return f"s{name}{b // 2}.{'xy'[b % 2]}"

    def loads(name, buf, base):
        if quant_reads:          # base = row * D4 (the caches sit at offset 0); each word loaded once,
            #                      its codes as integers: the callers apply each block's scale once (qk, acc_add)
            word0 = base if per == 1 else f"{base} / {per}u"
            return ("".join(f"  let s{name}{w} = unpack2x16float({buf}q[KV_SOFF + ({base} / D4) * SW + {w}u]);\n"
                            for w in range(-(-n // 16)))
                    + "".join(f"  let {name}w{j} = {buf}q[{word0} + {j}u];\n" for j in range(n // per))
                    + "".join(f"  let {name}{i} = kv_unpack({name}w{i // per}, {i % per}u);\n" for i in r))
        if not packed:
            return "".join(f"  let {name}{i} = vec4<f32>({buf}[{base} + {i}u]);\n" for i in r)
        return "".join(f"  let w{i} = {buf}p[{base} / 2u + {i}u];\n"
                       f"  let {name}{2 * i} = vec4<f32>(unpack2x16float(w{i}.x), unpack2x16float(w{i}.y));\n"
                       f"  let {name}{2 * i + 1} = vec4<f32>(unpack2x16float(w{i}.z), unpack2x16float(w{i}.w));\n"
                       for i in range(n // 2))
    if quant_reads:
        dots = [" + ".join(f"({' + '.join(f'dot(q{j}_{i}, k{i})' for i in rb)}) * {scale('k', b)}"
                           for b, rb in enumerate(blocks)) for j in gs]
    else:
        dots = [" + ".join(f"dot(q{j}_{i}, k{i})" for i in r) for j in gs]
    out.append("fn qk(kr: u32) -> sv {\n" + loads("k", kv[0], "kr") + "  return sv(" + ", ".join(dots) + ");\n}")
    out.append("fn acc_scale(c: sv) {\n" + "".join(f"  a{j}_{i} *= {comp('c', j)};\n" for j in gs for i in r)
               + "}")
    if quant_reads:              # each block's weights scaled once
        adds = "".join(f"  let wt{b} = wt * {scale('v', b)};\n" + "".join(
            f"  a{j}_{i} += {comp(f'wt{b}', j)} * v{i};\n" for j in gs for i in rb) for b, rb in enumerate(blocks))
    else:
        adds = "".join(f"  a{j}_{i} += {comp('wt', j)} * v{i};\n" for j in gs for i in r)
    out.append("fn acc_add(wt: sv, vr: u32) {\n" + loads("v", kv[1], "vr") + adds + "}")
    cases = [(j * n + i, f"a{j}_{i}") for j in gs for i in r]
    out.append("fn acc_get(g: u32, d: u32) -> vec4<f32> {\n  switch g * D4 + d {\n" + "".join(
        f"    case {c}u: {{ return {v}; }}\n" for c, v in cases[:-1])
        + f"    default: {{ return {cases[-1][1]}; }}\n  }}\n}}")
    out.append(load_shader_source("attention_common.wgsl"))    # the online softmax's shared part
    return "\n".join(out) + "\n"


def check_attention(k, qkv, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, rows, window, softcap):
    """The checks every attention op makes of its heads, rows and buffers (the caches: contiguous or
    paged, in the activations' dtype or quantised u32 words); (activation dtype, heads per qkv row)."""
    dt = _act(k, qkv, out) if k_cache.dtype == "u32" else _act(k, qkv, k_cache, v_cache, out)
    n_rows, heads = _qkv_heads(k, qkv, head_dim)
    check(rows <= n_rows, k, f"qkv has {n_rows} rows, {rows} dispatched")
    check(head_dim % 4 == 0, k, f"head_dim {head_dim} must be a multiple of 4")
    check(n_kv_heads > 0 and n_q_heads % n_kv_heads == 0, k,
          f"n_q_heads {n_q_heads} must be a multiple of n_kv_heads {n_kv_heads}")
    check(heads >= n_q_heads + 2 * n_kv_heads, k, f"qkv rows have {heads} heads, need {n_q_heads}+2*{n_kv_heads}")
    check(out.numel >= rows * n_q_heads * head_dim, k, f"out {out.shape} is smaller than ({rows}, Hq*D)")
    check(all(out.buf is not t.buf for t in (qkv, k_cache, v_cache)), k,
          "out must not share a buffer with qkv or the caches (they are bound read-only)")
    check(window >= 0 and softcap >= 0, k, f"window {window} and softcap {softcap} must be >= 0")
    return dt, heads


def check_sinks(dev: Device, k: str, sinks: Tensor | None, n_q_heads: int) -> dict:
    """{8: sinks' binding} of an attention with sinks ((Hq,) f32), {} without."""
    if sinks is None:
        return {}
    check(sinks.dtype == "f32" and sinks.numel == n_q_heads, k, f"sinks {sinks.shape}/{sinks.dtype} must be "
          f"({n_q_heads},) f32")
    return {8: _vec_entry(dev, sinks, k)}


def _heads_per_lane(k: str, group: int, head_dim: int, g: int | None) -> int:
    """The q heads of one kv head a lane serves: `g` if given, else the most (up to 4) dividing the
    group within _MAX_LANE_DIMS query dims (the paged kernels choose the same way)."""
    g = g or max(d for d in (1, 2, 3, 4) if group % d == 0 and (d == 1 or d * head_dim <= _MAX_LANE_DIMS))
    check(group % g == 0, k, f"heads_per_lane {g} must divide Hq/Hkv = {group}")
    check(g == 1 or g * head_dim <= _MAX_LANE_DIMS, k,
          f"heads_per_lane {g} x head_dim {head_dim} exceeds {_MAX_LANE_DIMS} dims per lane")
    return g


def flash_attention(dev: Device) -> bool:
    """Whether prefill attention stages key tiles in workgroup memory (shaders/attention_flash.wgsl):
    where the matmuls run the GPU kernel family (kernels/matmul/config.py kernel_family). The CPU family
    keeps attn_causal, so that CPU adapters run exactly what they ran before the families."""
    from .matmul import is_cpu_adapter, kernel_family     # the matmul package does not import this module
    family = kernel_family(dev)
    return family == "gpu" or family == "tuned" and not is_cpu_adapter(dev)


def attention(dev: Device, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, step, *,
              n_q_heads: int, n_kv_heads: int, head_dim: int, ctx: int, scale: float,
              max_t: int | None = None, min_chunk: int | None = None, max_splits: int = 128,
              heads_per_lane: int | None = None, split_wg: int | None = None,
              causal: bool = False, window: int = 0, softcap: float = 0.0, decode_rows: bool = False,
              ring: Ring | None = None, q_sink: Tensor | None = None, sinks: Tensor | None = None) -> Op:
    """Causal attention of the q heads of qkv (T, Hq+2Hkv, D) over the caches (Hkv, ctx, D), which
    already hold this step's keys: query t (position pos0+t) sees keys 0..pos0+t; head h reads kv
    head h // (Hq/Hkv). out (T, Hq*D). Rows t >= step.n_new are skipped (n_new 0: all T rows).
    max_t (default T) rows are dispatched; max_t == 1 takes the split-key decode path (2 dispatches),
    sized once for ctx: splits past the live context exit at once; `causal` keeps the prefill
    kernel for one row too (a query's result then does not depend on how many rows run with it:
    every query folds its keys in the same 16-key blocks from key 0); `decode_rows`: each of the
    max_t rows as the decode path attends for one row at its position (the short form up to
    op.max_keys keys, split-key beyond, chosen per row: a row's output equals that decode step's;
    record(n_keys=pos0 + T) leaves out the combine when no row needs it). `window` > 0: a sliding
    window, query at position p sees keys p-window+1..p only (Mistral, Gemma's local layers);
    `softcap` > 0: scores s become softcap*tanh(s/softcap) (Gemma 2). f16 caches are read 8 halves
    per load when head_dim % 8 == 0 and the cache offsets are 16-byte aligned.
    Per-device tuning: heads_per_lane (q heads of one kv head served by one lane, which loads each
    key once for them; default the largest divisor of Hq/Hkv up to 4); decode: min_chunk /
    max_splits (keys per split) and split_wg (workgroup size), defaults in decode_geometry.
    `ring` (common.Ring): WebLLM's sliding window with sinks over a cache that is a ring past ctx;
    q_sink (T, Hq, D): the sink queries nn.rope_kv wrote with the same ring (not with `window`, and
    prefill takes attn_causal: no flash tiles). `sinks` (Hq,) f32: a logit per q head added to each
    softmax's denominator (gpt-oss's attention sinks; no value rows)."""
    k = "attention"
    rows = _qkv_heads(k, qkv, head_dim)[0]
    t_max = rows if max_t is None else int(max_t)
    check(0 < t_max <= rows, k, f"max_t={max_t} must be in 1..{rows}")
    dt, heads = check_attention(k, qkv, k_cache, v_cache, out, n_q_heads, n_kv_heads, head_dim, t_max, window,
                                softcap)
    quant = None                 # a quantised cache (kernels/kv_quant.py): its block type and rows
    if k_cache.dtype == "u32":
        quant = check_quant_caches(k, (k_cache, v_cache), n_kv_heads * ctx, head_dim)
    else:
        for c in (k_cache, v_cache):
            check(c.numel == n_kv_heads * ctx * head_dim, k,
                  f"cache {c.shape} must be (Hkv={n_kv_heads}, ctx={ctx}, D={head_dim})")
    check(ring is None or window == 0, k, "a ring replaces the model's own sliding window")
    sink = ring_query(k, ring, q_sink, t_max, n_q_heads, head_dim, ctx)     # binding 7, with a ring
    sinked = check_sinks(dev, k, sinks, n_q_heads)                           # {8: sinks} or {}
    owner = out.buf.owner
    group = n_q_heads // n_kv_heads
    (qe, qo), (oe, oo) = _window(dev, qkv, k, 4), _window(dev, out, k, 4)
    if quant:
        (ke, ko), (ve, vo) = ((k_cache.buf, 0, k_cache.nbytes), 0), ((v_cache.buf, 0, v_cache.nbytes), 0)
    else:
        (ke, ko), (ve, vo) = _window(dev, k_cache, k, 4), _window(dev, v_cache, k, 4)
    # a lane holds G heads' q and accumulator in unrolled vec4 registers; lavapipe computed wrong
    # results from G*D = 384 on (Llama-3's G = 4 x 128, Gemma's 2 x 256), so wide heads share less
    g = _heads_per_lane(k, group, head_dim, heads_per_lane)
    # f16 caches are read 8 halves per load when head rows and cache offsets are 16-byte aligned
    packed = dt == "f16" and not quant and head_dim % 8 == 0 and ko % 2 == 0 and vo % 2 == 0
    if (t_max > 1 or causal) and not decode_rows:
        n_blk = -(-t_max // WG)
        par = params(dev, [t_max, n_q_heads, group, heads, ctx, 0, 0, float(scale), qo, ko, vo, oo,
                           n_blk, int(window), float(softcap), 0], owner=owner, label=k)
        if flash_attention(dev) and ring is None:   # the same folds, keys and values staged in workgroup memory
            header = _attn_header(dt, head_dim, g, windowed=window > 0, capped=softcap > 0, kv=("ksh", "vsh"),
                                  quant=quant, sinks=bool(sinked))
            return _op(dev, k, "attention_flash.wgsl", "attn_flash", header + load_shader_source("attention.wgsl"),
                       par, {**dict(enumerate([_step_entry(step), qe, ke, ve, oe], 1)), **sinked},
                       n_blk * (n_q_heads // g) * WG)
        return _op(dev, k, "attention.wgsl", "attn_causal",
                   _attn_header(dt, head_dim, g, packed=packed, windowed=window > 0, capped=softcap > 0,
                                quant=quant, ring=ring, sinks=bool(sinked)),
                   par, {**dict(enumerate([_step_entry(step), qe, ke, ve, oe], 1)), **dict(zip([7], sink)),
                         **sinked}, n_blk * (n_q_heads // g) * WG)
    n_hg = n_q_heads // g
    chunk, n_splits, swg, max_keys = decode_geometry(dev, ctx, n_hg, min_chunk, max_splits, split_wg)
    T = t_max if decode_rows else 1
    part = dev.buffer(T * n_q_heads * n_splits * (head_dim // 4 + 1) * 16, owner=owner, label="attention.partials")
    par = params(dev, [T, n_q_heads, group, heads, ctx, chunk, n_splits, float(scale), qo, ko, vo, oo,
                       0, int(window), float(softcap), max_keys if decode_rows else 0], owner=owner, label=k)
    header = _attn_header(dt, head_dim, g, swg, packed, windowed=window > 0, capped=softcap > 0, quant=quant,
                          ring=ring, sinks=bool(sinked))
    entries = [_step_entry(step), qe, ke, ve, (part, 0, part.size), oe] + sink
    pipe = dev.pipeline("attention.wgsl", "attn_split", header=header)
    op = Op(name=k, buffers=[par])
    x, y = _grid(-(-T * n_splits * n_q_heads // g // swg) * WG, k)
    op.add(pipe, dev.bind(pipe, {**dict(enumerate([par] + entries)), **sinked}), x, y)
    comb = dev.pipeline("attention.wgsl", "attn_combine", header=header)
    x, y = _grid(T * n_q_heads * head_dim // 4, k)
    op.add(comb, dev.bind(comb, {**dict(enumerate([par, _step_entry(step), (part, 0, part.size), oe])), **sinked}),
           x, y)
    op.buffers.append(part)
    op.max_keys = max_keys
    if decode_rows:                  # every row short (the longest's keys <= max_keys): no combine
        op.short = op.dispatches[:1]
        return op
    one = dev.pipeline("attention.wgsl", "attn_decode1", header=header)
    x, y = _grid(-(-n_hg // swg) * WG, k)
    binds = {**dict(enumerate([par, _step_entry(step), qe, ke, ve, oe])), **dict(zip([7], sink)), **sinked}
    op.short = [(one, dev.bind(one, binds), x, y, 1)]
    return op


def attention_bidir(dev: Device, qkv: Tensor, lengths: Tensor, out: Tensor, *, batch: int, seq: int,
                    n_heads: int, head_dim: int, scale: float, queries_per_lane: int | None = None,
                    window: int = 0, lanes: int | None = None) -> Op:
    """BERT self-attention over B sequences padded to S: qkv (B*S, 3*H*D) rows [q | k | v];
    key j of sequence b is visible iff j < lengths[b] (u32). out (B*S, H*D); padded query rows
    get finite values. queries_per_lane (1..4): consecutive queries one lane serves, loading each
    key once for them; lanes (8..64): invocations per workgroup, a workgroup per (sequence, head,
    block of lanes x queries_per_lane queries). Defaults: 2 x 64 on GPUs; 4 x 8 on CPU adapters,
    whose lanes take turns and load keys lane by lane, so a short sequence's block wastes few
    lanes and each key load serves 4 queries (lavapipe, MiniLM 32 x 48: 3.2x less CPU time; a
    query's sums are the same either way). window > 0: query i also sees only keys with
    |j - i| <= window (ModernBERT's local layers; one query per lane then)."""
    k = "attention_bidir"
    dt = _act(k, qkv, out)
    rows = batch * seq
    check(head_dim % 4 == 0, k, f"head_dim {head_dim} must be a multiple of 4")
    check(qkv.numel == rows * 3 * n_heads * head_dim, k,
          f"qkv {qkv.shape} must be (B*S={rows}, 3*H*D={3 * n_heads * head_dim})")
    check(out.numel == rows * n_heads * head_dim, k, f"out {out.shape} must be (B*S, H*D)")
    check(out.buf is not qkv.buf, k, "out must not share a buffer with qkv (bound read-only)")
    check(lengths.numel >= batch, k, f"lengths {lengths.shape} must hold B={batch} entries")
    queries_per_lane = queries_per_lane or (4 if dev.info.cpu else 2)
    lanes = lanes or (8 if dev.info.cpu else WG)
    check(1 <= queries_per_lane <= 4, k, f"queries_per_lane must be 1..4, got {queries_per_lane}")
    check(window >= 0, k, f"window must be >= 0, got {window}")
    queries_per_lane = 1 if window else min(queries_per_lane, seq)     # the kernel needs S >= queries per lane
    (qe, qo), (oe, oo) = _window(dev, qkv, k, 4), _window(dev, out, k, 4)
    check(lanes in (8, 16, 32, 64), k, f"lanes must be 8, 16, 32 or 64, got {lanes}")
    n_blk = -(-seq // (lanes * queries_per_lane))
    par = params(dev, [rows, n_heads, 1, 3 * n_heads, seq, 0, 0, float(scale), qo, qo, qo, oo,
                       n_blk, int(window), 0, 0], owner=out.buf.owner, label=k)
    # the qkv window is bound as q, k and v source alike (the kernel shares code with attn_causal)
    header = _attn_header(dt, head_dim, queries_per_lane, split_wg=lanes, windowed=window > 0)
    return _op(dev, k, "attention.wgsl", "attn_bidir", header, par,            # a workgroup per block
               [_vec_entry(dev, lengths, k), qe, qe, qe, oe], batch * n_blk * n_heads * WG)
