"""The Triton kernels against the torch path (dequantize, then multiply), small shapes.

Without CUDA these run in Triton's interpreter (root conftest). Measured relative errors
||y - y_ref|| / ||y_ref|| against float64 over the same dequantized weight: float32 activations
about 1e-7 (summation order), float16 2-3e-4 and bfloat16 3-4e-3 (the activations' own rounding
in the tl.dot path; the interpreter multiplies its bfloat16 tiles in float32). Bars: 1e-5, 2e-3, 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from engine_quant_gguf import formats
from engine_quant_gguf.kernels import gemv_config, gguf_matmul

TYPES = {"Q4_0": formats.Q4_0, "Q4_1": formats.Q4_1, "Q8_0": formats.Q8_0, "Q4_K": formats.Q4_K,
         "Q6_K": formats.Q6_K}
BAR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("m", [1, 5])
def test_kernel_matches_the_torch_path(name: str, m: int) -> None:
    qtype = TYPES[name]
    gen = torch.Generator().manual_seed(qtype * 10 + m)
    # 24 rows: a partial last tile; 32-element types get K = 288 (a partial last unit of 8 blocks)
    k = 288 if formats.KEPT[qtype][0] == 32 else 512
    w = formats.random_blocks(24, k, qtype, gen, torch.device("cpu"))
    x = torch.randn(m, k, generator=gen)
    want = x.double() @ formats.dequantize(w, qtype).double().T
    assert _rel(gguf_matmul(x, w, qtype, 24), want) < BAR[torch.float32]


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_in_half_precision_writes_its_columns_only(name: str, dtype: torch.dtype) -> None:
    qtype = TYPES[name]
    gen = torch.Generator().manual_seed(7)
    w = formats.random_blocks(16, 256, qtype, gen, torch.device("cpu"))
    for m in (1, 7):
        x = torch.randn(m, 256, generator=gen).to(dtype)
        out = torch.zeros(m, 40, dtype=dtype)
        gguf_matmul(x, w, qtype, 16, out=out, col0=8)
        want = x.double() @ formats.dequantize(w, qtype).double().T
        assert _rel(out[:, 8:24], want) < BAR[dtype], f"M={m}"
        assert out[:, :8].abs().max() == 0 and out[:, 24:].abs().max() == 0


def test_split_k_gemv_adds_the_partial_sums() -> None:
    block_n, split, _ = gemv_config(16, 2048, formats.Q4_K, sms=8)
    assert split > 1, "the shape must exercise the split-K path"
    gen = torch.Generator().manual_seed(3)
    w = formats.random_blocks(16, 2048, formats.Q4_K, gen, torch.device("cpu"))
    x = torch.randn(1, 2048, generator=gen)
    want = x.double() @ formats.dequantize(w, formats.Q4_K).double().T
    assert _rel(gguf_matmul(x, w, formats.Q4_K, 16), want) < BAR[torch.float32]


def test_gemv_config_fills_the_gpu_for_llama_8b_shapes() -> None:
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        block_n, split, _ = gemv_config(n, k, formats.Q4_K, sms=132)
        assert -(-n // block_n) * split >= 2 * 132, (n, k)
        assert (k // 256) % split == 0
