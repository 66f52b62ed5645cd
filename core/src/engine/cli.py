"""The ``engine`` command line (typer): serve, generate, bench, plugins, config.

Flags of ``serve``, ``generate`` and ``config show`` are generated from
``ServerArgs``; every user error exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Optional

import typer

from engine.version import __version__
from engine.config import ServerArgs
from engine.errors import EngineError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="A pluggable LLM serving engine.")
plugins_app = typer.Typer(no_args_is_help=True, help="Installed plugins.")
config_app = typer.Typer(no_args_is_help=True, help="Effective configuration.")
app.add_typer(plugins_app, name="plugins")
app.add_typer(config_app, name="config")


def fail(message: str) -> typing.NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


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


# -- ServerArgs flags ----------------------------------------------------------------
def _server_arg_params() -> list[inspect.Parameter]:
    hints = typing.get_type_hints(ServerArgs)
    params = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                                default=typer.Option(None, "--config", help="YAML deployment file"))]
    for f in dataclasses.fields(ServerArgs):
        if not f.metadata.get("cli", True):
            continue
        hint = hints[f.name]
        # Unwrap only Optional[X] (a Union with None); list[str]'s own argument is not the type.
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = args[0] if len(args) == 1 else hint
        origin = typing.get_origin(hint) or hint
        flag = "--" + f.name.replace("_", "-")
        decls = [flag]
        if f.name == "model_path":
            decls.append("--model")
        if origin is list:
            # Repeatable: each use adds one item (``--disable-plugin a --disable-plugin b``).
            annotation: Any = Optional[list[str]]
            if f.name == "required_plugins":
                decls.append("--required-plugin")  # one requirement per use reads better singular
        elif origin is bool:
            annotation = Optional[bool]
            decls = [f"{flag}/--no-{flag[2:]}"]
        else:
            annotation = Optional[origin]
        params.append(inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
            default=typer.Option(None, *decls, help=f.metadata.get("help", ""), show_default=False)))
    params.append(inspect.Parameter("plugin_option", inspect.Parameter.KEYWORD_ONLY,
                                    annotation=Optional[list[str]],
                                    default=typer.Option(None, "--plugin-option",
                                                         help="PLUGIN.KEY=VALUE option for a plugin; repeatable")))
    return params


def _parse_plugin_options(items: list[str] | None) -> dict[str, dict[str, Any]]:
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        plugin, dot, name = key.partition(".")
        if not sep or not dot or not plugin or not name:
            fail(f"--plugin-option: invalid value {item!r}; expected PLUGIN.KEY=VALUE")
        out.setdefault(plugin, {})[name] = yaml.safe_load(value)
    return out


def build_server_args(values: dict[str, Any]) -> ServerArgs:
    """ServerArgs from a YAML file (``config``) overridden by the flags that were given."""
    from engine.config import load_yaml

    config_path = values.pop("config", None)
    plugin_opts = _parse_plugin_options(values.pop("plugin_option", None))
    given = {k: v for k, v in values.items() if v is not None and v != []}
    base = load_yaml(config_path) if config_path else {}
    where = f" in {config_path}" if config_path else ""
    merged = {**base, **given}
    if plugin_opts:
        merged_opts = dict(merged.get("plugin_options") or {})
        for plugin, opts in plugin_opts.items():
            merged_opts[plugin] = {**merged_opts.get(plugin, {}), **opts}
        merged["plugin_options"] = merged_opts
    names = set(ServerArgs.field_names())
    unknown = [k for k in base if k not in names]
    if unknown:
        ServerArgs.from_dict({unknown[0]: base[unknown[0]]}, where=where)
    return ServerArgs.from_dict(merged, where=where)


def with_server_args(extra: list[inspect.Parameter]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives a command every ServerArgs flag plus ``extra``; it receives ``server_args``."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = {p.name for p in extra}

        def wrapper(**kwargs: Any) -> Any:
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
            config_path = kwargs.get("config")
            flags = {k for k, v in kwargs.items() if v is not None and v != [] and k != "config"}
            try:
                server_args = build_server_args(kwargs)
                return fn(server_args=server_args, **mine)
            except EngineError as exc:
                fail(_name_yaml_key(str(exc), config_path, flags))

        wrapper.__signature__ = inspect.Signature(extra + _server_arg_params())  # type: ignore[attr-defined]
        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper
    return decorate


def _name_yaml_key(message: str, config_path: str | None, flags: set[str]) -> str:
    """An error about a value that came from the YAML file names its key there, not the flag:
    ``--attention: unknown ...`` becomes ``attention (in deploy.yaml): unknown ...`` when
    ``attention`` was set in deploy.yaml and not overridden on the command line."""
    import re

    match = re.match(r"--([a-z0-9-]+)", message)
    if config_path is None or match is None:
        return message
    key = match.group(1).replace("-", "_")
    if key in flags:
        return message
    from engine.config import load_yaml

    try:
        from_yaml = key in load_yaml(config_path)
    except EngineError:
        return message
    if not from_yaml:
        return message
    rest = message[match.end():]
    head, colon, tail = rest.partition(":")
    # ``--dtype float16: ...`` keeps the value beside the key.
    return f"{key}{head} (in {config_path}){colon}{tail}" if colon else f"{key}{rest} (in {config_path})"


def _opt(name: str, annotation: Any, default: Any, *decls: str, help: str) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *decls, help=help))


# -- commands ----------------------------------------------------------------------------
@app.command("serve")
@with_server_args([])
def serve_cmd(server_args: ServerArgs) -> None:
    """Start the HTTP server (OpenAI-compatible and native APIs; see docs/api.md)."""
    from engine.entrypoints.http_server import serve

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
])
def generate_cmd(server_args: ServerArgs, prompt: str, max_new_tokens: int, temperature: float,
                 top_p: float, top_k: int, seed: int | None, stream: bool) -> None:
    """Generate a completion for one prompt and print it."""
    from engine.entrypoints.engine import Engine

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
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output"),
    disable_plugin: Optional[list[str]] = typer.Option(None, "--disable-plugin", help="Plugin not to load"),
) -> None:
    """List installed plugins: name, distribution, version, what they register, status."""
    import engine.plugins as plugins

    infos = plugins.list_plugins(disable_plugin or [])
    platforms = plugins.platform_statuses(disable_plugin or [])
    if as_json:
        rows_json = [p.to_dict() for p in infos]
        for row in rows_json:  # platform plugins also say what they found here and where they were tested
            mine = {s["name"]: {k: v for k, v in s.items() if k not in ("name", "plugin")}
                    for s in platforms if s["plugin"] == row["name"]}
            if mine:
                row["platforms"] = mine
        typer.echo(json.dumps(rows_json, indent=2))
        return
    rows = [("NAME", "DISTRIBUTION", "VERSION", "REGISTERS", "STATUS")]
    for p in infos:
        registers = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(p.kinds.items())) or "-"
        status = p.status if p.status == "ok" else f"{p.status}: {p.error}" if p.error else p.status
        rows.append((p.name, p.distribution, p.version, registers, status))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    if platforms:
        typer.echo("")
        table = [("PLATFORM", "DEVICE", "TESTED ON HARDWARE", "HERE")]
        for s in platforms:
            here = ("selected" if s["selected"] else "available") if s["available"] else f"unavailable: {s['reason']}"
            if s["available"] and s["reason"]:
                here += f" ({s['reason']})"
            table.append((s["name"], s["device_type"], s["tested_on_hardware"] or "no: simulated devices only", here))
        widths = [max(len(r[i]) for r in table) for i in range(3)]
        for r in table:
            typer.echo("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])


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

    app.add_typer(bench_app, name="bench")


_register_subcommands()


# Help is a table as wide as the terminal; piped or captured it would be 80 columns, where rich
# cuts long option names (``--mem-fraction-st…``). This width fits every option name and type
# with room for the descriptions to wrap; tests/test_cli_help.py checks that nothing is cut.
_HELP_WIDTH_OFF_TERMINAL = 160


def _widen_help_off_terminal() -> None:
    """Lets help written to a pipe or file use ``_HELP_WIDTH_OFF_TERMINAL`` columns.

    Rich sizes its console from ``COLUMNS`` (typer from ``TERMINAL_WIDTH``); a width the user
    set either way is kept. A terminal keeps its own width.
    """
    if sys.stdout.isatty() or os.environ.get("COLUMNS") or os.environ.get("TERMINAL_WIDTH"):
        return
    os.environ["COLUMNS"] = str(_HELP_WIDTH_OFF_TERMINAL)


def main() -> None:
    _widen_help_off_terminal()
    try:
        app(standalone_mode=True)
    except EngineError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
