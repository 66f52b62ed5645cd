"""Commands that answer without a model do not import torch.

The commands run through the typer app in a fresh interpreter (``sys.modules`` starts clean),
which reports after each one whether it imported ``torch`` (or transformers, triton). No timing is asserted:
importing torch is what makes a command take seconds, so its absence is what is checked.

``engine config show --attention NAME`` (or ``--quant``) without ``--platform`` imports torch when
the named backend or method does not run on every installed platform's device type (flashinfer,
fp8): whether it runs here depends on which platform claims the machine, and probing a platform
imports its implementation and torch. ``engine plugins list --verbose`` and ``--json`` probe the
platforms the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Runs each command of a JSON list in turn and reports, per command, which heavy modules it
# imported (new in sys.modules): one interpreter for many commands keeps the test short, and a
# module once imported stays imported, so a command that imports one is the one reported.
_PROBE = """
import json, sys
from typer.testing import CliRunner
from engine.cli import app
HEAVY = ("torch", "transformers", "triton")
out = []
for args in json.loads(sys.argv[1]):
    before = {m for m in HEAVY if m in sys.modules}
    result = CliRunner().invoke(app, args)
    heavy = sorted(m for m in HEAVY if m in sys.modules and m not in before)
    out.append({"exit_code": result.exit_code, "heavy": heavy, "output": result.output[-2000:]})
print(json.dumps(out))
"""


def _run_all(commands: list[list[str]]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(commands)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(args: list[str]) -> dict:
    """One command in a fresh interpreter."""
    return _run_all([args])[0]


@pytest.fixture(scope="module")
def deploy_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "deploy.yaml"
    path.write_text("max_total_tokens: 4096\nschedule_policy: lpm\nplatform: cpu\nattention: torch_native\n")
    return path


COMMANDS: list[tuple[list[str], int]] = [
    (["--help"], 0),
    (["--version"], 0),
    (["plugins", "list"], 0),
    (["plugins", "list", "--disable-plugin", "fcfs"], 0),
    (["config", "show"], 0),
    (["config", "show", "--page-size", "8", "--schedule-policy", "lpm", "--json"], 0),
    (["config", "show", "--platform", "cpu", "--attention", "torch_native"], 0),
    (["config", "show", "--attention", "torch_native"], 0),  # runs on every platform: no probe
    (["serve", "--help"], 0),
    (["bench", "--help"], 0),
    (["bench", "one-batch", "--help"], 0),
    # argument errors
    (["config", "show", "--dtype", "fp33"], 2),
    (["config", "show", "--schedule-policy", "lmp"], 2),
    (["config", "show", "--quant", "fp9", "--platform", "cpu"], 2),
    (["serve", "--no-such-flag"], 2),
    (["generate", "--max-new-tokens", "many"], 2),
    (["bench", "one-batch", "--batch-size", "x"], 2),
    (["serve", "--attention", "flashinfr", "--port", "1"], 2),
    (["generate", "--quant", "fp9"], 2),
    (["generate", "--schedule-policy", "lmp"], 2),
    (["serve", "--model-path", "/nonexistent/model", "--port", "1"], 2),
    (["serve", "--model-path", __file__], 2),  # a file, not a GGUF
    (["generate", "--model-path", "/nonexistent/model"], 2),
    (["config", "show", "--model-path", "/nonexistent/model"], 2),
    (["generate", "--port", "8080"], 2),  # a flag of the server alone
    (["generate", "--api-key", "k"], 2),
]


@pytest.fixture(scope="module")
def command_results() -> dict[str, dict]:
    results = _run_all([args for args, _ in COMMANDS])
    return {" ".join(args): result for (args, _), result in zip(COMMANDS, results, strict=True)}


@pytest.mark.parametrize("args,exit_code", COMMANDS, ids=[" ".join(args) for args, _ in COMMANDS])
def test_command_does_not_import_torch(args: list[str], exit_code: int, command_results: dict[str, dict]) -> None:
    result = command_results[" ".join(args)]
    assert result["exit_code"] == exit_code, result["output"]
    assert result["heavy"] == [], f"engine {' '.join(args)} imported {result['heavy']}"


def test_config_show_with_a_yaml_file_does_not_import_torch(deploy_yaml: Path) -> None:
    result = _run(["config", "show", "--config", str(deploy_yaml)])
    assert result["exit_code"] == 0, result["output"]
    assert "max_total_tokens: 4096" in result["output"]
    assert result["heavy"] == []


def test_a_model_that_does_not_split_fails_before_torch(llama_ckpt: str) -> None:
    # The tiny Llama has 4 attention heads: 3 ranks cannot split them.
    results = _run_all([["config", "show", "--model-path", llama_ckpt, "--tp-size", "3"],
                        ["serve", "--model-path", llama_ckpt, "--tp-size", "3", "--port", "1"]])
    for result in results:
        assert result["exit_code"] == 2 and "--tp-size: invalid value 3" in result["output"], result["output"]
        assert result["heavy"] == [], result


def test_probe_sees_torch_when_a_command_imports_it() -> None:
    # Guards the check itself: probing the platforms imports torch, and the probe reports it.
    result = _run(["plugins", "list", "--verbose"])
    assert result["exit_code"] == 0 and "torch" in result["heavy"]
    # A backend that runs on CUDA only: whether it runs here needs the probe.
    result = _run(["config", "show", "--attention", "flashinfer"])
    assert "torch" in result["heavy"]


def test_built_in_plugins_name_their_factories() -> None:
    # A factory given as an object (a class) imports the implementation when the plugin registers;
    # "module:attr" defers that to the moment the implementation is selected.
    import engine.plugins as plugins

    registry = plugins.get_registry(())
    built_in = [(kind, name, entry) for kind, entries in registry.entries.items()
                for name, entry in entries.items()
                if entry.plugin.distribution.startswith("plugserve-") and hasattr(entry.spec, "factory")]
    assert len(built_in) > 20  # policies, platforms, backends, methods, models, parsers, ...
    by_object = [f"{kind} {name} ({entry.plugin.distribution})" for kind, name, entry in built_in
                 if not isinstance(entry.spec.factory, str)]
    assert not by_object, f"registered with a factory object instead of 'module:attr': {by_object}"
