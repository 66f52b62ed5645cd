"""The plugin author's path, as docs/plugins.md tells it: one plugin of each kind made from the
template outside the repo, pip-installed (editable), listed, its generated conformance tests run,
one selected, then all uninstalled: selecting the attention backend becomes a clear error.

The plugins go into a virtual environment of the test's own that sees this one's packages
(``--system-site-packages``), and every command runs with its Python: under pytest-xdist the other
workers start servers and list plugins meanwhile, and must not meet five plugins that come and go."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# template kind -> (plugin name, distribution, registry kind in `engine plugins list --json`)
PLUGINS = {
    "attention": ("thirdparty", "plugserve-attention-thirdparty", "attention"),
    "quant": ("thirdparty_quant", "plugserve-quant-thirdparty-quant", "quantization"),
    "model": ("thirdparty_model", "plugserve-models-thirdparty-model", "model"),
    "policy": ("thirdparty_policy", "plugserve-policy-thirdparty-policy", "policy"),
    "platform": ("thirdparty_platform", "plugserve-platform-thirdparty-platform", "platform"),
}


def _engine(python: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "engine", *args], capture_output=True, text=True, timeout=timeout)


def _pip(python: str, command: str, *args: str) -> None:
    # The plugins are local directories without dependencies: pip needs no index, and asking
    # PyPI for a newer pip is a network call a test should not make.
    offline = ["--no-index"] if command == "install" else []
    subprocess.run([python, "-m", "pip", command, "-q", "--disable-pip-version-check", *offline, *args],
                   check=True, capture_output=True, timeout=300)


def _virtualenv(where: pathlib.Path) -> str:
    """The Python of a new virtual environment over this one's packages (pip, setuptools and the
    engine included: nothing is installed into it but the plugins)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(where)],
                   check=True, capture_output=True, timeout=120)
    return str(where / "bin" / "python")


@pytest.mark.slow
def test_one_plugin_of_each_kind_from_the_template(tmp_path: pathlib.Path, llama_ckpt_dir: str) -> None:
    python = _virtualenv(tmp_path / "venv")
    dests = {}
    for kind, (name, dist, _) in PLUGINS.items():
        dests[kind] = tmp_path / dist
        made = subprocess.run([sys.executable, str(ROOT / "scripts" / "new_plugin.py"), kind, name,
                               "--dest", str(dests[kind])], capture_output=True, text=True, check=True)
        assert f"created {dist}" in made.stdout
    _pip(python, "install", "--no-deps", "--no-build-isolation", *[a for d in dests.values() for a in ("-e", str(d))])
    try:
        listed = {p["name"]: p for p in json.loads(_engine(python, "plugins", "list", "--json").stdout)}
        for name, dist, registry_kind in PLUGINS.values():
            assert listed[name]["distribution"] == dist and listed[name]["status"] == "ok", listed[name]
            assert listed[name]["registers"] == {registry_kind: [name]}
            with pytest.raises(importlib.metadata.PackageNotFoundError):  # only the virtual environment has it
                importlib.metadata.distribution(dist)
        ran = _engine(python, "generate", "--model-path", llama_ckpt_dir, "--attention", "thirdparty", "--max-new-tokens", "3")
        assert ran.returncode == 0, ran.stderr
        # Every generated conformance test passes against its installed plugin, in one pytest run;
        # -rs prints skip reasons (the template's quant method has no checkpoint format).
        # The generated tests need no pytest plugin; without autoloading, pytest skips importing
        # (and assertion-rewriting) the ones this environment happens to have: ~4 CPU-s of a
        # ~16 CPU-s run here (langsmith's alone rewrites 227 modules where no bytecode is cached).
        # One torch thread unless the caller chose (scripts/test.sh does): the tiny models' matmuls
        # spin 2 OpenMP threads beside the other test workers for ~10x their CPU time.
        kit = subprocess.run([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                              *[str(d / "tests") for d in dests.values()]],
                             capture_output=True, text=True, timeout=400, cwd=str(tmp_path),
                             env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                                  "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        assert kit.returncode == 0, kit.stdout[-3000:]
        assert "failed" not in kit.stdout and "serialized_config is None" in kit.stdout, kit.stdout[-3000:]
        # Installed but disabled: the error names the plugin and what disabled it, before any model load.
        off = _engine(python, "generate", "--model-path", llama_ckpt_dir, "--attention", "thirdparty",
                      "--disable-plugin", "thirdparty")
        assert off.returncode == 2
        assert off.stderr.strip() == ("error: --attention: attention backend 'thirdparty' is provided by plugin 'thirdparty' "
                                      "(plugserve-attention-thirdparty 0.1.0), which is disabled (--disable-plugin thirdparty)")
    finally:
        _pip(python, "uninstall", "-y", *[dist for _, dist, _ in PLUGINS.values()])
    gone = _engine(python, "generate", "--model-path", llama_ckpt_dir, "--attention", "thirdparty")
    assert gone.returncode == 2
    assert "unknown attention backend 'thirdparty'; installed: " in gone.stderr and "torch_native" in gone.stderr
