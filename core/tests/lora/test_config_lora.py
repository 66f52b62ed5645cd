"""The LoRA settings: --lora-paths forms (flag values, YAML list or mapping), several values after
one flag, and one-line errors with exit status 2."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from engine.cli import app
from engine.cli_args import split_multi_value_flags
from engine.config import ServerArgs, parse_lora_paths
from engine.errors import ConfigError


def test_lora_paths_forms(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a, b = tmp_path / "a", tmp_path / "sql"
    a.mkdir()
    b.mkdir()
    assert parse_lora_paths([f"x={a}", str(b)]) == {"x": str(a), "sql": str(b)}
    assert parse_lora_paths({"x": str(a)}) == {"x": str(a)}
    args = ServerArgs.from_dict({"lora_paths": [str(b) + "/"]})
    assert args.lora_paths == {"sql": str(b) + "/"} and args.lora_enabled
    assert not ServerArgs().lora_enabled and ServerArgs(enable_lora=True).lora_enabled
    with pytest.raises(ConfigError, match="adapter name 'x' is given twice"):
        parse_lora_paths([f"x={a}", f"x={b}"])
    with pytest.raises(ConfigError, match="--lora-paths: y=/nonexistent: not a directory"):
        ServerArgs.from_dict({"lora_paths": {"y": "/nonexistent"}})
    with pytest.raises(ConfigError, match="--max-loaded-loras: invalid value 1; accepted: at least the 2 adapters"):
        ServerArgs.from_dict({"lora_paths": [str(a), str(b)], "max_loaded_loras": 1})
    assert ServerArgs.from_dict({"lora_target_modules": ["all"]}).lora_target_modules[-1] == "down_proj"


def test_multi_value_flags_split() -> None:
    argv = ["serve", "--lora-paths", "a=/x", "b=/y", "--lora-target-modules", "q_proj", "v_proj", "--port", "1"]
    assert split_multi_value_flags(argv) == ["serve", "--lora-paths", "a=/x", "--lora-paths", "b=/y",
                                             "--lora-target-modules", "q_proj", "--lora-target-modules", "v_proj",
                                             "--port", "1"]
    # A command's positional argument after the values stays one.
    assert split_multi_value_flags(["generate", "--lora-paths", "a=/x", "Hello"]) == [
        "generate", "--lora-paths", "a=/x", "Hello"]


@pytest.mark.parametrize("flags,message", [
    (["--lora-target-modules", "qproj"], "--lora-target-modules: invalid value 'qproj'"),
    (["--max-loras-per-batch", "0"], "--max-loras-per-batch: invalid value 0; accepted: an integer >= 1"),
    (["--lora-paths", "a=/nonexistent"], "--lora-paths: a=/nonexistent: not a directory"),
    (["--enable-lora", "--lora-backend", "nope"], "--lora-backend: unknown LoRA backend 'nope'"),
    (["--enable-lora", "--speculative-algorithm", "ngram"], "--speculative-algorithm: invalid value 'ngram' with LoRA"),
])
def test_cli_errors_exit_2_with_one_line(flags: list[str], message: str) -> None:
    res = CliRunner().invoke(app, ["config", "show", *flags])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], res.output


def test_cli_takes_several_adapters_after_one_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    argv = split_multi_value_flags(["config", "show", "--lora-paths", f"one={tmp_path / 'a'}", str(tmp_path / "b")])
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert f"one: {tmp_path / 'a'}" in res.output and f"b: {tmp_path / 'b'}" in res.output
