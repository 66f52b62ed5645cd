"""Every hook is documented, tested and versioned (datasette's habit)."""

from __future__ import annotations

import inspect
import pathlib

from engine import hookspecs

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs.EngineHookSpecs, inspect.isfunction)]


def test_every_hook_has_a_docstring_with_version() -> None:
    for name in HOOKS:
        doc = getattr(hookspecs.EngineHookSpecs, name).__doc__ or ""
        assert "Since hook API" in doc and "firstresult" in doc, name


def test_every_hook_is_in_the_plugin_guide() -> None:
    guide = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    for name in HOOKS:
        assert f"`{name}`" in guide, f"docs/plugins.md does not document {name}"


def test_every_hook_is_implemented_by_some_test_or_plugin() -> None:
    sources = "\n".join(p.read_text(encoding="utf-8") for base in ("plugins", "plugins-attention", "plugins-models", "plugins-quant", "core/tests", "tests")
                        for p in (ROOT / base).rglob("*.py"))
    for name in HOOKS:
        assert f"def {name}(" in sources, f"no plugin or test implements {name}"


def test_core_imports_no_plugin_package() -> None:
    import ast

    offenders = []
    for path in (ROOT / "core" / "src" / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0].startswith("engine_")]
    assert not offenders, offenders


def test_call_with_accepted_passes_only_what_a_factory_accepts() -> None:
    from engine.hookspecs import call_with_accepted

    def old(config: dict) -> tuple:  # type: ignore[type-arg]
        return (config,)

    def new(config: dict, options: dict) -> tuple:  # type: ignore[type-arg]
        return (config, options)

    def loose(config: dict, **kwargs: object) -> tuple:  # type: ignore[type-arg]
        return (config, kwargs)

    assert call_with_accepted(old, {}, options={"a": 1}) == ({},)
    assert call_with_accepted(new, {}, options={"a": 1}) == ({}, {"a": 1})
    assert call_with_accepted(loose, {}, options={"a": 1}) == ({}, {"options": {"a": 1}})
