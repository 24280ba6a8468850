"""Image input benchmark: per image, the host's decode (PNG bytes -> RGB) and preprocessing (resize,
normalise, unfold into patches: vision/gemma3.py) and the GPU tower (models/siglip.py: SigLIP, pool,
projection), and the tokens an image costs, for a Gemma 3 vision folder or a synthetic tower.

    python bench/vision.py [--model DIR] [--runs 5] [--size 640x480]
    python bench/vision.py --synthetic 384,6,224,14,64 [--runs 3]     # width, layers, pixels, patch, tokens
    python bench/vision.py --smoke [--out PATH]

Default model: the tiny test model (tests/fixtures/tiny_gemma3_vision: figures of a toy). A
synthetic tower has random weights of the given shape (Gemma 3's own: 1152,27,896,14,256; its MLP
4.3x the width). Prints a table and writes bench/results/vision.json. Timing: best of --runs after
one warm-up (the machine may be shared); the tower's time runs from writing the patches to a
blocking readback of its output.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TINY = ROOT / "tests" / "fixtures" / "tiny_gemma3_vision"


def synthetic_folder(spec: str, folder: Path) -> Path:
    """A folder holding a random SigLIP tower + Gemma 3 projector of width,layers,pixels,patch,tokens."""
    import numpy as np

    from webgpu_engine.loaders.safetensors import write_safetensors
    C, L, S, p, n = (int(x) for x in spec.split(","))
    F, Ct, N = (C * 43 // 10 + 3) // 4 * 4, 640, (S // p) ** 2
    rng = np.random.default_rng(0)
    t = {}

    def put(name, *shape, scale=0.02, base=0.0):
        t[name] = ("f32", shape, (base + scale * rng.standard_normal(shape)).astype(np.float32).tobytes())
    put("vision_tower.embeddings.patch_embedding.weight", C, 3, p, p)
    put("vision_tower.embeddings.patch_embedding.bias", C)
    put("vision_tower.embeddings.position_embedding.weight", N, C)
    for i in range(L):
        a = f"vision_tower.encoder.layers.{i}."
        for ln in ("layer_norm1", "layer_norm2"):
            put(a + ln + ".weight", C, base=1.0)
            put(a + ln + ".bias", C)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            put(a + f"self_attn.{proj}.weight", C, C)
            put(a + f"self_attn.{proj}.bias", C)
        put(a + "mlp.fc1.weight", F, C)
        put(a + "mlp.fc1.bias", F)
        put(a + "mlp.fc2.weight", C, F)
        put(a + "mlp.fc2.bias", C)
    put("vision_tower.post_layernorm.weight", C, base=1.0)
    put("vision_tower.post_layernorm.bias", C)
    put("multi_modal_projector.mm_soft_emb_norm.weight", C)
    put("multi_modal_projector.mm_input_projection_weight", C, Ct)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", t)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": n,
        "text_config": {"hidden_size": Ct},
        "vision_config": {"hidden_size": C, "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads":
                          max(1, C // 64), "image_size": S, "patch_size": p, "layer_norm_eps": 1e-6}}))
    return folder


def best(fn, runs: int) -> float:
    fn()                                     # warm-up (pipelines compile, caches fill)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(TINY))
    ap.add_argument("--synthetic", default=None, metavar="C,L,S,P,N")
    ap.add_argument("--size", default="640x480", help="the test picture's width x height")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="the tiny model, two runs: checks the script runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vision.json"))
    args = ap.parse_args()
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())
    import numpy as np
    from PIL import Image

    from webgpu_engine.gpu import request_device_sync
    from webgpu_engine.kernels.common import new_tensor
    from webgpu_engine.loaders.safetensors import SafetensorsFolder
    from webgpu_engine.models.siglip import SiglipTower
    from webgpu_engine.vision.config import patches
    from webgpu_engine.vision.runner import read_vision_config
    from webgpu_engine.vision.gemma3 import preprocess
    from webgpu_engine.vision.images import decode_bytes

    runs = 2 if args.smoke else args.runs
    with tempfile.TemporaryDirectory() as tmp:
        folder = synthetic_folder(args.synthetic, Path(tmp) / "tower") if args.synthetic and not args.smoke \
            else Path(args.model)
        cfg = read_vision_config(folder)
        dev = request_device_sync()
        files = SafetensorsFolder(folder)
        try:
            tower = SiglipTower(dev, cfg, files.tensors, owner="bench:vision")
        finally:
            files.close()
    w, h = (int(x) for x in args.size.split("x"))
    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    png = buf.getvalue()
    img = decode_bytes(png, "bench")
    rows = patches(cfg, preprocess(cfg, img.image))
    out = new_tensor(dev, (cfg.tokens_per_image, cfg.text_hidden), "f32", owner="bench:vision", label="out")

    def run_tower():
        tower.write_patches(rows)
        dev.submit(tower.record(dev.batch(), out, 0))
        dev.read_sync(out.buf, 0, 4)
    decode_s = best(lambda: decode_bytes(png, "bench"), runs)
    pre_s = best(lambda: patches(cfg, preprocess(cfg, img.image)), runs)
    tower_s = best(run_tower, runs)
    tower.dispose()
    dev.release_owner("bench:vision")
    res = {"device": dev.info.name, "model": str(args.synthetic or folder.name),
           "picture": f"{w}x{h} PNG", "pixels": cfg.image_size, "patch": cfg.patch_size, "width": cfg.hidden_size,
           "layers": cfg.n_layers, "patches": cfg.patches_per_side ** 2, "tokens_per_image": cfg.tokens_per_image,
           "decode_ms": round(decode_s * 1e3, 3), "preprocess_ms": round(pre_s * 1e3, 3),
           "tower_ms": round(tower_s * 1e3, 3), "runs": runs}
    print(f"{'model':28s} {'picture':>12s} {'patches':>8s} {'tokens':>7s} {'decode ms':>10s} "
          f"{'preproc ms':>11s} {'tower ms':>9s}")
    print(f"{res['model'][:28]:28s} {res['picture']:>12s} {res['patches']:8d} {res['tokens_per_image']:7d} "
          f"{res['decode_ms']:10.2f} {res['preprocess_ms']:11.2f} {res['tower_ms']:9.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
