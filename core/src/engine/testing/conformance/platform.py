"""``PlatformConformance``: a platform answers its probes with the documented types."""

from __future__ import annotations

from typing import ClassVar

from engine import plugins


class PlatformConformance:
    """Set ``platform_name``; probes must answer with the documented types."""

    platform_name: ClassVar[str] = ""

    def test_answers_probes(self) -> None:
        spec = plugins.get_platform_spec(self.platform_name)
        platform = plugins.create(spec.factory, options=plugins.declared_options("platform", spec.name))
        assert isinstance(platform.is_available(), bool)
        assert platform.device_type == spec.device_type
        assert isinstance(platform.distributed_backend(), str) and platform.distributed_backend()
        assert plugins.default_attention_backend(platform) in plugins.attention_backends(), "default attention backend is not installed"
        assert isinstance(platform.supports_graph_capture(), bool)
        if not platform.is_available():
            assert platform.unavailable_reason()
            return
        free, total = platform.memory_info(platform.device(0))
        assert 0 <= free <= total and total > 0
