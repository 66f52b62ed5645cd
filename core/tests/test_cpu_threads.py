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


@pytest.mark.parametrize("v2,v1,expected", [
    ("max 100000\n", None, None),
    ("150000 100000\n", None, 2),  # 1.5 CPUs: two threads can run at once
    ("50000 100000\n", None, 1),
    (None, ("200000", "100000"), 2),
    (None, ("-1", "100000"), None),  # v1 without a quota
    (None, None, None),
])
def test_cgroup_cpu_limit(tmp_path: pathlib.Path, v2: str | None, v1: tuple[str, str] | None,
                          expected: int | None) -> None:
    v2_path, quota, period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    if v2 is not None:
        v2_path.write_text(v2)
    if v1 is not None:
        quota.write_text(v1[0])
        period.write_text(v1[1])
    assert cgroup_cpu_limit(str(v2_path), str(quota), str(period)) == expected


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
