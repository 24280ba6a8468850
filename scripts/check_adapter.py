"""Exit 0 when wgpu finds a Vulkan/Metal/D3D12 adapter, 1 otherwise (used by `make setup`)."""
import os
import sys

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
try:
    import wgpu
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
except Exception as e:  # noqa: BLE001 - no driver at all
    print(f"no WebGPU adapter: {e}")
    sys.exit(1)
if adapter is None or adapter.info.get("backend_type") not in ("Vulkan", "Metal", "D3D12"):
    print("no Vulkan/Metal/D3D12 WebGPU adapter found")
    sys.exit(1)
print(f"WebGPU adapter: {adapter.info.get('device')} ({adapter.info.get('backend_type')})")
