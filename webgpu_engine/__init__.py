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


__all__ = ["__version__", *_ENGINE_EXPORTS]
