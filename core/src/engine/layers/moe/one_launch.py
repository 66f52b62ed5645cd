"""The MoE layer's experts at batch 1 in one launch: gate/up and down split along the intermediate
dimension, the programs' partial sums added in fixed point.

``small_batch`` runs a token's experts as two launches (gate/up, then down), because every down
output needs the whole ``silu(gate) * up`` row of its expert. Here the split is along the
intermediate features instead: program ``(j, slot)`` streams expert ``topk_ids[slot]``'s gate and up
rows ``j * BLOCK_I ..`` (against the token's activation row), forms those ``BLOCK_I`` activations,
and multiplies them at once by the matching ``BLOCK_I`` columns of the expert's down matrix: a
partial sum for every one of the ``H`` outputs, times the slot's routing weight. So the down weights
stream in the same launch as gate/up, with no launch boundary (or grid-wide wait) between them.

The partial sums are added across programs with integer atomics on a fixed-point image
(``FIXED_POINT_BITS`` fraction bits in int64): integer addition does not depend on the order the
programs arrive in, so the result is the same on every run (float atomics would not be). The program
that arrives last (an atomic ticket) converts the sums to the activation dtype, writes them, and
zeroes the accumulator and the ticket for the next call: the workspace is always zero between
launches, so a CUDA graph replays it with no clearing launch.

Rounding: the activations are rounded where the grouped kernel's epilogue rounds them; each
program's partial sum is float32, truncated to a multiple of ``2**-FIXED_POINT_BITS``, and the
total is rounded once to the output dtype (the two-launch path rounds each slot's row to the
activation dtype before the top-k sum). A partial sum that is not finite, or past
``FIXED_POINT_LIMIT`` in magnitude, makes its token's row NaN instead of saturating silently.

``fused_moe`` takes this path at one token when given a workspace: ``FusedMoE`` keeps one per layer
where the platform's ``moe_one_launch`` layer-kernel entry is on (``--plugin-option
cuda.moe_one_launch=off`` turns it off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Fraction bits of the fixed-point accumulator: resolution 2**-32 (about 2.3e-10).
FIXED_POINT_BITS = 32
#: Largest partial sum (and total) magnitude the int64 accumulator takes exactly: 2**30, leaving
#: the headroom of 2**(63 - 32 - 30) = 2 programs' worth of maximal sums.
FIXED_POINT_LIMIT = 2.0**30


@triton.jit
def _one_launch_kernel(
    x_ptr, w13_ptr, w2_ptr, s13_ptr, s2_ptr, ids_ptr, topk_w_ptr, acc_ptr, bad_ptr, ticket_ptr, out_ptr,
    I, stride_xm, stride_ue, stride_un, stride_de, stride_dn, stride_s13e, stride_s13n,
    stride_s2e, stride_s2n, stride_om,
    H: tl.constexpr, TOKENS: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE: tl.constexpr,
    LIMIT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_i = tl.program_id(0)
    slot = tl.program_id(1)
    if PDL:
        # The ids are the previous kernel's output; the next kernel reads this one's output only
        # after its own wait, so it may start at once.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = slot // TOP_K
    expert = tl.load(ids_ptr + slot)
    held = expert >= 0
    e64 = tl.maximum(expert, 0).to(tl.int64)
    routing = tl.load(topk_w_ptr + slot).to(tl.float32)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < I
    # Rows past I read row I-1 again (unmasked vectors); their activations are zeroed below.
    rows = tl.minimum(offs_i, I - 1).to(tl.int64)

    # gate/up: [BLOCK_I, BLOCK_K] tiles along H, float32 lanes summed once at the end.
    offs_k = tl.arange(0, BLOCK_K)
    zero_i = tl.zeros([BLOCK_I], dtype=tl.int64)[:, None]
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + zero_i + offs_k[None, :]
    g_ptrs = w13_ptr + e64 * stride_ue + rows[:, None] * stride_un + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_un
    acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    for kk in range(0, H, BLOCK_K):
        k_ok = (offs_k[None, :] + kk < H) & held  # a slot held elsewhere: no memory request
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc_g += x * tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc_u += x * tl.load(u_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_SCALE:
        s_ptrs = s13_ptr + e64 * stride_s13e + rows * stride_s13n
        gate = gate * tl.load(s_ptrs, mask=held, other=0.0)
        up = up * tl.load(s_ptrs + I * stride_s13n, mask=held, other=0.0)
    # Rounded where the grouped kernel's epilogue rounds (gate and up, then SiLU, then the product).
    act_ty = out_ptr.dtype.element_ty
    gate = gate.to(act_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(act_ty).to(tl.float32) * up.to(act_ty).to(tl.float32)
    act = tl.where(i_ok, act.to(act_ty).to(tl.float32), 0.0)

    # down: this program's BLOCK_I columns of every output row, [BLOCK_H, BLOCK_I] tiles.
    offs_h = tl.arange(0, BLOCK_H)
    d_ptrs = w2_ptr + e64 * stride_de + offs_h[:, None].to(tl.int64) * stride_dn + rows[None, :]
    acc_row = acc_ptr + token.to(tl.int64) * H
    bad = tl.zeros([BLOCK_H], dtype=tl.int32)
    for hh in range(0, H, BLOCK_H):
        h_ok = offs_h + hh < H
        w = tl.load(d_ptrs, mask=h_ok[:, None] & held, other=0.0).to(tl.float32)
        y = tl.sum(w * act[None, :], axis=1)
        if HAS_SCALE:
            y = y * tl.load(s2_ptr + e64 * stride_s2e + (offs_h + hh) * stride_s2n, mask=h_ok & held, other=0.0)
        y = y * routing
        exact = tl.abs(y) <= LIMIT  # False for NaN too
        bad += (~exact).to(tl.int32)
        fixed = (tl.where(exact, y, 0.0) * SCALE).to(tl.int64)
        tl.atomic_add(acc_row + hh + offs_h, fixed, mask=h_ok & held, sem="relaxed")
        d_ptrs += BLOCK_H * stride_dn
    if tl.sum(bad, axis=0) > 0:
        tl.atomic_max(bad_ptr + token, 1, sem="relaxed")

    # Every thread's adds are issued before the ticket (the barrier), and the ticket's release
    # orders them before the last program's acquire.
    tl.debug_barrier()
    total = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == total - 1:
        for t in tl.static_range(TOKENS):
            flagged = tl.atomic_xchg(bad_ptr + t, 0, sem="relaxed") > 0
            for hh in range(0, H, BLOCK_H):
                h_ok = offs_h + hh < H
                src = acc_ptr + t * H + hh + offs_h
                y = tl.atomic_xchg(src, tl.zeros([BLOCK_H], dtype=tl.int64), mask=h_ok, sem="relaxed")
                y = tl.where(flagged, float("nan"), y.to(tl.float32) * (1.0 / SCALE))
                tl.store(out_ptr + t * stride_om + hh + offs_h, y.to(act_ty), mask=h_ok)
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed")


class OneLaunchWorkspace:
    """The kernel's zeroed accumulator (int64 ``[tokens, H]``), per-token flags and ticket; the
    kernel leaves them zero, so one workspace serves every call of one layer (and CUDA graph
    replays). ``tokens``: the most tokens a call may have."""

    def __init__(self, tokens: int, hidden: int, device: torch.device | str) -> None:
        self.tokens, self.hidden = tokens, hidden
        self.acc = torch.zeros(tokens, hidden, dtype=torch.int64, device=device)
        self.flags = torch.zeros(tokens + 1, dtype=torch.int32, device=device)  # last: the ticket

    def fits(self, tokens: int, hidden: int, device: torch.device) -> bool:
        return tokens <= self.tokens and hidden == self.hidden and self.acc.device == device


def one_launch_tiles(hidden: int, inter: int) -> dict[str, int]:
    """Tile sizes: ``BLOCK_I`` intermediate features a program owns, ``BLOCK_K`` columns a gate/up
    step, ``BLOCK_H`` output rows a down step."""
    block_i = min(16, triton.next_power_of_2(inter))
    return {"BLOCK_I": block_i, "BLOCK_K": min(256, triton.next_power_of_2(hidden)),
            "BLOCK_H": min(256, triton.next_power_of_2(hidden)), "WARPS": 4}


def fused_moe_one_launch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None, workspace: OneLaunchWorkspace | None = None,
                         tiles: dict[str, int] | None = None, pdl: bool = False) -> torch.Tensor:
    """``fused_moe`` (SwiGLU experts) in one launch: same arguments and result as
    ``fused_moe_reference`` (up to the rounding in the module docstring). Correct for any batch;
    meant for one token. ``workspace``: a zeroed ``OneLaunchWorkspace`` that fits the call, kept
    by the caller across calls (a fresh one is made when None). ``pdl`` as
    ``fused_moe_small_batch``'s."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    _, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden or w2.shape[1:] != (hidden, inter):
        raise ValueError(f"fused_moe_one_launch: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} for x {tuple(x.shape)};"
                         f" accepted: w13 [experts, 2 * I, {hidden}], w2 [experts, {hidden}, I]")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"fused_moe_one_launch: weight strides w13 {w13.stride()}, w2 {w2.stride()}; "
                         "accepted: unit stride along the last (input) dimension")
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    if workspace is None:
        workspace = OneLaunchWorkspace(tokens, hidden, x.device)
    elif not workspace.fits(tokens, hidden, x.device):
        raise ValueError(f"fused_moe_one_launch: workspace for {workspace.tokens} tokens x {workspace.hidden} on "
                         f"{workspace.acc.device}; the call has {tokens} x {hidden} on {x.device}")
    t = tiles or one_launch_tiles(hidden, inter)
    x = x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    s13 = w13_scale if w13_scale is not None else w13
    s2 = w2_scale if w2_scale is not None else w2
    s13_strides = (w13_scale.stride(0), w13_scale.stride(1)) if w13_scale is not None else (0, 0)
    s2_strides = (w2_scale.stride(0), w2_scale.stride(1)) if w2_scale is not None else (0, 0)
    flags = workspace.flags
    _one_launch_kernel[(triton.cdiv(inter, t["BLOCK_I"]), ids.numel())](
        x, w13, w2, s13, s2, ids, weights, workspace.acc, flags, flags[workspace.tokens:], out,
        inter, x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), *s13_strides,
        *s2_strides, out.stride(0),
        H=hidden, TOKENS=tokens, TOP_K=top_k, HAS_SCALE=w13_scale is not None, SCALE=2.0**FIXED_POINT_BITS,
        LIMIT=FIXED_POINT_LIMIT, BLOCK_I=t["BLOCK_I"], BLOCK_K=t["BLOCK_K"], BLOCK_H=t["BLOCK_H"], PDL=pdl,
        num_warps=t.get("WARPS", 4), num_stages=t.get("STAGES", 1), launch_pdl=pdl)
    return out
