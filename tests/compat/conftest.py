"""The compatibility corpus: plugins written against the oldest supported hook API and SDK.

Each directory here is a plugin distribution as its author wrote it from docs/plugins.md of hook
API 1 (an attention backend, a quantization method, a model, a schedule policy, a platform), with
the conformance-kit tests and the conftest its author wrote then. They run unchanged on every
release: a failure here means the engine broke a public form a plugin relies on (docs/stability.md).

Installing them is not needed: this conftest does what ``pip install`` and the entry point would
do. It puts each distribution's ``src`` on ``sys.path`` and registers the modules named in its
``pyproject.toml`` entry points (group ``engine.plugins``) as in-process plugins, for the tests of
that directory only (so the rest of the suite sees the installed plugins alone). The deprecation
warnings those old forms raise are expected here and filtered; ``test_compat_deprecations.py``
checks that each one is raised and names its replacement.
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest

HERE = pathlib.Path(__file__).resolve().parent
PLUGIN_DIRS = sorted(p.parent for p in HERE.glob("*/pyproject.toml"))


def entry_points(plugin_dir: pathlib.Path) -> dict[str, str]:
    """``{entry-point name: module}`` of the distribution in ``plugin_dir`` (group ``engine.plugins``)."""
    project = tomllib.loads((plugin_dir / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return dict(project["entry-points"]["engine.plugins"])


for _plugin_dir in PLUGIN_DIRS:
    if str(_plugin_dir / "src") not in sys.path:
        sys.path.insert(0, str(_plugin_dir / "src"))


def _plugin_dir_of(path: pathlib.Path) -> pathlib.Path | None:
    return next((d for d in PLUGIN_DIRS if d in path.parents), None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The old forms warn by design (engine.deprecation); only those warnings are filtered, so any
    # other deprecation the corpus meets still shows in the summary.
    for item in items:
        if _plugin_dir_of(item.path) is not None:
            item.add_marker(pytest.mark.filterwarnings(
                r"ignore:.*is deprecated since plugserve-core .*See docs/stability\.md:DeprecationWarning"))


@pytest.fixture(autouse=True, scope="module")
def _installed_as_entry_points(request: pytest.FixtureRequest) -> Iterator[None]:
    """The plugin whose tests run here is registered as its entry points would register it."""
    plugin_dir = _plugin_dir_of(request.path)
    if plugin_dir is None:
        yield
        return
    from engine import plugins

    modules: list[tuple[str, Any]] = [(name, importlib.import_module(module))
                                      for name, module in entry_points(plugin_dir).items()]
    with plugins.in_process_plugins(*modules):
        yield
