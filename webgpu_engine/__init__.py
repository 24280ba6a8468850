"""webgpu_engine: LLM and embedding engine on any WebGPU device, with WebLLM's MLCEngine API."""
__version__ = "0.1.0"

# The public engine API, imported on first use so that `import webgpu_engine` stays light.
_ENGINE_EXPORTS = ("AsyncMLCEngine", "MLCEngine", "create_mlc_engine", "create_mlc_engine_sync",
                   "EngineConfig", "AppConfig", "ModelRecord", "ChatConfig", "GenerationConfig")


def __getattr__(name: str):
    if name in _ENGINE_EXPORTS:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'webgpu_engine' has no attribute {name!r}")


# The decoder families (models/family_*.py) register their config reading with the loaders when the
# registry is imported; importing it here makes a loader called directly (GGUFFile.model_config(),
# hf_config.load_llama_config) know every family, while the loaders never import models/.
# Standard library only, like the loaders.
from .models import registry as _registry  # noqa: E402,F401

__all__ = ["__version__", *_ENGINE_EXPORTS]
