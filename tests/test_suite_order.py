"""The root conftest's list of slow modules (the order scripts/test.sh's xdist workers take them in)
names modules that exist: a renamed or deleted module would silently lose its place."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _root_conftest() -> Any:
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slow_modules_name_existing_test_modules() -> None:
    module = _root_conftest()
    missing = [path for path in module.SLOW_MODULES if not (ROOT / path).is_file()]
    assert not missing, f"conftest.SLOW_MODULES names modules that do not exist: {missing}"
    assert len(set(module.SLOW_MODULES)) == len(module.SLOW_MODULES), "conftest.SLOW_MODULES repeats a module"


def test_the_modules_of_a_shared_server_form_one_group() -> None:
    """A module that calls a shared server, or whose conftest.py does, joins that server's group
    (so one worker starts it); other modules keep a group of their own."""
    group = _root_conftest()._shared_server_group
    default = {group(str(ROOT / p)) for p in ("tests/test_docs_examples.py", "tests/test_default_model.py",
                                              "plugins/lang/tests/test_runtime_endpoint.py")}
    assert default == {"shared-default-model-server"}
    assert group(str(ROOT / "tests/test_server_e2e_errors.py")) == "shared-tiny-checkpoint-server"
    assert group(str(ROOT / "tests/test_server_e2e_lifecycle.py")) is None
