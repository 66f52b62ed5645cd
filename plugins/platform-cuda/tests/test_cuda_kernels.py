"""The fused Triton layer kernels against the PyTorch layers they replace (GPU only)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.layernorm import RMSNorm  # noqa: E402
from engine.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from engine_platform_cuda.kernels import layer_kernels  # noqa: E402

TOL = {torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.float32: dict(atol=1e-5, rtol=1e-5)}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,tokens", [(4096, 1), (4096, 77), (1000, 5), (128, 300)])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    ref = RMSNorm(hidden, 1e-5).cuda().to(dtype)
    ref.weight.data = torch.randn(hidden, device="cuda").to(dtype)
    fused = RMSNorm(hidden, 1e-5).cuda().to(dtype)
    fused.weight.data = ref.weight.data.clone()
    fused.use_kernels(layer_kernels())
    assert fused.fused is not None
    x = torch.randn(tokens, hidden, device="cuda").to(dtype) * 3
    r = torch.randn(tokens, hidden, device="cuda").to(dtype)
    torch.testing.assert_close(fused(x), ref(x), **TOL[dtype])
    out, res = fused(x, r)
    ref_out, ref_res = ref(x, r)
    torch.testing.assert_close(res, ref_res, **TOL[dtype])
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,d", [(1, 14336), (33, 14336), (7, 100)])
def test_silu_and_mul(dtype: torch.dtype, tokens: int, d: int) -> None:
    x = torch.randn(tokens, 2 * d, device="cuda").to(dtype) * 2
    ref = SiluAndMul()(x)
    layer = SiluAndMul()
    layer.use_kernels(layer_kernels())
    torch.testing.assert_close(layer(x), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (64, 64), (128, 64)])
def test_rotary_in_place_on_strided_views(dtype: torch.dtype, head_dim: int, rotary_dim: int) -> None:
    heads, kv_heads, tokens = 8, 2, 19
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, 500000.0).cuda()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    rope.use_kernels(layer_kernels())
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place, inside the fused qkv output
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])
