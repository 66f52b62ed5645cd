"""The torch dequantization (the CPU path, and the kernels' reference) against the ``gguf`` package.

Bit-for-bit: ``formats.dequantize`` must equal ``gguf.quants.dequantize`` exactly on every type the
plugin keeps, on blocks gguf's own quantizers made (Q4_0, Q4_1, Q8_0) and on random well-formed
blocks (every type; the K-quants have no quantizer in gguf), including negative and subnormal scales.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from engine_quant_gguf import formats

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]


def _random_raw(qtype: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    elems, nbytes = formats.KEPT[qtype]
    raw = rng.integers(0, 256, size=(rows, k // elems * nbytes), dtype=np.uint8)
    view = raw.reshape(rows, -1, nbytes)
    for lo, hi in formats._SCALE_FIELDS[qtype]:  # finite float16 scales of either sign, some subnormal
        scale = rng.uniform(-2, 2, size=view.shape[:2] + (1,)) * rng.choice([1.0, 1e-6], size=view.shape[:2] + (1,))
        view[..., lo:hi] = scale.astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_equals_the_gguf_package_on_random_blocks(name: str) -> None:
    qtype = int(gguf.GGMLQuantizationType[name])
    raw = _random_raw(qtype, 12, 768, np.random.default_rng(qtype))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    got = formats.dequantize(torch.from_numpy(raw), qtype).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape == (12, 768)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantize_equals_the_gguf_package_on_quantized_weights(name: str) -> None:
    qt = gguf.GGMLQuantizationType[name]
    w = np.random.default_rng(1).standard_normal((16, 320)).astype(np.float32)
    raw = gguf.quants.quantize(w, qt)
    got = formats.dequantize(torch.from_numpy(raw), int(qt)).numpy()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qt))
    # and the blocks are what they claim to be: close to the weights they were made from
    assert np.abs(got - w).max() <= 0.2 * np.abs(w).max()


@pytest.mark.parametrize("name", TYPES)
def test_dummy_blocks_are_well_formed(name: str) -> None:
    qtype = int(gguf.GGMLQuantizationType[name])
    blocks = formats.random_blocks(8, 512, qtype, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert blocks.shape == (8, formats.row_bytes(qtype, 512)) and blocks.dtype == torch.uint8
    w = formats.dequantize(blocks, qtype)
    np.testing.assert_array_equal(w.numpy(), gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype)))
    assert torch.isfinite(w).all() and 1e-3 < w.abs().max().item() < 0.05  # like the engine's float dummies


def test_type_names_and_row_sizes() -> None:
    assert formats.type_from_name("q4_k") == formats.Q4_K
    with pytest.raises(ValueError, match="accepted: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K"):
        formats.type_from_name("Q5_K")
    assert formats.row_bytes(formats.Q4_K, 4096) == 16 * 144
    with pytest.raises(ValueError, match="multiple"):
        formats.row_bytes(formats.Q6_K, 576)
