"""webgpu_engine: LLM and embedding engine on any WebGPU device, with WebLLM's MLCEngine API."""
__version__ = "0.1.0"
