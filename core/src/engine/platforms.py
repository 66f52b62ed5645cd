"""The hardware-platform contract (CUDA, ROCm, XPU, NPU, CPU).

Platform plugins subclass ``Platform``; the core asks it everything device
specific so that no other module tests for CUDA by hand.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any

import torch


class Platform(ABC):
    """Probes and policies of one kind of device."""

    #: short name, as in ``--platform``.
    name: str = ""
    #: torch device type ("cuda", "cpu", "xpu", "npu"; ROCm reports "cuda").
    device_type: str = ""

    @abstractmethod
    def is_available(self) -> bool:
        """True when this machine has a usable device of this platform."""

    def unavailable_reason(self) -> str:
        """Why ``is_available()`` is False, for error messages."""
        return "no device found"

    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device a worker of this local rank runs on."""
        return torch.device(self.device_type, local_rank) if self.device_type != "cpu" else torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        """Makes ``device`` current for the calling process (no-op where meaningless)."""

    @abstractmethod
    def distributed_backend(self) -> str:
        """torch.distributed backend for collectives ("nccl", "gloo", "hccl", "xccl")."""

    @abstractmethod
    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(free bytes, total bytes) of device memory available to the engine."""

    @abstractmethod
    def default_attention_backend(self, available: Collection[str]) -> str:
        """Attention backend used when ``--attention`` is not given.

        Args:
            available: the attention backends installed and enabled in this run (hook API 2;
                an implementation may leave the argument out). Never return a name outside it
                when one of yours is in it: the engine fails on a default that is not available.
        """

    def default_mem_fraction_static(self) -> float:
        """Share of device memory for weights + KV pool when ``--mem-fraction-static`` is unset."""
        return 0.85

    def kv_cache_budget(self, free_at_start: int, free_now: int, total: int, weight_bytes: int,
                        fraction: float | None) -> int:
        """Bytes the KV pool may take when ``--max-total-tokens`` is not given.

        Args:
            free_at_start: ``memory_info()[0]`` before the weights were loaded.
            free_now: ``memory_info()[0]`` after the weights were loaded.
            total: ``memory_info()[1]``.
            weight_bytes: bytes of the model's parameters and buffers.
            fraction: ``--mem-fraction-static``; None means the platform's default.

        The default suits a device the engine owns (a GPU, as in SGLang): weights and pool
        together take ``fraction`` of the device, less what other processes held at start.
        A platform whose memory is shared with everything (the CPU) overrides it.
        """
        fraction = fraction or self.default_mem_fraction_static()
        weights = max(0, free_at_start - free_now)
        return int(total * fraction - weights - (total - free_at_start))

    def default_dtype(self) -> torch.dtype:
        """Activation dtype for ``--dtype auto`` when the checkpoint gives none usable."""
        return torch.bfloat16

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return True

    def supports_graph_capture(self) -> bool:
        """Whether decode steps can be captured and replayed as device graphs."""
        return False

    def supports_overlap_schedule(self) -> bool:
        """Whether the CPU can prepare batch N+1 while the device runs batch N."""
        return False

    def layer_kernels(self) -> dict[str, Any]:
        """Fused kernels the layer SDK may use on this platform, by name.

        Known names: ``rms_norm(x, weight, eps, residual=None)``, ``silu_and_mul(x)``,
        ``rotary_inplace(positions, x, cos_cache, sin_cache, head_dim, rotary_dim)``,
        ``rotary_qk_inplace(positions, q, k, cos_cache, sin_cache, head_dim, rotary_dim)`` and
        ``store_kv(k_cache, v_cache, loc, k, v)`` (the KV pool's write). Layers and the pool
        fall back to their PyTorch code for names not given. Default: none.
        """
        return {}

    def synchronize(self) -> None:
        """Blocks until the current device finished its queued work."""

    def empty_cache(self) -> None:
        """Returns cached allocator memory to the device."""

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)

    def describe(self) -> str:
        """One line naming the device; the scheduler logs it at start-up (``platform: ...``)."""
        return self.name
