"""``benchmarks/sweep_moe_tiles.py --tiers`` times what ``fused_moe`` launches: every tile config
``pick_blocks`` can return (as each of the two launches runs it) is one of ``tier_configs``, at the
boundaries of its tiers and for both benchmarked shapes, so a new tier added to the table without
the script fails here. CPU only: the configs are plain dicts."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sweep_moe_tiles", ROOT / "benchmarks" / "sweep_moe_tiles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("experts", [8, 128], ids=["mixtral", "qwen3-moe"])
@pytest.mark.parametrize("launch", ["gate_up", "down"])
def test_tiers_hold_every_config_fused_moe_launches(experts: int, launch: str) -> None:
    from engine.layers.moe.fused_moe import _gate_up_config, pick_blocks

    sweep = _script()
    own = sweep.tier_configs(launch, experts)
    for slots in (1, 12 * experts, 12 * experts + 1, 16 * experts, 64 * experts, 64 * experts + 1, 512 * experts):
        cfg = pick_blocks(slots, experts)
        assert sweep.tiles(_gate_up_config(cfg) if launch == "gate_up" else cfg) in own
    old = sweep.tiles(_gate_up_config(sweep.OLD_MIDDLE_TIER) if launch == "gate_up" else sweep.OLD_MIDDLE_TIER)
    assert old in own and len(own) == 4
    assert sweep.candidates(False, {}, [], own) == own


def test_group_m_variants_each_config_once_per_value_in_order() -> None:
    sweep = _script()
    a, b = {"BLOCK_M": 16, "GROUP_M": 1}, {"BLOCK_M": 64, "GROUP_M": 8}
    assert sweep.with_group_m([a, b], None) == [a, b]
    assert sweep.with_group_m([a, b], [1, 8]) == [a, {"BLOCK_M": 16, "GROUP_M": 8}, {"BLOCK_M": 64, "GROUP_M": 1}, b]
    assert sweep.with_group_m([a, a], [2]) == [{"BLOCK_M": 16, "GROUP_M": 2}]
