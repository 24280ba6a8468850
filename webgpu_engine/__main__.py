"""`python -m webgpu_engine ...`: the command line (see cli/)."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
