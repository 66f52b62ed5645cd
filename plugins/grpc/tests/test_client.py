"""The client side needs neither the engine nor torch: ``pip install plugserve-grpc`` is enough."""

from __future__ import annotations

import subprocess
import sys


def test_the_client_and_stubs_import_without_the_engine() -> None:
    code = ("import sys; import engine_grpc.client, engine_grpc.plugserve_pb2_grpc; "
            "loaded = sorted(m for m in ('engine', 'torch', 'fastapi') if m in sys.modules); print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
