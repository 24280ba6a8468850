"""WebLLM's prebuilt model ids (webgpu_engine/webllm_catalogue.py) and whether this engine loads each:
the table `list --webllm` prints. Reads the catalogue only (no network, no files)."""
from __future__ import annotations

import json


def webllm_rows() -> list[dict]:
    """One dict per WebLLM prebuilt model: its catalogue fields, `loads`, and `refused` (why not)."""
    from ..loaders.mlc import refusal
    from ..models import registry  # noqa: F401  (registers the families whose MLC model_types refusal reads)
    from ..webllm_catalogue import WEBLLM_MODELS
    rows = []
    for m in WEBLLM_MODELS:
        why = refusal(m.family, m.quantization, m.model_type)
        rows.append({**m._asdict(), "loads": not why, "refused": why})
    return rows


def print_webllm(as_json: bool = False) -> int:
    from ..webllm_catalogue import WEBLLM_VERSION
    rows = webllm_rows()
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'MODEL ID':52s} {'FAMILY':9s} {'QUANT':8s} {'CONTEXT':>7s}  LOADS")
    for r in rows:
        print(f"{r['model_id']:52s} {r['family'] or '-':9s} {r['quantization'] or '-':8s} "
              f"{r['context_window_size'] or '-':>7}  {'yes' if r['loads'] else 'no: ' + r['refused']}")
    print(f"\n{sum(r['loads'] for r in rows)} of {len(rows)} (web-llm {WEBLLM_VERSION}) load by id, e.g. "
          f"chat --model {rows[0]['model_id']}")
    return 0


__all__ = ["print_webllm", "webllm_rows"]
