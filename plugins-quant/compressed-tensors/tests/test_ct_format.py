"""pack-quantized layout: our packer and unpacker against the compressed-tensors library.

The library (``pip install compressed-tensors``, pure Python) packs RTN-quantized weights; our
unpacker must read its tensors back to exactly its own decompressed weight, and our packer must
write the same bytes.
"""

from __future__ import annotations

import pytest
import torch
from engine_quant_compressed_tensors.format import pack_compressed, unpack_compressed
from engine_quant_wna16.rtn import quantize_rtn

from engine_quant_compressed_tensors.testing import library_pack, library_unpack

CASES = [(4, 32, True), (4, 64, False), (4, 128, False), (4, -1, True), (4, -1, False), (8, 128, True), (8, 32, False)]


@pytest.mark.parametrize(("bits", "group_size", "symmetric"), CASES)
def test_round_trip(bits: int, group_size: int, symmetric: bool) -> None:
    w = quantize_rtn(torch.randn(48, 256, generator=torch.Generator().manual_seed(bits + group_size)), bits,
                     group_size, symmetric, scale_dtype=torch.float32)
    t = pack_compressed(w)
    assert t["weight_packed"].shape == (48, 256 * bits // 32)
    assert t["weight_shape"].tolist() == [48, 256]
    back = unpack_compressed(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), None, bits, w.group_size)
    assert torch.equal(back.dequantize(), w.dequantize())


@pytest.mark.parametrize(("bits", "group_size", "symmetric"), CASES)
def test_matches_compressed_tensors_library(bits: int, group_size: int, symmetric: bool) -> None:
    pytest.importorskip("compressed_tensors")
    w = quantize_rtn(torch.randn(48, 256, generator=torch.Generator().manual_seed(7 * bits + group_size)), bits,
                     group_size, symmetric, scale_dtype=torch.float32)
    theirs = library_pack(w)
    ours = pack_compressed(w)
    assert sorted(theirs) == sorted(ours)
    for name in ("weight_packed", "weight_zero_point", "weight_shape"):
        if name in ours:
            assert torch.equal(theirs[name], ours[name]), name
    read = unpack_compressed(theirs["weight_packed"], theirs["weight_scale"], theirs.get("weight_zero_point"), None,
                             bits, w.group_size)
    assert torch.equal(read.dequantize(), library_unpack(theirs, w).float())
