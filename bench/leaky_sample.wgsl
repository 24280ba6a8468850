// The sampling kernel as it was before it was split into barrier-free passes: kept only as the input of
// bench/dispatch_leak.py, which shows that lavapipe leaks host memory on every dispatch of it.
// sampling: one token id from a logits row, entirely on the GPU, in ONE workgroup of 256 invocations.
//   z[i]  = (penalties(logits[i]) + bias[i]) / temperature
//           penalties: HF repetition penalty on seen tokens (prompt + generated: positive logits
//           divided, negative multiplied), then OpenAI frequency/presence over generated counts.
//   greedy (mode 0): token = argmax z (lowest index on ties, like numpy.argmax).
//   sample (mode 1): u = hash(seed, counter); top-k then top-p (HF order; top-p over the
//           renormalised top-k set); inverse CDF with u.
//   top-k / top-p work on a candidate set: a 512-bucket histogram of (max z - z) in 1/16-nat buckets
//   picks the smallest bucket range that provably holds the top-k set and the nucleus (bucket masses
//   bounded from below); those tokens (at most CAP = 1024) are sorted (bitonic, value desc, index asc)
//   and cut exactly. Exactness: exact whenever that range holds <= 1024 tokens; otherwise the range
//   shrinks to the top buckets that fit (the nucleus is truncated to the most probable <= 1024 tokens),
//   and if even the first 1/16-nat bucket holds more than 1024 tokens, the full distribution is used.
//   Without top-k/top-p the inverse CDF runs over the whole vocabulary (exact).
//   logprobs: log-softmax of the RAW logits (OpenAI/vLLM semantics): the chosen token's and the top-N
//   (N <= 5), ties to the lower index.
//   After choosing, counts[token] += 1, seen[token] = 1, state.counter += 1, next_ids[0] = token.
// dispatch (1,1,1), workgroup 256. Header provides `act` (logits dtype).

struct Params {
  vocab: u32,
  mode: u32,              // 0 greedy, 1 sample
  top_k: u32,             // 0: off
  n_top: u32,             // top logprobs wanted (0..5)
  inv_temperature: f32,
  top_p: f32,             // >= 1: off
  repetition_penalty: f32,
  frequency_penalty: f32,
  presence_penalty: f32,
  want_logprobs: u32,
  use_penalty: u32,
  use_bias: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<act>;         // (V)
@group(0) @binding(2) var<storage, read> bias: array<f32>;           // (V) dense logit_bias
@group(0) @binding(3) var<storage, read_write> hist: array<u32>;     // (V + ceil(V/32)): counts | seen bits
@group(0) @binding(4) var<storage, read_write> scratch: array<f32>;  // (V) z
@group(0) @binding(5) var<storage, read_write> io: array<u32>;       // (32): [0,16) result, 16 seed_lo, 17 seed_hi, 18 counter
@group(0) @binding(6) var<storage, read_write> next_ids: array<u32>; // (>=1) the model's next input id

const WG: u32 = 256u;
const NB: u32 = 512u;
const CAP: u32 = 1024u;
const INV_W: f32 = 16.0;       // buckets per nat
const NEG_INF: f32 = -3.0e38;

var<workgroup> red_f: array<f32, 256>;
var<workgroup> red_u: array<u32, 256>;
var<workgroup> tsum: array<f32, 256>;    // per-invocation sum of exp(z - max)
var<workgroup> hcount: array<atomic<u32>, 512>;
var<workgroup> cval: array<f32, 1280>;   // candidates (CAP) / per-invocation top-5 raw logits (256*5)
var<workgroup> cidx: array<u32, 1280>;
var<workgroup> ncand: atomic<u32>;
var<workgroup> sh_u: array<u32, 4>;      // broadcast: 0 token, 1 cut bucket, 2 flags, 3 owner invocation
var<workgroup> sh_f: array<f32, 4>;      // broadcast: 0 max z, 1 sum, 2 residual goal, 3 raw max

fn pcg(v: u32) -> u32 {
  let s = v * 747796405u + 2891336453u;
  let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
  return (w >> 22u) ^ w;
}

fn penalized(i: u32) -> f32 {
  var x = f32(logits[i]);
  if (p.use_penalty != 0u) {
    let seen = (hist[p.vocab + (i >> 5u)] >> (i & 31u)) & 1u;
    if (seen != 0u) {
      x = select(x * p.repetition_penalty, x / p.repetition_penalty, x > 0.0);
    }
    let c = hist[i];
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

// candidate a goes before candidate b: larger value, then lower index
fn before(a: u32, b: u32) -> bool {
  return cval[a] > cval[b] || (cval[a] == cval[b] && cidx[a] < cidx[b]);
}

@compute @workgroup_size(256)
fn sample(@builtin(local_invocation_index) tid: u32) {
  let V = p.vocab;
  let sampling = p.mode == 1u;
  let want_lp = p.want_logprobs != 0u;

  // ---- phase A: z, its max/argmax, and (for logprobs) the raw max and a local raw top-5
  var m = NEG_INF;
  var mi = 0xffffffffu;
  var rm = NEG_INF;
  var tv = array<f32, 5>(NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF);
  var ti = array<u32, 5>(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  for (var i = tid; i < V; i += WG) {
    var z = penalized(i);
    if (sampling) { z *= p.inv_temperature; scratch[i] = z; }   // greedy needs only the argmax
    if (z > m) { m = z; mi = i; }
    if (want_lp) {
      let r = f32(logits[i]);
      rm = max(rm, r);
      if (r > tv[4]) {   // i increases per invocation, so strict > keeps the lower index on ties
        var j = 4u;
        while (j > 0u && r > tv[j - 1u]) { tv[j] = tv[j - 1u]; ti[j] = ti[j - 1u]; j -= 1u; }
        tv[j] = r; ti[j] = i;
      }
    }
  }
  red_f[tid] = m; red_u[tid] = mi;
  tsum[tid] = rm;
  for (var r = 0u; r < 5u; r++) { cval[tid * 5u + r] = tv[r]; cidx[tid * 5u + r] = ti[r]; }
  atomicStore(&hcount[tid], 0u);
  atomicStore(&hcount[tid + WG], 0u);   // NB = 2 * WG
  if (tid == 0u) { atomicStore(&ncand, 0u); }
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (tid < s) {
      let a = red_f[tid]; let b = red_f[tid + s];
      if (b > a || (b == a && red_u[tid + s] < red_u[tid])) { red_f[tid] = b; red_u[tid] = red_u[tid + s]; }
      tsum[tid] = max(tsum[tid], tsum[tid + s]);
    }
    workgroupBarrier();
  }
  let zmax = red_f[0];
  let rmax = tsum[0];
  var token = red_u[0];
  workgroupBarrier();

  // ---- top-N raw logprob candidates: merged by invocation 0 before cval is reused
  if (want_lp && tid == 0u) {
    var bv = array<f32, 5>(NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF);
    var bi = array<u32, 5>(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
    for (var e = 0u; e < WG * 5u; e++) {
      let v = cval[e]; let id = cidx[e];
      if (v > bv[4] || (v == bv[4] && id < bi[4])) {
        var j = 4u;
        while (j > 0u && (v > bv[j - 1u] || (v == bv[j - 1u] && id < bi[j - 1u]))) {
          bv[j] = bv[j - 1u]; bi[j] = bi[j - 1u]; j -= 1u;
        }
        bv[j] = v; bi[j] = id;
      }
    }
    for (var r = 0u; r < 5u; r++) { io[4u + r] = bi[r]; io[9u + r] = bitcast<u32>(bv[r]); }
  }

  // ---- phase B: softmax sums (z for sampling, raw for logprobs), histogram for the cut
  let need_cut = sampling && (p.top_k > 0u || p.top_p < 1.0);
  var s_loc = 0.0;
  var rs_loc = 0.0;
  for (var i = tid; i < V; i += WG) {
    if (sampling) {
      let z = scratch[i];
      s_loc += exp(z - zmax);
      if (need_cut) {
        let b = bucket(z, zmax);
        if (b < NB - 1u) { atomicAdd(&hcount[b], 1u); }   // the catch-all last bucket is V - the rest
      }
    }
    if (want_lp) { rs_loc += exp(f32(logits[i]) - rmax); }
  }
  tsum[tid] = s_loc;
  red_f[tid] = s_loc;
  workgroupBarrier();
  // raw sum into red_u as f32 bits would lose the tree; reuse cval (free now) for it
  cval[tid] = rs_loc;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (tid < s) { red_f[tid] += red_f[tid + s]; cval[tid] += cval[tid + s]; }
    workgroupBarrier();
  }
  let zsum = red_f[0];
  let log_rsum = log(cval[0]);
  workgroupBarrier();

  if (sampling) {
    let u = f32(pcg(io[18] ^ pcg(io[16] ^ pcg(io[17]))) >> 8u) * (1.0 / 16777216.0);
    // ---- choose the cut bucket (invocation 0), then collect its tokens as candidates
    if (tid == 0u) {
      var cut = NB - 1u;
      var flags = 0u;       // 1: candidates sorted and cut; 0: full-vocabulary inverse CDF
      if (need_cut) {
        var cnt = 0u;
        var mass = 0.0;
        var bk = NB - 1u;
        var bp = NB - 1u;
        var found_k = p.top_k == 0u;
        var found_p = p.top_p >= 1.0;
        for (var b = 0u; b < NB - 1u; b++) {
          cnt += atomicLoad(&hcount[b]);
          mass += f32(atomicLoad(&hcount[b])) * exp(-f32(b + 1u) / INV_W);   // lower bound
          if (!found_k && cnt >= p.top_k) { bk = b; found_k = true; }
          if (!found_p && mass >= p.top_p * zsum) { bp = b; found_p = true; }
          if (found_k && found_p) { break; }
        }
        cut = min(bk, bp);
        // how many tokens lie in buckets <= cut; shrink until they fit in CAP
        var c2 = 0u;
        for (var b = 0u; b <= cut; b++) {
          if (b == NB - 1u) { c2 = V; } else { c2 += atomicLoad(&hcount[b]); }
          if (c2 > CAP) { cut = b; break; }
        }
        if (c2 > CAP) {
          if (cut == 0u) { flags = 0u; } else { cut -= 1u; flags = 1u; }
        } else { flags = 1u; }
      }
      sh_u[1] = cut; sh_u[2] = flags;
    }
    let flags = workgroupUniformLoad(&sh_u[2]);
    if (flags == 1u) {
      let cut = sh_u[1];
      for (var i = tid; i < V; i += WG) {
        let z = scratch[i];
        if (bucket(z, zmax) <= cut) {
          let slot = atomicAdd(&ncand, 1u);
          if (slot < CAP) { cval[slot] = z; cidx[slot] = i; }
        }
      }
      let n = min(workgroupUniformLoad(&ncand), CAP);
      var n2 = 1u;
      while (n2 < n) { n2 <<= 1u; }
      for (var t = n + tid; t < n2; t += WG) { cval[t] = NEG_INF; cidx[t] = 0xffffffffu; }
      workgroupBarrier();
      // bitonic sort of cval/cidx[0..n2): value desc, index asc (atomic slot order is not deterministic)
      for (var k = 2u; k <= n2; k <<= 1u) {
        for (var j = k >> 1u; j > 0u; j >>= 1u) {
          for (var t = tid; t < n2; t += WG) {
            let l = t ^ j;
            if (l > t) {
              let up = (t & k) == 0u;
              if ((up && before(l, t)) || (!up && before(t, l))) {
                let v = cval[t]; cval[t] = cval[l]; cval[l] = v;
                let x = cidx[t]; cidx[t] = cidx[l]; cidx[l] = x;
              }
            }
          }
          workgroupBarrier();
        }
      }
      if (tid == 0u) {
        // top-k, then top-p over the renormalised top-k set: keep j while mass before j < p * mass_k
        var lk = n;
        if (p.top_k > 0u) { lk = min(lk, p.top_k); }
        // the mass top-p is relative to: the whole vocabulary, or the top-k set when k cuts
        var mk = zsum;
        if (p.top_k > 0u && p.top_k <= n) {
          mk = 0.0;
          for (var j = 0u; j < lk; j++) { mk += exp(cval[j] - zmax); }
        }
        var keep = lk;
        if (p.top_p < 1.0) {
          var cum = 0.0;
          keep = 0u;
          for (var j = 0u; j < lk; j++) {
            if (cum >= p.top_p * mk) { break; }
            cum += exp(cval[j] - zmax);
            keep = j + 1u;
          }
          mk = cum;
        } else {
          mk = 0.0;
          for (var j = 0u; j < lk; j++) { mk += exp(cval[j] - zmax); }
        }
        let goal = u * mk;
        var cum = 0.0;
        token = cidx[max(keep, 1u) - 1u];
        for (var j = 0u; j < keep; j++) {
          cum += exp(cval[j] - zmax);
          if (cum > goal) { token = cidx[j]; break; }
        }
        sh_u[0] = token;
      }
    } else {
      // full-vocabulary inverse CDF: find the invocation whose strided slice holds u * sum
      if (tid == 0u) {
        let goal = u * zsum;
        var cum = 0.0;
        var owner = WG - 1u;
        for (var t = 0u; t < WG; t++) {
          if (cum + tsum[t] > goal) { owner = t; break; }
          cum += tsum[t];
        }
        sh_u[3] = owner;
        sh_f[2] = goal - cum;
      }
      workgroupBarrier();
      if (tid == sh_u[3]) {
        let r = sh_f[2];
        var cum = 0.0;
        var last = tid;
        var tok = 0xffffffffu;
        for (var i = tid; i < V; i += WG) {
          let e = exp(scratch[i] - zmax);
          if (e > 0.0) { last = i; }
          cum += e;
          if (cum > r) { tok = i; break; }
        }
        sh_u[0] = select(tok, last, tok == 0xffffffffu);
      }
    }
    workgroupBarrier();
    token = sh_u[0];
  }

  // ---- results and history (one invocation)
  if (tid == 0u) {
    io[0] = token;
    io[1] = bitcast<u32>(f32(logits[token]) - rmax - log_rsum);
    io[2] = select(0u, p.n_top, want_lp);
    io[3] = io[18];
    if (want_lp) {
      for (var r = 0u; r < 5u; r++) { io[9u + r] = bitcast<u32>(bitcast<f32>(io[9u + r]) - rmax - log_rsum); }
    }
    io[18] = io[18] + 1u;
    hist[token] = hist[token] + 1u;
    hist[V + (token >> 5u)] = hist[V + (token >> 5u)] | (1u << (token & 31u));
    next_ids[0] = token;
  }
}

// ---- greedy without logprobs, barrier-free (the common decode case). On CPU Vulkan a kernel with
// barriers runs its invocations as coroutines, which cost milliseconds per dispatch here; these two
// passes have no barriers. Same result as `sample` in mode 0 without logprobs (ties: lowest index).
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

// argmax_final: one invocation merges the partials and records the token as `sample` does.
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
  io[3] = io[18];
  io[18] = io[18] + 1u;
  let V = p.vocab;
  hist[token] = hist[token] + 1u;
  hist[V + (token >> 5u)] = hist[V + (token >> 5u)] | (1u << (token & 31u));
  next_ids[0] = token;
  _ = bias[0];
  _ = logits[0];
}
