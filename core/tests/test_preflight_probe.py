"""``preflight.probes_platform`` says exactly when the start-up checks probe the platform (and so
import torch): ``engine serve``/``engine generate`` import torch on one compute thread before such
a probe, so that their engine processes can still be forks of the main process."""

from __future__ import annotations

from typing import Any

import pytest

import engine.plugins as plugins
from engine import preflight
from engine.config import ServerArgs
from engine.errors import EngineError


@pytest.mark.parametrize("kw", [
    {}, {"tp_size": 2}, {"pp_size": 2}, {"dp_size": 2}, {"tp_size": 2, "nnodes": 2},
    {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True},
    {"attention": "torch_native"}, {"attention": "flashinfer"}, {"attention": "flashinfer", "platform": "cpu"},
    {"quant": "fp8"}, {"attention": "no_such_backend"},
], ids=repr)
def test_probes_platform_matches_the_checks(kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ServerArgs(**kw)
    probed = []
    choose = plugins.choose_platform

    def recording(*a: Any, **k: Any) -> Any:
        probed.append(a)
        return choose(*a, **k)

    monkeypatch.setattr(plugins, "choose_platform", recording)
    for check in (preflight.check_without_checkpoint, preflight.check_devices):
        try:
            check(args)
        except EngineError:
            pass  # an unusable name or a backend for another device: refused, probed or not
    assert preflight.probes_platform(args) == bool(probed), probed
