"""``engine config show`` runs the start-up checks that need no checkpoint: a misspelt component
name or a backend that cannot run on the platform exits 2 with one line naming the field, the
value and what is accepted; errors about YAML values name the YAML key; ``--disable-plugin``
takes the name users select an implementation by; the start-up log names the parsers."""

from __future__ import annotations

import logging
import pathlib

import pytest
from typer.testing import CliRunner

from engine.cli import app
from engine.config import ServerArgs

runner = CliRunner()


def _one_line_error(args: list[str]) -> str:
    res = runner.invoke(app, ["config", "show", *args])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (args, res.exit_code, res.output)
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--attention", "flashinfr"],
     "--attention: unknown attention backend 'flashinfr'; installed: flashinfer, torch_native, triton"),
    (["--schedule-policy", "lmp"], "--schedule-policy: unknown schedule policy 'lmp'; installed: "),
    (["--quant", "fp9"], "--quant: unknown quantization method 'fp9'; installed: "),
    (["--router-policy", "cache-awre"], "--router-policy: unknown router policy 'cache-awre'; installed: cache-aware"),
    (["--platform", "cpux"], "--platform: unknown platform 'cpux'; installed: "),
    (["--platform", "cpu", "--attention", "flashinfer"],
     "--attention: backend 'flashinfer' does not run on cpu (it supports: cuda); backends for platform 'cpu': "),
    (["--platform", "npu", "--quant", "fp8"], "--quant: quantization method 'fp8' does not run on platform 'npu'"),
])
def test_misspelt_or_misplaced_components_exit_2(args: list[str], needle: str) -> None:
    line = _one_line_error(args)
    assert needle in line, line
    if "unknown" in needle:
        assert "(did you mean " in line, line


def test_a_valid_configuration_is_shown() -> None:
    res = runner.invoke(app, ["config", "show", "--platform", "cpu", "--attention", "torch_native",
                              "--schedule-policy", "lpm", "--router-policy", "round-robin"])
    assert res.exit_code == 0, res.output
    assert "schedule_policy: lpm" in res.output


def test_yaml_values_are_named_by_their_yaml_key(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "deploy.yaml"
    f.write_text("platform: cpu\nattention: flashinfer\nschedule_policy: lmp\n")
    line = _one_line_error(["--config", str(f)])
    assert line.startswith(f"error: schedule_policy (in {f}): unknown schedule policy 'lmp'"), line
    f.write_text("platform: cpu\nattention: flashinfer\n")
    line = _one_line_error(["--config", str(f)])
    assert line.startswith(f"error: attention (in {f}): backend 'flashinfer' does not run on cpu"), line
    f.write_text("dtype: fp33\n")
    assert _one_line_error(["--config", str(f)]).startswith(f"error: dtype (in {f}): invalid value 'fp33'")
    # A flag given on the command line is named as the flag, even when the YAML sets the key too.
    line = _one_line_error(["--config", str(f), "--dtype", "fp34"])
    assert line.startswith("error: --dtype: invalid value 'fp34'"), line


def test_disable_plugin_takes_the_user_facing_name() -> None:
    args = ServerArgs.from_dict({"disable_plugin": ["hermes", "toolparser_llama3", "qwen3"]})
    assert args.disable_plugin == ["toolparser_hermes", "toolparser_llama3", "reasoning_qwen3"]
    res = runner.invoke(app, ["config", "show", "--disable-plugin", "hermes", "--tool-call-parser", "llama3"])
    assert res.exit_code == 0, res.output
    line = _one_line_error(["--disable-plugin", "hermes", "--tool-call-parser", "hermes"])
    assert "--tool-call-parser: " in line and "disabled (--disable-plugin toolparser_hermes)" in line, line
    line = _one_line_error(["--disable-plugin", "hermez"])
    assert "--disable-plugin: unknown plugin 'hermez'" in line and "(did you mean hermes?)" in line, line


def test_start_up_log_names_the_parsers(caplog: pytest.LogCaptureFixture) -> None:
    from engine.preflight import parser_log_lines

    args = ServerArgs.from_dict({"tool_call_parser": "hermes", "reasoning_parser": "qwen3"})
    assert parser_log_lines(args) == ["tool-call parser: hermes (plugserve-toolparser-hermes 0.1.0)",
                                      "reasoning parser: qwen3 (plugserve-reasoning-qwen3 0.1.0)"]
    assert parser_log_lines(ServerArgs()) == []


def test_preflight_logs_the_parsers(llama_ckpt: str, caplog: pytest.LogCaptureFixture) -> None:
    from engine.entrypoints.launch import preflight

    args = ServerArgs.from_dict({"model_path": llama_ckpt, "tool_call_parser": "hermes"})
    with caplog.at_level(logging.INFO, logger="engine.entrypoints.launch"):
        preflight(args, llama_ckpt)
    assert "tool-call parser: hermes (plugserve-toolparser-hermes 0.1.0)" in caplog.text


def test_plugins_list_disable_plugin_takes_the_user_facing_name() -> None:
    import json

    res = runner.invoke(app, ["plugins", "list", "--json", "--disable-plugin", "hermes"])
    assert res.exit_code == 0, res.output
    status = {row["name"]: row["status"] for row in json.loads(res.output)}
    assert status["toolparser_hermes"] == "disabled" and status["toolparser_llama3"] == "ok"
