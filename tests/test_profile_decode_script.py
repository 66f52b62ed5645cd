"""``scripts/profile_decode.py`` refuses bad ``--extra`` input with one line and exit status 2, as
the engine's CLI does (a ServerArgs value, a plugin-option value, ``--extra`` that is not JSON),
before it loads a model."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("extra,says", [
    ('{"max_running_requests": -3}', "--max-running-requests: invalid value -3"),
    ('{"plugin_options": {"triton": {"pdl": "off"}}}', "triton.pdl: invalid value 'off'"),
    ("{bad", "Expecting property name"),
])
def test_bad_extra_is_one_line_and_exit_2(extra: str, says: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_decode.py"),
                           str(ROOT / "docs" / "bench_configs" / "qwen3-0.6b"), "--attention", "torch_native",
                           "--extra", extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("profile_decode.py: error: ") and says in lines[0], proc.stderr
