// sampling: one token id from a logits row, entirely on the GPU, in barrier-free passes.
//   z[i]  = (penalties(logits[i]) + bias[i]) / temperature
//           penalties: HF repetition penalty on seen tokens (prompt + generated: positive logits
//           divided, negative multiplied), then OpenAI frequency/presence over generated counts.
//   greedy (mode 0): token = argmax z (lowest index on ties, like numpy.argmax).
//   sample (mode 1): u = hash(seed, counter); top-k, top-p, then min-p (HF order; top-p over the
//           renormalised top-k set; min-p keeps z >= max z + ln(min_p), which no earlier cut
//           changes); inverse CDF with u.
//   top-k / top-p / min-p work on a candidate set: a 512-bucket histogram of (max z - z) in 1/16-nat buckets
//   picks the smallest bucket range that provably holds the top-k set and the nucleus (bucket masses
//   bounded from below); those tokens (at most CAP = 1024) are sorted (each placed at its rank:
//   value desc, index asc) and cut exactly. Exactness: exact whenever that range holds <= 1024
//   tokens; otherwise the range shrinks to the top buckets that fit (the nucleus is truncated to the
//   most probable <= 1024 tokens), and if even the first 1/16-nat bucket holds more than 1024
//   tokens, the full distribution is used. Without top-k/top-p the inverse CDF runs over the whole
//   vocabulary (exact), in slice order: slice t = ids t, t + NS, t + 2 NS, ... for t = 0 .. NS - 1.
//   logprobs: log-softmax of the RAW logits (OpenAI/vLLM semantics): the chosen token's and the top-N
//   (N <= TOPN = 20), ties to the lower index.
//   After choosing, count[token] += 1, seen[token] = 1, state.counter += 1, next_ids[0] = token.
// Passes, none with a workgroup barrier: lavapipe runs a kernel with barriers as coroutines, which
// costs milliseconds per dispatch, and it leaked host memory on every dispatch of the former
// one-workgroup kernel. Storage buffers carry the state from one dispatch to the next:
//   sample_scan (4 x 64) -> sample_merge (1) -> sample_sums (4 x 64) -> sample_cut (1)
//   [-> sample_collect (4 x 64) -> sample_rank (16 x 64): only with top-k/top-p/min-p] -> sample_finish (1)
// Greedy without logprobs takes argmax_partial + argmax_final instead (end of file).
// Header provides `act` (logits dtype).

struct Params {
  vocab: u32,
  mode: u32,              // 0 greedy, 1 sample
  top_k: u32,             // 0: off
  n_top: u32,             // top logprobs wanted (0..TOPN)
  inv_temperature: f32,
  top_p: f32,             // >= 1: off
  repetition_penalty: f32,
  frequency_penalty: f32,
  presence_penalty: f32,
  want_logprobs: u32,
  use_penalty: u32,
  use_bias: u32,
  min_p: f32,             // 0: off
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<act>;         // (V)
@group(0) @binding(2) var<storage, read> bias: array<f32>;           // (V) dense logit_bias
@group(0) @binding(3) var<storage, read_write> hist: array<u32>;     // (V): SEEN bit | generated count
@group(0) @binding(4) var<storage, read_write> scratch: array<f32>;  // (max(V, 2 NPART)) z
@group(0) @binding(5) var<storage, read_write> io: array<u32>;       // (64): [0, RES) result, SEED: seed_lo, seed_hi, counter
@group(0) @binding(6) var<storage, read_write> next_ids: array<u32>; // (>=1) the model's next input id
@group(0) @binding(7) var<storage, read_write> work: array<u32>;     // (WORK) state between passes; f32 as bits
@group(0) @binding(8) var<storage, read_write> cnt: array<atomic<u32>>;  // (NB + 1): histogram | ncand

const NS: u32 = 256u;          // slices of the vocabulary (one invocation each in the wide passes)
const NB: u32 = 512u;
const CAP: u32 = 1024u;
const INV_W: f32 = 16.0;       // buckets per nat
const TOPN: u32 = 20u;         // most top logprobs per token (MAX_TOP_LOGPROBS in protocol/rules.py)
// io words: 0 token, 1 its logprob, 2 top count, 3 the step's RNG counter, [4, 4 + TOPN) top ids,
// [4 + TOPN, 4 + 2 TOPN) top logprobs; the result is RES words. SEED, SEED + 1: the seed (lo, hi),
// SEED + 2: the RNG counter (kernels/sampling.py: RESULT_BYTES, SEED_WORD).
const TOPV: u32 = 4u + TOPN;
const RES: u32 = 4u + 2u * TOPN;
const SEED: u32 = 48u;
const NEG_INF: f32 = -3.0e38;
// hist[i]'s top bit marks token i seen (prompt or generated), the rest count its generations. One word
// per token: a seen bitset (word i / 32 read for token i) made lavapipe leak host memory per dispatch.
const SEEN: u32 = 0x80000000u;
// work layout (u32 words): per-slice partials of sample_scan (PW words each: max z, its id, raw max,
// top-TOPN raw values, their ids), per-slice sums and two reduction trees, broadcast values, the
// candidates and the sorted candidates (CAP values then CAP ids each).
const PW: u32 = 3u + 2u * TOPN;
const SUMS: u32 = NS * PW;             // [z sums | raw sums | z tree | raw tree], NS each
const STAT: u32 = SUMS + 4u * NS;      // 0 max z, 1 token, 2 raw max, 3 z sum, 4 log raw sum, 5 cut, 6 flags
const CAND: u32 = STAT + 16u;
const SORT: u32 = CAND + 2u * CAP;
const WORK: u32 = SORT + 2u * CAP;     // 16144 words: WORK_WORDS in kernels/sampling.py

// The running top-n (value, id) pairs of a scan or a merge, best first (top_clear, top_insert).
var<private> top_v: array<f32, TOPN>;
var<private> top_i: array<u32, TOPN>;

fn top_clear() {
  for (var r = 0u; r < TOPN; r++) { top_v[r] = NEG_INF; top_i[r] = 0xffffffffu; }
}

// (x, id) is kept before kept pair j where x > top_v[j], or with `ties`, x == top_v[j] and a lower id
// (a scan visits ids in increasing order, so strict > keeps the lower id on its own ties).
fn top_before(x: f32, id: u32, j: u32, ties: bool) -> bool {
  return x > top_v[j] || (ties && x == top_v[j] && id < top_i[j]);
}

// Inserts (x, id) into the first n kept pairs where it ranks among them (n <= TOPN).
fn top_insert(x: f32, id: u32, n: u32, ties: bool) {
  if (n == 0u || !top_before(x, id, n - 1u, ties)) { return; }
  var j = n - 1u;
  while (j > 0u && top_before(x, id, j - 1u, ties)) { top_v[j] = top_v[j - 1u]; top_i[j] = top_i[j - 1u]; j -= 1u; }
  top_v[j] = x; top_i[j] = id;
}

fn pcg(v: u32) -> u32 {
  let s = v * 747796405u + 2891336453u;
  let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
  return (w >> 22u) ^ w;
}

fn penalized(i: u32) -> f32 {
  var x = f32(logits[i]);
  if (p.use_penalty != 0u) {
    let h = hist[i];
    if ((h & SEEN) != 0u) {
      x = select(x * p.repetition_penalty, x / p.repetition_penalty, x > 0.0);
    }
    let c = h & ~SEEN;
    x -= f32(c) * p.frequency_penalty + select(0.0, p.presence_penalty, c > 0u);
  }
  if (p.use_bias != 0u) {
    x += bias[i];
  }
  return x;
}

fn bucket(z: f32, m: f32) -> u32 {
  return u32(min((m - z) * INV_W, f32(NB - 1u)));
}

fn f(k: u32) -> f32 { return bitcast<f32>(work[k]); }
fn put(k: u32, v: f32) { work[k] = bitcast<u32>(v); }

fn uniform_u() -> f32 {
  return f32(pcg(io[SEED + 2u] ^ pcg(io[SEED] ^ pcg(io[SEED + 1u]))) >> 8u) * (1.0 / 16777216.0);
}

// ---- pass 1, per slice t: z (kept in scratch when sampling), its max/argmax, and for logprobs the
// raw max and a local raw top-n_top; clears the histogram and the candidate count.
// dispatch (NS / 64, 1, 1), workgroup 64
@compute @workgroup_size(64)
fn sample_scan(@builtin(global_invocation_id) gid: vec3<u32>) {
  let t = gid.x;
  let sampling = p.mode == 1u;
  let want_lp = p.want_logprobs != 0u;
  var m = NEG_INF;
  var mi = 0xffffffffu;
  var rm = NEG_INF;
  let nt = p.n_top;
  top_clear();
  for (var i = t; i < p.vocab; i += NS) {
    var z = penalized(i);
    if (sampling) { z *= p.inv_temperature; scratch[i] = z; }   // greedy needs only the argmax
    if (z > m) { m = z; mi = i; }
    if (want_lp) {
      let r = f32(logits[i]);
      rm = max(rm, r);
      top_insert(r, i, nt, false);   // i increases along the slice
    }
  }
  let o = t * PW;
  put(o, m); work[o + 1u] = mi; put(o + 2u, rm);
  for (var r = 0u; r < nt; r++) { put(o + 3u + r, top_v[r]); work[o + 3u + TOPN + r] = top_i[r]; }
  atomicStore(&cnt[t], 0u);
  atomicStore(&cnt[t + NS], 0u);   // NB = 2 NS
  if (t == 0u) { atomicStore(&cnt[NB], 0u); }
}

// ---- pass 2, one invocation: max z and its lowest id, the raw max, the merged raw top-n_top
// dispatch (1, 1, 1), workgroup 1
@compute @workgroup_size(1)
fn sample_merge() {
  var m = NEG_INF;
  var token = 0xffffffffu;
  var rm = NEG_INF;
  let nt = p.n_top;
  top_clear();
  let want_lp = p.want_logprobs != 0u;
  for (var t = 0u; t < NS; t++) {
    let o = t * PW;
    let v = f(o);
    let i = work[o + 1u];
    if (v > m || (v == m && i < token)) { m = v; token = i; }
    rm = max(rm, f(o + 2u));
    if (want_lp) {
      for (var r = 0u; r < nt; r++) { top_insert(f(o + 3u + r), work[o + 3u + TOPN + r], nt, true); }
    }
  }
  put(STAT, m); work[STAT + 1u] = token; put(STAT + 2u, rm);
  if (want_lp) {
    for (var r = 0u; r < nt; r++) { io[4u + r] = top_i[r]; io[TOPV + r] = bitcast<u32>(top_v[r]); }
  }
}

// ---- pass 3, per slice t: softmax sums (z for sampling, raw for logprobs), histogram for the cut
// dispatch (NS / 64, 1, 1), workgroup 64
@compute @workgroup_size(64)
fn sample_sums(@builtin(global_invocation_id) gid: vec3<u32>) {
  let t = gid.x;
  let sampling = p.mode == 1u;
  let want_lp = p.want_logprobs != 0u;
  let need_cut = sampling && (p.top_k > 0u || p.top_p < 1.0 || p.min_p > 0.0);
  let zmax = f(STAT);
  let rmax = f(STAT + 2u);
  var s_loc = 0.0;
  var rs_loc = 0.0;
  for (var i = t; i < p.vocab; i += NS) {
    if (sampling) {
      let z = scratch[i];
      s_loc += exp(z - zmax);
      if (need_cut) {
        let b = bucket(z, zmax);
        if (b < NB - 1u) { atomicAdd(&cnt[b], 1u); }   // the catch-all last bucket is V - the rest
      }
    }
    if (want_lp) { rs_loc += exp(f32(logits[i]) - rmax); }
  }
  put(SUMS + t, s_loc);
  put(SUMS + NS + t, rs_loc);
}

// ---- pass 4, one invocation: the totals (summed as a pairwise tree), the cut bucket and whether
// candidates are sorted and cut (flags 1); else the token: the argmax (greedy) or the full-vocabulary
// inverse CDF over the slices in order.
// dispatch (1, 1, 1), workgroup 1
@compute @workgroup_size(1)
fn sample_cut() {
  let V = p.vocab;
  let zt = SUMS + 2u * NS;
  let rt = SUMS + 3u * NS;
  for (var t = 0u; t < NS; t++) { work[zt + t] = work[SUMS + t]; work[rt + t] = work[SUMS + NS + t]; }
  for (var s = NS / 2u; s > 0u; s >>= 1u) {
    for (var t = 0u; t < s; t++) { put(zt + t, f(zt + t) + f(zt + t + s)); put(rt + t, f(rt + t) + f(rt + t + s)); }
  }
  let zsum = f(zt);
  put(STAT + 3u, zsum);
  put(STAT + 4u, log(f(rt)));
  var flags = 0u;       // 1: candidates sorted and cut; 0: token already chosen here
  if (p.mode == 1u) {
    let zmax = f(STAT);
    var cut = NB - 1u;
    if (p.top_k > 0u || p.top_p < 1.0 || p.min_p > 0.0) {
      var cnum = 0u;
      var mass = 0.0;
      var bk = NB - 1u;
      var bp = NB - 1u;
      var found_k = p.top_k == 0u;
      var found_p = p.top_p >= 1.0;
      for (var b = 0u; b < NB - 1u; b++) {
        let c = atomicLoad(&cnt[b]);
        cnum += c;
        mass += f32(c) * exp(-f32(b + 1u) / INV_W);   // lower bound
        if (!found_k && cnum >= p.top_k) { bk = b; found_k = true; }
        if (!found_p && mass >= p.top_p * zsum) { bp = b; found_p = true; }
        if (found_k && found_p) { break; }
      }
      cut = min(bk, bp);
      if (p.min_p > 0.0) {   // min-p keeps max z - z <= -ln(min_p): buckets up to that distance
        cut = min(cut, u32(min(-log(p.min_p) * INV_W, f32(NB - 1u))));
      }
      // how many tokens lie in buckets <= cut; shrink until they fit in CAP
      var c2 = 0u;
      for (var b = 0u; b <= cut; b++) {
        if (b == NB - 1u) { c2 = V; } else { c2 += atomicLoad(&cnt[b]); }
        if (c2 > CAP) { cut = b; break; }
      }
      if (c2 > CAP) {
        if (cut == 0u) { flags = 0u; } else { cut -= 1u; flags = 1u; }
      } else { flags = 1u; }
    }
    work[STAT + 5u] = cut;
    if (flags == 0u) {
      // full-vocabulary inverse CDF: the slice that holds u * sum, then the token inside it
      let goal = uniform_u() * zsum;
      var cum = 0.0;
      var owner = NS - 1u;
      for (var t = 0u; t < NS; t++) {
        let st = f(SUMS + t);
        if (cum + st > goal) { owner = t; break; }
        cum += st;
      }
      let r = goal - cum;
      var c = 0.0;
      var last = owner;
      var tok = 0xffffffffu;
      for (var i = owner; i < V; i += NS) {
        let e = exp(scratch[i] - zmax);
        if (e > 0.0) { last = i; }
        c += e;
        if (c > r) { tok = i; break; }
      }
      work[STAT + 1u] = select(tok, last, tok == 0xffffffffu);
    }
  }
  work[STAT + 6u] = flags;
}

// ---- pass 5, per slice t (only with top-k/top-p/min-p): the tokens in buckets <= cut become candidates
// (in no fixed order: atomic slots)
// dispatch (NS / 64, 1, 1), workgroup 64
@compute @workgroup_size(64)
fn sample_collect(@builtin(global_invocation_id) gid: vec3<u32>) {
  if (work[STAT + 6u] != 1u) { return; }
  let zmax = f(STAT);
  let cut = work[STAT + 5u];
  for (var i = gid.x; i < p.vocab; i += NS) {
    let z = scratch[i];
    if (bucket(z, zmax) <= cut) {
      let slot = atomicAdd(&cnt[NB], 1u);
      if (slot < CAP) { put(CAND + slot, z); work[CAND + CAP + slot] = i; }
    }
  }
}

// ---- pass 6, per candidate c (only with top-k/top-p/min-p): its rank in (value desc, index asc) order is
// the number of candidates before it; ranks are distinct because ids are.
// dispatch (CAP / 64, 1, 1), workgroup 64
@compute @workgroup_size(64)
fn sample_rank(@builtin(global_invocation_id) gid: vec3<u32>) {
  let c = gid.x;
  let n = min(atomicLoad(&cnt[NB]), CAP);
  if (work[STAT + 6u] != 1u || c >= n) { return; }
  let v = f(CAND + c);
  let id = work[CAND + CAP + c];
  var rank = 0u;
  for (var d = 0u; d < n; d++) {
    let w = f(CAND + d);
    rank += select(0u, 1u, w > v || (w == v && work[CAND + CAP + d] < id));
  }
  put(SORT + rank, v);
  work[SORT + CAP + rank] = id;
}

// ---- pass 7, one invocation: the top-k/top-p/min-p cut over the sorted candidates (flags 1), then the
// results and the history
// dispatch (1, 1, 1), workgroup 1
@compute @workgroup_size(1)
fn sample_finish() {
  let want_lp = p.want_logprobs != 0u;
  var token = work[STAT + 1u];
  if (p.mode == 1u && work[STAT + 6u] == 1u) {
    let zmax = f(STAT);
    let zsum = f(STAT + 3u);
    let n = min(atomicLoad(&cnt[NB]), CAP);
    // top-k, then top-p over the renormalised top-k set: keep j while mass before j < p * mass_k
    var lk = n;
    if (p.top_k > 0u) { lk = min(lk, p.top_k); }
    // the mass top-p is relative to: the whole vocabulary, or the top-k set when k cuts
    var mk = zsum;
    if (p.top_k > 0u && p.top_k <= n) {
      mk = 0.0;
      for (var j = 0u; j < lk; j++) { mk += exp(f(SORT + j) - zmax); }
    }
    var keep = lk;
    if (p.top_p < 1.0) {
      var cum = 0.0;
      keep = 0u;
      for (var j = 0u; j < lk; j++) {
        if (cum >= p.top_p * mk) { break; }
        cum += exp(f(SORT + j) - zmax);
        keep = j + 1u;
      }
      mk = cum;
    } else {
      mk = 0.0;
      for (var j = 0u; j < lk; j++) { mk += exp(f(SORT + j) - zmax); }
    }
    if (p.min_p > 0.0) {   // the sorted prefix with z >= max z + ln(min_p) (its first token always)
      let lo = log(p.min_p);
      var km = 1u;
      while (km < keep && f(SORT + km) - zmax >= lo) { km += 1u; }
      if (km < keep) {
        keep = km;
        mk = 0.0;
        for (var j = 0u; j < keep; j++) { mk += exp(f(SORT + j) - zmax); }
      }
    }
    let goal = uniform_u() * mk;
    var cum = 0.0;
    token = work[SORT + CAP + max(keep, 1u) - 1u];
    for (var j = 0u; j < keep; j++) {
      cum += exp(f(SORT + j) - zmax);
      if (cum > goal) { token = work[SORT + CAP + j]; break; }
    }
  }
  let rmax = f(STAT + 2u);
  let log_rsum = f(STAT + 4u);
  io[0] = token;
  io[1] = bitcast<u32>(f32(logits[token]) - rmax - log_rsum);
  io[2] = select(0u, p.n_top, want_lp);
  io[3] = io[SEED + 2u];
  if (want_lp) {
    for (var r = 0u; r < p.n_top; r++) { io[TOPV + r] = bitcast<u32>(bitcast<f32>(io[TOPV + r]) - rmax - log_rsum); }
  }
  io[SEED + 2u] = io[SEED + 2u] + 1u;
  hist[token] = (hist[token] + 1u) | SEEN;
  next_ids[0] = token;
}

// ---- greedy without logprobs, barrier-free (the common decode case). On CPU Vulkan a kernel with
// barriers runs its invocations as coroutines, which cost milliseconds per dispatch here; these two
// passes have no barriers. Same result as the sampling passes in mode 0 without logprobs (ties: lowest index).
const NPART: u32 = 1024u;   // pass-1 invocations (16 workgroups of 64)

// argmax_partial: scratch[2g], scratch[2g+1] = max z and its index over i = g, g + NPART, ...
// dispatch (NPART / 64, 1, 1), workgroup 64
@compute @workgroup_size(64)
fn argmax_partial(@builtin(global_invocation_id) gid: vec3<u32>) {
  var m = NEG_INF;
  var mi = 0xffffffffu;
  for (var i = gid.x; i < p.vocab; i += NPART) {
    let z = penalized(i);
    if (z > m) { m = z; mi = i; }
  }
  scratch[2u * gid.x] = m;
  scratch[2u * gid.x + 1u] = bitcast<f32>(mi);
}

// argmax_final: one invocation merges the partials and records the token as sample_finish does.
// dispatch (1, 1, 1), workgroup 1
@compute @workgroup_size(1)
fn argmax_final() {
  var m = NEG_INF;
  var token = 0u;
  var found = false;
  for (var g = 0u; g < NPART; g++) {
    let v = scratch[2u * g];
    let i = bitcast<u32>(scratch[2u * g + 1u]);
    if (i != 0xffffffffu && (!found || v > m || (v == m && i < token))) { m = v; token = i; found = true; }
  }
  io[0] = token;
  io[1] = 0u;
  io[2] = 0u;
  io[3] = io[SEED + 2u];
  io[SEED + 2u] = io[SEED + 2u] + 1u;
  hist[token] = (hist[token] + 1u) | SEEN;
  next_ids[0] = token;
}
