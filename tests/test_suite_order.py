"""The root conftest's list of slow modules (the order scripts/test.sh's xdist workers take them in)
names modules that exist: a renamed or deleted module would silently lose its place."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_slow_modules_name_existing_test_modules() -> None:
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [path for path in module.SLOW_MODULES if not (ROOT / path).is_file()]
    assert not missing, f"conftest.SLOW_MODULES names modules that do not exist: {missing}"
    assert len(set(module.SLOW_MODULES)) == len(module.SLOW_MODULES), "conftest.SLOW_MODULES repeats a module"
