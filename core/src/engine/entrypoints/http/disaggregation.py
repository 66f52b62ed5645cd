"""The request fields of prefill/decode disaggregation: ``bootstrap_host``, ``bootstrap_port``
and ``bootstrap_room`` (SGLang's names), which ``engine router`` sets on both halves of a
request. A server without ``--disaggregation-mode`` refuses them; a server with it runs a
request without them as a whole server would (docs/disaggregation.md)."""

from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.http.errors import APIError

_ROOM_MAX = 2**63 - 1


def _one_room(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _ROOM_MAX:
        raise APIError(400, f"{param}: invalid value {value!r}; accepted: an integer 0..2**63-1", param=param)
    return value


def bootstrap_fields(ctx: Any, req: Any, count: int = 1) -> list[dict[str, Any]]:
    """Per prompt, the GenerateRequest keywords of the bootstrap fields (empty dicts when unset)."""
    host, port, room = req.bootstrap_host, req.bootstrap_port, req.bootstrap_room
    if host is None and port is None and room is None:
        return [{} for _ in range(count)]
    args = getattr(ctx, "args", None)
    mode = getattr(args, "disaggregation_mode", "null")
    if mode == "null":
        name, value = next((n, v) for n, v in (("bootstrap_room", room), ("bootstrap_host", host),
                                                ("bootstrap_port", port)) if v is not None)
        raise APIError(400, f"{name}: {json.dumps(value, default=str)} asks for prefill/decode disaggregation, which "
                            "this server does not run (it has no --disaggregation-mode); accepted: null (or omit the "
                            "field), or send the request through `engine router --prefill URL --decode URL`",
                       param=name, code="unsupported_feature")
    if room is None:
        raise APIError(400, "bootstrap_room: missing; a disaggregated request names its KV by a room "
                            "(an integer 0..2**63-1)", param="bootstrap_room")
    if isinstance(room, list):
        if len(room) != count:
            raise APIError(400, f"bootstrap_room: {len(room)} rooms for {count} prompts", param="bootstrap_room")
        rooms = [_one_room(r, f"bootstrap_room[{i}]") for i, r in enumerate(room)]
    else:
        rooms = [_one_room(room, "bootstrap_room")] * count
    if mode == "decode":
        if not isinstance(host, str) or not host:
            raise APIError(400, f"bootstrap_host: invalid value {host!r}; accepted: the prefill server's host name "
                                "or address", param="bootstrap_host")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise APIError(400, f"bootstrap_port: invalid value {port!r}; accepted: the prefill server's "
                                "--disaggregation-bootstrap-port (1..65535)", param="bootstrap_port")
    else:  # the prefill server is the one named: it needs only the room
        host = host if isinstance(host, str) else None
        port = port if isinstance(port, int) and not isinstance(port, bool) else None
    return [{"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": r} for r in rooms]
