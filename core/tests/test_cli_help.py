"""``engine --help`` off a terminal, and flags generated from list fields of ServerArgs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from engine.cli import app
from engine.config import ServerArgs

COMMANDS = [["serve"], ["generate"], ["config", "show"], ["bench", "serving"], ["plugins", "list"]]


def _help(command: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH", "LINES")}
    out = subprocess.run([sys.executable, "-m", "engine", *command, "--help"], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    return out.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_into_a_pipe_cuts_no_option_name(command: list[str]) -> None:
    text = _help(command)
    assert "…" not in text, text
    if command in (["serve"], ["config", "show"]):
        for f in dataclasses.fields(ServerArgs):
            if f.metadata.get("cli", True):
                assert "--" + f.name.replace("_", "-") in text, f.name


@pytest.mark.parametrize("columns", ["80", "200"])
def test_help_fits_the_terminal_and_shows_defaults(columns: str) -> None:
    env = {**os.environ, "COLUMNS": columns}
    env.pop("TERMINAL_WIDTH", None)
    out = subprocess.run([sys.executable, "-m", "engine", "serve", "--help"], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "…" not in out
    port = out[out.index("--port <int>"):].split("\n  --", 1)[0]
    assert "[default: 30000]" in port, port


def test_generate_refuses_server_flags_and_hides_them() -> None:
    from engine.cli_args import SERVER_ONLY

    runner = CliRunner()
    for name in SERVER_ONLY:
        flag = "--" + name.replace("_", "-")
        value = [] if isinstance(getattr(ServerArgs(), name), bool) else ["1"]  # a switch takes none
        result = runner.invoke(app, ["generate", flag, *value])
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines()[-1].startswith(f"error: {flag}: not an option of this command"), \
            result.output
    shown = runner.invoke(app, ["generate", "--help"]).output
    assert "--port" not in shown and "--api-key" not in shown and "--max-new-tokens" in shown


def test_list_flags_repeat() -> None:
    result = CliRunner().invoke(app, ["config", "show", "--json", "--disable-plugin", "lpm", "--disable-plugin", "lof",
                                      "--required-plugins", "plugserve-core", "--required-plugin", "plugserve-core>=0"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["disable_plugin"] == ["lpm", "lof"]
    assert shown["required_plugins"] == ["plugserve-core", "plugserve-core>=0"]
