"""The ``cuda`` platform plugin: NVIDIA GPUs through PyTorch's CUDA build.

Importing this module registers the platform only; CUDA is probed (and
initialised) when the platform's methods are called.
"""

from __future__ import annotations

from engine.hookspecs import PlatformSpec, hookimpl


@hookimpl
def register_platforms(register):  # type: ignore[no-untyped-def]
    register(PlatformSpec(
        name="cuda", factory="engine_platform_cuda.platform:CudaPlatform", device_type="cuda",
        description="NVIDIA GPUs via PyTorch CUDA (NCCL, CUDA graphs, flashinfer/triton attention)",
        tested_on_hardware="NVIDIA H100 80GB, H200 (GPU test suite, benchmarks)",
    ))
