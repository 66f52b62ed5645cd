"""The MoE layer's experts at batch 1 (and other batches where no two slots share an expert): two
weight-streaming launches with no slot alignment.

At decode batch 1 each of a token's ``top_k`` slots goes to a different expert, so the grouped
GEMMs of ``fused_moe`` gain nothing from sorting slots by expert: their ``BLOCK_M`` tiles hold one
real row in sixteen, and the alignment, the per-slot down rows and the top-k sum are launches of
their own. Here, as the dense skinny GEMM (``engine_platform_cuda.gemv``) does for a linear layer,
every program streams rows of one expert's weights and multiplies them by the one activation row
they serve, accumulating in float32 registers (no tensor cores):

1. ``gate/up``, program ``(slot, n)``: expert ``topk_ids[slot]``'s gate rows ``n * BLOCK_N ..`` and
   the matching up rows ``I + n * BLOCK_N ..`` against ``x[slot // top_k]``; the epilogue writes
   ``silu(gate) * up`` (``[slots, I]``), rounded as the grouped kernel's epilogue rounds.
2. ``down``, program ``(token, n)``: rows ``n * BLOCK_N ..`` of all ``top_k`` experts of the token
   at once (a ``[top_k, BLOCK_N, BLOCK_K]`` tile: the experts' loads are in flight together), each
   against its slot's activation row; the epilogue scales each slot's sum by its routing weight,
   rounds it to the activation dtype (as the grouped down launch stores it), and adds the slots in
   order ``k = 0 .. top_k - 1`` in float32 (as ``sum_top_k``): the top-k sum is this launch's, not
   a third one.

So the layer's experts are two launches after the router's (which needs no alignment), and every
result equals the grouped path's up to the float32 order of the K sums.

``fused_moe_small_batch_routed`` takes the router's logits instead of its top-k: gate/up computes
its own slot's expert and down its token's experts and weights (``router_kernel``'s helpers, the
same bits as ``select_experts``), so no top-k launch sits between the router's GEMM and these two.

Slots of experts on another expert-parallel rank (``-1``) read nothing and add zero. Weights may be
fp8 codes with one scale per expert and output channel (``--quant fp8``), converted as they load.

``small_batch_applies`` says when this path is taken: every slot a different expert is certain at
one token (a token's top-k are distinct) and likely at two; past that, slots share experts more
often and the grouped GEMM reads each expert once for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.layers.moe.router_kernel import _slot_expert, _token_routing

#: Tokens up to which ``fused_moe`` takes this path (on its own choice: no tiles or blocks given).
#: H100, Qwen3-30B-A3B shape, cold weights, router included (``scripts/bench_moe_small.py``,
#: 2026-11-23): 34.4 us against the grouped path's 37.9 at one token, 58.0 against 62.3 at two.
SMALL_BATCH_MAX_TOKENS = 2


def small_batch_applies(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether ``fused_moe`` runs a batch of ``tokens`` through this module's kernels: one token, or
    up to ``SMALL_BATCH_MAX_TOKENS`` where few slots can share an expert, each other token's
    ``top_k`` picks landing on this token's experts at most 1/16 of the time (``(tokens - 1) *
    top_k <= num_experts / 16``: two tokens of Qwen3-30B-A3B, top 8 of 128, but not of Mixtral, top 2
    of 8, where on an H200 the small path took 302 us at two tokens against the grouped path's 236)."""
    if tokens == 1:
        return True
    return 1 < tokens <= SMALL_BATCH_MAX_TOKENS and 16 * (tokens - 1) * top_k <= num_experts


@triton.jit
def _gate_up_rows(x_ptr, w_ptr, scale_ptr, act_ptr, slot, expert, pid_n,
                  N, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
                  K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (slot, n)'s work once its expert is known (-1: held elsewhere, nothing read).
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    held = expert >= 0
    # Rows past N read row N-1 again (unmasked 16-byte vectors; the store drops them).
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # x is addressed with the tile's full [BLOCK_N, BLOCK_K] shape (stride 0 along N), so it lands
    # in the weights' register layout; the repeated addresses are served by L1.
    zero_n = tl.zeros([BLOCK_N], dtype=tl.int64)[:, None]
    x_ptrs = x_ptr + (slot // TOP_K).to(tl.int64) * stride_xm + zero_n + offs_k[None, :]
    g_ptrs = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for kk in range(0, K, BLOCK_K):
        k_ok = (offs_k[None, :] + kk < K) & held  # a slot held elsewhere: no memory request
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc_g += x * tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc_u += x * tl.load(u_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_SCALE:
        s_ptrs = scale_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_se + rows * stride_sn
        gate = gate * tl.load(s_ptrs, mask=held, other=0.0)
        up = up * tl.load(s_ptrs + N * stride_sn, mask=held, other=0.0)
    # Rounded where the grouped kernel's epilogue rounds (gate and up, then SiLU, then the product).
    out_ty = act_ptr.dtype.element_ty
    gate = gate.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32) * up.to(out_ty).to(tl.float32)
    tl.store(act_ptr + slot.to(tl.int64) * stride_am + offs_n, act.to(out_ty), mask=n_ok)


@triton.jit
def _small_gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, ids_ptr, act_ptr,
    N, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    slot = tl.program_id(0)
    if PDL:
        # The ids are the previous kernel's output: wait for it. Then let the down launch start:
        # its programs read the ids before they wait, which is safe once this program has waited.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    expert = tl.load(ids_ptr + slot)
    _gate_up_rows(x_ptr, w_ptr, scale_ptr, act_ptr, slot, expert, tl.program_id(1),
                  N, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am, K, TOP_K, HAS_SCALE,
                  BLOCK_N, BLOCK_K)


@triton.jit
def _small_gate_up_routed_kernel(
    x_ptr, w_ptr, scale_ptr, logits_ptr, act_ptr,
    N, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    stride_lt, stride_le, expert_start, num_local,
    K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, ROUTE_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    slot = tl.program_id(0)
    if PDL:
        # The logits (and x) are the previous kernel's (the router GEMM's) output: wait for it, then
        # let the down launch start; its programs read the logits before they wait, safe once
        # this program has waited.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    expert = _slot_expert(logits_ptr, slot // TOP_K, slot % TOP_K, NUM_EXPERTS, stride_lt, stride_le,
                          expert_start, num_local, ROUTE_ROWS, BLOCK_E)
    _gate_up_rows(x_ptr, w_ptr, scale_ptr, act_ptr, slot, expert, tl.program_id(1),
                  N, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am, K, TOP_K, HAS_SCALE,
                  BLOCK_N, BLOCK_K)


@triton.jit
def _down_rows(act_ptr, w_ptr, scale_ptr, out_ptr, token, pid_n, expert, weight,
               N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
               K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
               BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # Program (token, n)'s work once its slots' experts and weights ([BLOCK_TK], -1 / 0 past TOP_K
    # and for experts held elsewhere) are known; with PDL it requests its first weight tile, then
    # waits for the gate/up launch, then reads the activations (that launch's output).
    offs_t = tl.arange(0, BLOCK_TK)
    slots = token * TOP_K + offs_t
    held = expert >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    zero_n = tl.zeros([BLOCK_N], dtype=tl.int64)[None, :, None]
    k3 = offs_k[None, None, :]
    held3 = held[:, None, None]
    a_ptrs = act_ptr + slots[:, None, None] * stride_am + zero_n + k3
    w_ptrs = (w_ptr + tl.maximum(expert, 0).to(tl.int64)[:, None, None] * stride_we
              + rows[None, :, None] * stride_wn + k3)
    acc = tl.zeros([BLOCK_TK, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PDL:
        ok = (k3 < K) & held3
        w = tl.load(w_ptrs, mask=ok, other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc += tl.load(a_ptrs, mask=ok, other=0.0).to(tl.float32) * w.to(tl.float32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # K is a compile-time constant (the trip count known to the compiler); with PDL the first
    # step ran above.
    for kk in range(BLOCK_K * PDL, K, BLOCK_K):
        ok = (k3 + kk < K) & held3
        a = tl.load(a_ptrs, mask=ok, other=0.0).to(tl.float32)
        acc += a * tl.load(w_ptrs, mask=ok, other=0.0).to(tl.float32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [BLOCK_TK, BLOCK_N]: each slot's down row
    if HAS_SCALE:
        s_ptrs = scale_ptr + tl.maximum(expert, 0).to(tl.int64)[:, None] * stride_se + rows[None, :] * stride_sn
        y = y * tl.load(s_ptrs, mask=held[:, None], other=0.0)
    # As the grouped down launch stores each slot's row (times its weight, in the activation dtype)
    # and sum_top_k adds them in slot order in float32.
    out_ty = out_ptr.dtype.element_ty
    y = (y * weight[:, None]).to(out_ty).to(tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        total += tl.sum(tl.where(offs_t[:, None] == k, y, 0.0), axis=0)
    tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ty), mask=offs_n < N)


@triton.jit
def _small_down_kernel(
    act_ptr, w_ptr, scale_ptr, ids_ptr, topk_w_ptr, out_ptr,
    N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # With PDL everything up to the wait (in _down_rows) runs while the gate/up launch drains: the
    # ids and routing weights (written before it) and the first weight tile are loaded then.
    token = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_TK)
    slots = token * TOP_K + offs_t
    expert = tl.load(ids_ptr + slots, mask=offs_t < TOP_K, other=-1)
    weight = tl.load(topk_w_ptr + slots, mask=expert >= 0, other=0.0).to(tl.float32)
    _down_rows(act_ptr, w_ptr, scale_ptr, out_ptr, token, tl.program_id(1), expert, weight,
               N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om, K, TOP_K, HAS_SCALE,
               BLOCK_TK, BLOCK_N, BLOCK_K, PDL)


@triton.jit
def _small_down_routed_kernel(
    act_ptr, w_ptr, scale_ptr, logits_ptr, out_ptr,
    N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    stride_lt, stride_le, expert_start, num_local,
    K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    ROUTE_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):
    # With PDL the routing is computed before the wait: the logits are the router GEMM's output,
    # two launches back, complete once the gate/up launch has let this one start.
    token = tl.program_id(0).to(tl.int64)
    expert, weight = _token_routing(logits_ptr, token, NUM_EXPERTS, stride_lt, stride_le, expert_start, num_local,
                                    TOP_K, RENORMALIZE, ROUTE_ROWS, BLOCK_E, BLOCK_TK)
    _down_rows(act_ptr, w_ptr, scale_ptr, out_ptr, token, tl.program_id(1), expert, weight,
               N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om, K, TOP_K, HAS_SCALE,
               BLOCK_TK, BLOCK_N, BLOCK_K, PDL)


def small_batch_tiles(top_k: int, hidden: int, inter: int) -> dict[str, int]:
    """Tile sizes of the two launches: ``BLOCK_N`` rows of each weight matrix a program streams and
    ``BLOCK_K`` columns a step (16-byte vectors along the contiguous K).

    Few rows, long steps: many small programs keep more loads in flight per SM. From
    ``scripts/bench_moe_small.py --sweep`` (one token, cold weights, 2026-11-23):

    - Qwen3-30B-A3B shape on an H100: gate/up 19.2 us (2.62 TB/s) at 2 rows x 512 against 22.7 us at
      8 x 256; down 12.4 us at 1 row of each of the 8 experts x 256 against 17.1 us at 4 x 128.
    - Mixtral-8x7B shape on an H200: gate/up 110.7 us at 2 x 512 with 8 warps (117.0 with 4, best
      107.5 at 2 x 256); down 56.5 us (4.16 TB/s) at 1 row of each of the 2 experts x 512 against
      67.3 at 4 x 256.
    """
    block_tk = triton.next_power_of_2(top_k)
    down_k = min(512, triton.next_power_of_2(inter), max(16, 2048 // block_tk))
    return {"UP_BLOCK_N": 2, "UP_BLOCK_K": min(512, triton.next_power_of_2(hidden)), "UP_WARPS": 8,
            "DOWN_BLOCK_N": 1, "DOWN_BLOCK_K": down_k, "DOWN_WARPS": 4}


def _check_weights(name: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """The intermediate size ``I`` of experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` for ``x [tokens, H]``;
    a clear error naming ``name`` (the entry point) otherwise."""
    hidden = x.shape[1]
    inter = w13.shape[1] // 2
    if w13.shape[2] != hidden or w2.shape[1:] != (hidden, inter) or w2.shape[0] != w13.shape[0]:
        raise ValueError(f"{name}: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} for x {tuple(x.shape)};"
                         f" accepted: w13 [experts, 2 * I, {hidden}], w2 [experts, {hidden}, I]")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"{name}: weight strides w13 {w13.stride()}, w2 {w2.stride()}; "
                         "accepted: unit stride along the last (input) dimension")
    return inter


def fused_moe_small_batch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                          w2_scale: torch.Tensor | None = None,
                          tiles: dict[str, int] | None = None, pdl: bool = False) -> torch.Tensor:
    """``fused_moe`` (SwiGLU experts) in two launches with no alignment: same arguments and result
    as ``fused_moe_reference``. Correct for any batch; fast where slots do not share experts
    (``small_batch_applies``). ``tiles`` overrides ``small_batch_tiles`` (tests, sweeps; optional
    ``UP_WARPS`` / ``DOWN_WARPS``, default 4).

    ``pdl`` (sm_90+; the ``pdl`` layer kernel entry): both launches use programmatic dependent
    launch. Gate/up waits for the previous kernel (the router's top-k) at once and then lets the down
    launch start, whose programs read the routing and their first weight tile while gate/up drains.
    Results are unchanged."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = _check_weights("fused_moe_small_batch", x, w13, w2)
    t = tiles or small_batch_tiles(top_k, hidden, inter)
    x = x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    launch_gate_up(x, w13, w13_scale, ids, act, t["UP_BLOCK_N"], t["UP_BLOCK_K"], t.get("UP_WARPS", 4), pdl=pdl)
    launch_down(act, w2, w2_scale, ids, weights, out, t["DOWN_BLOCK_N"], t["DOWN_BLOCK_K"], t.get("DOWN_WARPS", 4),
                pdl=pdl)
    return out


def fused_moe_small_batch_routed(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
                                 top_k: int, renormalize: bool, expert_start: int = 0,
                                 num_local_experts: int | None = None, w13_scale: torch.Tensor | None = None,
                                 w2_scale: torch.Tensor | None = None, tiles: dict[str, int] | None = None,
                                 pdl: bool = False) -> torch.Tensor:
    """``select_experts`` (softmax top-k of ``router_logits``), the mapping to this rank's expert
    ids (``to_local_expert_ids``) and ``fused_moe_small_batch``, in the same two launches and no
    top-k launch: each launch routes for itself from the logits.

    - gate/up, program ``(slot, n)``: slot ``k``'s expert alone, ``k + 1`` arg-max rounds over its
      token's softmax (``router_kernel._slot_expert``);
    - down, program ``(token, n)``: the token's ``top_k`` experts and weights
      (``router_kernel._token_routing``).

    Both run ``router_kernel``'s rounds on the router kernel's softmax (float32, the denominator
    summed exactly, selection on the probabilities, of equal ones the lower expert id, the
    renormalising sum in slot order), so ids and weights are the ones ``select_experts`` gives on
    CUDA, bit for bit, and the result is ``fused_moe_small_batch``'s with those.

    Args:
        x, w13, w2, w13_scale, w2_scale, tiles: as ``fused_moe_small_batch``; ``w13``/``w2`` hold
            this rank's ``num_local_experts`` experts.
        router_logits: ``[tokens, num_experts]`` over all experts (every rank's), any float dtype.
        top_k, renormalize: as ``select_experts``.
        expert_start, num_local_experts: the experts this rank holds (default: all); slots of
            the others read nothing and add zero.
        pdl: (sm_90+) programmatic dependent launch. Gate/up waits for the previous kernel (the
            router GEMM) before it reads the logits and then lets down start; down routes and
            requests its first weight tile before it waits (the logits were written two launches
            before it).

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.
    """
    tokens, hidden = x.shape
    inter = _check_weights("fused_moe_small_batch_routed", x, w13, w2)
    if router_logits.dim() != 2 or router_logits.shape[0] != tokens:
        raise ValueError(f"fused_moe_small_batch_routed: router_logits {tuple(router_logits.shape)} for x "
                         f"{tuple(x.shape)}; accepted: [{tokens}, num_experts]")
    num_experts = router_logits.shape[1]
    num_local = num_experts - expert_start if num_local_experts is None else num_local_experts
    if not 0 < top_k <= num_experts:
        raise ValueError(f"fused_moe_small_batch_routed: top_k {top_k} out of range for {num_experts} experts; "
                         f"accepted: 1..{num_experts}")
    if not (0 <= expert_start and 0 < num_local and expert_start + num_local <= num_experts):
        raise ValueError(f"fused_moe_small_batch_routed: local experts [{expert_start}, {expert_start + num_local}) "
                         f"out of range for {num_experts} experts; accepted: a non-empty range inside [0, {num_experts})")
    if w13.shape[0] != num_local:
        raise ValueError(f"fused_moe_small_batch_routed: w13 holds {w13.shape[0]} experts, the local range "
                         f"[{expert_start}, {expert_start + num_local}) {num_local}; accepted: equal counts")
    t = tiles or small_batch_tiles(top_k, hidden, inter)
    x = x.contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    route = RouteArgs(router_logits, top_k, renormalize, expert_start, num_local)
    launch_gate_up(x, w13, w13_scale, route, act, t["UP_BLOCK_N"], t["UP_BLOCK_K"], t.get("UP_WARPS", 4), pdl=pdl)
    launch_down(act, w2, w2_scale, route, None, out, t["DOWN_BLOCK_N"], t["DOWN_BLOCK_K"], t.get("DOWN_WARPS", 4),
                pdl=pdl)
    return out


@dataclass(frozen=True)
class RouteArgs:
    """What the routed launches route from (``fused_moe_small_batch_routed``'s arguments)."""

    #: ``[tokens, num_experts]`` over all experts.
    logits: torch.Tensor
    #: experts per token.
    top_k: int
    #: renormalise the ``top_k`` weights to sum to one.
    renormalize: bool
    #: first expert this rank holds.
    expert_start: int
    #: how many it holds.
    num_local: int

    def kernel_args(self) -> tuple[int, ...]:
        """``stride_lt, stride_le, expert_start, num_local`` as the kernels take them."""
        return self.logits.stride(0), self.logits.stride(1), self.expert_start, self.num_local

    def kernel_consts(self, num_warps: int) -> dict[str, int]:
        """The routed kernels' constexprs: the expert count (a model constant: its mask folds and
        the logits load in vectors), the replicated routing rows (one per warp, ``_token_probs``)."""
        experts = self.logits.shape[1]
        return {"NUM_EXPERTS": experts, "ROUTE_ROWS": num_warps, "BLOCK_E": triton.next_power_of_2(experts)}


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    return (scale.stride(0), scale.stride(1)) if scale is not None else (0, 0)


def launch_gate_up(x: torch.Tensor, w13: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor | RouteArgs,
                   act: torch.Tensor, block_n: int, block_k: int, num_warps: int, pdl: bool = False) -> None:
    """The gate/up launch alone (``act [slots, I]`` written): ``fused_moe_small_batch``'s first
    step, and what a tile sweep times. ``ids``: contiguous int32 ``[tokens, top_k]``, or the
    ``RouteArgs`` to route from (the routed kernel)."""
    inter = w13.shape[1] // 2
    routed = isinstance(ids, RouteArgs)
    slots = ids.logits.shape[0] * ids.top_k if routed else ids.numel()
    top_k = ids.top_k if routed else ids.shape[1]
    common = (inter, x.stride(0), w13.stride(0), w13.stride(1), *_scale_strides(scale), act.stride(0))
    consts = dict(K=w13.shape[2], TOP_K=top_k, HAS_SCALE=scale is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                  PDL=pdl, num_warps=num_warps, num_stages=1, launch_pdl=pdl)
    grid = (slots, triton.cdiv(inter, block_n))
    scale_arg = scale if scale is not None else w13
    if routed:
        _small_gate_up_routed_kernel[grid](
            x, w13, scale_arg, ids.logits, act, *common, *ids.kernel_args(), **ids.kernel_consts(num_warps), **consts)
    else:
        _small_gate_up_kernel[grid](x, w13, scale_arg, ids, act, *common, **consts)


def launch_down(act: torch.Tensor, w2: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor | RouteArgs,
                weights: torch.Tensor | None, out: torch.Tensor, block_n: int, block_k: int, num_warps: int,
                pdl: bool = False) -> None:
    """The down launch alone (``out [tokens, H]`` written, routing weights and top-k sum applied):
    ``fused_moe_small_batch``'s second step. ``ids``, ``weights``: contiguous int32 and float32
    ``[tokens, top_k]``, or the ``RouteArgs`` to route from (the routed kernel) and None."""
    routed = isinstance(ids, RouteArgs)
    tokens, top_k = (ids.logits.shape[0], ids.top_k) if routed else ids.shape
    hidden = w2.shape[1]
    common = (hidden, act.stride(0), w2.stride(0), w2.stride(1), *_scale_strides(scale), out.stride(0))
    consts = dict(K=w2.shape[2], TOP_K=top_k, HAS_SCALE=scale is not None, BLOCK_TK=triton.next_power_of_2(top_k),
                  BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=num_warps, num_stages=1, launch_pdl=pdl)
    grid = (tokens, triton.cdiv(hidden, block_n))
    scale_arg = scale if scale is not None else w2
    if routed:
        _small_down_routed_kernel[grid](
            act, w2, scale_arg, ids.logits, out, *common, *ids.kernel_args(), RENORMALIZE=ids.renormalize,
            **ids.kernel_consts(num_warps), **consts)
    else:
        _small_down_kernel[grid](act, w2, scale_arg, ids, weights, out, *common, **consts)
