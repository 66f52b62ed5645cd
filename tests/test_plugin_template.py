"""Every kind the template makes is a plugin the registry accepts and whose factory loads."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest

from engine import plugins
from engine.hookspecs import resolve_factory

ROOT = pathlib.Path(__file__).resolve().parents[1]
KIND_TO_REGISTRY = {"attention": "attention", "policy": "policy", "platform": "platform",
                    "quant": "quantization", "model": "model", "router": "router",
                    "toolparser": "tool-parser", "reasoning": "reasoning-parser", "grammar": "grammar",
                    "spec": "speculative", "lora": "lora-backend", "kvtier": "kv-tier",
                    "kvtransfer": "kv-transfer"}
SEGMENT = {"model": "models"}  # distribution/package segment, as the built-in plugins spell it


@pytest.mark.parametrize("kind", sorted(KIND_TO_REGISTRY))
def test_template_plugin_registers_and_loads(kind: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"tmpl_{kind}"
    dest = tmp_path / name
    subprocess.run([sys.executable, str(ROOT / "scripts" / "new_plugin.py"), kind, name, "--dest", str(dest)],
                   check=True, capture_output=True)
    text = (dest / "pyproject.toml").read_text()
    segment = SEGMENT.get(kind, kind)
    assert f'{name} = "engine_{segment}_{name}"' in text and '[project.entry-points."engine.plugins"]' in text
    assert f'name = "plugserve-{segment}-{name.replace("_", "-")}"' in text and '"plugserve-core>=0.1"' in text
    monkeypatch.syspath_prepend(str(dest / "src"))
    module = importlib.import_module(f"engine_{segment}_{name}")
    reg = plugins.PluginRegistry(load_entry_points=True, extra_plugins=[(name, module)])
    assert reg.plugins[name].status == "ok", reg.plugins[name].error
    registry_kind = KIND_TO_REGISTRY[kind]
    (key,) = reg.plugins[name].kinds[registry_kind]
    spec = reg.entries[registry_kind][key].spec
    assert resolve_factory(spec.factory) is not None  # the implementation module imports
    if kind == "model":
        # A name of its own, so the engine (and its kit) select this plugin, not the built-in llama one.
        assert spec.architectures == ("TmplModelForCausalLM",)
        test_text = (dest / "tests" / f"test_{segment}_{name}.py").read_text()
        assert 'architecture = "TmplModelForCausalLM"' in test_text and f'plugin_name = "{name}"' in test_text
    assert (dest / "tests" / f"test_{segment}_{name}.py").exists() and (dest / "README.md").exists()


@pytest.mark.parametrize("bad", ["bad name", "9lives", "trailing-", "double--dash", "dot.ted"])
def test_bad_name_is_refused(bad: str, tmp_path: pathlib.Path) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "new_plugin.py"), "policy", bad,
                          "--dest", str(tmp_path / "x")], capture_output=True, text=True)
    assert res.returncode == 2 and f"error: NAME: invalid value {bad!r}; accepted: " in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_hyphenated_name_is_the_one_name_users_see(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``deep-think``: the entry point, the registered parser and the name in the kit's test are
    all ``deep-think``; only the import package spells it ``engine_reasoning_deep_think``."""
    dest = tmp_path / "dt"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "new_plugin.py"), "reasoning", "deep-think", "--dest",
                    str(dest)], check=True, capture_output=True)
    text = (dest / "pyproject.toml").read_text()
    assert 'deep-think = "engine_reasoning_deep_think"' in text and 'name = "plugserve-reasoning-deep-think"' in text
    test_text = (dest / "tests" / "test_reasoning_deep_think.py").read_text()
    assert 'parser_name = "deep-think"' in test_text and "class TestDeepThink(" in test_text
    monkeypatch.syspath_prepend(str(dest / "src"))
    module = importlib.import_module("engine_reasoning_deep_think")
    reg = plugins.PluginRegistry(load_entry_points=True, extra_plugins=[("deep-think", module)])
    assert reg.plugins["deep-think"].status == "ok", reg.plugins["deep-think"].error
    assert reg.plugins["deep-think"].kinds == {"reasoning-parser": ["deep-think"]}


def test_docs_list_every_kind_the_template_makes() -> None:
    """docs/plugins.md's kind list and table name every kind new_plugin.py accepts, and its naming
    section every segment (a kind left out there is a kind authors cannot find)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("new_plugin", ROOT / "scripts" / "new_plugin.py")
    assert spec is not None and spec.loader is not None
    new_plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(new_plugin)
    guide = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    kinds_line = guide.split("Kinds: ", 1)[1].split("(`python scripts/new_plugin.py", 1)[0]
    naming = guide.split("## Naming", 1)[1].split("\n## ", 1)[0]
    for kind in new_plugin.KINDS:
        segment = new_plugin.NAME_SEGMENT.get(kind, kind)
        assert f"`{kind}`" in kinds_line, f"docs/plugins.md's kind list leaves out {kind}"
        assert f"| `{kind}` | `plugserve-{segment}-NAME`" in guide, f"docs/plugins.md's table leaves out {kind}"
        assert f"`{segment}`" in naming, f"docs/plugins.md's naming section leaves out the segment {segment}"
