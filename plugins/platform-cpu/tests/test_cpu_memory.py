"""What the CPU platform counts as usable memory, and the default KV budget, on simulated readings."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_platform_cpu import memory
from engine_platform_cpu.platform import (
    DEFAULT_KV_CAP_BYTES,
    DEFAULT_KV_FLOOR_BYTES,
    DEFAULT_MEM_FRACTION_STATIC,
    CpuPlatform,
)

GiB = 1 << 30


def _meminfo(tmp_path: Path, total: int, available: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {total // 1024} kB\nMemFree:        {available // 2048} kB\n"
                    f"MemAvailable:   {available // 1024} kB\nHugePages_Total:       0\n")
    return str(path)


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_meminfo_without_cgroup(tmp_path: Path) -> None:
    info = _meminfo(tmp_path, 24 * GiB, 22 * GiB)
    assert memory.usable_memory(info, str(tmp_path / "no-cgroup"), str(tmp_path)) == (22 * GiB, 24 * GiB)


def test_cgroup_v2_limit_bounds_available_and_total(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/worker\n")
    root = tmp_path / "sys"
    _write(root, cgroup_controllers="cpu memory\n")
    _write(root / "job", memory_max=str(6 * GiB), memory_current=str(5 * GiB), memory_stat="inactive_file 0\n")
    # The leaf's own limit is looser; the parent's is what binds.
    _write(root / "job" / "worker", memory_max="max", memory_current=str(1 * GiB),
           memory_stat=f"anon 1\ninactive_file {GiB // 2}\n")
    info = _meminfo(tmp_path, 24 * GiB, 20 * GiB)
    assert memory.usable_memory(info, str(proc), str(root)) == (1 * GiB, 6 * GiB)


def test_cgroup_v1_reclaimable_cache_counts_as_usable(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/\n4:memory:/box\n0::/\n")
    root = tmp_path / "sys"
    _write(root / "memory", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes="0")
    _write(root / "memory" / "box", memory_limit_in_bytes=str(4 * GiB), memory_usage_in_bytes=str(3 * GiB),
           memory_stat=f"cache 5\ntotal_inactive_file {GiB}\n")
    info = _meminfo(tmp_path, 24 * GiB, 20 * GiB)
    assert memory.usable_memory(info, str(proc), str(root)) == (2 * GiB, 4 * GiB)


def test_default_budget_ignores_what_other_processes_use() -> None:
    """The old rule (total * fraction - others' use - weights) gave 0 on a busy machine."""
    cpu = CpuPlatform()
    weights = 300 << 20
    quiet = cpu.kv_cache_budget(3 * GiB, 3 * GiB, 4 * GiB, weights, None)
    busy = cpu.kv_cache_budget(3 * GiB, 3 * GiB, 64 * GiB, weights, None)  # 61 GiB used by others
    assert quiet == busy == int(3 * GiB * DEFAULT_MEM_FRACTION_STATIC) - weights
    assert DEFAULT_KV_FLOOR_BYTES < quiet < DEFAULT_KV_CAP_BYTES  # the share itself, not a bound


def test_default_budget_has_a_floor_and_a_cap() -> None:
    cpu = CpuPlatform()
    # Weights larger than the default share: the floor still gives a working pool.
    assert cpu.kv_cache_budget(1 * GiB, 0, 24 * GiB, 600 << 20, None) == DEFAULT_KV_FLOOR_BYTES
    # Almost nothing left after the weights: at most half of what is left, never more.
    left = 100 << 20
    assert cpu.kv_cache_budget(GiB + left, 0, 24 * GiB, GiB, None) == left // 2
    assert cpu.kv_cache_budget(512 * GiB, 0, 1024 * GiB, GiB, None) == DEFAULT_KV_CAP_BYTES


def test_explicit_fraction_is_a_share_of_available_memory() -> None:
    cpu = CpuPlatform()
    assert cpu.kv_cache_budget(10 * GiB, 0, 24 * GiB, GiB, 0.5) == 4 * GiB  # no cap when asked for
    assert cpu.kv_cache_budget(10 * GiB, 0, 24 * GiB, GiB, 0.05) < 0  # too small: the runner says so


def test_memory_info_reads_this_machine() -> None:
    free, total = CpuPlatform().memory_info(None)  # type: ignore[arg-type]
    assert 0 < free <= total


@pytest.mark.parametrize("text", ["max\n", "9223372036854771712\n", "garbage\n"])
def test_unlimited_or_unreadable_limits_are_ignored(tmp_path: Path, text: str) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    root = tmp_path / "sys"
    _write(root, cgroup_controllers="memory\n", memory_max=text, memory_current="0")
    assert memory.cgroup_limit(str(proc), str(root)) is None
