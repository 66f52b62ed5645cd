"""``--grpc-port``: its checks before start-up, and how the frontend's entry point is found."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from engine.config import ServerArgs
from engine.errors import ConfigError, PluginError
from engine.preflight import (
    FRONTEND_GROUP,
    enabled_frontends,
    frontend_entry_point,
    frontend_entry_points,
)


def test_grpc_port_is_checked() -> None:
    assert enabled_frontends(ServerArgs()) == []
    assert enabled_frontends(ServerArgs(grpc_port=50051)) == [("grpc", 50051)]
    for bad in (0, 70000, 30000):
        with pytest.raises(ConfigError, match=f"--grpc-port: invalid value {bad}; accepted: 1..65535, other than --port"):
            ServerArgs(grpc_port=bad).validate()


def _no_frontends(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib_metadata

    real = importlib_metadata.entry_points

    def entry_points(**kw: Any) -> Any:
        return [] if kw.get("group") == FRONTEND_GROUP else real(**kw)

    monkeypatch.setattr(importlib_metadata, "entry_points", entry_points)


def test_a_missing_frontend_names_the_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_frontends(monkeypatch)
    with pytest.raises(PluginError, match=r"^--grpc-port: serving grpc needs the plugserve-grpc distribution, "
                                          r"which is not installed; pip install plugserve-grpc"):
        frontend_entry_point("grpc")
    from engine.cli import app

    result = CliRunner().invoke(app, ["config", "show", "--grpc-port", "50051"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: --grpc-port: serving grpc needs"), result.output


def test_the_installed_frontend_is_found_without_importing_it() -> None:
    pytest.importorskip("engine_grpc", reason="plugserve-grpc is not installed")
    entry = frontend_entry_point("grpc")
    assert entry.value == "engine_grpc.server:start" and entry.group == FRONTEND_GROUP


def test_plugins_list_rows_of_the_frontends(monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine plugins list`` shows an installed frontend as a plugin of kind frontend, and none
    when none is installed."""
    from engine.cli_table import frontend_infos

    if frontend_entry_points():
        infos = {info.name: info for info in frontend_infos()}
        assert infos["grpc"].kinds == {"frontend": ["grpc"]}, infos
    _no_frontends(monkeypatch)
    assert frontend_infos() == []
