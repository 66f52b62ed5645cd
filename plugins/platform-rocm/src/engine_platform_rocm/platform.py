"""ROCm platform: AMD GPUs through a HIP build of PyTorch.

A ROCm build keeps PyTorch's CUDA API: devices are ``torch.device("cuda", i)``, queried
through ``torch.cuda``, collectives go through the ``nccl`` backend (RCCL behind it), and
``torch.cuda.CUDAGraph`` captures HIP graphs. What differs from NVIDIA and is decided here:

- fp8: MI300-class GPUs (gfx942) compute in ``float8_e4m3fnuz`` (bias 8, no negative zero);
  MI350-class (gfx950) and RDNA4 (gfx12xx) in the OCP ``float8_e4m3fn``; older ones have none.
  The architecture comes from ``get_device_properties(i).gcnArchName``: HIP's
  ``get_device_capability`` is not a feature level like CUDA's compute capability.
- attention: ``triton`` (this project's kernels under ROCm's Triton); FlashInfer has no ROCm build.
- quantization: the methods whose Triton kernels embed NVIDIA PTX are refused by name.

Every probe is lazy; constructing the platform never initialises HIP.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

import torch

from engine.platforms import TorchCudaPlatform, device_index

DEFAULT_ATTENTION = "triton"
# Same reasoning as the cuda platform's 0.88 (SGLang's value for large-memory GPUs): the rest
# holds activations, graph pools, RCCL buffers and attention workspaces.
DEFAULT_MEM_FRACTION_STATIC = 0.88

#: gfx architecture prefix -> the e4m3 fp8 format its matrix cores use.
FP8_BY_ARCH: dict[str, torch.dtype] = {
    "gfx942": torch.float8_e4m3fnuz,  # MI300X / MI300A / MI325X
    "gfx950": torch.float8_e4m3fn,    # MI350X / MI355X (OCP formats)
    "gfx12": torch.float8_e4m3fn,     # RDNA4 (Radeon RX 9000, AI PRO R9700)
}
#: the e5m2 sibling of each e4m3 format (KV caches may store either).
_E5M2_OF = {torch.float8_e4m3fnuz: torch.float8_e5m2fnuz, torch.float8_e4m3fn: torch.float8_e5m2}

_PTX = ("its Triton kernels embed NVIDIA PTX (tl.inline_asm_elementwise), which ROCm's Triton "
        "cannot compile")
#: quantization methods refused on ROCm, with the reason.
UNSUPPORTED_QUANT: dict[str, str] = {
    "gguf": _PTX + "; without --quant a GGUF checkpoint still loads, dequantized at load",
    "awq": _PTX + " (the shared W4A16 kernels of plugserve-quant-wna16)",
    "gptq": _PTX + " (the shared W4A16 kernels of plugserve-quant-wna16)",
    "compressed-tensors": _PTX + " (its W4A16 schemes use the plugserve-quant-wna16 kernels)",
}
#: attention backends refused on ROCm, with the reason.
UNSUPPORTED_ATTENTION: dict[str, str] = {
    "flashinfer": "FlashInfer is built for NVIDIA GPUs only (no ROCm build); use triton",
}


def gfx_arch(props: Any) -> str:
    """``gfx942`` from ``gcnArchName`` (``gfx942:sramecc+:xnack-``); "" when torch gives none."""
    return str(getattr(props, "gcnArchName", "") or "").split(":")[0]


def fp8_for_arch(arch: str) -> torch.dtype | None:
    for prefix, dtype in FP8_BY_ARCH.items():
        if arch.startswith(prefix):
            return dtype
    return None


class RocmPlatform(TorchCudaPlatform):
    """AMD GPUs: RCCL (torch's ``nccl`` backend), HIP graphs, overlap scheduling, bf16."""

    name = "rocm"
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    device_type = "cuda"

    # -- availability ------------------------------------------------------
    def is_available(self) -> bool:
        """A ROCm build of torch (``torch.version.hip``) that sees at least one GPU."""
        return getattr(torch.version, "hip", None) is not None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if getattr(torch.version, "hip", None) is None:
            build = f"a CUDA build (CUDA {torch.version.cuda})" if torch.version.cuda else "a CPU-only build"
            return (f"torch {torch.__version__} is {build}, not a ROCm build (torch.version.hip is None); "
                    "install torch from a ROCm index (https://download.pytorch.org/whl/rocm6.4)")
        if not torch.cuda.is_available():
            visible = {k: os.environ[k] for k in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                                                  "CUDA_VISIBLE_DEVICES") if k in os.environ}
            hint = f" ({', '.join(f'{k}={v!r}' for k, v in visible.items())})" if visible else ""
            return f"no AMD GPU visible to torch {torch.__version__} (HIP {torch.version.hip}){hint}"
        return "available"

    # -- memory ------------------------------------------------------------
    def default_mem_fraction_static(self) -> float:
        return DEFAULT_MEM_FRACTION_STATIC

    # -- policies ----------------------------------------------------------
    def default_attention_backend(self, available: Collection[str] = ()) -> str:
        """``triton``; ``torch_native`` only when triton is disabled or not installed."""
        if DEFAULT_ATTENTION in available or "torch_native" not in available:
            return DEFAULT_ATTENTION
        return "torch_native"

    def unsupported_attention_reason(self, name: str) -> str | None:
        return UNSUPPORTED_ATTENTION.get(name)

    def unsupported_quant_reason(self, name: str) -> str | None:
        return UNSUPPORTED_QUANT.get(name)

    def arch(self, device: torch.device | None = None) -> str:
        """The gfx architecture of ``device`` (default: the current one), e.g. ``gfx942``."""
        return gfx_arch(torch.cuda.get_device_properties(device_index(device)))

    def fp8_dtype(self, device: torch.device | None = None) -> torch.dtype | None:
        """``float8_e4m3fnuz`` on gfx942, ``float8_e4m3fn`` on gfx950 / gfx12, else None."""
        if not self.is_available():
            return None
        return fp8_for_arch(self.arch(device))

    def default_dtype(self) -> torch.dtype:
        if self.is_available() and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if not self.is_available():
            return False
        if dtype == torch.bfloat16:
            return bool(torch.cuda.is_bf16_supported())
        if dtype in (torch.float16, torch.float32):
            return True
        native = self.fp8_dtype()
        return native is not None and dtype in (native, _E5M2_OF[native])

    # -- housekeeping --------------------------------------------------------
    def describe(self) -> str:
        """e.g. ``rocm cuda:0 AMD Instinct MI300X (gfx942, 191.5 GiB, 304 CUs), HIP 6.4, torch 2.8.0``."""
        if not self.is_available():
            return f"rocm (unavailable: {self.unavailable_reason()})"
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return (f"rocm cuda:{index} {props.name} ({gfx_arch(props) or 'unknown gfx'}, "
                f"{props.total_memory / 2**30:.1f} GiB, {getattr(props, 'multi_processor_count', '?')} CUs), "
                f"HIP {torch.version.hip}, torch {torch.__version__}")
