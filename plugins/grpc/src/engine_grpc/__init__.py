"""The engine's native API over gRPC (service ``plugserve.v1.Engine``).

Clients: ``engine_grpc.client.Client``, or the generated ``plugserve_pb2`` (messages) and
``plugserve_pb2_grpc`` (``EngineStub``) with any gRPC channel. The server side
(``engine_grpc.server``) is started by ``engine serve --grpc-port N``. Importing this package
imports neither the engine nor grpc.
"""

from __future__ import annotations

__version__ = "0.1.0"
