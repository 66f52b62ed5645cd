"""The ``engine`` command line (typer): serve, generate, bench, plugins, config.

Flags of ``serve``, ``generate`` and ``config show`` are generated from
``ServerArgs``; every user error exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import atexit
import gc
import json
import sys
from typing import Any, Optional

import typer

from engine.cli_args import SERVER_ONLY, _opt, build_server_args, fail, with_server_args
from engine.config import ServerArgs
from engine.errors import EngineError
from engine.version import __version__

# build_server_args is re-exported: tests and plugins' tests build ServerArgs as the CLI does.
__all__ = ["app", "build_server_args", "fail", "main", "with_server_args"]

# Help is click's plain layout (rich_markup_mode=None): option names are never cut and the text
# wraps to the terminal (80 columns off a terminal), where rich's table cut long flag names.
app = typer.Typer(add_completion=False, no_args_is_help=True, help="A pluggable LLM serving engine.",
                  rich_markup_mode=None)
plugins_app = typer.Typer(no_args_is_help=True, help="Installed plugins.", rich_markup_mode=None)
config_app = typer.Typer(no_args_is_help=True, help="Effective configuration.", rich_markup_mode=None)
app.add_typer(plugins_app, name="plugins")
app.add_typer(config_app, name="config")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"engine {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Optional[bool] = typer.Option(None, "--version", callback=_version_callback, is_eager=True,
                                           help="Print the version and exit."),
) -> None:
    """A pluggable LLM serving engine."""


def _allow_forked_children() -> None:
    from engine.entrypoints.child_process import allow_forked_children

    allow_forked_children()


def check_before_start(server_args: ServerArgs) -> None:
    """The checks ``engine config show`` runs, then the devices for several ranks per node and the
    model's split over ``--tp-size`` x ``--pp-size`` read from the checkpoint's config.json (a GGUF
    is converted first, as start-up would), all before the server is imported or any process
    starts."""
    from engine.preflight import (
        check_devices,
        check_split_from_config_json,
        check_without_checkpoint,
    )

    # Where a check probes the platform (importing torch), torch is imported just before through
    # allow_forked_children (one compute thread): the engine's children can still be forks of
    # this process, as when nothing probes. Checks that fail earlier still fail before torch.
    before_probe = _allow_forked_children if server_args.node_rank == 0 else None
    check_without_checkpoint(server_args, before_probe)
    check_devices(server_args, before_probe)
    if server_args.tp_size * server_args.pp_size * server_args.ep_size > 1 and server_args.node_rank == 0:
        from engine.entrypoints.launch import resolve_model_path

        # The embedded embedding model under --task embed, the default model's conversion, or the path.
        check_split_from_config_json(server_args, resolve_model_path(server_args))


# -- commands ----------------------------------------------------------------------------
@app.command("serve")
@with_server_args([])
def serve_cmd(server_args: ServerArgs) -> None:
    """Start the HTTP server (OpenAI-compatible and native APIs; see docs/api.md)."""
    # A misspelt or unusable component or path fails here, before the server (and torch) is
    # imported; start-up runs the same checks again with the checkpoint's.
    check_before_start(server_args)
    # The light start-up: the scheduler process starts before the HTTP server is imported.
    from engine.entrypoints.serve_start import serve

    code = serve(server_args)
    if code:
        raise typer.Exit(code)


@app.command("generate")
@with_server_args([
    _opt("prompt", str, "Hello, my name is", "--prompt", "-p", help="Prompt text"),
    _opt("max_new_tokens", int, 32, "--max-new-tokens", help="Tokens to generate"),
    _opt("temperature", float, 0.0, "--temperature", help="0 = greedy"),
    _opt("top_p", float, 1.0, "--top-p", help="Nucleus sampling threshold"),
    _opt("top_k", int, -1, "--top-k", help="-1 = whole vocabulary"),
    _opt("seed", Optional[int], None, "--seed", help="Per-request sampling seed"),
    _opt("stream", bool, False, "--stream/--no-stream", help="Print tokens as they come"),
], refuse=SERVER_ONLY, refused_why="engine generate runs no HTTP server; engine serve takes it")
def generate_cmd(server_args: ServerArgs, prompt: str, max_new_tokens: int, temperature: float,
                 top_p: float, top_k: int, seed: int | None, stream: bool) -> None:
    """Generate a completion for one prompt and print it."""
    check_before_start(server_args)  # as in serve: before torch is imported
    from engine.managers.process_utils import setup_child_logging

    # This process's start-up lines (the checkpoint found or converted, the threads chosen) go
    # to stderr as serve's do; the children log there too.
    setup_child_logging(server_args.log_level, "generate")
    _allow_forked_children()  # before torch is imported: children share this process's imports where safe
    from engine.cpu_threads import limit_torch_threads
    from engine.entrypoints.engine import Engine

    limit_torch_threads(1)  # this process only tokenizes; the scheduler computes (engine.cpu_threads)

    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
              "top_k": top_k, "seed": seed}
    engine = Engine(**{k: v for k, v in server_args.to_dict().items()})
    try:
        if stream:
            printed = 0
            out: dict[str, Any] = {}
            for out in engine.generate(prompt, params, stream=True):  # type: ignore[union-attr]
                sys.stdout.write(out["text"][printed:])
                sys.stdout.flush()
                printed = len(out["text"])
            sys.stdout.write("\n")
        else:
            out = engine.generate(prompt, params)  # type: ignore[assignment]
            typer.echo(out["text"])
        meta = out.get("meta_info", {})
        typer.echo(f"[{meta.get('prompt_tokens')} prompt + {meta.get('completion_tokens')} generated tokens, "
                   f"finish: {json.dumps(meta.get('finish_reason'))}]", err=True)
    finally:
        engine.shutdown()


@plugins_app.command("list")
def plugins_list(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output, with every platform probed"),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Name every option a plugin registers, and probe each platform on this machine"),
    disable_plugin: Optional[list[str]] = typer.Option(None, "--disable-plugin", help="Plugin not to load"),
) -> None:
    """List installed plugins: name, distribution, version, status, what they register.

    Listing imports only the plugins' registration modules. Probing the platforms (--verbose,
    --json) imports their implementations and torch, which takes seconds.
    """
    import engine.plugins as plugins
    from engine.cli_table import frontend_infos, plugin_rows, render_table

    try:
        # As for serve: a plugin's name, or a name it registers (hermes for toolparser_hermes).
        disable_plugin = plugins.resolve_plugin_names(disable_plugin or [], "--disable-plugin")
    except EngineError as exc:
        fail(str(exc))
    # Hook plugins, then the frontends beside HTTP (engine.frontends), which register no hook.
    infos = sorted(plugins.list_plugins(disable_plugin or []) + frontend_infos(), key=lambda p: p.name)
    if as_json:
        platforms = plugins.platform_statuses(disable_plugin or [])
        rows_json = [p.to_dict() for p in infos]
        for row in rows_json:  # platform plugins also say what they found here and where they were tested
            mine = {s["name"]: {k: v for k, v in s.items() if k not in ("name", "plugin")}
                    for s in platforms if s["plugin"] == row["name"]}
            if mine:
                row["platforms"] = mine
        typer.echo(json.dumps(rows_json, indent=2))
        return
    typer.echo(render_table(("NAME", "DISTRIBUTION", "VERSION", "STATUS", "REGISTERS"), plugin_rows(infos, verbose)))
    platform_names = sorted({name for p in infos for name in p.kinds.get("platform", [])})
    if not verbose:
        if platform_names:
            typer.echo(f"\nplatforms: {', '.join(platform_names)} (--verbose: which is available and selected here)")
        return
    platforms = plugins.platform_statuses(disable_plugin or [])
    if platforms:
        typer.echo("")
        table = []
        for s in platforms:
            here = ("selected" if s["selected"] else "available") if s["available"] else f"unavailable: {s['reason']}"
            if s["available"] and s["reason"]:
                here += f" ({s['reason']})"
            table.append((s["name"], s["device_type"], s["tested_on_hardware"] or "no: simulated devices only", here))
        typer.echo(render_table(("PLATFORM", "DEVICE", "TESTED ON HARDWARE", "HERE"), table))


@config_app.command("show")
@with_server_args([_opt("as_json", bool, False, "--json", help="JSON instead of YAML")])
def config_show(server_args: ServerArgs, as_json: bool) -> None:
    """Print the effective configuration (file + flags) after validation."""
    import yaml

    from engine.preflight import check_without_checkpoint

    # The checks start-up runs before it reads the checkpoint: a configuration shown as valid
    # is not rejected at start for a misspelt name or a component that cannot run here.
    check_without_checkpoint(server_args)
    data = server_args.to_dict()
    typer.echo(json.dumps(data, indent=2) if as_json else yaml.safe_dump(data, sort_keys=False).rstrip())


def _register_subcommands() -> None:
    from engine.cli_bench import bench_app
    from engine.cli_router import router_cmd

    app.add_typer(bench_app, name="bench")
    app.command("router")(router_cmd)


_register_subcommands()


def main() -> None:
    from engine.cli_args import split_multi_value_flags
    from engine.entrypoints.child_process import tune_gc

    tune_gc()  # before the command imports torch and transformers

    # At exit, what the command imported (torch, transformers) would otherwise be walked by one
    # last garbage collection (0.3-1 s of CPU: a stopped `engine serve` took twice as long to
    # exit). Frozen objects are skipped by it; the other atexit handlers and refcount releases
    # still run, the engine's shutdown (registered later) before it; nothing freezes before exit.
    atexit.register(gc.freeze)
    try:
        app(args=split_multi_value_flags(sys.argv[1:]), standalone_mode=True)
    except EngineError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
