"""The fused MoE Triton kernel: two grouped GEMM launches for a whole MoE layer.

Design (the idea of vLLM's/SGLang's fused_moe, written for this project):

1. ``align_slots_by_expert`` sorts the ``tokens * top_k`` slots by expert and pads each
   expert's run to a multiple of ``BLOCK_M`` (one Triton launch at decode sizes on CUDA; torch
   operations of fixed shapes above that). ``FusedMoE`` computes it in the router's launch at
   decode sizes (``route_and_align``) and hands it over as ``blocks``.
2. Launch 1, gate/up with SiLU-and-mul: program ``(m, n)`` takes block ``m`` of sorted slots (one
   expert ``e``), gathers the rows ``x[slot // top_k]`` and multiplies them by ``w13[e]``'s gate
   columns ``n * BLOCK_N ..`` and the matching up columns ``I + n * BLOCK_N ..`` (two
   accumulators); its epilogue writes ``silu(gate) * up``, ``[slots, I]`` rows indexed by slot,
   rounded as ``F.silu(g) * u`` on stored ``g``, ``u`` rounds in the activation dtype. With an
   ``act_fn`` (an activation the epilogue does not compute) the launch writes ``[slots, 2I]`` and
   ``act_fn`` runs after it.
3. Launch 2, down: the same blocks, rows ``act[slot]`` times ``w2[e]``; the epilogue multiplies
   each row by its routing weight ``topk_weights[slot]`` and writes ``[slots, H]``.
4. ``sum_top_k``: ``out[t] = sum_k y[t * top_k + k]`` in float32, one launch (none when ``top_k``
   is 1).

With the router and alignment in one launch that is four launches per MoE layer at decode. At
batches of 1-2 tokens (``small_batch.small_batch_applies``) there is nothing to group: ``fused_moe_small_batch``
streams each slot's expert rows in two launches after a router launch with no alignment, the top-k
sum in the second.
Float32 atomics in the down launch instead of the top-k sum were left out: they would need a
zeroed float32 buffer and a cast back (two launches for the one saved) and would make the result
depend on the order the programs run in. SiLU-and-mul applied to the down launch's A tiles as it
loads them was left out too (at the decode tile it spilled registers, Triton 3.9, sm_90); the
gate/up epilogue does it with no extra load and half the intermediate bytes.

Every expert's weights are read once per launch however many tokens it serves, which is where
the per-expert loop loses: one launch (and one small GEMM) per expert. Blocks of experts held
on another expert-parallel rank (``-1``) write zeros. Weights may be fp8 codes with one scale
per expert and output channel (``--quant fp8``): the kernel converts them to the activation
dtype as it loads them and applies the scale to the accumulator (weight-only fp8: half the bytes
read, which is what decode is bound by).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from engine.layers.moe.align import ExpertBlocks, align_slots_by_expert
from engine.layers.moe.small_batch import fused_moe_small_batch, small_batch_applies


@triton.jit
def _moe_grouped_gemm(
    a_ptr, b_ptr, c_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K: tl.constexpr, num_slots, max_padded,  # K: a layer constant (hidden or intermediate size)
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_se, stride_sn,
    A_ROW_DIV: tl.constexpr,  # slot -> row of A: slot // A_ROW_DIV (top_k for x, 1 for act)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_B_SCALE: tl.constexpr,
    SILU_MUL: tl.constexpr,  # B holds 2N rows (gate, then up); C gets silu(gate) * up, N wide
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(max_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: neighbouring programs share B columns (the same expert's weights).
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_rows
    pid_n = (pid % group) // group_rows

    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slot_ids_ptr + offs_m)
    row_ok = slots < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_ok[:, None] & col_ok[None, :]
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        # Slots whose expert lives on another expert-parallel rank contribute nothing here.
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        # The up rows of the expert's w13 are N rows after its gate rows: columns n of the product
        # pair with columns N + n.
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_B_SCALE:
            b = b.to(a.dtype)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if SILU_MUL:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if HAS_B_SCALE:
                b_up = b_up.to(a.dtype)
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_B_SCALE:
        scale_ptrs = b_scale_ptr + expert * stride_se + offs_n * stride_sn
        acc = acc * tl.load(scale_ptrs, mask=col_ok, other=0.0)[None, :]
        if SILU_MUL:
            acc_up = acc_up * tl.load(scale_ptrs + N * stride_sn, mask=col_ok, other=0.0)[None, :]
    if SILU_MUL:
        # Rounded where the unfused path rounds: gate and up stored in the activation dtype, SiLU
        # rounded to it (as F.silu), the product rounded to it (as the platform's silu_and_mul).
        out_ty = c_ptr.dtype.element_ty
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * acc_up.to(out_ty).to(tl.float32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _sum_top_k_kernel(y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = y[t * TOP_K] + ... + y[t * TOP_K + TOP_K - 1], in float32, in that order.
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < hidden
    rows = y_ptr + token * TOP_K * hidden + offs
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(rows + k * hidden, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_top_k(y: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """``y.view(tokens, top_k, H).sum(1)`` (``y`` contiguous ``[tokens * top_k, H]``) in one
    launch: program ``(t, h)`` adds token ``t``'s ``top_k`` rows over ``BLOCK_H`` columns in
    float32, always in the same order (no atomics: the result does not depend on scheduling)."""
    hidden = y.shape[1]
    if y.shape[0] != tokens * top_k or not y.is_contiguous():
        raise ValueError(f"sum_top_k: y of shape {tuple(y.shape)} (contiguous: {y.is_contiguous()}); "
                         f"accepted: contiguous [{tokens} * {top_k}, hidden]")
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    if tokens == 0:
        return out
    block_h = min(512, triton.next_power_of_2(hidden))
    _sum_top_k_kernel[(tokens, triton.cdiv(hidden, block_h))](y, out, hidden, TOP_K=top_k, BLOCK_H=block_h,
                                                               num_warps=4)
    return out


def pick_blocks(num_slots: int, num_experts: int) -> dict[str, int]:
    """Tile sizes for a batch by slots per expert. Not autotuned: a table from
    ``benchmarks/sweep_moe_tiles.py`` (and ``--prefill``) on an H100 at the Qwen3-30B-A3B shape
    (128 experts, top 8, hidden 2048, intermediate 768), 2026-11-24:

    - up to 12 (decode): ``BLOCK_M`` 16, little of each block padding when an expert sees a token
      or two; within 1% of the best of 72 tiles at 1 and 8 tokens. ``GROUP_M`` 8: an expert with
      more than 16 slots spans two blocks, and the grouped order runs them as neighbouring programs,
      so the second reads the expert's weights from L2. With ``GROUP_M`` 1 they were a whole row of
      column blocks apart: at the Mixtral-8x7B shape (an expert's gate/up is 235 MB) 64 tokens took
      870 / 420 us (gate/up / down) against 674 / 384 us with ``GROUP_M`` 8 (H100).
    - up to 64: ``BLOCK_M`` 64 with 64 x 128 tiles, 4 warps. At 1,024 tokens (64 slots an expert)
      gate/up 308 us and down 167 us, against 457 and 189 us with the 32 x 64 tiles before. From 13
      slots an expert on: at the Mixtral shape 56 and 64 tokens (14 and 16 slots) take 654 / 323 and
      655 / 323 us, against 662 / 351 and 674 / 384 us with the decode tier; at the Qwen3 shape, 208
      to 256 tokens, the decode tier would be 1-3% faster.
    - more (prefill): 128 x 256 tensor-core tiles, 8 warps; gate/up (128 columns of each of its
      two accumulators) with 4 stages, down with 3 (``up_num_stages``). At 8,192 tokens gate/up
      790 us (522 TFLOP/s) and down 458 us, against 1,236 and 618 us with the 64 x 128 tiles
      before; at 4,096 tokens 466 and 284 us against 636 and 331.

    ``BLOCK_N`` is the down launch's; the gate/up launch takes half as many columns of each of
    gate and up (``fused_moe``)."""
    per_expert = num_slots / max(1, num_experts)
    if per_expert <= 12:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    if per_expert <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
            "up_num_stages": 4}


def _gate_up_config(cfg: dict[str, int], silu_mul: bool = True) -> dict[str, int]:
    """The gate/up launch's tiles: ``up_num_stages`` where given; with the SiLU-and-mul epilogue
    two accumulators a program, so half of ``BLOCK_N`` each (the registers and the bytes of B a
    program reads stay as they were)."""
    out = {**cfg, "num_stages": cfg.get("up_num_stages", cfg["num_stages"])}
    return {**out, "BLOCK_N": max(16, cfg["BLOCK_N"] // 2)} if silu_mul else out


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, out: torch.Tensor,
                  blocks: ExpertBlocks, a_row_div: int, topk_weights: torch.Tensor | None,
                  cfg: dict[str, int], silu_mul: bool = False) -> None:
    n, k = w.shape[1] // 2 if silu_mul else w.shape[1], w.shape[2]
    max_padded = blocks.sorted_slot_ids.shape[0]
    grid = (triton.cdiv(max_padded, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    scale = w_scale if w_scale is not None else w  # any pointer; unused without HAS_B_SCALE
    _moe_grouped_gemm[grid](
        a, w, out, scale, topk_weights if topk_weights is not None else a,
        blocks.sorted_slot_ids, blocks.block_expert_ids, blocks.num_padded,
        n, k, blocks.num_slots, max_padded,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        scale.stride(0) if w_scale is not None else 0, scale.stride(1) if w_scale is not None else 0,
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_B_SCALE=w_scale is not None,
        SILU_MUL=silu_mul, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              config: dict[str, int] | None = None,
              act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
              blocks: ExpertBlocks | None = None, pdl: bool = False,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE layer's expert part, fused: same arguments and result as ``fused_moe_reference``.

    ``config`` overrides the tile sizes ``pick_blocks`` chooses (tests use small tiles).
    ``act_fn``: None (SwiGLU) computes ``silu(gate) * up`` in the gate/up launch's epilogue; an
    activation-and-mul function (``[slots, 2I] -> [slots, I]``) instead runs after a gate/up launch
    that writes both halves, for an activation the epilogue does not compute.
    ``blocks``: the alignment of ``topk_ids`` when the caller has it already (``route_and_align``
    computes it with the routing, in the router's launch); None aligns here.

    With none of ``config``, ``act_fn`` and ``blocks`` given, a batch where
    ``small_batch_applies`` (one or two tokens) takes ``fused_moe_small_batch`` instead: two launches, no
    alignment, the top-k sum in the down launch; ``pdl`` (sm_90+) launches those two with
    programmatic dependent launch (``fused_moe_small_batch``). The grouped path ignores it.
    ``shared``: shared experts run in the small-batch launches (``fused_moe_small_batch``), their
    output added; only where that path is taken (a ValueError otherwise).
    """
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    if config is None and act_fn is None and blocks is None and small_batch_applies(tokens, top_k, num_experts):
        return fused_moe_small_batch(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, pdl=pdl, shared=shared)
    if shared is not None:
        raise ValueError(f"fused_moe: shared experts with {tokens} tokens, top {top_k} of {num_experts} experts "
                         f"(config, act_fn or blocks given: {config is not None}, {act_fn is not None}, "
                         f"{blocks is not None}); accepted only where the small-batch path is taken")
    num_slots = tokens * top_k
    cfg = config or pick_blocks(num_slots, num_experts)
    x = x.contiguous()
    if blocks is None:
        blocks = align_slots_by_expert(topk_ids, num_experts, cfg["BLOCK_M"])
    elif blocks.block_m != cfg["BLOCK_M"] or blocks.num_slots != num_slots:
        raise ValueError(f"fused_moe: blocks of {blocks.num_slots} slots by {blocks.block_m} do not fit this call "
                         f"({num_slots} slots, BLOCK_M {cfg['BLOCK_M']}); accepted: route_and_align's blocks for "
                         f"these ids at block_m = pick_blocks(...)['BLOCK_M'], or None")
    if act_fn is None:
        act = torch.empty(num_slots, two_inter // 2, dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, w13_scale, act, blocks, top_k, None, _gate_up_config(cfg), silu_mul=True)
    else:
        gate_up = torch.empty(num_slots, two_inter, dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, w13_scale, gate_up, blocks, top_k, None, _gate_up_config(cfg, silu_mul=False))
        act = act_fn(gate_up)
    down = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    # The kernel reads the weights in any float dtype: no conversion launch.
    _grouped_gemm(act, w2, w2_scale, down, blocks, 1, topk_weights.reshape(-1).contiguous(), cfg)
    if top_k == 1:
        return down
    return sum_top_k(down, tokens, top_k)
