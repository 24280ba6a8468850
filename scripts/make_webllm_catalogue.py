"""Write webgpu_engine/webllm_catalogue.py from WebLLM's prebuilt app config: its `src/config.ts`, or
the npm package's `lib/index.js` (the same object literals, compiled).

    python scripts/make_webllm_catalogue.py path/to/web-llm/src/config.ts VERSION
    npm pack @mlc-ai/web-llm@0.2.86 && tar xzf mlc-ai-web-llm-0.2.86.tgz &&
        python scripts/make_webllm_catalogue.py package/lib/index.js 0.2.86

Reads each record of `prebuiltAppConfig.model_list` (commented-out ones skipped): model_id, the
Hugging Face repo its `model` URL names, model_type, vram_required_MB, low_resource_required and the
context_window_size of its overrides. The family is read from the id (WebLLM's list does not say it;
the artifact's mlc-chat-config.json does, and decides at load): a family this engine does not run
(Qwen3.5's hybrid linear attention, Gemma 4) is named as MLC names it, so `list --webllm` refuses it
by that name instead of taking it for the family its id starts like.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

# id prefix (lower case) -> MLC model_type; first match wins, unknown ones are ""
FAMILY_PREFIXES = (
    ("deepseek-r1-distill-qwen", "qwen2"), ("deepseek-r1-distill-llama", "llama"), ("qwen3.5", "qwen3_5"),
    ("qwen3", "qwen3"),
    ("qwen2", "qwen2"), ("qwen1.5", "qwen2"), ("llama", "llama"), ("hermes-2-theta-llama", "llama"),
    ("hermes-2-pro-llama", "llama"), ("hermes-3-llama", "llama"), ("hermes-2-pro-mistral", "mistral"),
    ("openhermes", "mistral"), ("neuralhermes", "mistral"), ("wizardmath", "mistral"), ("mistral", "mistral"),
    ("ministral-3", "ministral3"), ("ministral", "mistral"), ("smollm", "llama"), ("tinyllama", "llama"), ("phi-3.5-vision", "phi3_v"),
    ("phi-3", "phi3"), ("phi-4", "phi3"), ("phi-2", "phi"), ("phi-1", "phi"), ("gemma-4", "gemma4"), ("gemma-3", "gemma3"), ("gemma3", "gemma3"),
    ("gemma-2-", "gemma2"), ("gemma", "gemma"), ("redpajama", "gpt_neox"), ("stablelm", "stablelm"),
    ("snowflake-arctic-embed", "bert"), ("olmo-2", "olmo2"),
)


def family(model_id: str) -> str:
    low = model_id.lower()
    return next((f for p, f in FAMILY_PREFIXES if low.startswith(p)), "")


def records(source: str) -> list[dict]:
    text = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("//"))
    body = text[text.index("prebuiltAppConfig"):]
    out = []
    for chunk in re.split(r"\n\s*\{\s*\n\s*model:", body)[1:]:
        url = re.match(r'\s*"([^"]+)"', chunk)
        mid = re.search(r'model_id:\s*"([^"]+)"', chunk)
        if not url or not mid:
            continue
        repo = "/".join(url.group(1).rstrip("/").split("/")[-2:])
        ctx = re.search(r"context_window_size:\s*(\d+)", chunk)
        vram = re.search(r"vram_required_MB:\s*([\d.]+)", chunk)
        kind = re.search(r"model_type:\s*ModelType\.(\w+)", chunk)
        quant = re.search(r"-(q\d+(?:f|bf)\d+(?:_\d+)?)-MLC", mid.group(1))
        out.append(dict(model_id=mid.group(1), repo=repo,
                        model_type={"embedding": "embedding", "VLM": "vlm"}.get(kind.group(1), "llm") if kind else "llm",
                        family=family(mid.group(1)), quantization=quant.group(1) if quant else "",
                        context_window_size=int(ctx.group(1)) if ctx else 0,
                        vram_required_MB=float(vram.group(1)) if vram else 0.0,
                        low_resource_required="low_resource_required: true" in chunk))
    return out


def main() -> None:
    src, version = Path(sys.argv[1]), sys.argv[2]
    rows = records(src.read_text(encoding="utf-8"))
    lines = [
        '"""WebLLM\'s prebuilt models (its `prebuiltAppConfig`, web-llm ' + version + "): each id, the",
        "mlc-ai repo that holds its MLC artifact, type, family (read from the id; the artifact's",
        "mlc-chat-config.json decides at load), quantisation, context window and WebLLM's VRAM figure.",
        "Written by scripts/make_webllm_catalogue.py; do not edit by hand. Standard library only.",
        '"""',
        "from __future__ import annotations",
        "",
        "from typing import NamedTuple",
        "",
        f'WEBLLM_VERSION = "{version}"',
        "",
        "",
        "class WebLLMModel(NamedTuple):",
        "    model_id: str",
        "    repo: str",
        "    model_type: str              # llm | embedding | vlm",
        "    family: str                  # MLC model_type, from the id",
        "    quantization: str",
        "    context_window_size: int     # WebLLM's override (0: the artifact's)",
        "    vram_required_MB: float",
        "    low_resource_required: bool",
        "",
        "",
        "WEBLLM_MODELS = (",
    ]
    for r in rows:
        lines.append(f"    WebLLMModel({r['model_id']!r}, {r['repo']!r}, {r['model_type']!r}, {r['family']!r}, "
                     f"{r['quantization']!r}, {r['context_window_size']}, {r['vram_required_MB']}, "
                     f"{r['low_resource_required']}),")
    lines += [")", "WEBLLM_BY_ID = {m.model_id: m for m in WEBLLM_MODELS}", "",
              '__all__ = ["WEBLLM_BY_ID", "WEBLLM_MODELS", "WEBLLM_VERSION", "WebLLMModel"]', ""]
    out = Path(__file__).resolve().parent.parent / "webgpu_engine" / "webllm_catalogue.py"
    out.write_text("\n".join(lines), encoding="utf-8")
    print(f"{len(rows)} models -> {out}")


if __name__ == "__main__":
    main()
