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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_one_tensor_per_launch_matches_the_fused_pair(dtype: torch.dtype) -> None:
    """Layers given only ``rotary_inplace`` (older platforms' kernel set) rotate q and k apart."""
    head_dim, heads, kv_heads, tokens = 128, 8, 2, 11
    rope = RotaryEmbedding(head_dim, head_dim, 4096, 10000.0).cuda()
    q = torch.randn(tokens, heads * head_dim, device="cuda").to(dtype)
    k = torch.randn(tokens, kv_heads * head_dim, device="cuda").to(dtype)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    rope.use_kernels({"rotary_inplace": layer_kernels()["rotary_inplace"]})
    assert rope.fused_qk is None
    got_q, got_k = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,kv_heads,head_dim,v_dim", [(1, 8, 128, 128), (300, 8, 128, 128), (17, 2, 64, 96)])
def test_store_kv_writes_exactly_the_given_slots(dtype: torch.dtype, tokens: int, kv_heads: int, head_dim: int,
                                                 v_dim: int) -> None:
    from engine.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(1024, 1, dtype, kv_heads, head_dim, 2, "cuda", v_head_dim=v_dim)
    ref = MHATokenToKVPool(1024, 1, dtype, kv_heads, head_dim, 2, "cuda", v_head_dim=v_dim)
    for p in (pool, ref):  # poison: slots not written must keep this value
        for buf in p.k_buffer + p.v_buffer:
            buf.fill_(7.0)
    pool.use_kernels(layer_kernels())
    assert pool.store_kv is not None and ref.store_kv is None
    # K and V as strided views of one fused projection output, as models produce them.
    qkv = torch.randn(tokens, (4 + kv_heads) * head_dim + kv_heads * v_dim, device="cuda").to(dtype)
    k = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim :].view(tokens, kv_heads, v_dim)
    loc = torch.randperm(1024, device="cuda")[:tokens] + 1
    pool.set_kv_buffer(1, loc, k, v)
    ref.set_kv_buffer(1, loc, k, v)
    for a, b in zip(pool.k_buffer + pool.v_buffer, ref.k_buffer + ref.v_buffer):
        assert torch.equal(a, b)
