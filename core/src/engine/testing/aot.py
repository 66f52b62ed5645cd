"""Ahead-of-time compile checks of Triton kernels for a GPU this machine may not have.

A plugin's test file doubles as a script: run as ``__main__`` it compiles its kernels for the
target (e.g. sm_90, with Triton's bundled ptxas) and prints one JSON line of facts about the
generated code (vector loads, async copies, spills ...). The test runs that script in a fresh
interpreter without ``TRITON_INTERPRET`` (which the workspace conftest sets on a machine
without a GPU, and which would turn ``triton.compile`` into the interpreter) and asserts on the
facts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import pytest


def compiled_facts(script: str, timeout: float) -> dict[str, Any]:
    """Runs ``script`` (a test file's ``__main__``) in a fresh interpreter without
    ``TRITON_INTERPRET`` and returns the JSON object on its last line of output; skips the test
    where this Triton has no bundled ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip(f"this triton has no bundled ptxas: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return facts


def ptxas_report(ptx: str, arch: int = 90) -> str:
    """What Triton's bundled ptxas says (``-v``: registers, spills) compiling ``ptx`` for
    ``sm_{arch}a``; raises ``CalledProcessError`` if it fails to compile."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", "--gpu-name", f"sm_{arch}a", src, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True)
    return proc.stderr


def spill_bytes(ptx: str, arch: int = 90) -> int:
    """Bytes of register spill stores ptxas reports for ``ptx`` (0: none)."""
    return sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", ptxas_report(ptx, arch)))


def compile_kernel(fn: Any, types: dict[str, str], consts: dict[str, Any], num_warps: int = 4,
                   arch: int = 90, divisible: tuple[str, ...] = (), num_stages: int | None = None) -> Any:
    """``triton.compile`` of the jitted ``fn`` for ``sm_{arch}``: ``types`` gives each run-time
    argument's Triton type (``"*bf16"``, ``"i32"``, ...), ``consts`` the constexprs. Pointers,
    ``stride*`` arguments and those named in ``divisible`` are declared divisible by 16, as Triton
    specializes them at a real launch on aligned shapes; ``num_stages`` None leaves Triton's default.
    Call it from a test file's ``__main__`` (``compiled_facts``), never under the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {a: "constexpr" if a in consts else types[a] for a in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if a not in consts and (signature[a].startswith("*") or a.startswith("stride") or a in divisible)}
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(names.index(c),): v for c, v in consts.items()})
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def pdl_order(ptx: str) -> dict[str, Any]:
    """Where a kernel's programmatic-dependent-launch instructions sit in its PTX: how many
    ``griddepcontrol.wait`` and ``griddepcontrol.launch_dependents`` it has, whether the (first)
    trigger comes before the (first) wait, and how many global loads come before the wait
    (what a program reads before the previous kernel completed)."""
    wait = ptx.find("griddepcontrol.wait")
    trigger = ptx.find("griddepcontrol.launch_dependents")
    return {"waits": ptx.count("griddepcontrol.wait"),
            "triggers": ptx.count("griddepcontrol.launch_dependents"),
            "trigger_first": 0 <= trigger < wait,
            "loads_before_wait": len(re.findall(r"\bld\.global", ptx[:wait])) if wait >= 0 else None}
