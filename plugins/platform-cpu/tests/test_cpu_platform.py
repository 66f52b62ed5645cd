from __future__ import annotations

from engine import plugins
from engine.testing import PlatformConformance


class TestCpuPlatform(PlatformConformance):
    platform_name = "cpu"


def test_cpu_is_the_fallback_choice() -> None:
    platform = plugins.select_platform(None)
    # On a machine with an accelerator plugin installed and available, that one wins instead.
    assert platform.name in plugins.platforms()
    assert plugins.select_platform("cpu").name == "cpu"
