"""The one-launch softmax top-k router against the torch one (``select_experts_reference``).

Runs on the GPU (marked gpu) and, without one, under Triton's interpreter on the CPU (see
conftest.py). The interpreter's bfloat16 is not faithful, so 16-bit logits are float16 there.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe.router import select_experts, select_experts_reference
from engine.layers.moe.router_kernel import select_experts_triton


def _logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("tokens", [1, 5, 67])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (8, 8), (128, 8), (60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_torch_routing(triton_device: str, tokens: int, experts: int, top_k: int, renormalize: bool) -> None:
    logits = _logits(tokens, experts, seed=tokens * 1000 + experts)
    weights, ids = select_experts_triton(logits.to(triton_device), top_k, renormalize)
    ref_w, ref_ids = select_experts_reference(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (tokens, top_k)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)


def test_16_bit_and_strided_logits(triton_device: str) -> None:
    """Logits in the activation dtype, and a column slice of a wider tensor (row stride != E)."""
    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float16
    wide = _logits(9, 40, seed=3).to(dtype)
    logits = wide[:, 3:35]
    weights, ids = select_experts_triton(logits.to(triton_device), 8, True)
    ref_w, ref_ids = select_experts_reference(logits, 8, True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)
    weights, ids = select_experts_triton(logits.t().contiguous().t().to(triton_device), 8, True)
    assert torch.equal(ids.cpu(), ref_ids)


def test_ties_go_to_the_lower_expert(triton_device: str) -> None:
    logits = torch.tensor([[0.0] * 8, [1.0, 3.0, 3.0, 0.0, 3.0, -2.0, 2.0, 2.0]], device=triton_device)
    weights, ids = select_experts_triton(logits, 4, renormalize=False)
    assert ids.tolist() == [[0, 1, 2, 3], [1, 2, 4, 6]]
    torch.testing.assert_close(weights[0].cpu(), torch.full((4,), 0.125))
    weights, _ = select_experts_triton(logits, 4, renormalize=True)
    torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(2))


def test_top_k_out_of_range_is_refused(triton_device: str) -> None:
    with pytest.raises(ValueError, match="top_k 9 out of range for 8 experts"):
        select_experts_triton(torch.zeros(1, 8, device=triton_device), 9, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_select_experts_takes_the_kernel_on_cuda() -> None:
    logits = _logits(4, 16, seed=1)
    logits[0, :] = 0.5  # all tied: the kernel's order (0, 1, ...) is the contract on CUDA
    weights, ids = select_experts(logits.cuda(), 3, renormalize=True)
    assert ids[0].tolist() == [0, 1, 2]
    ref_w, ref_ids = select_experts_reference(logits, 3, renormalize=True)
    assert torch.equal(ids[1:].cpu(), ref_ids[1:])
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)
