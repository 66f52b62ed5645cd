"""XPU platform: Intel GPUs through PyTorch's ``torch.xpu`` (PyTorch 2.5+, no extension needed).

- devices ``xpu:i`` (``ZE_AFFINITY_MASK`` selects which), memory from ``torch.xpu.mem_get_info``;
- collectives: the ``xccl`` backend of torch.distributed (PyTorch 2.8+; oneCCL underneath);
- attention: ``torch_native``, or ``triton`` where Intel's Triton backend is installed **and**
  the triton attention plugin declares ``xpu`` in its ``device_types`` (it does not yet: its
  kernels have run on NVIDIA GPUs and the CPU interpreter only);
- no graph capture, no overlap schedule, no fp8 arithmetic.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Collection
from pathlib import Path

import torch

from engine.platforms import Platform

DEFAULT_MEM_FRACTION_STATIC = 0.85


def _xpu_module():  # type: ignore[no-untyped-def]
    return getattr(torch, "xpu", None)


def intel_triton_present() -> bool:
    """Whether the installed Triton has Intel's XPU backend (``triton/backends/intel``), found
    on disk without importing triton."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(p) / "backends" / "intel").is_dir() for p in spec.submodule_search_locations)


def _triton_backend_runs_on_xpu() -> bool:
    """Whether the registered ``triton`` attention backend lists ``xpu`` in its device types."""
    from engine import plugins
    from engine.errors import PluginError

    try:
        return "xpu" in plugins.get_attention_backend("triton").device_types
    except PluginError:
        return False


class XpuPlatform(Platform):
    """Intel GPUs: XCCL collectives, bf16, eager decode."""

    name = "xpu"
    device_type = "xpu"

    def is_available(self) -> bool:
        module = _xpu_module()
        return module is not None and bool(module.is_available())

    def unavailable_reason(self) -> str:
        if _xpu_module() is None:
            return (f"torch {torch.__version__} has no XPU support (torch.xpu missing); install torch from "
                    "the XPU index (https://download.pytorch.org/whl/xpu)")
        if not torch.xpu.is_available():
            mask = os.environ.get("ZE_AFFINITY_MASK")
            hint = f" (ZE_AFFINITY_MASK={mask!r})" if mask is not None else ""
            return (f"no Intel GPU visible to torch {torch.__version__} through torch.xpu{hint}; "
                    "a CPU/CUDA build of torch never sees one")
        return "available"

    def device_count(self) -> int:
        return int(torch.xpu.device_count()) if self.is_available() else 0

    def device(self, local_rank: int = 0) -> torch.device:
        count = self.device_count()
        if count and not 0 <= local_rank < count:
            raise ValueError(f"local rank {local_rank} has no XPU: {count} visible (xpu:0..xpu:{count - 1}); "
                             "lower --tp-size or widen ZE_AFFINITY_MASK")
        return torch.device("xpu", local_rank)

    def set_device(self, device: torch.device) -> None:
        torch.xpu.set_device(device)

    def distributed_backend(self) -> str:
        return "xccl"

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        free, total = torch.xpu.mem_get_info(device)
        return int(free), int(total)

    def default_mem_fraction_static(self) -> float:
        return DEFAULT_MEM_FRACTION_STATIC

    def default_attention_backend(self, available: Collection[str] = ()) -> str:
        if "triton" in available and intel_triton_present() and _triton_backend_runs_on_xpu():
            return "triton"
        return "torch_native"

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float16, torch.float32)

    def unsupported_quant_reason(self, name: str) -> str | None:
        if "fp8" in name:
            return "the fp8 kernels and fallbacks were written for CUDA and the CPU, never validated on Intel GPUs"
        return None

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def empty_cache(self) -> None:
        torch.xpu.empty_cache()

    def describe(self) -> str:
        """e.g. ``xpu:0 Intel(R) Data Center GPU Max 1550 (64.0 GiB), torch 2.8.0+xpu``."""
        if not self.is_available():
            return f"xpu (unavailable: {self.unavailable_reason()})"
        index = torch.xpu.current_device()
        props = torch.xpu.get_device_properties(index)
        return f"xpu:{index} {props.name} ({props.total_memory / 2**30:.1f} GiB), torch {torch.__version__}"
