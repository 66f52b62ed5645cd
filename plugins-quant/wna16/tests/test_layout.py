"""The packed layouts: word packing, RTN's grid, the kernel layout's repacking and act-order."""

from __future__ import annotations

import pytest
import torch
from engine.errors import ModelLoadError
from engine_quant_wna16.layout import (
    IntWeight,
    dequantize_kernel_weight,
    pack_int32,
    to_kernel_layout,
    unpack_int32,
)
from engine_quant_wna16.rtn import act_order_g_idx, quantize_rtn


def test_word_layout_by_hand() -> None:
    codes = torch.arange(8, dtype=torch.int32)[None, :]
    assert pack_int32(codes, 4, 1).item() == 0x76543210
    # AWQ's interleave: the nibble at bits 4*i holds element (0, 2, 4, 6, 1, 3, 5, 7)[i].
    assert pack_int32(codes, 4, 1, (0, 2, 4, 6, 1, 3, 5, 7)).item() == 0x75316420
    assert pack_int32(torch.tensor([[1, 2, 3, 255]]), 8, 1).item() == -0x00FCFDFF  # 0xFF030201 as int32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("order", [None, (0, 2, 4, 6, 1, 3, 5, 7)])
def test_pack_round_trip(bits: int, dim: int, order: tuple[int, ...] | None) -> None:
    if order is not None and bits != 4:
        pytest.skip("AWQ's order is for 4-bit words")
    codes = torch.randint(0, 1 << bits, (32, 64), generator=torch.Generator().manual_seed(bits + dim))
    packed = pack_int32(codes, bits, dim, order)
    assert packed.dtype == torch.int32 and packed.shape[dim] == codes.shape[dim] * bits // 32
    assert torch.equal(unpack_int32(packed, bits, dim, order), codes.to(torch.int32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_within_the_grid(bits: int, group_size: int, symmetric: bool) -> None:
    # Round to nearest: half a step, except at a group's extremes, which the grid's top code (and
    # the float16 rounding of the scale) may clip by up to one step.
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits * group_size))
    w = quantize_rtn(weight, bits, group_size, symmetric)
    step = w.scales.float()[w.group_of_channel()].t()
    err = (w.dequantize() - weight).abs() / step
    assert float(err.max()) <= 1.0 + 1e-4
    assert float((err > 0.5 + 1e-4).float().mean()) < 0.02


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_kernel_layout_keeps_the_weight(group_size: int, symmetric: bool, act_order: bool) -> None:
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(group_size))
    g_idx = act_order_g_idx(256, group_size, seed=3) if act_order else None
    w = quantize_rtn(weight, 4, group_size, symmetric, g_idx)
    kw = to_kernel_layout(w, "test")
    assert (kw.perm is not None) == act_order
    assert kw.scales.dtype == torch.float16 and (kw.zeros is None) == symmetric
    assert torch.equal(dequantize_kernel_weight(kw), w.dequantize())


def test_errors() -> None:
    w = quantize_rtn(torch.randn(16, 128), 4, 32)
    bad_group = IntWeight(w.codes, w.scales, w.zeros, None, 4, 48)
    with pytest.raises(ModelLoadError, match="group_size 48 does not divide the layer's input size 128"):
        to_kernel_layout(bad_group, "layer x")
    with pytest.raises(ModelLoadError, match=r"layer x: scales of shape \(4, 16\); expected \(2, 16\)"):
        to_kernel_layout(IntWeight(w.codes, w.scales, w.zeros, None, 4, 64), "layer x")
    uneven = torch.zeros(128, dtype=torch.int32)
    uneven[:40] = 1
    with pytest.raises(ModelLoadError, match="g_idx does not put 32 input channels in each group"):
        to_kernel_layout(IntWeight(w.codes, w.scales, w.zeros, uneven, 4, 32), "layer x")
    with pytest.raises(ModelLoadError, match="bits 3 is not supported"):
        to_kernel_layout(IntWeight(w.codes, w.scales, w.zeros, None, 3, 32), "layer x")
