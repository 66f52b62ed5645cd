"""MLA's steps between the projections and attention, in one Triton launch (CUDA).

After ``q_proj`` (or ``q_b_proj``) and ``kv_a_proj_with_mqa``, the torch path runs some thirty
small kernels a layer: the latent's copy and RMSNorm, the cos/sin gathers, the de-interleave and
rotation of q's and k's rope dims (float32 casts, products, cats), the cats that build the
576-dim query and key rows, and the pool's indexed store. At batch 1 each takes 1-3 us, more than
the work. Here program ``t`` does token ``t``'s:

* the latent's RMSNorm (float32, cast to the model dtype, times the weight: ``RMSNorm``'s rounding);
* the rope of the key and of every head's query rope dims, de-interleaved as
  ``DeepseekRotaryEmbedding`` does (output in the half-split layout);
* the writes: the key row ``[c_kv || k_pe]`` to ``k_out`` and to the MLA pool at ``out_loc``
  (``row / k_scale`` saturated, for an fp8 pool, as ``quantize_kv``), and the roped query dims to
  ``q_out[:, :, lora:]``.

The absorbed ``q_nope @ W_UK`` goes to ``q_out[:, :, :lora]``: at decode batches (``w_uk`` given)
from programs of the same launch (``head_matvec``'s tiles, beside the prologue's programs: both
read only the projections' output), else from a batched GEMM writing there directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_models_deepseek.head_matvec import _head_matvec_tile, head_matvec_plan


@triton.jit
def _rope_pair(base, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVE: tl.constexpr, mask):
    """The two halves ``(x1, x2)`` of rope dims at ``base`` (``[rows, BLOCK_HALF]`` offsets), float32."""
    offs = tl.arange(0, BLOCK_HALF)
    if INTERLEAVE:
        x1 = tl.load(base + 2 * offs[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * offs[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _prologue_token(
    t, Q, KV_A, Positions, Cos, Sin, Norm_W, K_Out, Q_Out, Pool, Out_Loc,
    eps, k_scale, fp8_max,
    stride_qt, stride_qh, stride_kvat, stride_kot, stride_qot, stride_qoh, stride_pool, stride_cos,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, LORA: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, FP8: tl.constexpr, WRITE_POOL: tl.constexpr, PDL: tl.constexpr,
):
    """Token ``t``'s prologue (one program's work)."""
    # With PDL the positions, their cos/sin rows and the norm weight (no kernel's output) are loaded
    # before the wait for the kernel before (the projections, or the W_UK product launched apart);
    # the attention launch may start then.
    t = t.to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_half, mask=mask_half, other=0.0)[None, :]
    sin = tl.load(Sin + pos * stride_cos + offs_half, mask=mask_half, other=0.0)[None, :]
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < LORA
    w = tl.load(Norm_W + offs_c, mask=mask_c, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    # The latent: RMSNorm as engine.layers.layernorm.RMSNorm rounds it.
    x = tl.load(KV_A + t * stride_kvat + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / LORA + eps)
    c = (w.to(tl.float32) * (x * rstd).to(K_Out.dtype.element_ty).to(tl.float32)).to(K_Out.dtype.element_ty)

    # The rope key (one "head"), then every query head's rope dims.
    k1, k2 = _rope_pair(KV_A + t * stride_kvat + LORA, HALF, BLOCK_HALF, INTERLEAVE, mask_half[None, :])
    r1 = (k1 * cos - k2 * sin).to(K_Out.dtype.element_ty)
    r2 = (k2 * cos + k1 * sin).to(K_Out.dtype.element_ty)
    k_row = K_Out + t * stride_kot
    tl.store(k_row + offs_c, c, mask=mask_c)
    tl.store(k_row + LORA + offs_half[None, :], r1, mask=mask_half[None, :])
    tl.store(k_row + LORA + HALF + offs_half[None, :], r2, mask=mask_half[None, :])
    if WRITE_POOL:
        p_row = Pool + tl.load(Out_Loc + t).to(tl.int64) * stride_pool
        if FP8:
            # quantize_kv: the stored row is row / k_scale, clamped to the format's range.
            pc = tl.clamp(tl.div_rn(c.to(tl.float32), k_scale), -fp8_max, fp8_max)
            p1 = tl.clamp(tl.div_rn(r1.to(tl.float32), k_scale), -fp8_max, fp8_max)
            p2 = tl.clamp(tl.div_rn(r2.to(tl.float32), k_scale), -fp8_max, fp8_max)
        else:
            pc, p1, p2 = c, r1, r2
        tl.store(p_row + offs_c, pc.to(Pool.dtype.element_ty), mask=mask_c)
        tl.store(p_row + LORA + offs_half[None, :], p1.to(Pool.dtype.element_ty), mask=mask_half[None, :])
        tl.store(p_row + LORA + HALF + offs_half[None, :], p2.to(Pool.dtype.element_ty), mask=mask_half[None, :])

    heads = tl.arange(0, BLOCK_H)
    mask_qh = (heads < NUM_HEADS)[:, None] & mask_half[None, :]
    q_base = Q + t * stride_qt + heads[:, None] * stride_qh + NOPE
    q1, q2 = _rope_pair(q_base, HALF, BLOCK_HALF, INTERLEAVE, mask_qh)
    qo = Q_Out + t * stride_qot + heads[:, None] * stride_qoh + LORA + offs_half[None, :]
    tl.store(qo, (q1 * cos - q2 * sin).to(Q_Out.dtype.element_ty), mask=mask_qh)
    tl.store(qo + HALF, (q2 * cos + q1 * sin).to(Q_Out.dtype.element_ty), mask=mask_qh)


@triton.jit
def _mla_prologue_kernel(
    Q, KV_A, Positions, Cos, Sin, Norm_W, K_Out, Q_Out, Pool, Out_Loc,
    eps, k_scale, fp8_max,
    stride_qt, stride_qh, stride_kvat, stride_kot, stride_qot, stride_qoh, stride_pool, stride_cos,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, LORA: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, FP8: tl.constexpr, WRITE_POOL: tl.constexpr, PDL: tl.constexpr,
):
    _prologue_token(tl.program_id(0), Q, KV_A, Positions, Cos, Sin, Norm_W, K_Out, Q_Out, Pool, Out_Loc,
                    eps, k_scale, fp8_max, stride_qt, stride_qh, stride_kvat, stride_kot, stride_qot, stride_qoh,
                    stride_pool, stride_cos, NUM_HEADS, NOPE, LORA, HALF, BLOCK_H, BLOCK_C, BLOCK_HALF,
                    INTERLEAVE, FP8, WRITE_POOL, PDL)


@triton.jit
def _mla_prologue_absorb_kernel(
    Q, KV_A, Positions, Cos, Sin, Norm_W, K_Out, Q_Out, Pool, Out_Loc, W_UK,
    eps, k_scale, fp8_max, tokens,
    stride_qt, stride_qh, stride_kvat, stride_kot, stride_qot, stride_qoh, stride_pool, stride_cos,
    stride_wh, stride_wk, stride_wn,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, LORA: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, FP8: tl.constexpr, WRITE_POOL: tl.constexpr, PDL: tl.constexpr,
    N_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Programs 0 .. tokens - 1: the prologue of one token each; the others: one (head, column
    # block) of q_nope @ W_UK each, written into the query rows' latent part. The two read only
    # the projections' output, so they run side by side in one launch.
    pid = tl.program_id(0)
    if pid < tokens:
        _prologue_token(pid, Q, KV_A, Positions, Cos, Sin, Norm_W, K_Out, Q_Out, Pool, Out_Loc,
                        eps, k_scale, fp8_max, stride_qt, stride_qh, stride_kvat, stride_kot, stride_qot, stride_qoh,
                        stride_pool, stride_cos, NUM_HEADS, NOPE, LORA, HALF, BLOCK_H, BLOCK_C, BLOCK_HALF,
                        INTERLEAVE, FP8, WRITE_POOL, PDL)
    else:
        p = pid - tokens
        _head_matvec_tile(Q, W_UK, Q_Out, p // N_BLOCKS, p % N_BLOCKS, tokens, stride_qt, stride_qh, stride_wh,
                          stride_wk, stride_wn, stride_qot, stride_qoh, NOPE, LORA, BLOCK_T, BLOCK_K, BLOCK_N, PDL)


def mla_prologue(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, norm_weight: torch.Tensor, eps: float, nope_dim: int, interleave: bool,
                 q_out: torch.Tensor, k_out: torch.Tensor, pool: torch.Tensor | None = None,
                 out_loc: torch.Tensor | None = None, k_scale: float = 1.0, pdl: bool = False,
                 w_uk: torch.Tensor | None = None) -> None:
    """Token by token: ``k_out[t] = [rmsnorm(c_kv) || rope(k_pe)]`` (also stored in ``pool`` at
    ``out_loc[t]`` when given) and ``q_out[t, h, lora:] = rope(q[t, h, nope:])``.

    Args:
        q: ``[T, H, nope + rope]``, last dim contiguous (a view of the q projection's output).
        kv_a: ``[T, lora + rope]``, last dim contiguous (``kv_a_proj_with_mqa``'s output).
        positions: ``[T]`` integer positions; ``cos``/``sin``: ``[max_position, rope / 2]`` float32.
        norm_weight: ``[lora]``, ``kv_a_layernorm``'s weight; ``eps`` its epsilon.
        interleave: the rope dims pair adjacent values (DeepSeek's layout), else halves.
        q_out: ``[T, H, lora + rope]``; ``k_out``: ``[T, lora + rope]`` (row-contiguous).
        pool: the layer's MLA buffer ``[slots, 1, lora + rope]`` (any float or fp8 dtype).
        k_scale: an fp8 pool's scale (rows are stored divided by it).
        pdl: a programmatic dependent launch (sm_90+): positions, cos/sin and the norm weight are
            read before the wait for the kernel before it, and the next launch may start at once.
        w_uk: ``[H, nope, lora]``: the same launch also writes ``q_out[t, h, :lora] = q[t, h, :nope]
            @ w_uk[h]`` (``head_matvec``'s programs beside the prologue's; at most
            ``head_matvec.MAX_TOKENS`` tokens), one launch instead of two.
    """
    tokens, num_heads, qk_dim = q.shape
    rope = qk_dim - nope_dim
    lora = kv_a.shape[1] - rope
    if rope % 2 or rope <= 0 or q_out.shape != (tokens, num_heads, lora + rope) or k_out.shape != kv_a.shape:
        raise ValueError(f"mla_prologue: q {tuple(q.shape)}, kv_a {tuple(kv_a.shape)}, q_out {tuple(q_out.shape)}, "
                         f"k_out {tuple(k_out.shape)}; accepted: an even rope dim, q_out [T, H, lora + rope], "
                         "k_out like kv_a")
    for name, t in (("q", q), ("kv_a", kv_a), ("q_out", q_out), ("k_out", k_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"mla_prologue: {name} needs a contiguous last dim")
    if tokens == 0:
        return
    write_pool = pool is not None
    if write_pool and out_loc is None:
        raise ValueError("mla_prologue: pool needs out_loc")
    fp8 = write_pool and pool.element_size() == 1
    fp8_max = float(torch.finfo(pool.dtype).max) if fp8 else 0.0
    target = pool if write_pool else k_out
    common = (float(eps), float(k_scale), fp8_max)
    strides = (q.stride(0), q.stride(1), kv_a.stride(0), k_out.stride(0), q_out.stride(0), q_out.stride(1),
               target.stride(0), cos.stride(0))
    meta = dict(NUM_HEADS=num_heads, NOPE=nope_dim, LORA=lora, HALF=rope // 2,
                BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_C=triton.next_power_of_2(lora),
                BLOCK_HALF=triton.next_power_of_2(rope // 2), INTERLEAVE=interleave, FP8=fp8, WRITE_POOL=write_pool,
                PDL=pdl, launch_pdl=pdl)
    tensors = (q, kv_a, positions, cos, sin, norm_weight, k_out, q_out, target, out_loc if write_pool else positions)
    if w_uk is None:
        _mla_prologue_kernel[(tokens,)](*tensors, *common, *strides, **meta, num_warps=4 if lora >= 256 else 1)
        return
    plan = head_matvec_plan(q[..., :nope_dim], w_uk, q_out[..., :lora], transposed=False)
    _mla_prologue_absorb_kernel[(tokens + num_heads * plan["n_blocks"],)](
        *tensors, w_uk, *common, tokens, *strides, w_uk.stride(0), plan["stride_wk"], plan["stride_wn"], **meta,
        N_BLOCKS=plan["n_blocks"], BLOCK_T=plan["BLOCK_T"], BLOCK_K=plan["BLOCK_K"], BLOCK_N=plan["BLOCK_N"],
        num_warps=4)
