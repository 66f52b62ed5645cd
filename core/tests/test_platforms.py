"""The platform interface: the core names no vendor device API outside it; API-4 platforms
still work; the device helpers for code that holds a tensor but not the platform."""

from __future__ import annotations

import io
import tokenize
from collections.abc import Collection
from pathlib import Path

import pytest
import torch

import engine
from engine import platforms
from engine.platforms import Platform

CORE = Path(engine.__file__).parent
#: the platform interface: the only core modules allowed to call torch.cuda / torch.xpu / torch.npu.
INTERFACE = {CORE / "platforms.py"}
VENDOR_MODULES = ("cuda", "xpu", "npu", "mps", "hip")


def vendor_api_uses(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every ``torch.<vendor>.<name>`` in code (strings and comments skipped),
    plus ``import torch.<vendor>`` / ``from torch import <vendor>`` / ``from torch.<vendor> import``."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                tokenize.DEDENT, tokenize.STRING)]
    found = []
    for i, tok in enumerate(tokens[:-3]):
        a, dot, b, dot2 = (t.string for t in tokens[i:i + 4])
        if a == "torch" and dot == "." and b in VENDOR_MODULES and dot2 == ".":
            found.append((tok.start[0], f"torch.{b}.{tokens[i + 4].string if i + 4 < len(tokens) else ''}"))
        if a in ("import", "from") and dot == "torch" and b == "." and dot2 in VENDOR_MODULES:
            found.append((tok.start[0], f"{a} torch.{dot2}"))
        if a == "from" and dot == "torch" and b == "import" and dot2 in VENDOR_MODULES:
            found.append((tok.start[0], f"from torch import {dot2}"))
    return found


def test_the_scanner_finds_calls_and_skips_text() -> None:
    code = ('import torch.cuda\nx = torch.cuda.Event()  # torch.cuda.foo in a comment\n'
            'y = "torch.cuda.bar in a string"\nfrom torch import xpu\nz = torch.npu.mem_get_info(0)\n'
            'w = torch.device("cuda")\n')
    assert [line for line, _ in vendor_api_uses(code)] == [1, 2, 4, 5]


def test_core_calls_no_vendor_device_api_outside_the_platform_interface() -> None:
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        if path in INTERFACE:
            continue
        for line, text in vendor_api_uses(path.read_text()):
            offenders.append(f"{path.relative_to(CORE.parent)}:{line}: {text}")
    assert not offenders, ("the core must reach the device through the Platform (engine.platforms): "
                           + "; ".join(offenders))


class Api4Platform(Platform):
    """A platform written against hook API 4: only the abstract methods."""

    name = "old"
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def distributed_backend(self) -> str:
        return "gloo"

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        return 1 << 30, 2 << 30

    def default_attention_backend(self, available: Collection[str] = ()) -> str:
        return "torch_native"


def test_an_api4_platform_gets_defaults_for_the_api5_contract() -> None:
    p = Api4Platform()
    assert p.device_count() == 1
    assert p.fp8_dtype() is None
    assert p.unsupported_attention_reason("triton") is None and p.unsupported_quant_reason("fp8") is None
    assert p.supported_attention_backends(["a", "b"]) == ["a", "b"]
    assert not p.supports_graph_capture() and not p.pin_host_memory()
    assert p.create_stream() is None and p.create_event() is None
    with p.stream_context(None):
        pass
    with pytest.raises(NotImplementedError, match="old"):
        p.create_graph()


def test_current_platform_and_helpers_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert platforms.device_event(cpu) is None
    platforms.synchronize_device(cpu)  # nothing to wait for
    assert platforms.device_type_available("cpu")
    p = Api4Platform()
    with platforms.using_platform(p):
        assert platforms.current_platform() is p
        assert platforms.pin_host_memory() is False
    assert platforms.current_platform() is not p


def test_device_event_asks_the_current_platform_of_that_device_type() -> None:
    class Eventful(Api4Platform):
        device_type = "meta"

        def create_event(self) -> str:
            return "event"

    with platforms.using_platform(Eventful()):
        assert platforms.device_event(torch.device("meta")) == "event"
        assert platforms.device_event(torch.device("cpu")) is None


def test_device_index_is_the_devices_own_else_the_current_one_of_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    class _Module:
        def current_device(self) -> int:
            return 3

    def module(device_type: str) -> _Module | None:
        asked.append(device_type)
        return None if device_type in ("cpu", "meta") else _Module()

    monkeypatch.setattr(platforms, "_device_module", module)
    assert platforms.device_index(torch.device("cuda", 1)) == 1 and asked == []  # no device call
    assert platforms.device_index(torch.device("cuda")) == 3
    assert platforms.device_index(None) == 3 and platforms.device_index(None, "xpu") == 3
    assert asked == ["cuda", "cuda", "xpu"]
    with pytest.raises(ValueError, match="device type 'meta' has no current device; accepted: cuda"):
        platforms.device_index(torch.device("meta"))
