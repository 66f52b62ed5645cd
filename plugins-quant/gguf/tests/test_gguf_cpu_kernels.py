"""The CPU block kernels (``cpu_matmul.c`` through ``cpu_kernels``) against the torch reference.

Dequantization must equal ``formats.dequantize`` bit for bit (negative and subnormal scales
included); the matmul must equal ``x @ dequantize(w).T`` up to float32 summation order, for every
row count around the 4-row tiles, on one thread and several, writing only its own columns.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from engine_quant_gguf import cpu_kernels, formats

TYPES = {"Q4_0": formats.Q4_0, "Q4_1": formats.Q4_1, "Q8_0": formats.Q8_0}

def _random_raw(qtype: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random codes; float16 scales of either sign, some subnormal."""
    elems, nbytes = formats.KEPT[qtype]
    raw = rng.integers(0, 256, size=(rows, k // elems * nbytes), dtype=np.uint8)
    view = raw.reshape(rows, -1, nbytes)
    for lo, hi in ((0, 2), (2, 4)) if qtype == formats.Q4_1 else ((0, 2),):
        scale = rng.uniform(-2, 2, size=view.shape[:2] + (1,)) * rng.choice([1.0, 1e-6], size=view.shape[:2] + (1,))
        view[..., lo:hi] = scale.astype(np.float16).view(np.uint8)
    return raw


pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for the CPU kernels")


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_identical(name: str) -> None:
    qtype = TYPES[name]
    raw = torch.from_numpy(_random_raw(qtype, 48, 256, np.random.default_rng(1)))
    assert torch.equal(cpu_kernels.dequantize(raw, qtype, 256), formats.dequantize(raw, qtype))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("threads", [1, 3])
def test_matmul_equals_the_dequantized_product(name: str, rows: int, threads: int) -> None:
    qtype = TYPES[name]
    n, k = 1000, 576  # 1000 columns: a thread's run is not a whole number of tiles
    blocks = formats.random_blocks(n, k, qtype, torch.Generator().manual_seed(rows), torch.device("cpu"))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    out = torch.full((rows, n + 16), 123.0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.matmul(x, blocks, qtype, out, 8)
    finally:
        torch.set_num_threads(previous)
    want = x @ formats.dequantize(blocks, qtype).T
    torch.testing.assert_close(out[:, 8:8 + n], want, rtol=1e-5, atol=1e-5)
    assert (out[:, :8] == 123.0).all() and (out[:, 8 + n:] == 123.0).all()


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    """Each row sums in one order whatever the tile it falls in: greedy output does not depend on
    which other requests share the step."""
    blocks = formats.random_blocks(64, 256, formats.Q4_1, torch.Generator().manual_seed(5), torch.device("cpu"))
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(6))
    batched = torch.empty(11, 64)
    cpu_kernels.matmul(x, blocks, formats.Q4_1, batched, 0)
    for i in range(11):
        alone = torch.empty(1, 64)
        cpu_kernels.matmul(x[i:i + 1], blocks, formats.Q4_1, alone, 0)
        assert torch.equal(alone[0], batched[i])


def test_exact_q8_0_recovers_the_gguf_blocks_and_refuses_other_floats() -> None:
    dense = np.random.default_rng(3).normal(size=(64, 128)).astype(np.float32)
    raw = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).copy())
    blocks = formats.exact_q8_0(weight)
    assert blocks is not None and torch.equal(formats.dequantize(blocks, formats.Q8_0), weight)
    assert formats.exact_q8_0(torch.from_numpy(dense)) is None  # not Q8_0 values: the head stays float
    assert formats.exact_q8_0(weight[:, :100].contiguous()) is None  # not whole blocks
