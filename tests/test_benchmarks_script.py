"""The micro-benchmarks: every script under ``benchmarks/`` and the plugins' ``benchmarks/`` folders is
listed in benchmarks/README.md (which says what it measures) and every script listed there exists;
each compiles, and its command-line parser is built from argparse in its ``main``, so ``--help``
answers without a GPU (run by hand: each imports torch, too slow to run all of them here)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _scripts() -> set[str]:
    found = {p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").glob("*.py")}
    for folder in ("plugins", "plugins-attention", "plugins-models", "plugins-quant"):
        found |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).glob("*/benchmarks/*.py")}
    return found


def _listed() -> set[str]:
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    names = set(re.findall(r"`((?:plugins[\w-]*/[\w-]+/benchmarks/)?[\w]+\.py)`", text))
    return {name if "/" in name else f"benchmarks/{name}" for name in names}


def test_every_benchmark_is_listed_in_the_readme_and_every_listed_one_exists() -> None:
    scripts = _scripts()
    assert scripts, "no benchmark scripts found"
    assert scripts == _listed(), f"unlisted: {sorted(scripts - _listed())}; missing: {sorted(_listed() - scripts)}"


def test_each_compiles_and_parses_its_arguments_with_argparse() -> None:
    for name in sorted(_scripts()):
        source = (ROOT / name).read_text(encoding="utf-8")
        tree = ast.parse(source, filename=name)  # a syntax error fails here, naming the file
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert "ArgumentParser" in calls or "parse_args" in calls, f"{name}: no argparse command line"
        assert "__main__" in source, f"{name}: runs on import (no __main__ guard)"
