"""The router's float32 logits at decode batches in one Triton launch (CUDA).

DeepSeek's gate keeps float32 weights; ``F.linear(x.float(), weight)`` is a cast kernel and a
float32 cuBLAS GEMV of two kernels (dot and reduce), about 6 us a layer at batch 1 on an H200 for
a 64 x 2048 weight. Here each program reads ``BLOCK_E`` experts' weight rows once for every token
of the batch (at most ``MAX_TOKENS``), widening ``x`` in registers and accumulating in float32.
With ``pdl`` (sm_90+) it is a programmatic dependent launch: each program requests its first weight
tile before it waits for the kernel before it (the RMSNorm that writes ``x``), and lets the
router's top-k launch start after its wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Batches up to this many tokens take the kernel (its tile holds every token); larger ones are
#: GEMMs that cuBLAS does better.
MAX_TOKENS = 8


@triton.jit
def _gate_kernel(X, W, Out, tokens, num_experts, stride_xt, stride_we, stride_ot, HIDDEN: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.arange(0, BLOCK_T)
    mask_e = offs_e < num_experts
    mask_t = offs_t < tokens
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    w_first = tl.load(W + offs_e[:, None] * stride_we + tl.arange(0, BLOCK_K)[None, :],
                      mask=mask_e[:, None] & (tl.arange(0, BLOCK_K) < HIDDEN)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < HIDDEN
        x = tl.load(X + offs_t[:, None] * stride_xt + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)
        if k0 == 0:
            w = w_first.to(tl.float32)
        else:
            w = tl.load(W + offs_e[:, None] * stride_we + offs_k[None, :], mask=mask_e[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(Out + offs_t[:, None] * stride_ot + offs_e[None, :], acc, mask=mask_t[:, None] & mask_e[None, :])


def gate_logits(x: torch.Tensor, weight: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``F.linear(x.float(), weight)`` for ``x`` ``[tokens <= MAX_TOKENS, hidden]`` (any float
    dtype, last dim contiguous) and ``weight`` ``[experts, hidden]``: float32 ``[tokens, experts]``.
    ``pdl``: a programmatic dependent launch (sm_90+; results unchanged)."""
    tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if not 0 < tokens <= MAX_TOKENS or weight.shape[1] != hidden or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gate_logits: x {tuple(x.shape)}, weight {tuple(weight.shape)}; accepted: 1..{MAX_TOKENS} "
                         "tokens, the weight's width equal to x's, contiguous rows")
    out = torch.empty(tokens, num_experts, dtype=torch.float32, device=x.device)
    block_e = 2
    _gate_kernel[(triton.cdiv(num_experts, block_e),)](
        x, weight, out, tokens, num_experts, x.stride(0), weight.stride(0), out.stride(0), HIDDEN=hidden,
        BLOCK_T=triton.next_power_of_2(tokens), BLOCK_E=block_e, BLOCK_K=512, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return out
