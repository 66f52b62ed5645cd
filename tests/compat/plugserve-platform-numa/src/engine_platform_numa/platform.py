"""The `numa` platform: a CPU platform that claims the machine only where Linux reports several
NUMA nodes, and budgets memory from the node the engine runs on (node 0)."""

from __future__ import annotations

import pathlib

import torch

from engine.platforms import Platform

NODES = pathlib.Path("/sys/devices/system/node")


def _nodes() -> list[pathlib.Path]:
    return sorted(NODES.glob("node[0-9]*")) if NODES.is_dir() else []


def _meminfo_kib(node: pathlib.Path, key: str) -> int:
    for line in (node / "meminfo").read_text().splitlines():
        # "Node 0 MemTotal:       16384000 kB"
        fields = line.split()
        if len(fields) >= 4 and fields[2] == f"{key}:":
            return int(fields[3])
    raise RuntimeError(f"{node}/meminfo has no {key}")


class NumaPlatform(Platform):
    name = "numa"
    device_type = "cpu"

    def is_available(self) -> bool:
        return len(_nodes()) > 1

    def unavailable_reason(self) -> str:
        return f"this machine has {len(_nodes())} NUMA node(s); the numa platform needs at least 2"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def distributed_backend(self) -> str:
        return "gloo"

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        node = _nodes()[0]
        return _meminfo_kib(node, "MemFree") * 1024, _meminfo_kib(node, "MemTotal") * 1024

    def default_attention_backend(self) -> str:
        return "torch_native"

    def default_dtype(self) -> torch.dtype:
        return torch.float32
