"""The CLI: version, plugins list, config show, generate, and exit status 2 on user errors."""

from __future__ import annotations

import json
import os
import pathlib
import logging
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from engine.cli import app, build_server_args
from engine.errors import EngineError

runner = CliRunner()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_version() -> None:
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("engine ")


def test_plugins_list_json() -> None:
    res = runner.invoke(app, ["plugins", "list", "--json"])
    assert res.exit_code == 0
    rows = {p["name"]: p for p in json.loads(res.output)}
    assert rows["torch_native"]["distribution"] == "plugserve-attention-torch-native"
    assert rows["torch_native"]["version"] == "0.1.0"
    assert rows["torch_native"]["registers"] == {"attention": ["torch_native"]}


def test_plugins_list_table() -> None:
    res = runner.invoke(app, ["plugins", "list"])
    assert res.exit_code == 0
    assert "plugserve-models-llama" in res.output and "model: llama" in res.output
    # Fits 100 columns: options are counted, and named with --verbose.
    assert max(len(line) for line in res.output.splitlines()) <= 100
    assert "options: 8" in res.output and "cuda.gemv" not in res.output
    assert "PLATFORM" not in res.output and "--verbose" in res.output
    verbose = runner.invoke(app, ["plugins", "list", "--verbose"])
    assert verbose.exit_code == 0 and "cuda.gemv" in verbose.output and "PLATFORM" in verbose.output


def test_plugins_list_shows_every_kind_registered_and_the_frontends() -> None:
    from importlib.metadata import entry_points

    from engine import plugins
    from engine.hookspecs import SPEC_KINDS

    res = runner.invoke(app, ["plugins", "list", "--json"])
    assert res.exit_code == 0
    rows = json.loads(res.output)
    listed = {kind for row in rows for kind in row["registers"]}
    registered = {kind for info in plugins.list_plugins() for kind in info.kinds}
    # Every hook kind an installed plugin registered is listed (LoRA backends, KV tiers, KV transfer,
    # router policies included: the repository installs one of each).
    assert registered <= listed
    assert {"lora-backend", "kv-tier", "kv-transfer", "router"} <= registered <= {k for k, _ in SPEC_KINDS.values()}
    frontends = sorted(ep.name for ep in entry_points(group="engine.frontends"))
    assert frontends == ["grpc"]  # plugserve-grpc is installed with the repository
    assert [r["name"] for r in rows if "frontend" in r["registers"]] == frontends
    assert next(r for r in rows if r["name"] == "grpc")["distribution"] == "plugserve-grpc"
    assert [r["name"] for r in rows] == sorted(r["name"] for r in rows)
    table = runner.invoke(app, ["plugins", "list"]).output
    assert re.search(r"^grpc +plugserve-grpc +0\.1\.0 +ok +frontend: grpc$", table, re.M)


def test_table_wraps_the_last_column_at_separators() -> None:
    from engine.cli_table import render_table, wrap_cell

    assert wrap_cell("platform: cuda; options: 8", 20) == ["platform: cuda;", "options: 8"]
    assert wrap_cell("see https://example.com/a/very/long/path", 10) == ["see", "https://example.com/a/very/long/path"]
    text = render_table(("A", "B"), [("x", "alpha, beta, gamma, delta, epsilon, zeta")], width=30)
    assert text.splitlines() == ["A  B", "x  alpha, beta, gamma, delta,", "   epsilon, zeta"]


def test_plugin_rows_count_options_and_carry_a_broken_plugins_error() -> None:
    from engine.cli_table import plugin_rows
    from engine.plugin_registry import PluginInfo

    ok = PluginInfo("cuda", "plugserve-platform-cuda", "0.1.0",
                    kinds={"platform": ["cuda"], "option": ["cuda.gemv", "cuda.pdl"]})
    broken = PluginInfo("bad", "plugserve-bad", "0.2", status="broken", error="ImportError: no module named 'x'")
    assert plugin_rows([ok, broken]) == [
        ("cuda", "plugserve-platform-cuda", "0.1.0", "ok", "platform: cuda; options: 2"),
        ("bad", "plugserve-bad", "0.2", "broken", "broken: ImportError: no module named 'x'"),
    ]
    assert plugin_rows([ok], verbose=True)[0][4] == "option: cuda.gemv, cuda.pdl; platform: cuda"


def test_config_show_flags_override_yaml(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("max_total_tokens: 4096\nschedule_policy: fcfs\npage_size: 4\n")
    res = runner.invoke(app, ["config", "show", "--config", str(f), "--page-size", "8", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["max_total_tokens"] == 4096 and data["page_size"] == 8


@pytest.mark.parametrize("args,needle", [
    (["config", "show", "--dtype", "fp33"], "--dtype: invalid value 'fp33'"),
    (["config", "show", "--plugin-option", "nodot"], "--plugin-option: invalid value 'nodot'"),
])
def test_config_errors_exit_2_one_line(args: list[str], needle: str) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output


def test_unknown_yaml_key_exit_2(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("atention: torch_native\n")
    res = runner.invoke(app, ["config", "show", "--config", str(f)])
    assert res.exit_code == 2 and "unknown key 'atention' in" in res.output and "did you mean attention" in res.output


def test_bad_yaml_exit_2(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("a: [b\n")
    res = runner.invoke(app, ["config", "show", "--config", str(f)])
    assert res.exit_code == 2 and "invalid YAML" in res.output


def test_generate_errors_exit_2(tmp_path: pathlib.Path, llama_ckpt: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--model-path", str(empty)], "has no config.json"),
        (["--model-path", llama_ckpt, "--attention", "flashinfr"], "unknown attention backend 'flashinfr'"),
        (["--model-path", llama_ckpt, "--schedule-policy", "lifo"], "unknown schedule policy 'lifo'"),
        (["--model-path", llama_ckpt, "--platform", "tpu"], "unknown platform 'tpu'"),
        (["--model-path", llama_ckpt, "--quant", "fp4"], "unknown quantization method 'fp4'"),
    ]
    for extra, needle in cases:
        res = runner.invoke(app, ["generate", *extra])
        assert res.exit_code == 2, (extra, res.output)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], res.output


def test_unsupported_architecture_exit_2(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    res = runner.invoke(app, ["generate", "--model-path", str(d)])
    assert res.exit_code == 2 and "no installed model plugin provides architecture 'GPT2LMHeadModel'" in res.output


def test_generate_end_to_end_subprocess(llama_ckpt: str) -> None:
    res = _run("generate", "--model-path", llama_ckpt, "--prompt", "Hello", "--max-new-tokens", "5")
    assert res.returncode == 0, res.stderr
    assert "5 generated tokens" in res.stderr


def test_generate_error_subprocess_is_one_line(llama_ckpt: str) -> None:
    res = _run("generate", "--model-path", llama_ckpt, "--attention", "nope")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error: --attention: unknown attention backend 'nope'")


def test_disabled_default_attention_backend_is_a_clear_error(llama_ckpt: str) -> None:
    res = runner.invoke(app, ["generate", "--model-path", llama_ckpt, "--disable-plugin", "torch_native"])
    assert res.exit_code == 2
    assert ("attention backend 'torch_native' is provided by plugin 'torch_native' (plugserve-attention-torch-native "
            "0.1.0), which is disabled (--disable-plugin torch_native); platform 'cpu' picks it") in res.output


@pytest.mark.parametrize("args,needle", [
    (["--plugin-option", "triton.max_kv_split=8"],
     "plugin_options: unknown option 'triton.max_kv_split'; declared: triton.max_kv_splits, triton.pdl (did you mean triton.max_kv_splits?)"),
    (["--disable-plugin", "flashinfr"], "--disable-plugin: unknown plugin 'flashinfr'; installed: "),
])
def test_config_show_runs_the_start_up_checks(args: list[str], needle: str) -> None:
    res = runner.invoke(app, ["config", "show", *args])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output


def test_checks_fail_before_the_model_loads(llama_ckpt: str) -> None:
    from engine.entrypoints.launch import preflight

    cases = [
        # (a third-party CPU backend installed by a concurrent test may be listed too)
        # (flashinfer, not triton: under TRITON_INTERPRET=1, set for CPU test runs, triton declares cpu too)
        (["--attention", "flashinfer"], "--attention: backend 'flashinfer' does not run on cpu (it supports: cuda); "
                                        "backends for platform 'cpu': "),
        (["--disable-plugin", "llama"], "architecture 'LlamaForCausalLM' is provided by plugin 'llama' "
                                        "(plugserve-models-llama 0.1.0), which is disabled (--disable-plugin llama)"),
        (["--schedule-policy", "dfs-weight", "--disable-plugin", "dfs_weight"],
         "schedule policy 'dfs-weight' is provided by plugin 'dfs_weight' (plugserve-policy-dfs-weight 0.1.0), "
         "which is disabled (--disable-plugin dfs_weight)"),
        (["--plugin-option", "torch_native.x=1"], "plugin_options: unknown option 'torch_native.x'"),
    ]
    for extra, needle in cases:
        # The main process's preflight (no weights, no child process) raises it ...
        args = build_server_args({"model_path": llama_ckpt, **_flags(extra)})
        with pytest.raises(EngineError, match=re.escape(needle)):
            preflight(args, llama_ckpt)
        # ... and the command prints it on one line with exit status 2.
        res = runner.invoke(app, ["generate", "--model-path", llama_ckpt, *extra])
        assert res.exit_code == 2, (extra, res.output)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], res.output


def _flags(extra: list[str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for flag, value in zip(extra[::2], extra[1::2]):
        key = flag[2:].replace("-", "_")
        if key == "disable_plugin":
            values[key] = [value]
        elif key == "plugin_option":
            values[key] = [value]
        else:
            values[key] = value
    return values


def test_plugins_list_says_per_platform_what_it_found_and_where_it_was_tested() -> None:
    from engine import plugins

    res = runner.invoke(app, ["plugins", "list", "--verbose"])
    assert res.exit_code == 0
    lines = res.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("PLATFORM"))
    # A row's first line starts with its name; a wrapped reason continues on indented lines.
    table: dict[str, str] = {}
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith(" "):
            name = line.split()[0]
            table[name] = line
        elif line.strip():
            table[name] += " " + line.strip()
    assert set(table) == set(plugins.platforms())
    assert sum("selected" in line for line in table.values()) == 1  # auto-detection picks exactly one
    for name in set(table) & {"rocm", "xpu", "npu"}:
        assert "no: simulated devices only" in table[name]
    for name, line in table.items():
        assert "selected" in line or "available" in line, line
    res = runner.invoke(app, ["plugins", "list", "--json"])
    rows = {p["name"]: p for p in json.loads(res.output)}
    cpu = rows["cpu"]["platforms"]["cpu"]
    assert cpu["available"] is True and cpu["tested_on_hardware"]
    assert "platforms" not in rows["torch_native"]


def test_fp8_on_a_platform_without_fp8_arithmetic_says_it_brings_no_speed(
        llama_ckpt: str, caplog: pytest.LogCaptureFixture) -> None:
    from engine.entrypoints.launch import preflight

    for quant, expected in (("fp8", 1), (None, 0)):
        caplog.clear()
        flags = {"model_path": llama_ckpt, "platform": "cpu", **({"quant": quant} if quant else {})}
        with caplog.at_level(logging.WARNING, logger="engine.entrypoints.launch"):
            preflight(build_server_args(flags), llama_ckpt)
        notes = [r.getMessage() for r in caplog.records if "no fp8 arithmetic" in r.getMessage()]
        assert len(notes) == expected, notes
        if notes:
            assert notes[0].startswith("quant fp8: platform 'cpu' has no fp8 arithmetic"), notes


def test_a_method_without_fast_cpu_kernels_says_so_once_on_the_cpu(
        llama_ckpt: str, caplog: pytest.LogCaptureFixture) -> None:
    from engine.entrypoints.launch import preflight

    # w8a8_int8 declares fast_device_types=("cuda",): the CPU runs its torch reference.
    with caplog.at_level(logging.WARNING, logger="engine.entrypoints.launch"):
        preflight(build_server_args({"model_path": llama_ckpt, "platform": "cpu", "quant": "w8a8_int8"}), llama_ckpt)
    notes = [r.getMessage() for r in caplog.records if "reference path" in r.getMessage()]
    assert notes == ["quant w8a8_int8: on cpu it runs its torch reference path (fast kernels on: cuda), which "
                     "saves weight memory but decodes slower than the unquantized model here"], notes


def test_more_ranks_than_devices_fails_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import engine.plugins as plugins
    from engine.preflight import check_devices

    gpu = SimpleNamespace(device_type="cuda", device_count=lambda: 1)
    monkeypatch.setattr(plugins, "choose_platform",
                        lambda *a, **k: (SimpleNamespace(name="cuda"), gpu))
    check_devices(build_server_args({}))  # one rank: no probe needed, nothing to check
    with pytest.raises(EngineError, match=re.escape("--tp-size 2 x --pp-size 1 x --dp-size 1: needs 2 devices "
                                                    "on this node; platform 'cuda' sees 1")):
        check_devices(build_server_args({"tp_size": 2}))
    monkeypatch.setattr(plugins, "choose_platform",
                        lambda *a, **k: (SimpleNamespace(name="cpu"), SimpleNamespace(device_type="cpu")))
    check_devices(build_server_args({"tp_size": 2}))  # the CPU runs any number of ranks
