"""The Triton dequantize-GEMV/GEMM against the torch reference (``wna16_linear_torch``).

Without a CUDA device these run under Triton's interpreter (root conftest.py) on small shapes:
every kernel path (GEMV and fused tl.dot tiles, groups inside and across K tiles, K splits,
zeros or not, act-order permutation, bias, 4 and 8 bits, groups of 32/64/128 and one group). The GPU tests take the Llama-3-8B shapes.
Measured under the interpreter: relative L2 error below 2e-6 in float32 and below 5e-4 in
float16 (output rounding) against the float32 reference.
"""

from __future__ import annotations

import pytest
import torch
from engine_quant_wna16.kernels import GEMM_MAX_M, GEMV_MAX_M, KernelConfig, choose_config, wna16_gemm
from engine_quant_wna16.layout import to_kernel_layout, wna16_linear_torch
from engine_quant_wna16.rtn import act_order_g_idx, quantize_rtn

_CUDA = torch.cuda.is_available()


def _weight(n: int, k: int, bits: int, group_size: int, symmetric: bool, act_order: bool, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    g_idx = act_order_g_idx(k, k if group_size == -1 else group_size, seed) if act_order else None
    kw = to_kernel_layout(quantize_rtn(weight, bits, group_size, symmetric, g_idx), "test")
    for name in ("qweight", "scales", "zeros", "perm"):
        value = getattr(kw, name)
        if value is not None:
            setattr(kw, name, value.to(device))
    return kw


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize(("bits", "group_size", "symmetric", "act_order"), [
    (4, 32, False, False), (4, 64, True, True), (4, 128, False, True), (4, -1, True, False), (8, 128, False, False),
    (8, 32, True, True),
])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_kernel_matches_reference(bits: int, group_size: int, symmetric: bool, act_order: bool, m: int) -> None:
    device = "cuda" if _CUDA else "cpu"
    n, k = 48, 256  # the configs 96 outputs get, at half the GEMV's programs (the interpreter's cost)
    kw = _weight(n, k, bits, group_size, symmetric, act_order, device, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    bias = torch.randn(n).to(device)
    got = wna16_gemm(x, kw, bias)
    want = wna16_linear_torch(x.double().float(), kw, bias)
    assert got.shape == (m, n)
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("config", [
    KernelConfig("gemv", 1, 32, 64, 4, 1),   # groups of 128 span two K tiles
    KernelConfig("gemv", 1, 16, 256, 4, 1),  # four groups of 64 in one K tile
    KernelConfig("gemv", 4, 16, 128, 4, 1),  # 3 rows in a block of 4, partial N tile
    KernelConfig("gemv", 2, 16, 256, 4, 1, x_f32=True),  # activations widened first
    KernelConfig("dequant", 1, 32, 64, 4, 1),  # dequantize + F.linear, partial N tile
    KernelConfig("gemm", 16, 32, 32, 4, 1),  # several K steps per group, partial N tile
    KernelConfig("gemm", 32, 64, 64, 4, 1),
    KernelConfig("gemm", 16, 16, 128, 4, 1, split_k=2),  # K split, float32 partials + reduce
    KernelConfig("gemm", 16, 32, 256, 4, 1, scale_first=True),  # K tile cut to the group (64 or 128)
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_explicit_tiles(config: KernelConfig, dtype: torch.dtype) -> None:
    device = "cuda" if _CUDA else "cpu"
    group = 64 if config.block_k == 256 else 128
    kw = _weight(80, 256, 4, group, False, True, device, seed=1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    got = wna16_gemm(x, kw, config=config)
    want = wna16_linear_torch(x.float(), kw)
    assert got.dtype == dtype
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize(("bits", "group_size", "symmetric", "act_order"), [
    (4, 32, False, False), (4, 32, True, True), (4, 64, False, True), (4, 64, True, False),
    (4, 128, False, True), (4, 128, True, False), (4, -1, False, False), (4, -1, True, True),
    (8, 32, False, True), (8, 64, True, False), (8, 128, True, True), (8, -1, False, False),
])
def test_fused_gemm_formats(bits: int, group_size: int, symmetric: bool, act_order: bool) -> None:
    """The fused dequantize-GEMM on every format: K tiles of 128 (or the group) and of 64 inputs, the
    latter split in two along K, the weights scaled after or before the dot; 5 rows in a tile of
    16. (The previous kernel read one scale per K tile even where the tile spanned several groups:
    0.26-0.41 relative error with groups of 32, reproduced here under the interpreter.)"""
    device = "cuda" if _CUDA else "cpu"
    n, k = 48, 256
    kw = _weight(n, k, bits, group_size, symmetric, act_order, device, seed=7)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8)).to(device)
    bias = torch.randn(n).to(device)
    want = wna16_linear_torch(x, kw, bias)
    for cfg in (KernelConfig("gemm", 16, 16, 128, 4, 1), KernelConfig("gemm", 16, 32, 64, 4, 1, split_k=2, scale_first=True)):
        got = wna16_gemm(x, kw, bias, config=cfg)
        assert _rel(got, want) < 1e-5, (cfg, _rel(got, want))


@pytest.mark.parametrize(("bits", "symmetric", "act_order"), [(4, False, False), (8, True, True)])
@pytest.mark.parametrize("kind", ["gemv", "dequant"])
def test_uneven_k_and_row_major_weight(bits: int, symmetric: bool, act_order: bool, kind: str) -> None:
    """K = 384 is not a multiple of the 256-code K tile (masked tail); the same weight stored
    K-major (a ``.contiguous()`` copy) gives the same result through the strides."""
    device = "cuda" if _CUDA else "cpu"
    kw = _weight(40, 384, bits, 128, symmetric, act_order, device, seed=3)
    assert kw.qweight.stride() == (1, 384 * bits // 32)  # output-major storage
    x = torch.randn(2, 384, generator=torch.Generator().manual_seed(4)).to(device)
    want = wna16_linear_torch(x, kw)
    cfg = KernelConfig(kind, 2, 16, 256, 4, 1)
    got = wna16_gemm(x, kw, config=cfg)
    kw.qweight = kw.qweight.contiguous()
    got_row_major = wna16_gemm(x, kw, config=cfg)
    assert _rel(got, want) < 1e-5 and _rel(got_row_major, want) < 1e-5


def test_choose_config_fills_an_h100() -> None:
    cpu = torch.device("cpu")  # counts as 132 SMs
    for n in (4096, 6144, 28672):
        cfg = choose_config(1, n, 4096, 128, cpu)
        assert cfg.kind == "gemv" and -(-n // cfg.block_n) >= 132  # no SM idle, no split-K
    for m in (2, 4, 16, 64, 256, 1024):
        cfg = choose_config(m, 4096, 14336, 128, cpu)
        assert cfg.kind == ("gemv" if m <= GEMV_MAX_M else "gemm" if m <= GEMM_MAX_M else "dequant")
        if cfg.kind == "gemm":  # 4096 outputs alone give too few tiles: K is split to fill the SMs
            assert -(-4096 // cfg.block_n) * -(-m // cfg.block_m) * cfg.split_k >= 132
            assert 14336 % (cfg.split_k * cfg.block_k) == 0
    # One group over K = 14336 (not a power of two): the GEMV's K tile must still tile it.
    assert 14336 % choose_config(1, 4096, 14336, 14336, cpu).block_k == 0


# Llama-3-8B linears: (K, N).
_LLAMA_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", list(_LLAMA_8B))
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize(("group_size", "symmetric", "act_order"), [(128, False, False), (128, True, True), (32, False, False)])
def test_llama_8b_shapes_on_gpu(shape: str, m: int, group_size: int, symmetric: bool, act_order: bool) -> None:
    k, n = _LLAMA_8B[shape]
    kw = _weight(n, k, 4, group_size, symmetric, act_order, "cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = wna16_gemm(x, kw)
    want = wna16_linear_torch(x.float(), kw)  # float32 weights and products
    # bf16 activations both ways; the kernel's own error is the bf16 output rounding and the
    # order of float32 sums (the reference's weight is exact in float32).
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [
    KernelConfig("gemm", 16, 64, 128, 4, 4), KernelConfig("gemm", 16, 64, 256, 4, 3, split_k=2),
    KernelConfig("gemm", 64, 128, 64, 4, 4, scale_first=True), KernelConfig("gemm", 128, 128, 64, 8, 4, scale_first=True),
    KernelConfig("gemv", 2, 8, 1024, 4, 1), KernelConfig("gemv", 1, 16, 2048, 4, 1, x_f32=True)])
@pytest.mark.parametrize(("group_size", "symmetric", "act_order"), [(128, False, False), (32, True, True)])
def test_explicit_kernels_on_gpu(config: KernelConfig, group_size: int, symmetric: bool, act_order: bool) -> None:
    """Non-default tiles (K tiles cut to groups of 32, K splits, scale_first, x_f32) on a Llama-8B shape."""
    k, n = _LLAMA_8B["qkv"]
    kw = _weight(n, k, 4, group_size, symmetric, act_order, "cuda", seed=5)
    x = torch.randn(max(config.block_m, 3), k, device="cuda", dtype=torch.bfloat16)
    got = wna16_gemm(x, kw, config=config)
    assert _rel(got, wna16_linear_torch(x.float(), kw)) < 1e-2
