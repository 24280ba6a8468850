#!/usr/bin/env bash
# GPU check: one prepared run of the kernel families on a machine with a real GPU and Vulkan (or
# Metal / DX12), from a clean checkout, in under 10 minutes. It sets up (make setup), prints the
# adapter (info), runs the matmul tuner on SmolLM2 (profile stored in the artifact cache),
# bench/kernels.py --family (GB/s and GFLOP/s per kernel variant, the tuner's picks), and short
# runs of bench/llm.py and bench/embeddings.py with the GPU family (as loaded by default, the
# tuned profile where stored) and with the CPU family for comparison; then writes one JSON.
#
#     bash bench/gpu_check.sh [OUT_JSON]        (default bench/results/gpu_check.json)
#     GPU_CHECK_SKIP_SETUP=1 bash bench/gpu_check.sh     (a rerun: the checkout is set up already)
#
# Every step has its own time limit; a failed or timed-out step is recorded (rc, seconds, the tail
# of its log) and the next step runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu_check.json}
WORK=$(mktemp -d)
PY=.venv/bin/python
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
: > "$WORK/steps.tsv"

step() {   # step NAME LIMIT_S COMMAND...: run, log to $WORK/NAME.log, record rc and seconds
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (at most ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$WORK/steps.tsv"
    tail -n 5 "$WORK/$name.log"
    echo "-- $name: rc $rc, $(( $(date +%s) - t0 )) s"
}

if [ -z "${GPU_CHECK_SKIP_SETUP:-}" ]; then
    step setup 190 make setup
fi
step info 30 "$PY" -m webgpu_engine info --json
step tune 110 "$PY" -m webgpu_engine tune --budget-s 50 --json "$WORK/tune.json"
step kernels 90 "$PY" bench/kernels.py --family --runs 2 --min-s 0.05 --out "$WORK/kernels_family.json"
step llm_gpu 45 "$PY" bench/llm.py --decode 32 --prompts 256 --reps 1 --out "$WORK/llm_gpu.json"
step llm_cpu 45 env WEBGPU_ENGINE_KERNELS=cpu "$PY" bench/llm.py --decode 32 --prompts 256 --reps 1 \
    --out "$WORK/llm_cpu.json"
step embeddings_gpu 40 "$PY" bench/embeddings.py --n 64 --dtypes f32 --out "$WORK/embeddings_gpu.json"
step embeddings_cpu 40 env WEBGPU_ENGINE_KERNELS=cpu "$PY" bench/embeddings.py --n 64 --dtypes f32 \
    --out "$WORK/embeddings_cpu.json"

mkdir -p "$(dirname "$OUT")"
python3 - "$WORK" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
def load(name):
    p = work / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
steps = []
for line in (work / "steps.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    log = (work / f"{name}.log").read_text(errors="replace") if (work / f"{name}.log").exists() else ""
    steps.append({"step": name, "rc": int(rc), "seconds": int(secs), "log_tail": log[-3000:]})
doc = {"steps": steps, "info": load("info.log"), "tune": load("tune.json"),
       "kernels_family": load("kernels_family.json"), "llm": {"gpu": load("llm_gpu.json"), "cpu": load("llm_cpu.json")},
       "embeddings": {"gpu": load("embeddings_gpu.json"), "cpu": load("embeddings_cpu.json")}}
out.write_text(json.dumps(doc, indent=1))
print(f"wrote {out}: " + ", ".join(f"{s['step']} rc {s['rc']} ({s['seconds']} s)" for s in steps))
EOF
