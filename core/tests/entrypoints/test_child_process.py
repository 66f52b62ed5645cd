"""Engine children are fresh interpreters: a script without a __main__ guard can use Engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.entrypoints.child_process import ChildProcess

# Every run of the script's top level appends a line to the marker file: multiprocessing's
# spawn would run it again in each child (and crash building a second Engine there).
_GUARDLESS = textwrap.dedent("""
    import os, sys
    with open(sys.argv[2], "a") as marker:
        marker.write(f"{os.getpid()}\\n")
    from engine import Engine
    engine = Engine(model_path=sys.argv[1], max_total_tokens=1024)
    out = engine.generate("Hello", {"max_new_tokens": 3})
    print("children", *[p.pid for p in engine.runtime.processes])
    print("completion_tokens", out["meta_info"]["completion_tokens"])
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_engine_in_a_script_without_main_guard(llama_ckpt: str, tmp_path: Path) -> None:
    script = tmp_path / "guardless.py"
    script.write_text(_GUARDLESS)
    marker = tmp_path / "ran"
    proc = subprocess.run([sys.executable, str(script), llama_ckpt, str(marker)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["completion_tokens"] == "3"
    assert len(marker.read_text().split()) == 1, "a child re-ran the user's main module"
    # The script never called shutdown(): its children went with it.
    deadline = time.monotonic() + 5
    children = [int(pid) for pid in lines["children"].split()]
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def test_child_exit_codes_follow_multiprocessing() -> None:
    child = ChildProcess("os:_exit", (3,), name="exits")
    child.join(30)
    assert child.exitcode == 3 and not child.is_alive()
    sleeper = ChildProcess("time:sleep", (60,), name="sleeps")
    assert sleeper.is_alive() and sleeper.exitcode is None
    sleeper.kill()
    sleeper.join(10)
    assert sleeper.exitcode == -9


def test_a_users_file_cannot_shadow_our_modules(tmp_path: Path) -> None:
    """The child imports ``engine`` before the parent's sys.path is installed: not from the cwd."""
    (tmp_path / "engine.py").write_text("raise SystemExit(7)\n")
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        child = ChildProcess("os:_exit", (0,), name="shadowed")
        child.join(30)
    finally:
        os.chdir(old)
    assert child.exitcode == 0


def test_detokenizer_gets_the_tokenizer_and_never_loads_torch(llama_ckpt: str) -> None:
    from engine import Engine

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc to see a process's shared libraries")
    with Engine(model_path=llama_ckpt, max_total_tokens=1024) as engine:
        out = engine.generate("Hello", {"max_new_tokens": 2})
        assert out["meta_info"]["completion_tokens"] == 2 and engine.tokenizer is engine.runtime.tokenizer
        scheduler, detokenizer = engine.runtime.processes
        with open(f"/proc/{scheduler.pid}/maps") as f:
            assert "libtorch" in f.read()  # the probe sees torch where it is loaded
        with open(f"/proc/{detokenizer.pid}/maps") as f:
            assert "libtorch" not in f.read(), "the detokenizer imported torch"


_FORKING = textwrap.dedent("""
    import decimal, sys, time
    from engine.entrypoints.child_process import ChildProcess, allow_forked_children, can_fork_children

    assert allow_forked_children() and can_fork_children()
    # The child has what this process imported (decimal: a fresh interpreter would not), and
    # computes on two threads without hanging.
    code = ("import sys, torch; torch.set_num_threads(2); torch.randn(512, 512).exp().matmul(torch.ones(512, 8)); "
            "sys.exit(5 if 'decimal' in sys.modules else 1)")
    child = ChildProcess("builtins:exec", (code,), name="forked")
    child.join(60)
    sleeper = ChildProcess("time:sleep", (60,), name="sleeps")
    assert sleeper.is_alive() and sleeper.exitcode is None
    sleeper.kill()
    sleeper.join(10)
    print(child.exitcode, sleeper.exitcode)
""")


def test_the_engines_commands_fork_children_that_share_their_imports(tmp_path: Path) -> None:
    from engine.entrypoints.child_process import _cpu_only_torch

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux")
    # Decided before the run (torch is not imported), so that a refusal on a CPU-only torch fails.
    if not _cpu_only_torch():
        pytest.skip("torch here has a device runtime: children start fresh")
    script = tmp_path / "forking.py"
    script.write_text(_FORKING)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["5", "-9"]


def test_a_process_that_imported_torch_first_starts_fresh_children() -> None:
    import torch  # noqa: F401  (this test process computed with it already)

    from engine.entrypoints.child_process import allow_forked_children, can_fork_children

    assert not allow_forked_children() and not can_fork_children()
