"""The start-up checks call ``before_probe`` right before they probe the platform (which imports
torch), and only then: ``engine serve``/``engine generate`` import torch there on one compute
thread, so that their engine processes can still be forks of the main process; a check that fails
earlier still fails before torch."""

from __future__ import annotations

from typing import Any

import pytest

import engine.plugins as plugins
from engine import preflight
from engine.config import ServerArgs
from engine.errors import EngineError


@pytest.mark.parametrize("kw, probes", [
    ({}, False), ({"tp_size": 2}, True), ({"pp_size": 2}, True), ({"dp_size": 2}, True),
    ({"tp_size": 2, "nnodes": 2}, False), ({"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}, True),
    ({"attention": "torch_native"}, False), ({"attention": "flashinfer"}, True),
    ({"attention": "flashinfer", "platform": "cpu"}, False), ({"quant": "fp8"}, True),
    ({"attention": "no_such_backend"}, False),
], ids=repr)
def test_before_probe_runs_right_before_each_probe(kw: dict[str, Any], probes: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    choose = plugins.choose_platform

    def recording(*a: Any, **k: Any) -> Any:
        events.append("probe")
        return choose(*a, **k)

    monkeypatch.setattr(plugins, "choose_platform", recording)
    args = ServerArgs(**kw)
    for check in (preflight.check_without_checkpoint, preflight.check_devices):
        try:
            check(args, lambda: events.append("before"))
        except EngineError:
            pass  # an unusable name or a backend for another device: refused, probed or not
    assert events == (["before", "probe"] if probes else []), events
