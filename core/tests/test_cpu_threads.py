"""engine.cpu_threads: how many threads each process computes with, and that children get them."""

from __future__ import annotations

import os
import pathlib

import pytest

from engine.cpu_threads import cgroup_cpu_limit, compute_threads, pool_env, usable_cores


def test_the_scheduler_gets_the_cores_less_one_split_over_the_ranks() -> None:
    assert compute_threads(None, 1, environ={}, cores=2) == 1
    assert compute_threads(None, 1, environ={}, cores=16) == 15
    assert compute_threads(None, 2, environ={}, cores=16) == 7
    assert compute_threads(None, 8, environ={}, cores=4) == 1  # never below one


def test_the_flag_then_omp_num_threads_override_the_default() -> None:
    assert compute_threads(None, 1, environ={"OMP_NUM_THREADS": "3"}, cores=16) == 3
    assert compute_threads(6, 1, environ={"OMP_NUM_THREADS": "3"}, cores=16) == 6
    # Not a positive integer: ignored, as torch ignores it.
    assert compute_threads(None, 1, environ={"OMP_NUM_THREADS": "0"}, cores=16) == 15
    assert compute_threads(None, 1, environ={"OMP_NUM_THREADS": "many"}, cores=16) == 15


def test_usable_cores_follow_the_affinity() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this system")
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def _tree(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("proc,files,expected", [
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: two threads can run at once
    ("0::/\n", {"cpu.max": "50000 100000\n"}, 1),
    # A systemd slice on a host: the process's own cgroup, and the smallest limit up the tree.
    ("0::/a.slice/b.service\n", {"a.slice/b.service/cpu.max": "max 100000\n", "a.slice/cpu.max": "300000 100000\n",
                                  "cpu.max": "max 100000\n"}, 3),
    ("4:memory:/x\n1:cpu,cpuacct:/docker/c1\n0::/\n",
     {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n"}, 2),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
    ("", {}, None),
])
def test_cgroup_cpu_limit(tmp_path: pathlib.Path, proc: str, files: dict[str, str], expected: int | None) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    _tree(root, files)
    (tmp_path / "proc_cgroup").write_text(proc)
    assert cgroup_cpu_limit(str(root), str(tmp_path / "proc_cgroup")) == expected


def test_a_child_starts_with_the_pool_sizes_it_is_given() -> None:
    from engine.entrypoints.child_process import ChildProcess, pipe

    reader, writer = pipe()
    proc = ChildProcess("engine.testing.child_targets:report_thread_env", (writer,), name="probe",
                        env=pool_env(3))
    try:
        assert reader.poll(120), "the child reported nothing"
        report = reader.recv()
    finally:
        proc.join(30)
        proc.kill()
    assert report["OMP_NUM_THREADS"] == "3" and report["MKL_NUM_THREADS"] == "3"
    assert report["torch_threads"] == 3 and report["interop_threads"] == 1
