"""How a CPU adapter (lavapipe) pays for the loads of a one-row decode matmul: WGSL probes that read a
Q4_1-shaped weight (blocks of 5 u32 words: the f16 scale pair, then 16 bytes of nibbles) in
different ways, timed per second of this process's CPU (a CPU adapter's threads are ours), beside a
copy kernel that streams the same bytes.

    python bench/load_probe.py [--rows 3072] [--k 576] [--rounds 5] [--dump-jit DIR] [--out PATH]
    python bench/load_probe.py --smoke [--out PATH]

Each probe gives each of its 8 lanes (workgroup 8: one SIMD vector on lavapipe at 256 bits) one
weight row, unrolled over K by the host as the engine's decode kernels are, x at constant offsets
(loaded once and broadcast to the lanes):
- u32 / vec4: the row's words loaded as u32 or vec4<u32> (as matmul_decode.wgsl / matmul_decode_v4.wgsl
  read them), dequantised and dotted with x;
- u32_load / vec4_load: the same loads alone (the words xor-ed together): the cost of the loads;
- select8: each word built from 8 loads at the workgroup's (not the lane's) addresses and a select on
  the lane index (would pay off if an address that depends only on the workgroup were broadcast);
- texture / texture_load: the rows as an rgba32uint texture, read with textureLoad;
- vec4_ahead: vec4 with each block's words loaded before the previous block's arithmetic;
- loop_x_storage / loop_x_uniform: the K loop kept (matmul.wgsl's loop kernel), u32 words, x read
  inside the loop from a storage buffer (lane by lane) or from a uniform buffer; loop4_*: with 4
  rows a lane sharing each x chunk, as the loop kernel runs (workgroups of 8 lanes: 32 rows);
  loop4v_*: 4 rows a lane, each row's words of 4 blocks read as 5 vec4<u32> a loop step (where
  K % 128 == 0: e.g. --rows 576 --k 1536, SmolLM2's down projection).
copy: each lane copies vec4<u32> words (shaders/copy.wgsl's copy_vec4), counted as read + written
bytes, as bench/kernels.py counts it. Rounds are interleaved; the best round of each is printed.
--dump-jit DIR: after the run, write this process's anonymous executable mappings (lavapipe's JIT
code: the compiled probes) to DIR as raw files named by their address, for
`objdump -D -b binary -m i386:x86-64` beside `perf record` / `perf script -F ip` of the same run.
Writes bench/results/load_probe.json. --smoke: a few rows, one short round: checks that the script
runs to the end; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

import wgpu  # noqa: E402

from webgpu_engine.gpu import request_device_sync  # noqa: E402

WG = 8
NIB = """
fn nib(q: u32) -> array<vec4<f32>, 2> {
    let v = vec4<u32>(q) >> vec4<u32>(0u, 8u, 16u, 24u);
    return array<vec4<f32>, 2>(vec4<f32>(v & vec4<u32>(15u)), vec4<f32>((v >> vec4<u32>(4u)) & vec4<u32>(15u)));
}
"""
IO = """@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
"""
COPY = """@group(0) @binding(0) var<storage, read> S: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> D: array<vec4<u32>>;
@compute @workgroup_size(64)
fn probe(@builtin(global_invocation_id) g: vec3<u32>) { D[g.x] = S[g.x]; }
"""


def loop_source(kind: str, k: int, rw4: int) -> str:
    """A probe with the K loop kept (matmul.wgsl's loop kernel): u32 weight words, x read inside the
    loop from a storage buffer (lane by lane, as the loop kernel reads it) or a uniform buffer;
    loop4_*: 4 rows a lane sharing each x chunk (the loop kernel's RR = 4)."""
    rr = 4 if kind.startswith("loop4") else 1
    xdecl = f"var<uniform> X: array<vec4<f32>, {k // 4}>;" if kind.endswith("uniform") else \
        "var<storage, read> X: array<vec4<f32>>;"
    xs = ", ".join(f"X[c * 8u + {i}u]" for i in range(8))
    rows = "".join(f"        let b{r} = (row + {r}u) * {4 * rw4}u + c * 5u;\n"
                   f"        let s{r} = unpack2x16float(W[b{r}]);\n"
                   f"        var lo{r} = vec4<f32>(0.0);\n        var hi{r} = vec4<f32>(0.0);\n"
                   + "".join(f"        let n{r}_{j} = nib(W[b{r} + {j + 1}u]);\n"
                             f"        lo{r} = fma(n{r}_{j}[0], x[{j}], lo{r});\n"
                             f"        hi{r} = fma(n{r}_{j}[1], x[{4 + j}], hi{r});\n" for j in range(4))
                   + f"        acc[{r}] += s{r}.x * dot(lo{r} + hi{r}, vec4<f32>(1.0)) + s{r}.y;\n" for r in range(rr))
    return (f"@group(0) @binding(0) var<storage, read> W: array<u32>;\n@group(0) @binding(1) {xdecl}\n"
            "@group(0) @binding(2) var<storage, read_write> Y: array<f32>;\n" + NIB +
            f"@compute @workgroup_size({WG})\n"
            "fn probe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {\n"
            f"    let row = (wid.x * {WG}u + lid) * {rr}u;\n    var acc = vec4<f32>(0.0);\n"
            f"    for (var c = 0u; c < {k // 32}u; c++) {{\n"
            f"        let x = array<vec4<f32>, 8>({xs});\n" + rows + "    }\n"
            + "".join(f"    Y[row + {r}u] = X[0].x + acc[{r}];\n" for r in range(rr)) + "}\n")


def block_sum(r: str, words: list, x: str) -> str:
    """WGSL adding a block's term to acc[r]: its 5 words (expressions), x chunk `x` (8 vec4)."""
    out = [f"        {{ let s = unpack2x16float({words[0]});",
           "        var lo = vec4<f32>(0.0);", "        var hi = vec4<f32>(0.0);"]
    for j in range(4):
        out += [f"        let n{j} = nib({words[j + 1]});", f"        lo = fma(n{j}[0], {x}[{j}], lo);",
                f"        hi = fma(n{j}[1], {x}[{4 + j}], hi);"]
    return "\n".join(out + [f"        acc[{r}] += s.x * dot(lo + hi, vec4<f32>(1.0)) + s.y; }}"]) + "\n"


def loop4v_source(kind: str, k: int, rw4: int) -> str:
    """The K loop over 4 blocks at a time with 4 rows a lane, each row's 20 words of them read as 5
    vec4<u32>, x from a storage or a uniform buffer (the down projection's options; K % 128 == 0)."""
    xdecl = f"var<uniform> X: array<vec4<f32>, {k // 4}>;" if kind.endswith("uniform") else \
        "var<storage, read> X: array<vec4<f32>>;"
    body = ""
    for r in range(4):
        body += "".join(f"        let w{r}_{i} = W[(row + {r}u) * {rw4}u + g * 5u + {i}u];\n" for i in range(5))
    for cc in range(4):
        body += f"        let x{cc} = array<vec4<f32>, 8>(" + \
            ", ".join(f"X[g * 32u + {cc * 8 + i}u]" for i in range(8)) + ");\n"
        for r in range(4):
            words = [f"w{r}_{(cc * 5 + i) // 4}.{'xyzw'[(cc * 5 + i) % 4]}" for i in range(5)]
            body += block_sum(str(r), words, f"x{cc}")
    return (f"@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;\n@group(0) @binding(1) {xdecl}\n"
            "@group(0) @binding(2) var<storage, read_write> Y: array<f32>;\n" + NIB +
            f"@compute @workgroup_size({WG})\n"
            "fn probe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {\n"
            f"    let row = (wid.x * {WG}u + lid) * 4u;\n    var acc = vec4<f32>(0.0);\n"
            f"    for (var g = 0u; g < {k // 128}u; g++) {{\n" + body + "    }\n"
            + "".join(f"    Y[row + {r}u] = X[0].x + acc[{r}];\n" for r in range(4)) + "}\n")


def probe_source(kind: str, k: int, rw4: int) -> str:
    """The WGSL of one probe over rows of rw4 vec4 words (K / 32 blocks of 5 words, padded)."""
    if kind.startswith("loop4v"):
        return loop4v_source(kind, k, rw4)
    if kind.startswith("loop"):
        return loop_source(kind, k, rw4)
    vec4 = kind not in ("u32", "u32_load", "select8")
    if kind.startswith("texture"):
        decl = "@group(0) @binding(0) var W: texture_2d<u32>;"
    else:
        decl = f"@group(0) @binding(0) var<storage, read> W: array<{'vec4<u32>' if vec4 else 'u32'}>;"
    body = [f"    let row = wid.x * {WG}u + lid;", "    var acc = 0.0;", "    var xs = 0u;"]
    loaded: set = set()

    def word(i: int) -> str:                         # word i of the lane's row, as a WGSL expression
        if not vec4:
            if kind != "select8":
                return f"W[row * {4 * rw4}u + {i}u]"
            e = f"W[wid.x * {WG * 4 * rw4}u + {i}u]"
            for j in range(1, WG):
                e = f"select({e}, W[wid.x * {WG * 4 * rw4}u + {j * 4 * rw4 + i}u], lid == {j}u)"
            return e
        v, c = divmod(i, 4)
        if v not in loaded:
            loaded.add(v)
            src = f"textureLoad(W, vec2<u32>({v}u, row), 0)" if kind.startswith("texture") else f"W[row * {rw4}u + {v}u]"
            body.append(f"    let v{v} = {src};")
        return f"v{v}.{'xyzw'[c]}"

    ahead = kind.endswith("_ahead")
    if ahead:                                         # chunk 0's words before any arithmetic
        for i in range(5):
            word(i)
    for c in range(k // 32):
        if ahead and c + 1 < k // 32:                 # chunk c + 1's words loaded before chunk c's arithmetic
            for i in range(5):
                word((c + 1) * 5 + i)
        if kind.endswith("_load"):
            body += [f"    xs ^= {word(c * 5 + j)};" for j in range(5)]
            continue
        body += [f"    let s{c} = unpack2x16float({word(c * 5)});",
                 f"    var lo{c} = vec4<f32>(0.0);", f"    var hi{c} = vec4<f32>(0.0);"]
        for j in range(4):
            body += [f"    let n{c}_{j} = nib({word(c * 5 + 1 + j)});",
                     f"    lo{c} = fma(n{c}_{j}[0], X[{c * 8 + j}u], lo{c});",
                     f"    hi{c} = fma(n{c}_{j}[1], X[{c * 8 + 4 + j}u], hi{c});"]
        body.append(f"    acc += s{c}.x * dot(lo{c} + hi{c}, vec4<f32>(1.0)) + s{c}.y;")
    body.append("    Y[row] = X[0].x + acc + f32(xs);")
    return (decl + "\n" + IO + NIB + f"@compute @workgroup_size({WG})\n"
            "fn probe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {\n"
            + "\n".join(body) + "\n}\n")


KINDS = ("u32", "vec4", "vec4_ahead", "u32_load", "vec4_load", "select8", "texture", "texture_load",
         "loop_x_storage", "loop_x_uniform", "loop4_x_storage", "loop4_x_uniform", "loop4v_x_storage",
         "loop4v_x_uniform")


def reference(words: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    """numpy's sums of the probes that do the arithmetic: per row, per block of 5 words, the scale
    pair's first half times the nibbles' dot with x, plus its second half; plus x[0]."""
    blocks = words[:, :k // 32 * 5].reshape(len(words), k // 32, 5)
    sd = blocks[:, :, 0].astype("<u4").view(np.float16).reshape(len(words), k // 32, 2).astype(np.float64)
    q = blocks[:, :, 1:]                                                   # (rows, chunks, 4 words)
    nib = (q[..., None] >> np.array([0, 8, 16, 24], np.uint32)) & 15       # low nibbles: [word j][byte]
    hi = (q[..., None] >> np.array([4, 12, 20, 28], np.uint32)) & 15
    xc = x.reshape(k // 32, 8, 4).astype(np.float64)                       # x chunk: vec4 0..3 low, 4..7 high
    dots = (nib * xc[None, :, :4]).sum((2, 3)) + (hi * xc[None, :, 4:]).sum((2, 3))
    return (x[0] + (sd[..., 0] * dots + sd[..., 1]).sum(1)).astype(np.float32)


class Probe:
    """A probe's pipeline and bind group on the raw wgpu device, and how long it took to build
    and run once (the compile: lavapipe compiles at the first dispatch)."""

    def __init__(self, raw, kind: str, source: str, resources: list, groups: int, sync):
        t0 = time.process_time()
        self.raw, self.kind, self.groups, self.sync = raw, kind, groups, sync
        self.pipe = raw.create_compute_pipeline(layout="auto", compute={
            "module": raw.create_shader_module(code=source), "entry_point": "probe"})
        self.bind = raw.create_bind_group(layout=self.pipe.get_bind_group_layout(0), entries=[
            {"binding": i, "resource": r} for i, r in enumerate(resources)])
        self.run(1)
        self.compile_cpu_s = time.process_time() - t0

    def run(self, n: int) -> float:
        """Process CPU seconds per dispatch of n dispatches in one submit, waited for."""
        enc = self.raw.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(self.pipe)
        cp.set_bind_group(0, self.bind)
        for _ in range(n):
            cp.dispatch_workgroups(self.groups)
        cp.end()
        c0 = time.process_time()
        self.raw.queue.submit([enc.finish()])
        self.raw.queue.read_buffer(self.sync, 0, 4)        # waits for the queue
        return (time.process_time() - c0) / n


def dump_jit(folder: Path) -> list[str]:
    """This process's anonymous executable mappings (lavapipe's JIT code) as raw files in folder."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb") as mem:
        for line in maps:
            f = line.split()
            if "x" not in f[1] or (len(f) > 5 and not f[5].startswith("[anon")):
                continue
            a, b = (int(v, 16) for v in f[0].split("-"))
            try:
                mem.seek(a)
                data = mem.read(b - a)
            except OSError:
                continue
            path = folder / f"jit_{a:x}.bin"
            path.write_bytes(data)
            out.append(str(path))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dispatches", type=int, default=100)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--dump-jit", default="")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "load_probe.json"))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.rows, a.k, a.rounds, a.dispatches = 64, 128, 1, 2
    dev = request_device_sync()
    raw = dev.raw
    rw4 = -(-(a.k // 32 * 5) // 4)
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 31, a.rows * rw4 * 4, dtype=np.uint32) & np.uint32(0x3BFF3BFF)  # finite f16 scales
    storage = wgpu.BufferUsage.STORAGE
    wbuf = raw.create_buffer_with_data(data=words.tobytes(), usage=storage)
    xs = rng.standard_normal(a.k).astype(np.float32)
    xbuf = raw.create_buffer_with_data(data=xs.tobytes(), usage=storage | wgpu.BufferUsage.UNIFORM)
    ybuf = raw.create_buffer(size=a.rows * 4, usage=storage | wgpu.BufferUsage.COPY_SRC)
    dst = raw.create_buffer(size=words.nbytes, usage=storage)
    kinds = a.kinds.split(",")
    if any(k.startswith("texture") for k in kinds):      # a row of texels per weight row (rows <= 16384)
        tex = raw.create_texture(size=(rw4, a.rows, 1), format="rgba32uint",
                                 usage=wgpu.TextureUsage.TEXTURE_BINDING | wgpu.TextureUsage.COPY_DST)
        raw.queue.write_texture({"texture": tex}, words.tobytes(),
                                {"bytes_per_row": rw4 * 16, "rows_per_image": a.rows}, (rw4, a.rows, 1))
    probes = [Probe(raw, "copy", COPY, [{"buffer": wbuf}, {"buffer": dst}], -(-words.nbytes // 1024), ybuf)]
    if a.k % 128:                               # the loop4v probes take 4 blocks a step
        kinds = [k for k in kinds if not k.startswith("loop4v")]
    for kind in kinds:
        w = tex.create_view() if kind.startswith("texture") else {"buffer": wbuf}
        probes.append(Probe(raw, kind, probe_source(kind, a.k, rw4), [w, {"buffer": xbuf}, {"buffer": ybuf}],
                            a.rows // WG // (4 if kind.startswith("loop4") else 1), ybuf))
    ref = reference(words.reshape(a.rows, rw4 * 4), xs, a.k)
    agree = {}
    for p in probes[1:]:                        # every probe that does the arithmetic gives numpy's sums
        if not p.kind.endswith("_load"):
            p.run(1)
            got = np.frombuffer(raw.queue.read_buffer(ybuf), np.float32)
            agree[p.kind] = bool(np.allclose(got, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max()))
    best = {p.kind: float("inf") for p in probes}
    for _ in range(a.rounds):                   # interleaved: each round runs every probe once
        for p in probes:
            best[p.kind] = min(best[p.kind], p.run(a.dispatches))
    weight_bytes = a.rows * (a.k // 32) * 20
    copy_rate = 2 * words.nbytes / best["copy"]
    print(f"adapter: {dev.info.name}; {a.rows} rows x K {a.k} (Q4_1 blocks, {weight_bytes} bytes); "
          f"best of {a.rounds} interleaved rounds, CPU us per dispatch")
    print(f"{'probe':14} {'cpu_us':>9} {'GB/cpu-s':>9} {'% copy':>7} {'compile_s':>9}")
    rows = []
    for p in probes:
        nbytes = 2 * words.nbytes if p.kind == "copy" else weight_bytes
        rate = nbytes / best[p.kind]
        rows.append({"probe": p.kind, "cpu_us": best[p.kind] * 1e6, "GB/cpu-s": rate / 1e9,
                     "pct_copy": 100 * rate / copy_rate, "compile_cpu_s": p.compile_cpu_s})
        r = rows[-1]
        print(f"{p.kind:14} {r['cpu_us']:9.1f} {r['GB/cpu-s']:9.2f} {r['pct_copy']:6.1f}% {r['compile_cpu_s']:9.2f}")
    print("sums equal to numpy's:", ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in agree.items()))
    result = {"adapter": dev.info.name, "rows": a.rows, "k": a.k, "rounds": a.rounds, "probes": rows, "agree": agree,
              "load": os.getloadavg()[0]}
    if a.dump_jit:
        result["jit_dumps"] = dump_jit(Path(a.dump_jit))
        print("JIT code written:", ", ".join(result["jit_dumps"]))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
