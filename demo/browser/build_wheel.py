"""Builds the project's pure-Python wheel into demo/browser/vendor/wheels and writes the manifest the
page reads (which wheels to install, in order). Run from anywhere: `python demo/browser/build_wheel.py`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WHEELS = HERE / "vendor" / "wheels"


def build() -> Path:
    WHEELS.mkdir(parents=True, exist_ok=True)
    for old in WHEELS.glob("webgpu_engine-*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEELS), str(ROOT)],
                   check=True)
    wheel = next(WHEELS.glob("webgpu_engine-*.whl"))
    # Dependencies first: the project wheel's chat template imports jinja2, which imports markupsafe.
    deps = sorted(p.name for p in WHEELS.glob("*.whl") if not p.name.startswith("webgpu_engine-"))
    deps.sort(key=lambda n: 0 if n.lower().startswith("markupsafe") else 1)
    (WHEELS / "manifest.json").write_text(json.dumps({"wheels": deps + [wheel.name]}, indent=1))
    return wheel


if __name__ == "__main__":
    print(build())
