"""CPU platform: gloo collectives, memory this process can use, torch_native attention."""

from __future__ import annotations

import os
import platform as _platform
from collections.abc import Collection

import torch

from engine.platforms import Platform
from engine_platform_cpu.memory import usable_memory

# Default KV pool: this share of the memory available when the engine starts, less the
# weights, kept between a floor (a busy machine still gets a working pool) and a cap (a big
# machine is not taken over: CPU memory is shared with everything). The pool's pages become
# resident as KV is written (``zeroed_buffer``), so its size costs nothing at start.
DEFAULT_MEM_FRACTION_STATIC = 0.2
DEFAULT_KV_FLOOR_BYTES = 128 << 20
DEFAULT_KV_CAP_BYTES = 512 << 20


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def distributed_backend(self) -> str:
        return "gloo"

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(available, total) bytes for this process: MemAvailable, bounded by its memory cgroup."""
        return usable_memory()

    def default_mem_fraction_static(self) -> float:
        return DEFAULT_MEM_FRACTION_STATIC

    def kv_cache_budget(self, free_at_start: int, free_now: int, total: int, weight_bytes: int,
                        fraction: float | None) -> int:
        """A share of what was available at start, less the weights; never of what others use.

        ``free_now`` is not used: other processes allocate and free while the weights load,
        so the weights are counted from the model's tensors instead.
        """
        after_weights = max(0, free_at_start - weight_bytes)
        if fraction is not None:  # an explicit --mem-fraction-static is taken as given
            return min(int(free_at_start * fraction) - weight_bytes, after_weights)
        share = int(free_at_start * DEFAULT_MEM_FRACTION_STATIC) - weight_bytes
        # Never more than half of what the weights leave: the process still needs activations.
        floor = min(DEFAULT_KV_FLOOR_BYTES, after_weights // 2)
        return min(max(share, floor), DEFAULT_KV_CAP_BYTES)

    def default_attention_backend(self, available: Collection[str] = ()) -> str:
        # The reference backend is the only CPU one we ship; if it is disabled the engine says so.
        return "torch_native"

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def describe(self) -> str:
        return f"cpu ({_platform.processor() or _platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__})"
