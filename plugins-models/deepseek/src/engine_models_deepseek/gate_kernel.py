"""The router's float32 logits at decode batches in one Triton launch (CUDA).

DeepSeek's gate keeps float32 weights; ``F.linear(x.float(), weight)`` is a cast kernel and a
float32 cuBLAS GEMV of two kernels (dot and reduce), about 6 us a layer at batch 1 on an H200 for
a 64 x 2048 weight. Here each program reads one expert's weight row once for every token of the
batch (at most ``MAX_TOKENS``), widening ``x`` in registers and accumulating in float32.
It may also take the RMSNorm before it (``PendingNorm``, ``cuda.norm_fusion``): every program
normalizes the rows itself, and one stores the norm output the experts read after it. With ``pdl``
(sm_90+) it is a programmatic dependent launch: each program requests its first weight
tile before it waits for the kernel before it (the RMSNorm that writes ``x``), and lets the
router's top-k launch start after its wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.layernorm import PendingNorm

#: Batches up to this many tokens take the kernel (its tile holds every token); larger ones are
#: GEMMs that cuBLAS does better.
MAX_TOKENS = 8


@triton.jit
def _sum_rows(X, R, offs_t, offs_k, mask, stride_xt, stride_rt, HAS_RES: tl.constexpr):
    """Rows of ``x (+ residual)``, the sum rounded to the activation dtype as PyTorch adds."""
    x = tl.load(X + offs_t[:, None] * stride_xt + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + offs_t[:, None] * stride_rt + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _gate_kernel(X, W, Out, R, NW, Normed, Res, tokens, num_experts, stride_xt, stride_we, stride_ot, stride_rt, eps,
                 HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    # NORM: X is an RMSNorm's input (R added first when HAS_RES, NW its weight): every program
    # normalizes its own copy (a few KB), program 0 also stores the sum (Res) and the norm output
    # (Normed) for the experts, which read it after this launch.
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
    first = tl.program_id(0) == 0
    rstd = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
    if NORM:
        squares = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = mask_t[:, None] & (offs_k < HIDDEN)[None, :]
            x = _sum_rows(X, R, offs_t, offs_k, mask, stride_xt, stride_rt, HAS_RES)
            if HAS_RES:
                tl.store(Res + offs_t[:, None] * HIDDEN + offs_k[None, :], x, mask=mask & first)
            squares += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(squares, axis=1) / HIDDEN + eps)
    for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < HIDDEN
        mask = mask_t[:, None] & mask_k[None, :]
        x = _sum_rows(X, R, offs_t, offs_k, mask, stride_xt, stride_rt, HAS_RES and NORM)
        if NORM:
            # RMSNorm's roundings: the normalized value, then its product with the weight.
            h = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
            nw = tl.load(NW + offs_k, mask=mask_k, other=0.0)
            x = (nw.to(tl.float32)[None, :] * h.to(tl.float32)).to(x.dtype)
            tl.store(Normed + offs_t[:, None] * HIDDEN + offs_k[None, :], x, mask=mask & first)
        if k0 == 0:
            w = w_first.to(tl.float32)
        else:
            w = tl.load(W + offs_e[:, None] * stride_we + offs_k[None, :], mask=mask_e[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    tl.store(Out + offs_t[:, None] * stride_ot + offs_e[None, :], acc, mask=mask_t[:, None] & mask_e[None, :])


def gate_logits(x: torch.Tensor | PendingNorm, weight: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``F.linear(x.float(), weight)`` for ``x`` ``[tokens <= MAX_TOKENS, hidden]`` (any float
    dtype, last dim contiguous) and ``weight`` ``[experts, hidden]``: float32 ``[tokens, experts]``.
    ``x`` may be an RMSNorm's ``PendingNorm`` (16-bit, contiguous rows): the launch computes the norm
    too and fills its ``normed`` and ``res_sum``. ``pdl``: a programmatic dependent launch (sm_90+;
    results unchanged)."""
    pending = x if isinstance(x, PendingNorm) else None
    rows = pending.x if pending is not None else x
    tokens, hidden = rows.shape
    num_experts = weight.shape[0]
    if not 0 < tokens <= MAX_TOKENS or weight.shape[1] != hidden or rows.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gate_logits: x {tuple(rows.shape)}, weight {tuple(weight.shape)}; accepted: 1..{MAX_TOKENS} "
                         "tokens, the weight's width equal to x's, contiguous rows")
    out = torch.empty(tokens, num_experts, dtype=torch.float32, device=rows.device)
    residual = pending.residual if pending is not None else None
    if pending is not None and (not pending.normed.is_contiguous() or (residual is not None and (
            residual.stride(1) != 1 or not pending.res_sum.is_contiguous()))):
        raise ValueError("gate_logits: a pending norm needs contiguous normed / res_sum buffers and residual rows")
    # One expert a program (64 programs for 64 experts), its whole row a step at one token: at
    # 2 experts a program and 512-wide steps the launch took 4.5 us at batch 1 on an H200 (32
    # programs each waiting on four dependent loads) for 512 KB of weights.
    block_e = 1
    block_t = triton.next_power_of_2(tokens)
    block_k = min(triton.next_power_of_2(hidden), max(512, 4096 // block_t))
    _gate_kernel[(triton.cdiv(num_experts, block_e),)](
        rows, weight, out, residual if residual is not None else rows,
        pending.weight if pending is not None else rows, pending.normed if pending is not None else rows,
        pending.res_sum if residual is not None else rows, tokens, num_experts, rows.stride(0), weight.stride(0),
        out.stride(0), residual.stride(0) if residual is not None else 0,
        float(pending.eps) if pending is not None else 0.0, HIDDEN=hidden,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, PDL=pdl, NORM=pending is not None,
        HAS_RES=residual is not None, num_warps=4, launch_pdl=pdl,
    )
    return out
