"""`python -m webgpu_engine.cache download MODEL_ID... | ls | rm MODEL_ID...` (see cli.py)."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
