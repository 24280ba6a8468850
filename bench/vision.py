"""Image input benchmark, per family: the host's decode (PNG bytes -> RGB) and preprocessing (resize,
normalise, tiles / crops / grid, unfold into patches: vision/<family>.py), the GPU tower's time per
image (vision/runner.py build_tower: every tile's tower, projector and layout), and the tokens the
image costs, for each family's tiny test checkpoint and a synthetic real-sized SigLIP tower.

    python bench/vision.py [--runs 5] [--size 640x480] [--synthetic 384,6,224,14,64] [--synthetic-qwen25vl 1280,2,1024]
    python bench/vision.py --model DIR                  # one HF vision folder (or MLC phi3_v artifact)
    python bench/vision.py --smoke [--out PATH]

The families' tiny checkpoints: tests/fixtures/tiny_gemma3_vision (Gemma 3), tiny_idefics3
(SmolVLM), tiny_llava (LLaVA 1.5), tiny_llava_next (LLaVA 1.6), tiny_qwen25vl (Qwen2.5-VL), and a
Phi-3.5-vision MLC artifact written by tests/tinyphi3v.py (q4f16_1). A synthetic tower has random
weights of the given shape (width, layers, pixels, patch, tokens; Gemma 3's own: 1152,27,896,14,256;
its MLP 4.3x the width); a synthetic Qwen2.5-VL tower: width, layers and the most tokens of a picture
(the 3B's: 1280,32,16384 with the hub's max_pixels; a load caps pictures at 4096 tokens). Prints a table and writes bench/results/vision.json. Timing: best of --runs
after one warm-up (the machine may be shared); the tower's time runs from writing the patches to a
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


def synthetic_qwen25vl(spec: str, folder: Path) -> Path:
    """A folder holding a random Qwen2.5-VL tower of width,layers,tokens (the 3B / 7B's: 1280,32,..;
    its heads of 80, MLP 3420 / 1280 of the width, 14 px patches, windows of 112 px, a full-attention
    layer every 8th, the merger into 2048) whose pictures take up to `tokens` tokens."""
    import numpy as np

    from webgpu_engine.loaders.safetensors import write_safetensors
    C, L, n = (int(x) for x in spec.split(","))
    F, T, p, rng, t = C * 342 // 128 // 4 * 4, 2048, 14, np.random.default_rng(0), {}

    def put(name, *shape, scale=0.02, base=0.0):
        t[name] = ("f32", shape, (base + scale * rng.standard_normal(shape)).astype(np.float32).tobytes())
    put("visual.patch_embed.proj.weight", C, 3, 2, p, p)
    for i in range(L):
        a = f"visual.blocks.{i}."
        put(a + "norm1.weight", C, base=1.0)
        put(a + "norm2.weight", C, base=1.0)
        put(a + "attn.qkv.weight", 3 * C, C)
        put(a + "attn.qkv.bias", 3 * C)
        put(a + "attn.proj.weight", C, C)
        put(a + "attn.proj.bias", C)
        for proj, shape in (("gate_proj", (F, C)), ("up_proj", (F, C)), ("down_proj", (C, F))):
            put(a + f"mlp.{proj}.weight", *shape)
            put(a + f"mlp.{proj}.bias", shape[0])
    put("visual.merger.ln_q.weight", C, base=1.0)
    put("visual.merger.mlp.0.weight", 4 * C, 4 * C)
    put("visual.merger.mlp.0.bias", 4 * C)
    put("visual.merger.mlp.2.weight", T, 4 * C)
    put("visual.merger.mlp.2.bias", T)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", t)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "image_token_id": 151655,
        "text_config": {"hidden_size": T},
        "vision_config": {"depth": L, "hidden_size": C, "intermediate_size": F, "num_heads": max(1, C // 80),
                          "out_hidden_size": T, "patch_size": p, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "window_size": 112, "fullatt_block_indexes": [i for i in range(L) if i % 8 == 7] or [L - 1]}}))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": p, "merge_size": 2, "temporal_patch_size": 2,
        "min_pixels": 4 * 28 * 28, "max_pixels": n * 28 * 28}))
    return folder


def best(fn, runs: int) -> float:
    fn()                                     # warm-up (pipelines compile, caches fill)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


FAMILIES = {"gemma3": "tiny_gemma3_vision", "idefics3": "tiny_idefics3", "llava": "tiny_llava",
            "llava_next": "tiny_llava_next", "qwen25vl": "tiny_qwen25vl", "phi3v": None}


def open_tower(dev, path: Path, owner: str):
    """(cfg, tower) of an HF vision folder or an MLC phi3_v artifact, as a load builds them."""
    from webgpu_engine.vision import phi3v, qwen25vl
    from webgpu_engine.vision.runner import build_tower, read_vision_config
    if (path / "mlc-chat-config.json").is_file():
        from tokenizers import Tokenizer

        from webgpu_engine.loaders.mlc import MLCArtifact
        files = MLCArtifact(path)
        cfg = phi3v.read_config(str(path), files.chat_config.get("model_config") or {},
                                Tokenizer.from_file(str(path / "tokenizer.json")))
    else:
        from webgpu_engine.loaders.safetensors import SafetensorsFolder
        cfg, files = read_vision_config(path), SafetensorsFolder(path)
        if cfg.kind == "qwen25vl":
            cfg = qwen25vl.fit_chunk(cfg, qwen25vl.MAX_TOKENS)
    try:
        return cfg, build_tower(dev, cfg, files, owner)
    finally:
        files.close()


def measure(dev, name: str, path: Path, png: bytes, runs: int) -> dict:
    """One family's row: decode, preprocessing and tower times of the picture `png`, its tokens."""
    from webgpu_engine.kernels.common import new_tensor
    from webgpu_engine.vision.config import patches as square_patches
    from webgpu_engine.vision.images import decode_bytes
    from webgpu_engine.vision.runner import FAMILY_MODULES
    owner = f"bench:vision:{name}"
    cfg, tower = open_tower(dev, path, owner)
    fam = FAMILY_MODULES[cfg.kind]
    img = decode_bytes(png, "bench")
    unfold = getattr(fam, "patches", square_patches)

    def preprocess():
        return [unfold(cfg, t) for t in fam.tiles(cfg, img.image)]
    rows = preprocess()
    tokens = len(rows) * getattr(fam, "n_tokens", lambda c, im: c.tokens_per_image)(cfg, img.image)
    out = new_tensor(dev, (cfg.tokens_per_image, cfg.text_hidden), "f32", owner=owner, label="out")

    def run_tower():
        for r in rows:
            tower.write_patches(r)
            dev.submit(tower.record(dev.batch(), out, 0))
        dev.read_sync(out.buf, 0, 4)
    res = {"family": name, "model": path.name, "tiles": len(rows), "tokens": tokens,
           "width": cfg.hidden_size, "layers": cfg.n_layers, "patch": cfg.patch_size,
           "decode_ms": round(best(lambda: decode_bytes(png, "bench"), runs) * 1e3, 3),
           "preprocess_ms": round(best(preprocess, runs) * 1e3, 3),
           "tower_ms": round(best(run_tower, runs) * 1e3, 3)}
    tower.dispose()
    dev.release_owner(owner)
    return res


def tiny_phi3v(folder: Path) -> Path:
    """The tests' tiny Phi-3.5-vision MLC artifact (tests/tinyphi3v.py), written into `folder`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tinyphi3v import write_tiny_phi3v_mlc
    return write_tiny_phi3v_mlc(folder / "phi3v", "q4f16_1")["folder"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="one vision folder or phi3_v artifact instead of the families")
    ap.add_argument("--synthetic", default=None, metavar="C,L,S,P,N", help="a random SigLIP tower (Gemma 3's)")
    ap.add_argument("--synthetic-qwen25vl", default=None, metavar="C,L,N", help="a random Qwen2.5-VL tower")
    ap.add_argument("--size", default="640x480", help="the test picture's width x height")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="the tiny models, two runs: checks the script runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vision.json"))
    args = ap.parse_args()
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())
    import numpy as np
    from PIL import Image

    from webgpu_engine.gpu import request_device_sync

    runs = 2 if args.smoke else args.runs
    w, h = (int(x) for x in args.size.split("x"))
    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    png = buf.getvalue()
    dev = request_device_sync()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            rows.append(measure(dev, "model", Path(args.model), png, runs))
        else:
            for name, fixture in FAMILIES.items():
                path = tiny_phi3v(Path(tmp)) if fixture is None else ROOT / "tests" / "fixtures" / fixture
                rows.append(measure(dev, name, path, png, runs))
        if args.synthetic and not args.smoke:
            row = measure(dev, "siglip", synthetic_folder(args.synthetic, Path(tmp) / "tower"), png, runs)
            rows.append({**row, "model": f"synthetic {args.synthetic}"})
        if args.synthetic_qwen25vl and not args.smoke:
            path = synthetic_qwen25vl(args.synthetic_qwen25vl, Path(tmp) / "qwen")
            rows.append({**measure(dev, "qwen25vl", path, png, runs), "model": f"synthetic {args.synthetic_qwen25vl}"})
    print(f"{'family':11s} {'model':30s} {'tiles':>5s} {'tokens':>7s} {'decode ms':>10s} {'preproc ms':>11s} "
          f"{'tower ms':>9s}")
    for r in rows:
        print(f"{r['family']:11s} {r['model'][:30]:30s} {r['tiles']:5d} {r['tokens']:7d} {r['decode_ms']:10.2f} "
              f"{r['preprocess_ms']:11.2f} {r['tower_ms']:9.2f}")
    res = {"device": dev.info.name, "picture": f"{w}x{h} PNG", "runs": runs, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
