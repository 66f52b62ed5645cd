"""``engine router``: the prefill/decode router in front of disaggregated servers
(docs/disaggregation.md). Imports neither torch nor the server."""

from __future__ import annotations

import os
from typing import Optional

import typer

from engine.cli_args import fail

_PORT_HELP = "HTTP port of the router"


def router_cmd(
    prefill: Optional[list[str]] = typer.Option(None, "--prefill", metavar="URL", help="URL of a server started with --disaggregation-mode prefill; repeat for several"),
    decode: Optional[list[str]] = typer.Option(None, "--decode", metavar="URL", help="URL of a server started with --disaggregation-mode decode; repeat for several"),
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP bind address"),
    port: int = typer.Option(8000, "--port", help=_PORT_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Key the router sends to the servers and requires from its clients on every route but /health (default: ENGINE_API_KEY, if set)"),
    wait_s: float = typer.Option(120.0, "--wait-s", help="Seconds to wait at start for the servers to answer (they may still be loading)"),
    policy: str = typer.Option("shortest-queue", "--policy", help="Router policy choosing among the servers of each kind (a router-policy plugin): shortest-queue (fewest requests in flight), round-robin, cache-aware, ..."),
    decode_policy: Optional[str] = typer.Option(None, "--decode-policy", help="Router policy for the decode servers alone (default: --policy's)"),
    log_level: str = typer.Option("info", "--log-level", help="Log verbosity: debug, info, warning, error"),
) -> None:
    """Pair prefill and decode servers: each request runs its prompt on a prefill server and its
    generation on a decode server, and the client gets the decode server's answer (streamed)."""
    from engine.disaggregation.router_app import create_app, discover
    from engine.errors import EngineError

    if not prefill or not decode:
        fail("engine router: give at least one --prefill URL and one --decode URL")
    for flag, urls in (("--prefill", prefill), ("--decode", decode)):
        for url in urls:
            if not url.startswith(("http://", "https://")):
                fail(f"{flag}: invalid value {url!r}; accepted: an http:// or https:// URL of a server")
    if not 0 < port < 65536:
        fail(f"--port: invalid value {port}; accepted: 1..65535")
    if log_level not in ("debug", "info", "warning", "error"):
        fail(f"--log-level: invalid value {log_level!r}; accepted: debug, info, warning, error")
    import engine.plugins as plugins

    policies = plugins.router_policies()
    for flag, name in (("--policy", policy), ("--decode-policy", decode_policy)):
        if name is not None and name not in policies:
            fail(f"{flag}: invalid value {name!r}; accepted: {', '.join(sorted(policies)) or 'none installed'}")
    api_key = api_key or os.environ.get("ENGINE_API_KEY") or None
    try:
        router = discover(prefill, decode, api_key, wait_s, policy, decode_policy)
    except EngineError as exc:
        fail(str(exc))
    import uvicorn

    app = create_app(router)
    typer.echo(f"router on http://{host}:{port} (policy {router.policy}, decode {router.decode_policy}): prefill {', '.join(p.url for p in router.prefill)}; "
               f"decode {', '.join(router.decode)}", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
