"""The MoE router's logits and its softmax top-k in one launch at one token (``layer_kernels()['router_topk']``).

At batch 1, with norm fusion and PDL, a MoE layer's routing took two launches: the router's skinny
GEMM with the post-attention RMSNorm folded in (``gemv.norm_skinny_linear``), then the softmax top-k
(``engine.layers.moe.router_kernel``), a one-program kernel the whole GPU waited for between the
router and the experts' gate/up launch. Here the top-k is the router's last program's epilogue:

1. Every program runs the skinny GEMM's own code (``gemv._gemv_fma_kernel``, called as a function,
   with the launch shape ``norm_skinny_linear`` picks): it triggers the next launch at once, requests
   its first weight tile, waits for the kernel before it, computes the norm and its share of the
   logits, and stores them (the logits tensor is the workspace); program 0 also stores the norm
   output and the residual sum for the readers after it.
2. Then it takes a ticket: a CTA barrier, then an acquire-release ``atomic_add`` at GPU scope on an
   int32 counter (the pattern of ``argmax.py``, and of CUTLASS's semaphore). The program that draws
   the last ticket reads every logit back from L2 (``.cg``), runs the top-k kernel's arithmetic
   (``router_kernel.softmax_topk_rows``) on them, writes the ids and weights, and puts the counter
   back to 0, so the next launch (the next layer's, or a CUDA graph's replay) finds it there.

The experts' gate/up launch (PDL) waits for this whole launch before it reads the ids, as it waited
for the top-k kernel; its down launch reads the routing before its own wait, which stays safe since
gate/up lets it start only after waiting. The counter is one per device, shared by the layers: a
launch touches it only after its ``gdc_wait`` (so after every launch before it in the stream has
completed) and leaves it at 0. Launches must therefore not run concurrently on two streams.

**Bit-equal to the two launches**, compiled: the logits are the GEMV's own code with its arguments
(the compile test finds its TTGIR, layouts included, unchanged at the start of this kernel), and
the top-k's float32 sums (the softmax denominator, the renormalisation) must be added in the order
the top-k kernel adds them, which its register layout decides. That kernel runs on
``topk_num_warps`` warps (1 up to 128 experts), this one on the GEMV's 4, so the top-k tile here is
``[4 / topk warps, experts]``: the same row once per warp, each warp holding its row in the top-k
kernel's layout (the same values per thread, the same butterflies). That holds where the top-k
kernel's row does not wrap around its warp's registers (``topk_tile_rows``); elsewhere (e.g. 60
experts, whose row stride allows no vector loads) the router keeps its two launches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from engine.layers.moe.router_kernel import softmax_topk_rows, topk_num_warps
from engine_platform_cuda.gemv import (
    _INTERPRETED,
    RULE,
    GemvConfig,
    GemvRule,
    _gemv_fma_kernel,
    _pow2_at_most,
    _sm_count,
    choose_config,
)

if TYPE_CHECKING:
    from engine.layers.layernorm import PendingNorm

#: 16-bit logits per 16-byte vector: the top-k kernel's widest load of a row.
_VECTOR = 8


@triton.jit
def _norm_router_topk_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
        r_ptr, nw_ptr, normed_ptr, res_ptr, stride_rm, eps, topk_w_ptr, topk_ids_ptr, ticket_ptr,
        K: tl.constexpr, K_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
        HAS_RES: tl.constexpr, ROW_BLOCK: tl.constexpr,
        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr,
        TOPK_ROWS: tl.constexpr):
    # 1. The logits: norm_skinny_linear's launch of the fma kernel (norm folded in, no split-K, one
    # weight step before the PDL wait), its part pointer unused.
    _gemv_fma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                     r_ptr, nw_ptr, normed_ptr, res_ptr, stride_rm, eps, K=K, K_SPLIT=K_SPLIT,
                     HAS_BIAS=HAS_BIAS, SPLIT=False, EVEN_K=EVEN_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                     BLOCK_K=BLOCK_K, PDL=PDL, NORM=True, HAS_RES=HAS_RES, ROW_BLOCK=ROW_BLOCK, PRE=1)
    # 2. The ticket: every thread's stores precede it (barrier, then a release at GPU scope); the
    # last program's acquire makes every program's logits visible to it.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        tl.debug_barrier()
        # Addressed as the top-k kernel addresses its token's row (a program id times the row
        # stride; here always row 0), so the compiler knows the same alignment and loads the same
        # vectors. Each of the TOPK_ROWS rows is that row again: one a warp group of the top-k size.
        row = tl.program_id(1).to(tl.int64)
        zero_r = tl.zeros([TOPK_ROWS, 1], dtype=tl.int32)
        offs_e = tl.arange(0, BLOCK_E)[None, :] + zero_r
        in_range = offs_e < N
        # .cg: from L2, where the other programs' stores are, not from this SM's L1.
        logits = tl.load(y_ptr + row * stride_ym + offs_e, mask=in_range, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
        top_w, top_ids = softmax_topk_rows(logits, in_range, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_TK)
        offs_k = tl.arange(0, BLOCK_TK)[None, :] + zero_r
        first_row = (offs_k < TOP_K) & (tl.arange(0, TOPK_ROWS)[:, None] == 0)
        tl.store(topk_w_ptr + offs_k, top_w, mask=first_row)
        tl.store(topk_ids_ptr + offs_k, top_ids, mask=first_row)
        tl.store(ticket_ptr, 0)  # ready for the next launch on this stream


def topk_tile_rows(num_experts: int, row_stride: int, num_warps: int) -> int | None:
    """Rows of this kernel's top-k tile (``num_warps`` warps) that reduce each row as the top-k
    kernel reduces its one row of ``num_experts`` logits with ``row_stride`` between rows; None when
    no such tile is known.

    The top-k kernel's row lies in ``topk_num_warps`` warps, ``per_thread`` consecutive values a
    thread (its loads' vector: 8 16-bit values where Triton knows the row 16-byte aligned, i.e. a row
    stride divisible by 16, else 1; at most the row's share of a thread). With as many warps here
    the tile is that row (1). With ``r`` times as many it is ``r`` copies of the row, one each
    ``topk_num_warps`` warps, in the same layout, but only where the row does not wrap around the
    threads (a thread's values contiguous): Triton then puts the copies along the rows, not along
    the experts. The compile test checks the layouts this predicts."""
    block_e = triton.next_power_of_2(num_experts)
    topk_warps = topk_num_warps(block_e)
    if num_warps % topk_warps:
        return None
    rows = num_warps // topk_warps
    if rows == 1:
        return 1
    vector = _VECTOR if row_stride % 16 == 0 else 1
    per_thread = max(1, block_e // (32 * topk_warps))
    return rows if per_thread <= vector else None


@dataclass(frozen=True)
class _Plan:
    """One launch: the GEMV's shape and the top-k tile."""

    config: GemvConfig
    #: columns of the norm's sum-of-squares tile (``norm_skinny_linear``'s rule).
    row_block: int
    #: rows of the top-k tile (``topk_tile_rows``).
    topk_rows: int


@functools.lru_cache(maxsize=256)  # asked on every call (takes, then the launch); a model's shapes repeat
def _plan(n: int, k: int, elem_bytes: int, sm_count: int, rule: GemvRule) -> _Plan | str:
    """The launch for one token, ``n`` experts and hidden size ``k``; a reason where there is none."""
    config = choose_config(1, n, k, sm_count, elem_bytes, rule)
    if config.kind != "fma" or config.split_k > 1:
        return f"the skinny GEMM's launch shape {config} (accepted: the fma kind without split-K)"
    rows = topk_tile_rows(n, n, config.num_warps)
    if rows is None:
        return (f"{n} experts at {config.num_warps} warps (no top-k tile reduces as the top-k kernel does: "
                "topk_tile_rows)")
    row_block = min(triton.next_power_of_2(k), max(16, _pow2_at_most(rule.norm_row_tile)))
    return _Plan(config, row_block, rows)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _ticket(device: torch.device) -> torch.Tensor:
    """The device's int32 counter (0 between launches); made on the first call, which must not be
    under CUDA graph capture (the engine's capture runs warm-up steps first)."""
    ticket = _TICKETS.get(device)
    if ticket is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("norm_router_topk: first call under CUDA graph capture; call it once before "
                               "capturing (its ticket counter must exist, zeroed, outside the graph)")
        ticket = _TICKETS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return ticket


def norm_router_topk(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                     pdl: bool = False, *, rule: GemvRule = RULE, normed: torch.Tensor | None = None,
                     res_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``norm_skinny_linear`` (one token) then ``select_experts_triton`` on its output, in one launch.

    Args:
        x, residual, norm_weight, eps, weight, bias, pdl, rule, normed, res_sum: as for
            ``gemv.norm_skinny_linear``, with ``x`` one row: the router's input and weight ``[E, K]``.
        top_k, renormalize: as for ``select_experts``.

    Returns:
        ``(logits, topk_weights, topk_ids, normed, res_sum)``: ``[1, E]`` in x's dtype, ``[1, top_k]``
        float32 and int32 (highest first, ties to the lower id), the norm output and ``x + residual``
        (``x`` itself without a residual), each bit-equal to the two launches'.

    Raises:
        ValueError: naming the input it does not take (``RouterTopK.takes`` says beforehand).
    """
    name = "norm_router_topk"
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: x shape {tuple(x.shape)} dtype {x.dtype}; accepted: [1, K] bfloat16 or float16")
    k = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype or weight.stride(1) != 1:
        raise ValueError(f"{name}: weight shape {tuple(weight.shape)} dtype {weight.dtype}; accepted: [E, {k}] in "
                         f"{x.dtype}, unit stride along K")
    n = weight.shape[0]
    if not 0 < top_k <= n:
        raise ValueError(f"{name}: top_k {top_k} out of range for {n} experts; accepted: 1..{n}")
    for what, t, shape in (("residual", residual, x.shape), ("bias", bias, (n,))):
        if t is not None and (t.shape != shape or t.dtype != x.dtype):
            raise ValueError(f"{name}: {what} shape {tuple(t.shape)} dtype {t.dtype}; accepted: {list(shape)} "
                             f"in {x.dtype}")
    if norm_weight.shape != (k,) or not norm_weight.is_floating_point():
        raise ValueError(f"{name}: norm_weight shape {tuple(norm_weight.shape)}; accepted: [{k}] floating point")
    plan = _plan(n, k, x.element_size(), _sm_count(x.device.index if x.is_cuda else None), rule)
    if isinstance(plan, str):
        raise ValueError(f"{name}: no one-launch plan: {plan}")
    normed = _out(name, "normed", normed, x)
    res_sum = x if residual is None else _out(name, "res_sum", res_sum, x)
    # As norm_skinny_linear hands them to its launch.
    xk = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    logits = torch.empty((1, n), dtype=x.dtype, device=x.device)
    topk_weights = torch.empty((1, top_k), dtype=torch.float32, device=x.device)
    topk_ids = torch.empty((1, top_k), dtype=torch.int32, device=x.device)
    cfg = plan.config
    k_split = triton.cdiv(k, cfg.block_k) * cfg.block_k
    r = residual
    _norm_router_topk_kernel[(triton.cdiv(n, cfg.block_n), 1)](
        xk, weight, logits if bias is None else bias, logits, 1, n, xk.stride(0), weight.stride(0), logits.stride(0),
        xk if r is None else r, norm_weight.contiguous(), normed, res_sum, 0 if r is None else r.stride(0),
        float(eps), topk_weights, topk_ids, _ticket(x.device),
        K=k, K_SPLIT=k_split, HAS_BIAS=bias is not None, EVEN_K=k % k_split == 0, BLOCK_M=1, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, PDL=pdl, HAS_RES=r is not None, ROW_BLOCK=plan.row_block,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(n),
        BLOCK_TK=triton.next_power_of_2(top_k), TOPK_ROWS=plan.topk_rows,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return logits, topk_weights, topk_ids, normed, res_sum


def _out(name: str, what: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A caller's contiguous buffer for ``like``'s values (checked), or a new one."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"{name}: {what} shape {tuple(out.shape)} dtype {out.dtype} on {out.device}; accepted: "
                         f"contiguous {list(like.shape)} in {like.dtype} on {like.device}")
    return out


@dataclass(frozen=True)
class RouterTopK:
    """``Platform.layer_kernels()['router_topk']``: ``FusedMoE.forward_with_router`` hands it the
    router's input at one token as the post-attention norm's ``PendingNorm`` (norm fusion) where
    ``takes`` says so, and gets the logits and the routing from one launch. Offered with ``linear``
    (norm fusion on) and PDL, unless ``cuda.router_topk`` is off."""

    #: the skinny GEMM the router layer holds (``layer_kernels()['linear']``): its PDL and launch rule.
    linear: Any

    def takes(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> bool:
        """Whether ``__call__`` takes ``pending``'s one row on the GPU (or under the interpreter) for
        this router ``weight``/``bias``: 16-bit operands as the skinny GEMM takes them, ``top_k`` of
        the experts, and a launch plan (``topk_tile_rows``)."""
        from engine.layers.linear import skinny_linear_applies

        x = pending.x
        if not ((x.is_cuda or _INTERPRETED) and x.dim() == 2 and x.shape[0] == 1
                and skinny_linear_applies(x, weight, bias, 1) and 0 < top_k <= weight.shape[0]
                and pending.weight.shape == (x.shape[1],)):
            return False
        sm_count = _sm_count(x.device.index if x.is_cuda else None)
        return not isinstance(_plan(weight.shape[0], x.shape[1], x.element_size(), sm_count, self.linear.rule), str)

    def __call__(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits, topk_weights, topk_ids)`` of the router's one token, filling ``pending``'s
        ``normed`` and ``res_sum`` as ``SkinnyLinear.norm_linear`` does."""
        k = pending.x.shape[-1]
        res_sum = pending.res_sum.view(-1, k) if pending.residual is not None else None
        logits, topk_weights, topk_ids, _, _ = norm_router_topk(
            pending.x, pending.residual, pending.weight, pending.eps, weight, bias, top_k, renormalize,
            pdl=self.linear.pdl, rule=self.linear.rule, normed=pending.normed.view(-1, k), res_sum=res_sum)
        return logits, topk_weights, topk_ids
