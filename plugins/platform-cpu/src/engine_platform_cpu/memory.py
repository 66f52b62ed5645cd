"""What memory this process can use on a CPU machine: /proc/meminfo bounded by the cgroup's limit.

The readers take their paths as arguments so tests can point them at simulated files.
"""

from __future__ import annotations

import os

# cgroup v1 and v2 write "no limit" as a huge number (or "max"); anything above this is unlimited.
_UNLIMITED = 1 << 60


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes by key; empty when it cannot be read (not Linux)."""
    values: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    values[key] = int(fields[0]) * 1024
    except OSError:
        pass
    return values


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _inactive_file(stat_path: str) -> int:
    """Page cache the kernel reclaims before it would OOM-kill: counted as usable."""
    try:
        with open(stat_path, encoding="ascii") as f:
            stats = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
    except OSError:
        return 0
    for key in ("total_inactive_file", "inactive_file"):  # v1 (hierarchical), v2
        if key in stats and stats[key].isdigit():
            return int(stats[key])
    return 0


def _cgroup_dirs(proc_cgroup: str, root: str) -> list[str]:
    """Directories of this process's memory cgroup and its ancestors (all of their limits apply)."""
    try:
        with open(proc_cgroup, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = os.path.join(root, "memory")  # v1: the memory controller's own hierarchy
            break
        if controllers == "" and os.path.exists(os.path.join(root, "cgroup.controllers")):
            base = root  # v2: one unified hierarchy
            break
    else:
        return []
    dirs: list[str] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(base, *parts[:depth])
        if os.path.isdir(directory):
            dirs.append(directory)
    return dirs


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(headroom, limit) bytes of the tightest memory cgroup above this process; None if unlimited."""
    best: tuple[int, int] | None = None
    for directory in _cgroup_dirs(proc_cgroup, root):
        for limit_name, usage_name in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            limit = _read_int(os.path.join(directory, limit_name))
            if limit is None:
                continue
            usage = _read_int(os.path.join(directory, usage_name)) or 0
            usage -= _inactive_file(os.path.join(directory, "memory.stat"))
            headroom = max(0, limit - max(0, usage))
            if best is None or headroom < best[0]:
                best = (headroom, limit)
    return best


def usable_memory(meminfo_path: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                  cgroup_root: str = "/sys/fs/cgroup") -> tuple[int, int]:
    """(available, total) bytes this process may still take: the machine's, bounded by its cgroup."""
    info = read_meminfo(meminfo_path)
    total = info.get("MemTotal", 8 << 30)
    available = info.get("MemAvailable", info.get("MemFree", total // 2))
    limit = cgroup_limit(proc_cgroup, cgroup_root)
    if limit is not None:
        available = min(available, limit[0])
        total = min(total, limit[1])
    return min(available, total), total
