"""The Triton kernels against the torch path (dequantize, then multiply), small shapes.

Without CUDA these run in Triton's interpreter (root conftest). Measured relative errors
||y - y_ref|| / ||y_ref|| against float64 over the same dequantized weight: float32 activations
1-2.5e-7 (summation order), float16 and bfloat16 the rounding of the output (and, on the dense
path, of the dequantized weight) to that dtype. Bars: 1e-5, 2e-3, 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from engine_quant_gguf import formats
from engine_quant_gguf import kernels
from engine_quant_gguf.kernels import dequantize_blocks, gguf_matmul, rows_config

TYPES = {"Q4_0": formats.Q4_0, "Q4_1": formats.Q4_1, "Q8_0": formats.Q8_0, "Q4_K": formats.Q4_K,
         "Q6_K": formats.Q6_K}
BAR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("m", [1, 2, 20])  # 1, 2: the rows kernel; 20: dequantize + matmul
def test_kernel_matches_the_torch_path(name: str, m: int) -> None:
    qtype = TYPES[name]
    gen = torch.Generator().manual_seed(qtype * 10 + m)
    # 24 rows: a partial last tile; 32-element types get K = 288 (a partial last unit of 8 blocks)
    k = 288 if formats.KEPT[qtype][0] == 32 else 512
    w = formats.random_blocks(24, k, qtype, gen, torch.device("cpu"))
    x = torch.randn(m, k, generator=gen)
    want = x.double() @ formats.dequantize(w, qtype).double().T
    assert _rel(gguf_matmul(x, formats.pack(w, qtype), qtype, 24), want) < BAR[torch.float32]


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_in_half_precision_writes_its_columns_only(name: str, dtype: torch.dtype) -> None:
    qtype = TYPES[name]
    gen = torch.Generator().manual_seed(7)
    w = formats.random_blocks(16, 256, qtype, gen, torch.device("cpu"))
    for m in (1, 7):
        x = torch.randn(m, 256, generator=gen).to(dtype)
        out = torch.zeros(m, 40, dtype=dtype)
        gguf_matmul(x, formats.pack(w, qtype), qtype, 16, out=out, col0=8)
        want = x.double() @ formats.dequantize(w, qtype).double().T
        assert _rel(out[:, 8:24], want) < BAR[dtype], f"M={m}"
        assert out[:, :8].abs().max() == 0 and out[:, 24:].abs().max() == 0


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_split_k_rows_kernel_adds_the_partial_sums(name: str) -> None:
    qtype = TYPES[name]
    _, _, split, _ = rows_config(qtype, 1, 32, 2048, sms=8)
    assert split > 1, "the shape must exercise the split-K path"
    gen = torch.Generator().manual_seed(3)
    w = formats.random_blocks(32, 2048, qtype, gen, torch.device("cpu"))
    want_w = formats.dequantize(w, qtype).double()
    for m in (1, 2):
        x = torch.randn(m, 2048, generator=gen)
        assert _rel(gguf_matmul(x, formats.pack(w, qtype), qtype, 32), x.double() @ want_w.T) < BAR[torch.float32], m


def test_rows_config_fills_the_gpu_for_llama_8b_shapes() -> None:
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        _, r, split, warps = rows_config(formats.Q4_K, 1, n, k, sms=132)
        assert -(-n // (r * 32 * warps)) * split >= 132, (n, k)
        assert (k // 256) % split == 0


@pytest.mark.parametrize("name", list(TYPES))
def test_packed_dequantize_kernel_is_bit_identical_to_the_torch_path(name: str) -> None:
    qtype = TYPES[name]
    k = 288 if formats.KEPT[qtype][0] == 32 else 512
    w = formats.random_blocks(20, k, qtype, torch.Generator().manual_seed(5), torch.device("cpu"))
    packed = formats.pack(w, qtype)
    assert packed.shape == (20, formats.packed_row_bytes(qtype, k)) and packed.shape[1] % 16 == 0
    assert packed.shape[1] - w.shape[1] < 16  # the same bytes, regrouped (plus row padding)
    assert torch.equal(dequantize_blocks(packed, qtype, k, torch.float32), formats.dequantize(w, qtype))


def test_every_path_is_taken_by_the_tests_above() -> None:
    # M = 1 and 2 stay below the dense switch point for every type, M = 20 is above it.
    for qtype in TYPES.values():
        assert 2 < kernels.DENSE_MIN_M.get(qtype, kernels.DENSE_MIN_M_DEFAULT) <= 20
