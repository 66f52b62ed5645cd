"""Regenerates the Python modules of ``plugserve.proto`` (needs ``grpcio-tools``).

    python -m engine_grpc.codegen           # writes plugserve_pb2.py, .pyi and _pb2_grpc.py
    python -m engine_grpc.codegen --check   # exit status 1 when they do not match the .proto

The modules are committed, so that installing plugserve-grpc needs no code generator. The
check compares what the .proto compiles to (its descriptor) with the descriptor the committed
module carries, so it does not depend on the grpcio-tools version that wrote them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.path.dirname(PACKAGE_DIR)
PROTO = "engine_grpc/plugserve.proto"
GENERATED = ("plugserve_pb2.py", "plugserve_pb2.pyi", "plugserve_pb2_grpc.py")


def run_protoc(out_dir: str, descriptor_set: str | None = None, source_root: str = SOURCE_ROOT) -> None:
    """Compiles ``source_root/engine_grpc/plugserve.proto`` into ``out_dir/engine_grpc/`` (and its
    descriptor set, when asked)."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    argv = ["protoc", f"-I{source_root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if descriptor_set:
        argv.append(f"--descriptor_set_out={descriptor_set}")
    code = protoc.main([*argv, PROTO])
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit status {code})")


def stale_reasons(source_root: str = SOURCE_ROOT) -> list[str]:
    """What differs between the .proto under ``source_root`` and the committed modules (empty:
    they match)."""
    from google.protobuf import descriptor_pb2

    from engine_grpc import plugserve_pb2

    with tempfile.TemporaryDirectory() as tmp:
        descriptor_set = os.path.join(tmp, "set.pb")
        run_protoc(tmp, descriptor_set, source_root)
        with open(descriptor_set, "rb") as f:
            compiled = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file[0]
        with open(os.path.join(tmp, "engine_grpc", "plugserve_pb2_grpc.py")) as f:
            fresh_stub = f.read()
    committed = descriptor_pb2.FileDescriptorProto.FromString(plugserve_pb2.DESCRIPTOR.serialized_pb)
    _drop_json_names(compiled)  # protoc fills them in a descriptor set, not in generated code
    reasons = []
    if compiled != committed:
        reasons.append("plugserve_pb2.py does not describe plugserve.proto")
    with open(os.path.join(PACKAGE_DIR, "plugserve_pb2_grpc.py")) as f:
        stub = f.read()
    # The stubs spell each method's path; the version line differs between grpcio-tools releases.
    for service in compiled.service:
        for method in service.method:
            path = f"/{compiled.package}.{service.name}/{method.name}"
            if path in fresh_stub and path not in stub:
                reasons.append(f"plugserve_pb2_grpc.py lacks {path}")
    return reasons


def _drop_json_names(file: Any) -> None:
    todo = list(file.message_type)
    while todo:
        message = todo.pop()
        todo.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        reasons = stale_reasons()
        for reason in reasons:
            print(f"stale: {reason}; run python -m engine_grpc.codegen", file=sys.stderr)
        return 1 if reasons else 0
    if argv:
        print("usage: python -m engine_grpc.codegen [--check]", file=sys.stderr)
        return 2
    run_protoc(SOURCE_ROOT)
    print("wrote " + ", ".join(os.path.join(PACKAGE_DIR, name) for name in GENERATED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
