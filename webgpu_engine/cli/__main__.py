"""`python -m webgpu_engine.cli ...`: the same command line as `python -m webgpu_engine ...`."""
from . import main

if __name__ == "__main__":
    raise SystemExit(main())
