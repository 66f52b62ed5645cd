"""CUDA platform: NVIDIA GPUs through PyTorch's CUDA build.

Every probe is lazy: constructing ``CudaPlatform`` or importing this module never
initialises CUDA, so the registry can ask ``is_available()`` in any process
(tokenizer side included) without creating a device context.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import weakref
from collections.abc import Collection
from typing import Any

import torch

from engine.errors import ConfigError
from engine.platforms import TorchCudaPlatform, device_index
from engine_platform_cuda import DEFAULT_OPTIONS

#: Attention backend preferred when its plugin is registered and ``flashinfer`` imports.
PREFERRED_ATTENTION = "flashinfer"
#: Always-available GPU attention backend (this project's own Triton kernels).
FALLBACK_ATTENTION = "triton"

# Share of GPU memory for weights + KV pool when --mem-fraction-static is unset. SGLang
# uses 0.88 on 80 GB-class GPUs (H100/H200/A100-80G): the remaining 12% holds
# activations, CUDA-graph memory pools, the NCCL buffers and the attention workspaces.
# Smaller cards need a lower value; operators set --mem-fraction-static there.
DEFAULT_MEM_FRACTION_STATIC = 0.88

# fp8 KV caches / weights need Ada (sm_89) or newer for native conversion instructions.
_FP8_MIN_CAPABILITY = (8, 9)
# Rows the skinny GEMM computes at most (``gemv.MAX_ROWS``; not imported: it imports triton).
_GEMV_ROWS_LIMIT = 16
# Weight steps the skinny GEMM may request before its PDL wait (``gemv.MAX_PDL_STEPS``).
_PDL_STEPS_LIMIT = 4
# Most MiB ``cuda.l2_prefetch_mb`` stages a layer (the H100's L2 holds 50 MB).
_L2_PREFETCH_MB_LIMIT = 64
# What ``cuda.l2_prefetch_mb=auto`` stages on a single GPU, in decode graphs of at most
# ``AUTO_L2_PREFETCH_ROWS`` tokens: the best amount at the Qwen3-30B-A3B shape on an H100 (2 to 16 MiB
# measured). At batch 1 it was faster for every model measured; at batch 64 the change was within
# -1.4% to +0.8%, so larger graphs get none (docs/cuda_kernels.md). Under tensor or pipeline parallelism,
# where it has not run, auto is off.
AUTO_L2_PREFETCH_MB = 6
AUTO_L2_PREFETCH_ROWS = 8


def _flashinfer_importable() -> bool:
    """True when the ``flashinfer`` package can be found (found, not imported: importing
    it pulls in CUDA libraries and JIT machinery)."""
    return importlib.util.find_spec("flashinfer") is not None


class CudaPlatform(TorchCudaPlatform):
    """NVIDIA GPUs: NCCL collectives, CUDA graphs, overlap scheduling, bf16 by default."""

    name = "cuda"
    device_type = "cuda"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = _parse_options(options or {})
        # One L2Prefetcher a model (its hooks stay on the model), dropped with the model.
        self._prefetchers: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()

    # -- availability ------------------------------------------------------
    def is_available(self) -> bool:
        """A CUDA (not ROCm) build of torch that sees at least one GPU."""
        # ROCm builds also answer torch.cuda.is_available(); they belong to a rocm platform.
        return torch.version.hip is None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.hip is not None:
            return (f"torch {torch.__version__} is a ROCm build (HIP {torch.version.hip}); "
                    "the cuda platform needs a CUDA build (use a rocm platform plugin)")
        if torch.version.cuda is None:
            return (f"torch {torch.__version__} is a CPU-only build; "
                    "install a CUDA build of torch to use the cuda platform")
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return f"no CUDA GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda}){hint}"
        return "available"

    # -- memory ------------------------------------------------------------
    def default_mem_fraction_static(self) -> float:
        return DEFAULT_MEM_FRACTION_STATIC

    # -- policies ----------------------------------------------------------
    def default_attention_backend(self, available: Collection[str]) -> str:
        """``flashinfer`` when it is enabled and the library is installed, else ``triton``.

        ``available`` holds the enabled backends (``--disable-plugin`` applied), so a disabled
        flashinfer is never picked; if triton is not available either, the engine reports it.
        """
        if PREFERRED_ATTENTION in available and _flashinfer_importable():
            return PREFERRED_ATTENTION
        return FALLBACK_ATTENTION

    def default_dtype(self) -> torch.dtype:
        """bfloat16 where the GPU has it (sm_80+), else float16 (V100, T4)."""
        if self.is_available() and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if not self.is_available():
            return False
        if dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return torch.cuda.get_device_capability() >= _FP8_MIN_CAPABILITY
        return dtype in (torch.float16, torch.float32)

    def fp8_dtype(self, device: torch.device | None = None) -> torch.dtype | None:
        """``float8_e4m3fn`` on sm_89+ (Ada, Hopper, Blackwell), None on older GPUs."""
        if not self.is_available():
            return None
        capability = torch.cuda.get_device_capability(device_index(device))
        return torch.float8_e4m3fn if capability >= _FP8_MIN_CAPABILITY else None

    # -- housekeeping --------------------------------------------------------
    def layer_kernels(self) -> dict[str, Any]:
        """Fused Triton kernels (RMSNorm+residual, SiLU-and-mul, in-place rotary, KV store), unless
        ``cuda.qkv_prologue`` is off the decode-step attention prologue ``qkv_prologue``, unless
        ``cuda.gemv`` is off the skinny GEMM ``linear`` for unquantized linear layers (with the
        RMSNorm before it folded in unless ``cuda.norm_fusion`` is off), and with ``cuda.argmax`` on
        the sampler's greedy ``argmax``."""
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return {}
        from engine_platform_cuda.gemv import supports_pdl
        from engine_platform_cuda.kernels import layer_kernels

        rows = self.options["gemv_max_rows"] if self.options["gemv"] else 0
        pdl = self.options["pdl"] and self.is_available() and supports_pdl()
        return layer_kernels(gemv_max_rows=rows, qkv_prologue=self.options["qkv_prologue"], pdl=pdl,
                             norm_fusion=self.options["norm_fusion"], pdl_preload=self.options["pdl_preload"],
                             argmax=self.options["argmax"])

    def decode_capture_context(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """With ``cuda.l2_prefetch_mb`` on an sm_90+ GPU: each layer's capture also stages the next
        layer's qkv weight in L2 from a side stream (``l2_prefetch.L2Prefetcher``)."""
        mb, max_rows = self.l2_prefetch_plan()
        if mb == 0 or importlib.util.find_spec("triton") is None:
            return contextlib.nullcontext()
        from engine_platform_cuda.l2_prefetch import L2Prefetcher, supports_l2_prefetch

        if not supports_l2_prefetch():
            return contextlib.nullcontext()
        if model not in self._prefetchers:
            self._prefetchers[model] = L2Prefetcher(model, mb, max_rows)
        return self._prefetchers[model].capture()

    def l2_prefetch_plan(self) -> tuple[int, int | None]:
        """``cuda.l2_prefetch_mb`` resolved for this process: (MiB staged a layer, most tokens of a
        decode graph that stages; None: any). A number applies to every decode graph; ``auto`` is
        ``AUTO_L2_PREFETCH_MB`` in graphs of up to ``AUTO_L2_PREFETCH_ROWS`` tokens when the model
        runs on one GPU, and off when it is split over tensor- or pipeline-parallel ranks."""
        mb = self.options["l2_prefetch_mb"]
        if mb != "auto":
            return int(mb), None
        from engine.distributed import get_pipeline_model_parallel_world_size, get_tensor_model_parallel_world_size

        single = get_tensor_model_parallel_world_size() == 1 and get_pipeline_model_parallel_world_size() == 1
        return (AUTO_L2_PREFETCH_MB, AUTO_L2_PREFETCH_ROWS) if single else (0, None)

    def seed_everything(self, seed: int) -> None:
        # torch.manual_seed seeds every CUDA device's generator too (lazily, no context needed).
        torch.manual_seed(seed)

    def describe(self) -> str:
        """e.g. ``cuda:0 NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB, 132 SMs), CUDA 13.0, torch 2.11.0``."""
        if not self.is_available():
            return f"cuda (unavailable: {self.unavailable_reason()})"
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return (
            f"cuda:{index} {props.name} (sm_{props.major}{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs), "
            f"CUDA {torch.version.cuda}, torch {torch.__version__}"
        )


def _parse_options(options: dict[str, Any]) -> dict[str, Any]:
    """``DEFAULT_OPTIONS`` overridden by ``options``; a clear error for a bad key or value."""
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ConfigError(f"plugin_options: unknown option 'cuda.{unknown[0]}'; declared: "
                          + ", ".join(f"cuda.{k}" for k in DEFAULT_OPTIONS))
    parsed = {**DEFAULT_OPTIONS, **options}
    for key in ("gemv", "qkv_prologue", "pdl", "norm_fusion", "argmax"):
        if not isinstance(parsed[key], bool):
            raise ConfigError(f"plugin_options: cuda.{key}: invalid value {parsed[key]!r}; "
                              "accepted: on/true or off/false")
    rows = parsed["gemv_max_rows"]
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= _GEMV_ROWS_LIMIT:
        raise ConfigError(f"plugin_options: cuda.gemv_max_rows: invalid value {rows!r}; "
                          f"accepted: an int from 1 to {_GEMV_ROWS_LIMIT}")
    steps = parsed["pdl_preload"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= _PDL_STEPS_LIMIT:
        raise ConfigError(f"plugin_options: cuda.pdl_preload: invalid value {steps!r}; "
                          f"accepted: an int from 1 to {_PDL_STEPS_LIMIT}")
    mb = parsed["l2_prefetch_mb"]
    if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, int) or not 0 <= mb <= _L2_PREFETCH_MB_LIMIT):
        raise ConfigError(f"plugin_options: cuda.l2_prefetch_mb: invalid value {mb!r}; "
                          f"accepted: auto or an int from 0 (off) to {_L2_PREFETCH_MB_LIMIT}")
    return parsed
