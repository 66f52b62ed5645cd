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
result equals the grouped path's up to the float32 order of the K sums. Slots of experts on another
expert-parallel rank (``-1``) read nothing and add zero. Weights may be fp8 codes with one scale per
expert and output channel (``--quant fp8``), converted as they load.

``small_batch_applies`` says when this path is taken: every slot a different expert is certain at
one token (a token's top-k are distinct) and likely at two; past that, slots share experts more
often and the grouped GEMM reads each expert once for all of them.
"""

from __future__ import annotations

import torch
import triton

from engine.layers.moe.small_batch_kernel import _small_down_kernel, _small_gate_up_kernel

#: Tokens up to which ``fused_moe`` takes this path (on its own choice: no tiles or blocks given).
#: H100, Qwen3-30B-A3B shape, cold weights, router included (``benchmarks/bench_moe_small.py``,
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


def small_batch_tiles(top_k: int, hidden: int, inter: int) -> dict[str, int]:
    """Tile sizes of the two launches: ``BLOCK_N`` rows of each weight matrix a program streams and
    ``BLOCK_K`` columns a step (16-byte vectors along the contiguous K).

    Few rows, long steps: many small programs keep more loads in flight per SM. From
    ``benchmarks/bench_moe_small.py --sweep`` (one token, cold weights, 2026-11-23):

    - Qwen3-30B-A3B shape on an H100: gate/up 19.2 us (2.62 TB/s) at 2 rows x 512 against 22.7 us at
      8 x 256; down 12.4 us at 1 row of each of the 8 experts x 256 against 17.1 us at 4 x 128.
    - Mixtral-8x7B shape on an H200: gate/up 110.7 us at 2 x 512 with 8 warps (117.0 with 4, best
      107.5 at 2 x 256); down 56.5 us (4.16 TB/s) at 1 row of each of the 2 experts x 512 against
      67.3 at 4 x 256.
    - DeepSeek-V2-Lite shape (6 routed + 2 shared slots, I = 1408) on an H200, 2026-11-29, every
      weight cold, PDL, after the gate/up launch: down 17.2 us (2.67 TB/s) at 1 row x 128 a step
      (1408 = 11 x 128; the step is halved until it divides I: no half-masked last step), 14.3 us
      (3.2 TB/s) with each step's weights requested a step ahead (``DOWN_AHEAD``), which loops of 8
      or more short steps (128 columns or fewer) take: a program then has two steps of loads in
      flight, where one short step of 16-byte loads across the GPU's one wave of programs (about
      4 MB) left HBM waiting on latency. The 8-warp and wider tiles (1 x 512 .. 2 x 1024) ran
      slower. Mixtral-8x7B's 28 steps of 512 columns (H200, same day) do not take it: 55.1 us
      (4.27 TB/s) without, 58.8 us with.
    """
    block_tk = triton.next_power_of_2(top_k)
    down_k = min(512, triton.next_power_of_2(inter), max(16, 2048 // block_tk))
    while down_k > 16 and inter % down_k:
        down_k //= 2  # a step that divides I: no half-masked last step
    return {"UP_BLOCK_N": 2, "UP_BLOCK_K": min(512, triton.next_power_of_2(hidden)), "UP_WARPS": 8,
            "DOWN_BLOCK_N": 1, "DOWN_BLOCK_K": down_k, "DOWN_WARPS": 4, "DOWN_AHEAD": int(down_k <= 128 and inter // down_k >= 8)}


def shared_chunks(shared_w13: torch.Tensor, shared_w2: torch.Tensor, w13: torch.Tensor) -> int:
    """How many ``I``-row chunks the shared experts' weights make (``[2 * S * I, H]`` gate then up
    rows, ``[H, S * I]`` down) for experts ``w13 [E, 2 * I, H]``: ``S``, the extra slots per token
    ``fused_moe_small_batch`` gives them; 0 where they do not split so (another width, layout or dtype)."""
    _, two_inter, hidden = w13.shape
    inter = two_inter // 2
    width = shared_w2.shape[-1] if shared_w2.dim() == 2 else 0
    if (inter == 0 or width % inter or shared_w13.shape != (2 * width, hidden) or shared_w2.shape != (hidden, width)
            or shared_w13.dtype != w13.dtype or shared_w2.dtype != w13.dtype
            or shared_w13.stride(1) != 1 or shared_w2.stride(1) != 1):
        return 0
    return width // inter


def fused_moe_small_batch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                          w2_scale: torch.Tensor | None = None,
                          tiles: dict[str, int] | None = None, pdl: bool = False,
                          shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``fused_moe`` (SwiGLU experts) in two launches with no alignment: same arguments and result
    as ``fused_moe_reference``. Correct for any batch; fast where slots do not share experts
    (``small_batch_applies``). ``tiles`` overrides ``small_batch_tiles`` (tests, sweeps; optional
    ``UP_WARPS`` / ``DOWN_WARPS``, default 4, ``UP_STAGES`` / ``DOWN_STAGES``, default 1, and
    ``DOWN_AHEAD``, default 0: 1 requests each K step's down weights one step ahead).

    ``pdl`` (sm_90+; the ``pdl`` layer kernel entry): both launches use programmatic dependent
    launch. Gate/up waits for the previous kernel (the router's top-k) at once and then lets the down
    launch start, whose programs read the routing and their first weight tile while gate/up drains.
    Results are unchanged.

    ``shared``: the shared experts every token goes through (DeepSeek), as one SwiGLU MLP's
    ``(gate_up weight [2 * S * I, H], down weight [H, S * I])`` (``shared_chunks`` > 0; unquantized
    experts only). They run in the same two launches as ``S`` more slots per token of weight 1: the
    result is the routed experts' plus the MLP's, each rounded to the activation dtype first as two
    separate layers' outputs would be, with one launch pair streaming both weights."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    _, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden or w2.shape[1:] != (hidden, inter):
        raise ValueError(f"fused_moe_small_batch: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} for x {tuple(x.shape)};"
                         f" accepted: w13 [experts, 2 * I, {hidden}], w2 [experts, {hidden}, I]")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"fused_moe_small_batch: weight strides w13 {w13.stride()}, w2 {w2.stride()}; "
                         "accepted: unit stride along the last (input) dimension")
    chunks = 0
    if shared is not None:
        chunks = shared_chunks(shared[0], shared[1], w13)
        if not chunks or w13_scale is not None:
            raise ValueError(f"fused_moe_small_batch: shared experts {tuple(shared[0].shape)}, {tuple(shared[1].shape)} "
                             f"({shared[0].dtype}) with experts w13 {tuple(w13.shape)} ({w13.dtype}, "
                             f"{'scaled' if w13_scale is not None else 'unscaled'}); accepted: unscaled experts and "
                             f"[2 * S * {inter}, {hidden}], [{hidden}, S * {inter}] of their dtype, unit last stride")
    t = tiles or small_batch_tiles(top_k + chunks, hidden, inter)
    x = x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    act = torch.empty(tokens * (top_k + chunks), inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    launch_gate_up(x, w13, w13_scale, ids, act, t["UP_BLOCK_N"], t["UP_BLOCK_K"], t.get("UP_WARPS", 4), pdl=pdl,
                   shared_w13=shared[0] if shared is not None else None, chunks=chunks,
                   num_stages=t.get("UP_STAGES", 1))
    launch_down(act, w2, w2_scale, ids, weights, out, t["DOWN_BLOCK_N"], t["DOWN_BLOCK_K"], t.get("DOWN_WARPS", 4),
                pdl=pdl, shared_w2=shared[1] if shared is not None else None, chunks=chunks,
                num_stages=t.get("DOWN_STAGES", 1), ahead=bool(t.get("DOWN_AHEAD", 0)))
    return out


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    return (scale.stride(0), scale.stride(1)) if scale is not None else (0, 0)


def launch_gate_up(x: torch.Tensor, w13: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor,
                   act: torch.Tensor, block_n: int, block_k: int, num_warps: int, pdl: bool = False,
                   shared_w13: torch.Tensor | None = None, chunks: int = 0, num_stages: int = 1) -> None:
    """The gate/up launch alone (``act [tokens * (top_k + chunks), I]`` written): ``fused_moe_small_batch``'s
    first step, and what a tile sweep times. ``ids``: contiguous int32 ``[tokens, top_k]``;
    ``shared_w13`` with ``chunks`` = ``shared_chunks(...)``: the shared experts' gate/up rows too."""
    inter = w13.shape[1] // 2
    tokens, top_k = ids.shape
    ws = shared_w13 if chunks else w13
    _small_gate_up_kernel[(tokens * (top_k + chunks), triton.cdiv(inter, block_n))](
        x, w13, scale if scale is not None else w13, ids, act, ws, inter, x.stride(0), w13.stride(0), w13.stride(1),
        *_scale_strides(scale), act.stride(0), ws.stride(0) if chunks else 0, K=w13.shape[2], TOP_K=top_k,
        SHARED=chunks, HAS_SCALE=scale is not None, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl)


def launch_down(act: torch.Tensor, w2: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor,
                weights: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, num_warps: int,
                pdl: bool = False, shared_w2: torch.Tensor | None = None, chunks: int = 0,
                num_stages: int = 1, ahead: bool = False) -> None:
    """The down launch alone (``out [tokens, H]`` written, routing weights and top-k sum applied):
    ``fused_moe_small_batch``'s second step. ``weights``: contiguous float32 ``[tokens, top_k]``;
    ``shared_w2`` with ``chunks``: the shared experts' down rows too, their sum added."""
    tokens, top_k = ids.shape
    hidden = w2.shape[1]
    ws = shared_w2 if chunks else w2
    _small_down_kernel[(tokens, triton.cdiv(hidden, block_n))](
        act, w2, scale if scale is not None else w2, ids, weights, out, ws, hidden, act.stride(0), w2.stride(0),
        w2.stride(1), *_scale_strides(scale), out.stride(0), ws.stride(0) if chunks else 0, K=w2.shape[2], TOP_K=top_k,
        SHARED=chunks, HAS_SCALE=scale is not None, BLOCK_TK=triton.next_power_of_2(top_k + chunks), BLOCK_N=block_n,
        BLOCK_K=block_k, PDL=pdl, AHEAD=ahead, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
