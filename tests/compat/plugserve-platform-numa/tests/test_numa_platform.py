"""The conformance kit against the `numa` platform."""

from __future__ import annotations

from engine.testing import PlatformConformance


class TestNumaPlatform(PlatformConformance):
    platform_name = "numa"
