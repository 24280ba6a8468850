"""Mixture-of-experts decode: weight bytes a decode step reads and its time, for models that differ
only in how many experts each layer holds (the same k per token), so a decode that reads only the
chosen experts takes the same bytes and about the same time whatever E.

    python bench/moe.py [--experts 8,64] [--k 2] [--hidden 512] [--ffn 512] [--layers 2] [--steps 24]
    python bench/moe.py --smoke [--out PATH]   (tiny shapes, one short run: checks the script runs)

Each model is tests/tinymoe.py's Qwen3-MoE GGUF (f32, random weights) at these shapes. "read MB" is
the weight bytes the decode step's kernels read, from their dispatches' layout: every dense matrix
whole (q|k|v, o, the router, the LM head), one embedding row, and per MoE layer the k chosen experts'
gate|up and down rows (moe_matmul / moe_down dispatch k slots of N rows each); "expert MB" is every
expert's bytes, what a dense read of the stacks would take. Decode ms: the median of --steps single
decode steps (each submitted and its logits read back) after one warm-up step. Prints a table and
writes bench/results/moe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from webgpu_engine.gpu import request_device_sync  # noqa: E402
from webgpu_engine.models.experts import decode_weight_bytes  # noqa: E402
from webgpu_engine.models.registry import open_model  # noqa: E402


def run(dev, E: int, k: int, hidden: int, ffn: int, layers: int, steps: int) -> dict:
    import tinymoe
    from decoder_runner import DecoderRunner
    dims = dict(n_experts=E, n_experts_used=k, expert_ffn=ffn, hidden_size=hidden, n_layers=layers, n_heads=8,
                n_kv_heads=4, head_dim=hidden // 8, context_length=256, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = tinymoe.write_tiny_moe_gguf("qwen3moe", Path(tmp) / "m.gguf", **dims)["path"]
        m = open_model(path)
        try:
            run = DecoderRunner(dev, m.config, m.weights, owner="bench:moe", context_window=256, chunk=16)
            try:
                run.prefill(list(range(3, 19)), {16})
                run.decode(5, 16)
                times = []
                for pos in range(17, 17 + steps):
                    t0 = time.perf_counter()
                    run.decode(7 + pos % 50, pos)
                    times.append(time.perf_counter() - t0)
                read, experts = decode_weight_bytes(run.model)
            finally:
                run.release()
        finally:
            m.close()
    return {"experts": E, "k": k, "read_bytes": read, "expert_bytes": experts,
            "decode_ms": 1e3 * statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="8,64")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe.json"))
    a = ap.parse_args()
    if a.smoke:
        a.experts, a.hidden, a.ffn, a.layers, a.steps = "4", 64, 64, 1, 2
    dev = request_device_sync()
    rows = [run(dev, int(E), a.k, a.hidden, a.ffn, a.layers, a.steps) for E in a.experts.split(",")]
    print(f"{'E':>4} {'k':>3} {'read MB':>9} {'expert MB':>10} {'decode ms':>10}   ({dev.info.description})")
    for r in rows:
        print(f"{r['experts']:>4} {r['k']:>3} {r['read_bytes'] / 1e6:>9.2f} {r['expert_bytes'] / 1e6:>10.2f} "
              f"{r['decode_ms']:>10.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"adapter": dev.info.description, "args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
