"""A third-party plugin package, made from the template outside the repo, pip-installed,
listed, selected, then uninstalled: selecting it becomes a clear error."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _engine(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=timeout)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, capture_output=True, timeout=300)


@pytest.mark.slow
def test_third_party_attention_plugin_lifecycle(tmp_path: pathlib.Path, llama_ckpt_dir: str) -> None:
    dest = tmp_path / "plugserve-attention-thirdparty"
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "new_plugin.py"), "attention", "thirdparty", "--dest", str(dest)],
                          capture_output=True, text=True, check=True)
    assert "created plugserve-attention-thirdparty" in made.stdout
    _pip("install", "--no-deps", "--no-build-isolation", str(dest))
    try:
        listed = json.loads(_engine("plugins", "list", "--json").stdout)
        mine = next(p for p in listed if p["name"] == "thirdparty")
        assert mine["distribution"] == "plugserve-attention-thirdparty" and mine["status"] == "ok"
        assert mine["registers"] == {"attention": ["thirdparty"]}
        ran = _engine("generate", "--model-path", llama_ckpt_dir, "--attention", "thirdparty", "--max-new-tokens", "3")
        assert ran.returncode == 0, ran.stderr
        # Its own generated conformance test passes against the installed plugin.
        kit = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(dest / "tests")],
                             capture_output=True, text=True, timeout=300, cwd=str(dest))
        assert kit.returncode == 0, kit.stdout[-2000:]
        # Installed but disabled: the error names the plugin and what disabled it, before any model load.
        off = _engine("generate", "--model-path", llama_ckpt_dir, "--attention", "thirdparty",
                      "--disable-plugin", "thirdparty")
        assert off.returncode == 2
        assert off.stderr.strip() == ("error: attention backend 'thirdparty' is provided by plugin 'thirdparty' "
                                      "(plugserve-attention-thirdparty 0.1.0), which is disabled (--disable-plugin thirdparty)")
    finally:
        _pip("uninstall", "-y", "plugserve-attention-thirdparty")
    gone = _engine("generate", "--model-path", llama_ckpt_dir, "--attention", "thirdparty")
    assert gone.returncode == 2
    assert "unknown attention backend 'thirdparty'; installed: " in gone.stderr and "torch_native" in gone.stderr
