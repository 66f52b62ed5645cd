"""The committed generated modules match plugserve.proto (``python -m engine_grpc.codegen`` rewrites them)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools compiles the .proto (pip install plugserve-grpc[codegen])")

from engine_grpc import codegen  # noqa: E402


def test_generated_modules_match_the_proto() -> None:
    assert codegen.stale_reasons() == [], "run: python -m engine_grpc.codegen"
    assert codegen.main(["--check"]) == 0


def test_a_changed_proto_is_reported_stale(tmp_path: Path) -> None:
    package = tmp_path / "engine_grpc"
    package.mkdir()
    proto = Path(codegen.PACKAGE_DIR, "plugserve.proto").read_text()
    changed = proto.replace("  int32 top_logprobs_num = 8;\n", "  int32 top_logprobs_num = 8;\n  bool echo = 99;\n")
    assert changed != proto
    (package / "plugserve.proto").write_text(changed)
    assert codegen.stale_reasons(str(tmp_path)) == ["plugserve_pb2.py does not describe plugserve.proto"]
    # A new method is named too (its stub is missing from plugserve_pb2_grpc.py).
    (package / "plugserve.proto").write_text(
        proto.replace("service Engine {\n", "service Engine {\n  rpc Echo(HealthRequest) returns (HealthResponse);\n"))
    assert "plugserve_pb2_grpc.py lacks /plugserve.v1.Engine/Echo" in codegen.stale_reasons(str(tmp_path))

