"""MLA's per-head products with ``W_UK`` and ``W_UV`` at decode batches in one Triton launch each (CUDA).

The absorbed form multiplies every head's query by its own ``W_UK[h]`` ``[nope, rank]`` and every
head's latent output by its ``W_UV[h]`` ``[v, rank]``: 16 matrix-vector products a layer for
DeepSeek-V2-Lite, 2 MB of weights each way. As a batched GEMM of one row, cuBLAS runs them as tiles
sized for matrices. Here program ``(head, n block)`` reads ``BLOCK_N`` output columns of its head's
weight once for all the batch's tokens (at most ``MAX_TOKENS``), widens in registers and
accumulates in float32, and stores into a strided destination (the query rows' latent part, or
the ``[T, H, v]`` rows ``o_proj`` reads), rounded once as the GEMM would round them.

With ``pdl`` (sm_90+, the platform's ``pdl`` layer-kernel entry) the launch is a programmatic
dependent one: each program requests its first weight tile (weights are no kernel's output) before
it waits for the kernel before it, then reads ``x``, and lets the next kernel start (the output
projection after ``W_UV`` streams its weights meanwhile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Batches up to this many tokens take the kernel (its tile holds every token); larger ones are
#: GEMMs that cuBLAS does better.
MAX_TOKENS = 4


@triton.jit
def _head_matvec_tile(X, W, Out, head, pid_n, tokens, stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot,
                      stride_oh, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Columns ``pid_n * BLOCK_N ..`` of head ``head``'s product for every token (one program's
    work; also run by the fused MLA prologue's programs, ``mla_prologue``)."""
    head = head.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mask_n = offs_n < N
    mask_t = offs_t < tokens
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + head * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    x_ptrs = X + offs_t[:, None] * stride_xt + head * stride_xh + offs_k[None, :]
    w = tl.load(w_ptrs, mask=(offs_k < K)[:, None] & mask_n[None, :], other=0.0)
    if PDL:
        # x is the previous kernel's output; the first weight tile is requested before the wait.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in tl.static_range(0, K, BLOCK_K):
        if k0 > 0:
            w = tl.load(w_ptrs + k0 * stride_wk, mask=(offs_k + k0 < K)[:, None] & mask_n[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=mask_t[:, None] & (offs_k + k0 < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    tl.store(Out + offs_t[:, None] * stride_ot + head * stride_oh + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=mask_t[:, None] & mask_n[None, :])


@triton.jit
def _head_matvec_kernel(X, W, Out, tokens, stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot,
                        stride_oh, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    _head_matvec_tile(X, W, Out, tl.program_id(0), tl.program_id(1), tokens, stride_xt, stride_xh, stride_wh,
                      stride_wk, stride_wn, stride_ot, stride_oh, K, N, BLOCK_T, BLOCK_K, BLOCK_N, PDL)


def head_matvec_plan(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> dict[str, int]:
    """The launch of ``head_matvec(x, w, out, transposed)`` after its checks: ``n_blocks`` (programs
    a head), the weight's ``stride_wk`` / ``stride_wn`` and the tile constexprs (``K``, ``N``,
    ``BLOCK_T``, ``BLOCK_K``, ``BLOCK_N``). Raises ValueError for the shapes it does not take."""
    tokens, heads, k = x.shape
    n = w.shape[1] if transposed else w.shape[2]
    w_k = w.shape[2] if transposed else w.shape[1]
    if (not 0 < tokens <= MAX_TOKENS or w.shape[0] != heads or w_k != k or out.shape != (tokens, heads, n)
            or x.stride(2) != 1 or w.stride(2) != 1 or out.stride(2) != 1):
        raise ValueError(f"head_matvec: x {tuple(x.shape)}, w {tuple(w.shape)} (transposed={transposed}), out "
                         f"{tuple(out.shape)}; accepted: 1..{MAX_TOKENS} tokens, w [H, K, N] (or [H, N, K] "
                         "transposed), out [T, H, N], contiguous last dims")
    # The weight's contiguous dim is the one its loads run along: N for w [H, K, N] (wide output
    # blocks), K when transposed (long K steps, few output columns).
    stride_wk, stride_wn = (w.stride(2), w.stride(1)) if transposed else (w.stride(1), w.stride(2))
    block_t = triton.next_power_of_2(tokens)
    block_n = min(8 if transposed else 64, triton.next_power_of_2(n))
    # The [T, K, N] product stays at 8192 values a program (64 registers a thread at 4 warps).
    block_k = min(8192 // (block_t * block_n), triton.next_power_of_2(k))
    return {"n_blocks": triton.cdiv(n, block_n), "stride_wk": stride_wk, "stride_wn": stride_wn, "K": k, "N": n,
            "BLOCK_T": block_t, "BLOCK_K": block_k, "BLOCK_N": block_n}


def head_matvec(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool = False,
                pdl: bool = False) -> None:
    """``out[t, h] = x[t, h] @ w[h]`` (``transposed``: ``x[t, h] @ w[h].T``) for ``x`` ``[T, H, K]``,
    ``w`` ``[H, K, N]`` (``[H, N, K]`` when transposed) and ``out`` ``[T, H, N]``: what
    ``torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))`` computes. ``T`` at most
    ``MAX_TOKENS``; each tensor's last dim contiguous (rows may be strided). ``pdl``: launched as a
    programmatic dependent launch (sm_90+; results unchanged)."""
    plan = head_matvec_plan(x, w, out, transposed)
    tokens, heads, _ = x.shape
    _head_matvec_kernel[(heads, plan["n_blocks"])](
        x, w, out, tokens, x.stride(0), x.stride(1), w.stride(0), plan["stride_wk"], plan["stride_wn"], out.stride(0),
        out.stride(1), K=plan["K"], N=plan["N"], BLOCK_T=plan["BLOCK_T"], BLOCK_K=plan["BLOCK_K"],
        BLOCK_N=plan["BLOCK_N"], PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
