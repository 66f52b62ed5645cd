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


def test_a_width_the_user_set_is_kept() -> None:
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("TERMINAL_WIDTH", None)
    out = subprocess.run([sys.executable, "-m", "engine", "serve", "--help"], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    assert max(len(line) for line in out.splitlines()) == 100


def test_list_flags_repeat() -> None:
    result = CliRunner().invoke(app, ["config", "show", "--json", "--disable-plugin", "lpm", "--disable-plugin", "lof",
                                      "--required-plugins", "plugserve-core", "--required-plugin", "plugserve-core>=0"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["disable_plugin"] == ["lpm", "lof"]
    assert shown["required_plugins"] == ["plugserve-core", "plugserve-core>=0"]
