"""Run Python code as the page runs the package: in a fresh interpreter where the native-only
dependencies (compiled ones, and those built on numpy) cannot be imported."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('pydantic', 'aiohttp', 'numpy', 'wgpu', 'tokenizers', 'llguidance',
                                  'jsonschema', 'gguf', 'safetensors'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
"""


def run_without_compiled(code: str) -> subprocess.CompletedProcess:
    """`code` run after the blocker, from the repository root; its stdout and stderr captured."""
    return subprocess.run([sys.executable, "-c", _BLOCK + code], check=False, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent)
