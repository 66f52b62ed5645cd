"""What every ``engine`` command that takes a configuration shares: its flags, generated from
``ServerArgs``, the YAML file they override, and the one-line error with exit status 2.

Below both ``engine.cli`` and ``engine.cli_bench`` (the bench commands take the same flags), so
neither command module imports the other for these.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Optional

import typer

from engine.config import ServerArgs
from engine.errors import EngineError


def fail(message: str) -> typing.NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


# Flags of the HTTP server alone: commands that run no server (``engine generate``) refuse them
# instead of ignoring them. A YAML file shared with ``engine serve`` may still set them.
SERVER_ONLY = ("host", "port", "grpc_port", "api_key", "max_body_bytes", "shutdown_grace_s",
               "allowed_origins", "responses_store_size", "metrics_compat", "disable_dashboard",
               "otlp_traces_endpoint")


def _help_with_default(f: dataclasses.Field[Any]) -> str:
    """The field's help with its default appended (``[default: 30000]``) when it has one worth
    showing: None, empty lists and False say nothing the help does not already say."""
    text = f.metadata.get("help", "")
    default = f.default
    if default is dataclasses.MISSING or default is None or default is False or isinstance(default, (list, dict)):
        return text
    return f"{text} [default: {default}]"


def _server_arg_params(hidden: tuple[str, ...] = ()) -> list[inspect.Parameter]:
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
        if origin in (list, dict):
            # Repeatable: each use adds one item (``--disable-plugin a --disable-plugin b``); a
            # mapping's items are KEY=VALUE (``--lora-paths a=DIR``), parsed by ServerArgs.
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
            default=typer.Option(None, *decls, help=_help_with_default(f), show_default=False,
                                 hidden=f.name in hidden)))
    params.append(inspect.Parameter("plugin_option", inspect.Parameter.KEYWORD_ONLY,
                                    annotation=Optional[list[str]],
                                    default=typer.Option(None, "--plugin-option",
                                                         help="PLUGIN.KEY=VALUE option for a plugin; repeatable")))
    return params


# Flags that take several values after one use, as SGLang's do (``--lora-paths a=DIR b=DIR``);
# click options take one value each, so ``split_multi_value_flags`` repeats the flag per value.
MULTI_VALUE_FLAGS = ("--lora-paths", "--lora-target-modules", "--lora-name")


def split_multi_value_flags(argv: list[str]) -> list[str]:
    """``--lora-paths a=X b=Y`` becomes ``--lora-paths a=X --lora-paths b=Y``: the words after a
    multi-value flag, up to the next option, are its values. A word is taken only while it reads
    as one (a ``NAME=PATH`` or an existing directory for --lora-paths, a module name or ``all``
    for --lora-target-modules), so a command's own positional argument after them stays one."""
    import os

    from engine.config import LORA_TARGET_MODULES

    def is_value(flag: str, word: str) -> bool:
        if word.startswith("-"):
            return False
        if flag == "--lora-paths":
            return "=" in word or os.path.isdir(word)
        if flag == "--lora-name":  # engine bench's adapter names: no command there takes a positional
            return True
        return word in LORA_TARGET_MODULES or word == "all"

    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        out.append(word)
        i += 1
        if word == "--":
            out.extend(argv[i:])
            break
        if word in MULTI_VALUE_FLAGS and i < len(argv):
            out.append(argv[i])  # the first value is the flag's own, whatever it reads as
            i += 1
            while i < len(argv) and is_value(word, argv[i]):
                out.extend([word, argv[i]])
                i += 1
    return out


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


def with_server_args(extra: list[inspect.Parameter], refuse: tuple[str, ...] = (),
                     refused_why: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives a command every ServerArgs flag plus ``extra``; it receives ``server_args``.

    ``refuse``: ServerArgs fields whose flags this command does not use; they are hidden from
    its help, and giving one fails naming the flag and ``refused_why``.
    """
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = {p.name for p in extra}

        def wrapper(**kwargs: Any) -> Any:
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
            config_path = kwargs.get("config")
            flags = {k for k, v in kwargs.items() if v is not None and v != [] and k != "config"}
            refused = [name for name in refuse if name in flags]
            if refused:
                fail(f"--{refused[0].replace('_', '-')}: not an option of this command ({refused_why})")
            try:
                server_args = build_server_args(kwargs)
                return fn(server_args=server_args, **mine)
            except EngineError as exc:
                fail(_name_yaml_key(str(exc), config_path, flags))

        wrapper.__signature__ = inspect.Signature(extra + _server_arg_params(refuse))  # type: ignore[attr-defined]
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
    """A keyword parameter that typer reads as ``--flag`` (``decls``) with this default and help."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *decls, help=help))
