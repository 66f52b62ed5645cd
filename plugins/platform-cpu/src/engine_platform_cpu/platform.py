"""CPU platform: gloo collectives, memory from /proc/meminfo, torch_native attention."""

from __future__ import annotations

import os
import platform as _platform

import torch

from engine.platforms import Platform


def _meminfo() -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def distributed_backend(self) -> str:
        return "gloo"

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        info = _meminfo()
        total = info.get("MemTotal", 8 << 30)
        return info.get("MemAvailable", total // 2), total

    def default_mem_fraction_static(self) -> float:
        # The CPU's memory is everyone's; take a small share by default.
        return 0.1

    def default_attention_backend(self) -> str:
        return "torch_native"

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def describe(self) -> str:
        return f"cpu ({_platform.processor() or _platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__})"
