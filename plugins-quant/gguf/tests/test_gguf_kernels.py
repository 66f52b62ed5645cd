"""The planes layout and the Triton kernels against the torch path, small shapes.

Without CUDA these run in Triton's interpreter (root conftest). Measured relative errors
||y - y_ref|| / ||y_ref|| against float64 over the same dequantized weight: float32 activations
0.7-2.4e-7 (summation order) on every path; float16 and bfloat16 the rounding of the output (and on
the GEMM/dense paths of the dequantized weight) to that dtype. Bars: 1e-5, 2e-3, 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from engine_quant_gguf import formats, kernels
from engine_quant_gguf.kernels import dequantize_blocks, gemv_config, gguf_matmul

TYPES = {"Q4_0": formats.Q4_0, "Q4_1": formats.Q4_1, "Q8_0": formats.Q8_0, "Q4_K": formats.Q4_K,
         "Q6_K": formats.Q6_K}
BAR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _weights(qtype: int, rows: int, seed: int) -> tuple[torch.Tensor, int]:
    # 32-element types get K = 288 (9 blocks: a partial last GEMV step and BLOCK_K 32 in the GEMM)
    k = 288 if formats.KEPT[qtype][0] == 32 else 512
    return formats.random_blocks(rows, k, qtype, torch.Generator().manual_seed(seed), torch.device("cpu")), k


@pytest.mark.parametrize("name", list(TYPES))
def test_planes_keep_every_bit_and_about_the_gguf_size(name: str) -> None:
    qtype = TYPES[name]
    for k in ((288, 4096) if formats.KEPT[qtype][0] == 32 else (512, 4096)):
        w = formats.random_blocks(6, k, qtype, torch.Generator().manual_seed(k), torch.device("cpu"))
        planes = formats.pack(w, qtype)
        assert planes.shape == (6, formats.packed_row_bytes(qtype, k)) and planes.shape[1] % formats.ROW_ALIGN == 0
        assert torch.equal(formats.dequantize_planes(planes, qtype, k), formats.dequantize(w, qtype))
        extra = 4 * k // 256 if qtype == formats.Q4_K else 0  # Q4_K's unpacked 6-bit scales
        assert 16 <= planes.shape[1] - w.shape[1] - extra < 16 + formats.ROW_ALIGN


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_kernel_is_bit_identical_to_the_torch_path(name: str) -> None:
    qtype = TYPES[name]
    w, k = _weights(qtype, 20, 5)
    assert torch.equal(dequantize_blocks(formats.pack(w, qtype), qtype, k, torch.float32), formats.dequantize(w, qtype))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("m", [1, 3, 17])  # M = 2 (the GEMV's second row) runs in the split-K and half-precision tests
def test_every_path_matches_the_torch_path(name: str, m: int) -> None:
    qtype = TYPES[name]
    w, k = _weights(qtype, 10, qtype * 10 + m)  # 10 rows: a partial last tile of the GEMV (4) and the GEMM (64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = x.double() @ formats.dequantize(w, qtype).double().T
    planes = formats.pack(w, qtype)
    # No path given: the GEMV at M <= GEMV_MAX_M, the GEMM up to 17 rows (the thresholds test), so
    # with one other path each M meets two (Triton's interpreter runs a GEMV program in 30-90 ms).
    paths = [None, "gemm"] if m <= kernels.GEMV_MAX_M else [None, "dense"]
    for path in paths:
        assert _rel(gguf_matmul(x, planes, qtype, 10, path=path), want) < BAR[torch.float32], path


# Without a GPU (Triton's interpreter, 5-12 s a case) a sample runs: each type in one half
# dtype, each dtype on some type, split-K on one K-quant; the rest run in the GPU sweep.
_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _sampled(*values: object, cpu: int | tuple[int, ...]) -> list[object]:
    keep = (cpu,) if isinstance(cpu, int) else cpu
    def param(v: object, marks: list[object]) -> object:
        return pytest.param(*v, marks=marks) if isinstance(v, tuple) else pytest.param(v, marks=marks)

    return [param(v, [] if i in keep else _GPU) for i, v in enumerate(values)]


@pytest.mark.parametrize("name,dtype", _sampled(
    ("Q4_K", torch.float16), ("Q8_0", torch.bfloat16), ("Q6_K", torch.float16),
    ("Q4_K", torch.bfloat16), ("Q8_0", torch.float16), ("Q6_K", torch.bfloat16), cpu=(0, 1, 2)))
def test_half_precision_writes_its_columns_only(name: str, dtype: torch.dtype) -> None:
    qtype = TYPES[name]
    w = formats.random_blocks(8, 256 if qtype != formats.Q6_K else 512, qtype, torch.Generator().manual_seed(7),
                              torch.device("cpu"))
    k = w.shape[1] // formats.KEPT[qtype][1] * formats.KEPT[qtype][0]
    for m in (1, 2, 7):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = torch.zeros(m, 24, dtype=dtype)
        gguf_matmul(x, formats.pack(w, qtype), qtype, 8, out=out, col0=8)
        want = x.double() @ formats.dequantize(w, qtype).double().T
        assert _rel(out[:, 8:16], want) < BAR[dtype], f"M={m}"
        assert out[:, :8].abs().max() == 0 and out[:, 16:].abs().max() == 0


@pytest.mark.parametrize("name", _sampled("Q4_K", "Q6_K", "Q4_0", cpu=0))
def test_split_k_adds_the_partial_sums(name: str) -> None:
    qtype = TYPES[name]
    _, _, split, _ = gemv_config(qtype, 1, 8, 512, sms=132)
    assert split > 1, "the shape must exercise the split-K GEMV"
    gen = torch.Generator().manual_seed(3)
    w = formats.random_blocks(8, 512, qtype, gen, torch.device("cpu"))
    planes, want_w = formats.pack(w, qtype), formats.dequantize(w, qtype).double()
    for m, path, cfg in ((1, None, None), (2, None, None), (5, "gemm", (16, 32, 256, 2, 4, 1))):
        x = torch.randn(m, 512, generator=gen)
        got = gguf_matmul(x, planes, qtype, 8, path=path, config=cfg)
        assert _rel(got, x.double() @ want_w.T) < BAR[torch.float32], m


def test_configs_fill_the_gpu_for_llama_8b_shapes() -> None:
    for qtype in TYPES.values():
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            bn, nu, split, _ = gemv_config(qtype, 1, n, k, sms=132)
            assert -(-n // bn) * split >= 132 and kernels._units(qtype, k) % split == 0, (n, k)
            bm, bn, bk, split, _, _ = kernels.gemm_config(qtype, 64, n, k, sms=132)
            assert k % (bk * split) == 0 and bm <= 64


def test_thresholds_put_m_1_2_on_the_gemv_and_3_to_17_on_the_gemm() -> None:
    assert kernels.GEMV_MAX_M == 2
    for qtype in TYPES.values():
        assert kernels.GEMM_MAX_M.get(qtype, kernels.GEMM_MAX_M_DEFAULT) >= 17
