"""Host-memory growth per compute dispatch, for variants of the sampling kernel: a standalone repro
for a driver leak (Mesa lavapipe leaks host memory on every dispatch of some kernels).

Each variant is dispatched N times (one submit per dispatch, as a decode step does) after a warm-up;
the script prints the process RSS growth per dispatch for each and writes the table as JSON.

    python bench/dispatch_leak.py [--n 300] [--vocab 32000] [--only barrier_sample,sample_passes] [--json out.json]
    python bench/dispatch_leak.py --smoke [--json out.json]    (every variant, 16 dispatches, vocab 2048:
                                                              checks the script, measures nothing)

Variants: the former one-workgroup `sample` kernel with barriers (bench/leaky_sample.wgsl), its first
phase alone and without the seen-bit read, the shipped barrier-free passes and greedy pair
(shaders/sampling.wgsl), and cut-down kernels that isolate one construct each (barrier reductions,
workgroup atomics, private arrays, workgroupUniformLoad, shared-word loads).

Found with it (Mesa 22.3 lavapipe): the former kernel leaked ~670 KiB per dispatch; its first phase
alone leaked, and stopped leaking when its per-token read of the seen bitset (`hist[V + (i >> 5)]`,
one word per 32 tokens) was removed; a barrier-free pass with that read leaked too (~170 KiB per
dispatch), and none of the isolated constructs leaks on its own. The shipped passes keep the seen
flag in each token's own history word and do not leak.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import wgpu

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
HEADER = "alias act = f32;\nalias act4 = vec4<f32>;\n"

# Declarations shared by the cut-down variants (same bindings as sampling.wgsl).
DECLS = """
struct Params { vocab: u32, mode: u32, top_k: u32, n_top: u32, inv_temperature: f32, top_p: f32,
  repetition_penalty: f32, frequency_penalty: f32, presence_penalty: f32, want_logprobs: u32,
  use_penalty: u32, use_bias: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> hist: array<u32>;
@group(0) @binding(4) var<storage, read_write> scratch: array<f32>;
@group(0) @binding(5) var<storage, read_write> io: array<u32>;
@group(0) @binding(6) var<storage, read_write> next_ids: array<u32>;
const WG: u32 = 256u;
"""

CUT = {
    # a strided loop, a max, then a tree reduction with barriers
    "barrier_reduce": """
var<workgroup> red_f: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  var m = -3.0e38;
  for (var i = tid; i < p.vocab; i += WG) { m = max(m, logits[i]); }
  red_f[tid] = m;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (tid < s) { red_f[tid] = max(red_f[tid], red_f[tid + s]); }
    workgroupBarrier();
  }
  if (tid == 0u) { io[0] = bitcast<u32>(red_f[0]); }
}""",
    # the same plus workgroup atomics
    "wg_atomics": """
var<workgroup> red_f: array<f32, 256>;
var<workgroup> hcount: array<atomic<u32>, 512>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  atomicStore(&hcount[tid], 0u);
  atomicStore(&hcount[tid + WG], 0u);
  workgroupBarrier();
  for (var i = tid; i < p.vocab; i += WG) { atomicAdd(&hcount[u32(abs(logits[i])) & 511u], 1u); }
  workgroupBarrier();
  if (tid == 0u) { io[0] = atomicLoad(&hcount[0]); }
}""",
    # the same plus workgroupUniformLoad
    "uniform_load": """
var<workgroup> sh_u: array<u32, 4>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  if (tid == 0u) { sh_u[0] = p.vocab; }
  let n = workgroupUniformLoad(&sh_u[0]);
  var acc = 0.0;
  for (var i = tid; i < n; i += WG) { acc += logits[i]; }
  scratch[tid] = acc;
}""",
    # private arrays written with a dynamic index in a data-dependent while loop, then a barrier
    "private_topk": """
var<workgroup> cval: array<f32, 1280>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  var tv = array<f32, 5>(-3.0e38, -3.0e38, -3.0e38, -3.0e38, -3.0e38);
  for (var i = tid; i < p.vocab; i += WG) {
    let r = logits[i];
    if (r > tv[4]) {
      var j = 4u;
      while (j > 0u && r > tv[j - 1u]) { tv[j] = tv[j - 1u]; j -= 1u; }
      tv[j] = r;
    }
  }
  for (var r = 0u; r < 5u; r++) { cval[tid * 5u + r] = tv[r]; }
  workgroupBarrier();
  if (tid == 0u) { io[0] = bitcast<u32>(cval[0]); }
}""",
    # one invocation loops over the workgroup memory after the barrier (data-dependent trip count)
    "serial_after_barrier": """
var<workgroup> cval: array<f32, 1280>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  for (var r = 0u; r < 5u; r++) { cval[tid * 5u + r] = logits[(tid * 5u + r) % p.vocab]; }
  workgroupBarrier();
  if (tid == 0u) {
    var best = -3.0e38;
    for (var e = 0u; e < WG * 5u; e++) { best = max(best, cval[e]); }
    io[0] = bitcast<u32>(best);
  }
}""",
    # the barrier reduction whose loop also loads from a word index shared by 32 consecutive ids
    # (the seen-bit read of `penalized`): this is the combination that leaks on lavapipe
    "barrier_shared_word": """
var<workgroup> red_f: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  var m = -3.0e38;
  for (var i = tid; i < p.vocab; i += WG) { m = max(m, logits[i] + f32(hist[p.vocab + (i >> 5u)] & 1u)); }
  red_f[tid] = m;
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s >>= 1u) {
    if (tid < s) { red_f[tid] = max(red_f[tid], red_f[tid + s]); }
    workgroupBarrier();
  }
  if (tid == 0u) { io[0] = bitcast<u32>(red_f[0]); }
}""",
    "barrier_shifted_index": """
var<workgroup> red_f: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  var m = -3.0e38;
  for (var i = tid; i < p.vocab; i += WG) { m = max(m, logits[i] + f32(hist[i >> 5u] & 1u)); }
  red_f[tid] = m;
  workgroupBarrier();
  if (tid == 0u) { io[0] = bitcast<u32>(red_f[0]); }
}""",
    "barrier_offset_index": """
var<workgroup> red_f: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) tid: u32) {
  var m = -3.0e38;
  for (var i = tid; i < p.vocab; i += WG) { m = max(m, logits[i] + f32(hist[p.vocab / 2u + i / 2u] & 1u)); }
  red_f[tid] = m;
  workgroupBarrier();
  if (tid == 0u) { io[0] = bitcast<u32>(red_f[0]); }
}""",
    # the pure barrier-free strided loop (the greedy path's shape)
    "no_barrier": """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  var m = -3.0e38;
  for (var i = gid.x; i < p.vocab; i += 1024u) { m = max(m, logits[i]); }
  scratch[gid.x] = m;
}""",
}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def barrier_source() -> str:
    """The former one-workgroup kernel with barriers (kept in bench/ as the repro's input)."""
    return HEADER + (ROOT / "bench" / "leaky_sample.wgsl").read_text()


def shipped_source() -> str:
    return HEADER + (ROOT / "shaders" / "sampling.wgsl").read_text()


def phase_a_only(src: str) -> str:
    """`sample` cut after its first phase (z, max/argmax, the local top-5, the first reduction)."""
    head, rest = src.split("@compute @workgroup_size(256)\nfn sample", 1)
    body_end = rest.index("  // ---- top-N raw logprob candidates")
    tail = "  if (tid == 0u) { io[0] = token; io[1] = bitcast<u32>(zmax + rmax); }\n}\n"
    return head + "@compute @workgroup_size(256)\nfn sample" + rest[:body_end] + tail


class Bench:
    def __init__(self, vocab: int):
        self.dev = wgpu.gpu.request_adapter_sync(power_preference="high-performance").request_device_sync()
        self.vocab = vocab
        d = self.dev
        S = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        rng = np.random.default_rng(0)
        self.params = d.create_buffer(size=64, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        self.logits = d.create_buffer_with_data(data=(rng.standard_normal(vocab) * 3).astype(np.float32), usage=S)
        self.bias = d.create_buffer(size=vocab * 4, usage=S)
        self.hist = d.create_buffer(size=(vocab + (vocab + 31) // 32) * 4, usage=S)   # both layouts fit
        self.scratch = d.create_buffer(size=max(vocab, 2048) * 4, usage=S)
        self.io = d.create_buffer(size=128, usage=S)
        self.next_ids = d.create_buffer(size=16, usage=S)
        self.work = d.create_buffer(size=8464 * 4, usage=S)      # the sampling passes' state
        self.counts = d.create_buffer(size=513 * 4, usage=S)
        entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": "uniform"}}]
        for b, ro in ((1, True), (2, True), (3, False), (4, False), (5, False), (6, False), (7, False), (8, False)):
            entries.append({"binding": b, "visibility": wgpu.ShaderStage.COMPUTE,
                            "buffer": {"type": "read-only-storage" if ro else "storage"}})
        self.bgl = d.create_bind_group_layout(entries=entries)
        self.layout = d.create_pipeline_layout(bind_group_layouts=[self.bgl])
        bufs = [self.params, self.logits, self.bias, self.hist, self.scratch, self.io, self.next_ids,
                self.work, self.counts]
        self.bg = d.create_bind_group(layout=self.bgl, entries=[
            {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}} for i, b in enumerate(bufs)])
        self.configure(mode=1, top_p=0.9, want_logprobs=1, n_top=5)

    def configure(self, *, mode=1, top_k=0, top_p=1.0, want_logprobs=0, n_top=0):
        raw = struct.pack("<4I5f3I", self.vocab, mode, top_k, n_top, 1.0, top_p, 1.0, 0.0, 0.0,
                          want_logprobs, 0, 0)
        self.dev.queue.write_buffer(self.params, 0, raw + b"\0" * (64 - len(raw)))

    def pipeline(self, code: str, entry: str):
        mod = self.dev.create_shader_module(code=code)
        return self.dev.create_compute_pipeline(layout=self.layout, compute={"module": mod, "entry_point": entry})

    def step(self, passes):
        enc = self.dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        for pipe, groups in passes:
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, self.bg)
            cp.dispatch_workgroups(groups, 1, 1)
        cp.end()
        self.dev.queue.submit([enc.finish()])

    def sync(self):
        self.dev.queue.read_buffer(self.io, 0, 4)

    def measure(self, passes, n: int, warm: int = 30) -> dict:
        for _ in range(warm):
            self.step(passes)
        self.sync()
        r0, t0 = rss_mib(), time.perf_counter()
        for i in range(n):
            self.step(passes)
            if i % 16 == 15:
                self.sync()
        self.sync()
        dt, r1 = time.perf_counter() - t0, rss_mib()
        return {"rss_before_mib": round(r0, 1), "rss_after_mib": round(r1, 1),
                "kib_per_dispatch": round((r1 - r0) * 1024 / n, 2), "ms_per_step": round(dt * 1000 / n, 3)}


PASSES = [("sample_scan", 4), ("sample_merge", 1), ("sample_sums", 4), ("sample_cut", 1),
          ("sample_collect", 4), ("sample_rank", 16), ("sample_finish", 1)]


def variants(b: Bench) -> dict:
    old, src = barrier_source(), shipped_source()
    return {
        "barrier_sample": lambda: [(b.pipeline(old, "sample"), 1)],
        "barrier_phase_a": lambda: [(b.pipeline(phase_a_only(old), "sample"), 1)],
        "barrier_phase_a_noseen": lambda: [(b.pipeline(phase_a_only(old).replace(
            "let seen = (hist[p.vocab + (i >> 5u)] >> (i & 31u)) & 1u;", "let seen = 0u;"), "sample"), 1)],
        "sample_passes": lambda: [(b.pipeline(src, e), g) for e, g in PASSES],
        "greedy_pair": lambda: [(b.pipeline(src, "argmax_partial"), 16), (b.pipeline(src, "argmax_final"), 1)],
        **{name: (lambda body=body: [(b.pipeline(HEADER + DECLS + body, "main"), 1 if "(256)" in body else 16)])
           for name, body in CUT.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--only", default="")
    ap.add_argument("--json", "--out", dest="json", default=str(ROOT / "bench" / "results" / "dispatch_leak.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="every variant, 16 dispatches after 4, vocab 2048: checks the script, measures nothing")
    a = ap.parse_args()
    warm = 30
    if a.smoke:
        a.n, a.vocab, warm = 16, 2048, 4
    b = Bench(a.vocab)
    vs = variants(b)
    only = [s for s in a.only.split(",") if s]
    rows = {}
    print(f"{'variant':<22} {'KiB/dispatch':>13} {'ms/step':>9}  rss before -> after (MiB)")
    for name, make in vs.items():
        if only and name not in only:
            continue
        r = b.measure(make(), a.n, warm)
        rows[name] = r
        print(f"{name:<22} {r['kib_per_dispatch']:>13.2f} {r['ms_per_step']:>9.3f}  "
              f"{r['rss_before_mib']} -> {r['rss_after_mib']}", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"vocab": a.vocab, "n": a.n, "adapter": str(b.dev.adapter.info),
                                            "variants": rows}, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
