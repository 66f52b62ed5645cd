"""NPU platform: Huawei Ascend NPUs through Ascend's PyTorch adapter ``torch_npu``.

``import torch_npu`` registers the ``npu`` device type and ``torch.npu`` (the same API shape
as ``torch.cuda``). It is imported lazily, by ``is_available()`` (the registry's probe) and the
methods that need a device, so importing or constructing the platform costs nothing on a
machine without it. Collectives: ``hccl``; attention: ``torch_native``; no fp8, no graph capture.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Collection
from typing import Any

import torch

from engine.platforms import Platform

VENDOR_MODULE = "torch_npu"
DEFAULT_MEM_FRACTION_STATIC = 0.85


def vendor_library_installed() -> bool:
    """Whether ``torch_npu`` can be found (found, not imported)."""
    try:
        return importlib.util.find_spec(VENDOR_MODULE) is not None
    except (ImportError, ValueError):
        return False


def _npu() -> Any:
    """``torch.npu``, importing ``torch_npu`` on first use (it registers the module)."""
    importlib.import_module(VENDOR_MODULE)
    return torch.npu  # type: ignore[attr-defined]


class NpuPlatform(Platform):
    """Ascend NPUs: HCCL collectives, torch_native attention, eager decode."""

    name = "npu"
    device_type = "npu"

    def __init__(self) -> None:
        self._import_error = ""

    def is_available(self) -> bool:
        if not vendor_library_installed():
            return False
        try:
            return bool(_npu().is_available())
        except Exception as exc:  # a torch_npu that does not match this torch raises on import
            self._import_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            return False

    def unavailable_reason(self) -> str:
        if not vendor_library_installed():
            return (f"vendor library {VENDOR_MODULE} (Ascend's PyTorch adapter) is not installed; "
                    "install the torch_npu matching torch and the CANN toolkit")
        if self.is_available():
            return "available"
        if self._import_error:
            return f"import {VENDOR_MODULE} failed: {self._import_error}"
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        hint = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"no Ascend NPU visible to {VENDOR_MODULE}{hint}"

    def device_count(self) -> int:
        return int(_npu().device_count()) if self.is_available() else 0

    def device(self, local_rank: int = 0) -> torch.device:
        count = self.device_count()
        if count and not 0 <= local_rank < count:
            raise ValueError(f"local rank {local_rank} has no NPU: {count} visible (npu:0..npu:{count - 1}); "
                             "lower --tp-size or widen ASCEND_RT_VISIBLE_DEVICES")
        return torch.device("npu", local_rank)

    def set_device(self, device: torch.device) -> None:
        _npu().set_device(device)

    def distributed_backend(self) -> str:
        return "hccl"

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        free, total = _npu().mem_get_info(device)
        return int(free), int(total)

    def default_mem_fraction_static(self) -> float:
        return DEFAULT_MEM_FRACTION_STATIC

    def default_attention_backend(self, available: Collection[str] = ()) -> str:
        return "torch_native"

    def default_dtype(self) -> torch.dtype:
        # Atlas A2 (910B) computes in bf16; the older 910A only in fp16.
        if self.is_available() and not _npu().is_bf16_supported():
            return torch.float16
        return torch.bfloat16

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16:
            return self.is_available() and bool(_npu().is_bf16_supported())
        return dtype in (torch.float16, torch.float32)

    def fp8_dtype(self, device: torch.device | None = None) -> torch.dtype | None:
        return None

    def unsupported_quant_reason(self, name: str) -> str | None:
        if "fp8" in name:
            return "Ascend NPUs have no float8 arithmetic"
        return None

    def synchronize(self) -> None:
        _npu().synchronize()

    def empty_cache(self) -> None:
        _npu().empty_cache()

    def describe(self) -> str:
        """e.g. ``npu:0 Ascend910B2 (64.0 GiB), torch_npu 2.6.0.post1, torch 2.6.0``."""
        if not self.is_available():
            return f"npu (unavailable: {self.unavailable_reason()})"
        npu = _npu()
        index = npu.current_device()
        props = npu.get_device_properties(index)
        version = getattr(importlib.import_module(VENDOR_MODULE), "__version__", "?")
        return f"npu:{index} {props.name} ({props.total_memory / 2**30:.1f} GiB), {VENDOR_MODULE} {version}, torch {torch.__version__}"
